"""benchmarks/cpu.py runs and accounts for a record's CPU: the writer's row and each
floor server's, side by side in one run. (The figures are for docs/benchmarks.md, never
asserted here beyond being there.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CPU = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu.py"


def test_the_writer_and_every_floor_get_a_row_at_each_rate(tmp_path: Path) -> None:
    command = [sys.executable, str(CPU), "--rates", "100", "--duration", "1", "--floor"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {
        line.split()[0]: line.split()
        for line in done.stdout.splitlines()
        if line.split()[1:2] == ["100/s"]
    }
    assert set(rows) == {"cmdbus-trio", "floor", "floor+disk", "floor+strict"}, done.stdout
    for name, row in rows.items():
        delivered, cores = float(row[2]), float(row[8])
        assert delivered > 50, f"{name} delivered {delivered}/s of 100/s"
        assert cores > 0, f"{name}: {row}"
    # The census (turns, steps, hops) is the writer's alone; the floors have no hook.
    assert len(rows["cmdbus-trio"]) > len(rows["floor"])
