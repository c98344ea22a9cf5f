"""benchmarks/ha.py measures a pair beside one writer and runs failovers with a ledger.
(Its figures are for docs/benchmarks.md; here only what must hold on any machine: each
deployment served the steady rate, both members' CPU was measured, and a paused primary
was replaced with nothing acknowledged lost, its publisher answered again within the lease
and a call's timeout.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HA = Path(__file__).resolve().parents[2] / "benchmarks" / "ha.py"
LEASE_MS = 1000


def test_a_pair_beside_one_writer_and_a_paused_primary_replaced_losing_nothing() -> None:
    command = [sys.executable, str(HA), "--only", "single,pair", "--rates", "200"]
    command += ["--seconds", "2", "--rounds", "1", "--failovers", "1", "--faults", "pause"]
    done = subprocess.run(
        [*command, "--lease-ms", str(LEASE_MS), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    single, pair = result["steady"]["single"], result["steady"]["pair"]
    for deployment in (single, pair):
        assert 180 < deployment["200/s"]["rate"] < 220, deployment
        assert deployment["saturation"]["rate"] > deployment["200/s"]["rate"], deployment
    assert single["200/s"]["standby_cores"] is None
    assert pair["200/s"]["primary_cores"] > 0 and pair["200/s"]["standby_cores"] > 0
    (paused,) = result["failovers"]["pair pause"]
    assert paused["acknowledged"] > 600 and paused["lost"] == 0 and paused["new_primary"]
    assert paused["waited_s"] < LEASE_MS / 1000 + 3 + 2  # the lease, a takeover, a timeout


def test_an_unknown_deployment_is_refused_naming_the_choices() -> None:
    done = subprocess.run(
        [sys.executable, str(HA), "--only", "single,kafka"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "no such deployment ['kafka']" in done.stderr and "nats-r3" in done.stderr
