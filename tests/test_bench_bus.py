"""benchmarks/bus.py runs and measures: a short steady end-to-end run against the writer
and the floor prints, for each, the records delivered, their latency, the server's CPU
and the load generators' CPU, and the writer's /healthz latency beside it. (The figures
themselves are for docs/benchmarks.md, never asserted here.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BUS = Path(__file__).resolve().parent.parent / "benchmarks" / "bus.py"


def test_the_steady_workload_reports_rates_latency_and_cpu(tmp_path: Path) -> None:
    command = [sys.executable, str(BUS), "--floor", "--rate", "100", "--duration", "2"]
    done = subprocess.run(
        [*command, "--only", "steady"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    rows = {
        line.split()[3]: line.split()
        for line in done.stdout.splitlines()
        if line.startswith("steady 100/s e2e") and not line.endswith("x")  # not a ratio
    }
    assert set(rows) == {"cmdbus-trio", "floor"}
    for name, row in rows.items():
        delivered, latency, cores, us_per_op, generator_cores = row[4:9]
        assert float(delivered) > 50, f"{name} delivered {delivered}/s of 100/s"
        p50, p99 = map(float, latency.split("/"))
        assert 0 < p50 <= p99
        assert float(cores) > 0 and float(us_per_op) > 0 and float(generator_cores) > 0
    healthz = rows["cmdbus-trio"][9]
    assert all(float(ms) > 0 for ms in healthz.split("/"))
    assert len(rows["floor"]) == 9  # no control face: nothing probed


def test_rounds_report_medians_and_each_rounds_ratio(tmp_path: Path) -> None:
    """--rounds N runs everything N times (the servers' order reversed each round) and
    reports the median of each figure, and of the rounds' ratios beside each of them."""
    command = [sys.executable, str(BUS), "--floor", "--duration", "1", "--rounds", "2"]
    done = subprocess.run(
        [*command, "--only", "publish x16 batched"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "medians of 2 rounds" in done.stdout
    (ratio,) = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("publish x16 batched") and "(" in line
    ]
    median, rounds = ratio.split("batched", 1)[1].split("(")
    each = [float(x) for x in rounds.rstrip(")").split()]
    assert len(each) == 2 and all(x > 0 for x in each)
    assert float(median.strip().rstrip("x")) == pytest.approx(sum(each) / 2, abs=0.011)


def test_rounds_below_one_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BUS), "--rounds", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "--rounds must be at least 1, not 0" in done.stderr
