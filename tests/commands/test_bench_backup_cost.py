"""benchmarks/backup_cost.py runs a writer, fills it, and measures publishes without and
during a backup. (The figures are for docs/benchmarks.md; here only that both phases
publish and the backup is as large as the data.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BACKUP_COST = Path(__file__).resolve().parents[2] / "benchmarks" / "backup_cost.py"


def test_both_phases_publish_and_the_backup_holds_the_data(tmp_path: Path) -> None:
    command = [sys.executable, str(BACKUP_COST), "--size-mib", "10", "--rate", "100"]
    done = subprocess.run(
        [*command, "--seconds", "1", "--json"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for phase in ("no_backup", "backup"):
        assert result[phase]["publishes"] > 50 and result[phase]["writer_cores"] > 0, result
    assert result["backup"]["backup_s"] > 0 and result["backup_mib"] >= 10, result
