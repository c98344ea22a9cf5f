"""A pair under the failures that lose acknowledged records elsewhere, checked from
outside with a ledger of every record a client was answered for (docs/ha.md, "What
happens when"): the primary paused while the standby takes over, then resumed; the
standby stopped and then the primary, both killed, the standby brought back (a primary
that acknowledged before its standby confirmed would pass a plain kill test: the kernel
still delivers what it sent); and the negative control, CMDBUS_HA_SYNC=off, which must
lose records, or the ledger is blind."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.client import ClientError
from cmdbus_trio.client.blocking import IngestClient

from ..helpers import cli
from .proxy import free_port, proxy_to
from .test_pair import LEASE_MS, claimed_keys, ha, in_sync_pair, member, until

pytestmark = pytest.mark.e2e


class Ledger:
    """Publishes to one address as fast as answers come, on a thread; keeps every sort
    key it was answered for, with when its request was sent."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.acked: dict[int, float] = {}  # sort key: when its request was sent
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Ledger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        n = 0
        with IngestClient(self.address, reconnect_for=0) as ingest:
            while not self._stop.is_set():
                n += 1
                record = {"execution_id": n, "payload": json.dumps({"n": n})}
                sent = time.monotonic()
                try:
                    key = ingest.publish(record, timeout=1.0).sort_key
                except ClientError:
                    self.errors += 1
                    time.sleep(0.05)
                    continue
                self.acked[key] = sent

    def wait_for(self, count: int) -> None:
        until(lambda: len(self.acked) >= count)


def test_a_paused_primary_acknowledges_nothing_after_the_takeover_and_rejoins(
    tmp_path: Path,
) -> None:
    with ExitStack() as stack:
        a, a_ports, _, b_ports = in_sync_pair(tmp_path, stack)
        with Ledger(a_ports["cmd_ingest"]) as ledger:
            ledger.wait_for(50)
            a.send_signal(signal.SIGSTOP)
            until(lambda: ha(b_ports)["role"] == "primary", timeout=LEASE_MS / 1000 + 5)
            took_over = time.monotonic()
            a.send_signal(signal.SIGCONT)
            time.sleep(2)  # the resumed primary's answers, if it gave any, reach the ledger
        # A request it read after the takeover is answered as by a member not primary
        # (one sent before may have been confirmed by the standby: then the new primary
        # has it, which the second check says).
        late = [key for key, sent in ledger.acked.items() if sent > took_over]
        assert late == [], "the deposed primary acknowledged a request sent after the takeover"
        assert ledger.errors > 0
        assert claimed_keys(b_ports) >= set(ledger.acked)
        rejoined = until(lambda: ha(a_ports)["role"] == "standby" and ha(a_ports)["primary"] == "b")
        assert rejoined < 10
        until(lambda: ha(a_ports)["in_sync"])
        # Its log names the term it lost, not the one that deposed it.
        assert [entry["epoch"] for entry in log_events(tmp_path / "a", "deposed")] == [1]


def log_events(home: Path, name: str) -> list[dict[str, Any]]:
    """The events ``name`` of a member's JSON log."""
    lines = (home / "server.log").read_text().splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    return [entry for entry in entries if entry.get("event") == name]


def test_a_standby_out_of_sync_never_takes_over_even_from_what_its_socket_held(
    tmp_path: Path,
) -> None:
    """The standby stops (SIGSTOP); the primary acknowledges alone once it has said so in
    the lease; then the primary stops, both are killed, and the standby comes back: it
    must not take over (it lacks what was acknowledged alone). The primary, back, has it."""
    lease = tmp_path / "lease"
    with ExitStack() as stack:
        a, a_ports, b, b_ports = in_sync_pair(tmp_path, stack)
        b.send_signal(signal.SIGSTOP)
        with Ledger(a_ports["cmd_ingest"]) as ledger:
            ledger.wait_for(20)
        assert not ha(a_ports)["in_sync"]
        a.send_signal(signal.SIGSTOP)
        for process in (a, b):
            process.send_signal(signal.SIGKILL)
            process.wait()
    with ExitStack() as stack:
        _, b_ports = stack.enter_context(member(tmp_path, "b", lease))
        time.sleep(LEASE_MS / 1000 * 3)
        assert ha(b_ports)["role"] != "primary"
        _, a_ports = stack.enter_context(member(tmp_path, "a", lease))
        until(lambda: ha(a_ports)["role"] == "primary")
        assert claimed_keys(a_ports) >= set(ledger.acked)


def test_with_sync_off_a_failover_loses_acknowledged_records(tmp_path: Path) -> None:
    """The negative control: the standby is killed while the primary goes on; the
    primary is killed; the standby, back, takes over with what it had."""
    lease = tmp_path / "lease"
    off = {"CMDBUS_HA_SYNC": "off"}
    with ExitStack() as stack:
        a, a_ports = stack.enter_context(member(tmp_path, "a", lease, **off))
        until(lambda: ha(a_ports)["role"] == "primary")
        b, b_ports = stack.enter_context(member(tmp_path, "b", lease, **off))
        until(lambda: ha(b_ports)["role"] == "standby" and ha(b_ports)["behind_records"] == 0)
        b.send_signal(signal.SIGKILL)
        b.wait()
        with Ledger(a_ports["cmd_ingest"]) as ledger:
            ledger.wait_for(30)
        a.send_signal(signal.SIGKILL)
        a.wait()
    with ExitStack() as stack:
        _, b_ports = stack.enter_context(member(tmp_path, "b", lease, **off))
        try:
            until(lambda: ha(b_ports)["role"] == "primary", timeout=LEASE_MS / 1000 + 10)
        except AssertionError:
            raise AssertionError(f"{ha(b_ports)}") from None
        missing = set(ledger.acked) - claimed_keys(b_ports)
        assert missing, "with sync off, the standby should lack what was acknowledged alone"


@pytest.mark.parametrize("way", ["both", "confirmations"])
def test_a_cut_replication_link_costs_a_pause_and_nothing_else(tmp_path: Path, way: str) -> None:
    """The replication link runs through a proxy the test cuts (both ways, or only the
    standby's confirmations) for longer (3 s) than the sync timeout (1 s): the primary
    says in the lease that no standby is in sync and goes on alone; the standby, which
    still sees the lease renewed, does not take over; healed, it catches up and is in
    sync again; then the primary is killed and the standby has every record."""
    lease = tmp_path / "lease"
    ha_port = free_port()
    with ExitStack() as stack:
        proxy = stack.enter_context(proxy_to(ha_port))
        via = {
            "CMDBUS_HA_BIND": f"127.0.0.1:{ha_port}",
            "CMDBUS_HA_ADVERTISE": f"127.0.0.1:{proxy.port}",
        }
        a, a_ports = stack.enter_context(member(tmp_path, "a", lease, **via))
        until(lambda: ha(a_ports)["role"] == "primary")
        _, b_ports = stack.enter_context(member(tmp_path, "b", lease))
        until(lambda: ha(a_ports)["in_sync"] and ha(b_ports)["role"] == "standby")
        with Ledger(a_ports["cmd_ingest"]) as ledger:
            ledger.wait_for(30)
            if way == "confirmations":
                proxy.cut(forward=True, backward=False)  # (forward: the standby's sends)
            else:
                proxy.cut()
            cut_at = time.monotonic()
            time.sleep(3)
            assert not ha(a_ports)["in_sync"] and ha(b_ports)["role"] == "standby"
            during = [key for key, sent in ledger.acked.items() if sent > cut_at + 1.5]
            assert during, "the primary should go on alone once it said so in the lease"
            proxy.heal()
            until(lambda: ha(a_ports)["in_sync"])
            ledger.wait_for(len(ledger.acked) + 20)
        a.send_signal(signal.SIGKILL)
        a.wait()
        until(lambda: ha(b_ports)["role"] == "primary", timeout=LEASE_MS / 1000 + 5)
        assert claimed_keys(b_ports) >= set(ledger.acked)


def test_operations_status_switchover_and_a_forced_promotion(tmp_path: Path) -> None:
    """`cmdbus-trio ha`: status of both; a switchover (the primary hands over and
    follows); then, with the standby out of sync and the primary killed, the standby
    waits until a forced promotion, which moves its keys on and says what it may lose."""
    with ExitStack() as stack:
        a, a_ports, b, b_ports = in_sync_pair(tmp_path, stack)
        urls = ["--url", a_ports["control"], "--url", b_ports["control"]]
        status = subprocess.run(
            cli("ha", "status", *urls, "--json"), capture_output=True, text=True
        )
        assert status.returncode == 0, status.stdout
        assert json.loads(status.stdout.splitlines()[-1])["verdict"] == "ok"
        switched = subprocess.run(
            cli("ha", "switchover", "--url", a_ports["control"]), capture_output=True, text=True
        )
        assert switched.returncode == 0, switched.stderr
        until(lambda: ha(b_ports)["role"] == "primary")
        until(lambda: ha(a_ports)["role"] == "standby" and ha(a_ports)["in_sync"])
        refused = subprocess.run(
            cli("ha", "switchover", "--url", a_ports["control"]), capture_output=True, text=True
        )
        assert refused.returncode == 1 and "not primary" in refused.stderr
        # Now a is the standby: stop it, let b go on alone, kill b.
        a.send_signal(signal.SIGSTOP)
        with Ledger(b_ports["cmd_ingest"]) as ledger:
            ledger.wait_for(10)
        looked = subprocess.run(
            cli("diagnose", "--url", b_ports["control"], "--interval", "0.2", "--json"),
            capture_output=True, text=True,
        )  # fmt: skip
        assert looked.returncode == 18, looked.stdout  # no standby in sync
        assert "no standby in sync" in looked.stdout
        b.send_signal(signal.SIGKILL)
        b.wait()
        a.send_signal(signal.SIGCONT)
        time.sleep(LEASE_MS / 1000 * 2)
        assert ha(a_ports)["role"] != "primary"  # not in sync: it waits for b
        status = subprocess.run(
            cli("ha", "status", *urls, "--json"), capture_output=True, text=True
        )
        assert status.returncode == 23, status.stdout  # no primary
        promoted = subprocess.run(
            cli("ha", "promote", "--force", "--yes", "--url", a_ports["control"], "--json"),
            capture_output=True, text=True,
        )  # fmt: skip
        assert promoted.returncode == 0, promoted.stderr
        assert "may_lose" in json.loads(promoted.stdout)
        until(lambda: ha(a_ports)["role"] == "primary", timeout=LEASE_MS / 1000 + 5)
        with IngestClient(a_ports["cmd_ingest"]) as ingest:
            key = ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key
        assert key > 1 << 40  # its keys moved on: none names a record b gave
