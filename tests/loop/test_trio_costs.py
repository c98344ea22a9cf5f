"""benchmarks/trio_costs.py prints a cost per use for every primitive, against the
checkpoint measured in the same run (the figures are for docs/benchmarks.md, never
asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

COSTS = Path(__file__).resolve().parents[2] / "benchmarks" / "trio_costs.py"
PRIMITIVES = (
    "checkpoint",
    "hand-over",
    "cancel scope with a deadline",
    "cancel scope, deadline moved",
    "checkpoint, a scheduling hook",
    "checkpoint, scheduling and step hooks",
)


def test_every_primitive_has_a_cost_against_the_checkpoint() -> None:
    done = subprocess.run(
        [sys.executable, str(COSTS), "--uses", "50"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split()[:1] == ["primitive"]
    assert [row[:40].strip() for row in rows] == list(PRIMITIVES)
    for row in rows:
        cost, ratio = row[40:].split()
        assert float(cost) > 0 and float(ratio.rstrip("x")) > 0
    assert rows[0].endswith("1.00x")


def test_a_run_of_no_uses_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(COSTS), "--uses", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "--uses must be at least 1" in done.stderr
