"""benchmarks/rollout.py runs the examples through a drain and a kill of the writer and
reports what they saw. (Its figures are for docs/benchmarks.md; here only what must
hold whatever the machine: no error reached a program, none stored twice, all ran.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROLLOUT = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout.py"


def test_a_drain_and_a_kill_reach_no_program(tmp_path: Path) -> None:
    command = [sys.executable, str(ROLLOUT), "--rate", "100", "--restarts", "1", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["errors"] == [] and result["stored_twice"] == 0, result
    assert result["published"] == result["ran"] > 0 and result["never_ran"] == 0, result
    for how in ("SIGTERM", "SIGKILL"):
        assert len(result[how]["to_ready_s"]) == 1 and result[how]["longest_publish_gap_s"] > 0


def test_bad_arguments_are_refused_naming_them() -> None:
    done = subprocess.run(
        [sys.executable, str(ROLLOUT), "--restarts", "0"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "--restarts" in done.stderr
