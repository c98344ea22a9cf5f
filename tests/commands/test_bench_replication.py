"""benchmarks/replication.py kills a writer and Litestream together, restores from the
replica, and times a restore from an empty volume. (Its figures, the RPO and the RTO,
are for docs/operations.md; here only what must hold on any machine: a kill loses at
most what Litestream had not synced, a couple of seconds' worth, and a restore ends with
a writer ready.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPLICATION = Path(__file__).resolve().parents[2] / "benchmarks" / "replication.py"


def test_a_kill_loses_at_most_the_unsynced_seconds_and_a_restore_serves() -> None:
    command = [sys.executable, str(REPLICATION), "--kills", "1", "--rate", "100"]
    done = subprocess.run(
        [*command, "--sizes", "5", "--json"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    (kill,) = result["kills"]
    assert kill["acknowledged"] > 100, kill  # published for 2 to 6 s at 100/s
    assert kill["lost"] < kill["acknowledged"] and kill["lost_s"] < 5, kill
    (rto,) = result["rto"]
    assert rto["size_mib"] == 5 and rto["restore_s"] > 0 and rto["start_s"] > 0, rto
