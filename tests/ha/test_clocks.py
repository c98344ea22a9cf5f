"""A pair whose wall clocks are stepped a day either way (libfaketime, as NTP steps a
clock) while it serves: expiry is judged by each member's monotonic clock, so nothing
changes. (A monotonic clock that jumps is tests/ha/test_keeper.py's, on trio's MockClock:
libfaketime's faked monotonic clock also stretches every timed wait of a thread, which
no real clock does.)"""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from ..durability.test_clocks import LIBFAKETIME
from .test_failures import Ledger
from .test_pair import claimed_keys, ha, member, until

pytestmark = pytest.mark.e2e

LEASE_MS = 5000
"""Longer than test_pair's: a primary's renewal is a write and an fsync of the lease's
directory, which on this one disk can wait over a second behind the standby's base
copy; with a 2 s lease (1.6 s of hold) the primary lost it about one run in ten."""


def stepped(tmp_path: Path, name: str) -> dict[str, str]:
    if not LIBFAKETIME.exists():
        if os.environ.get("CI"):
            pytest.fail("libfaketime is missing: .ci/run installs faketime")
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    offset = tmp_path / f"{name}.offset"
    offset.write_text("+0\n")
    env = {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(offset),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    return env


def test_wall_clocks_stepped_a_day_either_way_change_nothing(tmp_path: Path) -> None:
    lease = tmp_path / "lease"
    with ExitStack() as stack:
        lease_ms = {"CMDBUS_HA_LEASE_MS": str(LEASE_MS)}
        a, a_ports = stack.enter_context(
            member(tmp_path, "a", lease, **stepped(tmp_path, "a"), **lease_ms)
        )
        until(lambda: ha(a_ports)["role"] == "primary")
        _, b_ports = stack.enter_context(
            member(tmp_path, "b", lease, **stepped(tmp_path, "b"), **lease_ms)
        )
        until(lambda: ha(a_ports)["in_sync"] and ha(b_ports)["role"] == "standby")
        with Ledger(a_ports["cmd_ingest"]) as ledger:
            ledger.wait_for(20)
            (tmp_path / "a.offset").write_text("+1d\n")
            (tmp_path / "b.offset").write_text("-1d\n")
            time.sleep(LEASE_MS / 1000 * 2)
            assert ha(a_ports)["role"] == "primary" and ha(a_ports)["epoch"] == 1
            assert ha(b_ports)["role"] == "standby" and ha(a_ports)["in_sync"]
            ledger.wait_for(len(ledger.acked) + 20)
        a.send_signal(signal.SIGKILL)
        a.wait()
        until(lambda: ha(b_ports)["role"] == "primary", timeout=LEASE_MS / 1000 + 5)
        assert claimed_keys(b_ports) >= set(ledger.acked)
