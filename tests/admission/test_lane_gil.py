"""benchmarks/lane_gil.py prints one row per share of the GIL held beside the appends,
the first (nothing beside them) the baseline of the same run (the figures are for
docs/benchmarks.md, never asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LANE_GIL = Path(__file__).resolve().parents[2] / "benchmarks" / "lane_gil.py"


def test_every_row_has_a_rate_and_a_ratio_to_the_appends_alone() -> None:
    done = subprocess.run(
        [sys.executable, str(LANE_GIL), "--seconds", "0.05"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split()[:3] == ["GIL", "held", "beside"]
    assert [row.split()[0] for row in rows] == ["0%", "50%", "90%"]
    for row in rows:
        _, rate, p50, p99, ratio = row.split()
        assert float(rate) > 0 and 0 < float(p50) <= float(p99) and float(ratio.rstrip("x")) > 0
    assert rows[0].split()[-1] == "1.00x"
