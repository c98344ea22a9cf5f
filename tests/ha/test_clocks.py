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

from cmdbus_trio.ha._file_lease import FileLeaseStore

from ..durability.test_clocks import LIBFAKETIME, offset_env
from .test_failures import Ledger
from .test_pair import claimed_keys, ha, member, until

pytestmark = pytest.mark.e2e

LEASE_MS = 5000
DAY = 86_400.0


def renewed_ahead(lease: Path) -> float:
    """How far ahead of the test's wall clock the lease's holder stamped its last
    renewal: its wall clock's step, give or take a renewal interval."""
    newest = FileLeaseStore(lease).read()
    assert newest is not None
    return newest.record.renewed_at - time.time()


def stepped(tmp_path: Path, name: str) -> dict[str, str]:
    if not LIBFAKETIME.exists():
        if os.environ.get("CI"):
            pytest.fail("libfaketime is missing: .ci/run installs faketime")
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    offset = tmp_path / f"{name}.offset"
    offset.write_text("+0\n")
    return offset_env(offset)


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
            time.sleep(LEASE_MS / 1000 * 1.2)  # (past a whole lease: a renewal and an expiry)
            assert abs(renewed_ahead(lease) - DAY) < LEASE_MS / 1000  # (the step took)
            assert ha(a_ports)["role"] == "primary" and ha(a_ports)["epoch"] == 1
            assert ha(b_ports)["role"] == "standby" and ha(a_ports)["in_sync"]
            ledger.wait_for(len(ledger.acked) + 20)
        a.send_signal(signal.SIGKILL)
        a.wait()
        # (The lease, the standby's read a third of it late at most, and its start.)
        until(lambda: ha(b_ports)["role"] == "primary", timeout=LEASE_MS / 1000 * 4 / 3 + 5)
        assert abs(renewed_ahead(lease) + DAY) < LEASE_MS / 1000  # (b's step took)
        assert claimed_keys(b_ports) >= set(ledger.acked)
