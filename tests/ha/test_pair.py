"""Two members of a shard, each a `serve` process with its own data dir, agreeing through
a `file:` lease (docs/ha.md): the second follows the first; killed (SIGKILL), the
primary is replaced within the lease and 3 s by the standby, which has every record the
primary acknowledged; asked to stop (SIGTERM), it hands over within a second."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.client import Unavailable
from cmdbus_trio.client.blocking import ClaimClient, IngestClient

from ..helpers import metric_sum, metrics_text, serving

pytestmark = pytest.mark.e2e

LEASE_MS = 2000


def ha(ports: dict[str, str]) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{ports['control']}/ha", timeout=5) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def until(check: Any, timeout: float = 20.0) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError("timed out")
        time.sleep(0.05)
    return time.monotonic() - start


@contextmanager
def member(
    tmp_path: Path, name: str, lease: Path, **env: str
) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    home = tmp_path / name
    home.mkdir(exist_ok=True)
    settings = {
        "CMDBUS_HA_LEASE": f"file:{lease}",
        "CMDBUS_HA_NAME": name,
        "CMDBUS_HA_BIND": "127.0.0.1:0",
        "CMDBUS_HA_LEASE_MS": str(LEASE_MS),
        "CMDBUS_CMD_INGEST_BIND": "127.0.0.1:0",
        "CMDBUS_CMD_CLAIM_BIND": "127.0.0.1:0",
    }
    with serving(home, **(settings | env)) as started:
        yield started


def in_sync_pair(
    tmp_path: Path, stack: ExitStack
) -> tuple[Any, dict[str, str], Any, dict[str, str]]:
    lease = tmp_path / "lease"
    a, a_ports = stack.enter_context(member(tmp_path, "a", lease))
    until(lambda: ha(a_ports)["role"] == "primary")
    b, b_ports = stack.enter_context(member(tmp_path, "b", lease))
    until(lambda: ha(b_ports)["role"] == "standby")
    until(lambda: ha(a_ports)["in_sync"] and ha(b_ports)["in_sync"])
    return a, a_ports, b, b_ports


def claimed_keys(ports: dict[str, str]) -> set[int]:
    keys: set[int] = set()
    with ClaimClient(ports["cmd_claim"]) as claim:
        while batch := claim.next_batch("commands.>", 1000, wait=0.5):
            keys |= {delivery.sort_key for delivery in batch}
    return keys


def test_a_killed_primary_is_replaced_by_its_standby_with_every_acknowledged_record(
    tmp_path: Path,
) -> None:
    with ExitStack() as stack:
        a, a_ports, _, b_ports = in_sync_pair(tmp_path, stack)
        assert ha(b_ports)["primary"] == "a"
        assert ha(b_ports)["primary_faces"]["cmd_ingest"] == a_ports["cmd_ingest"]
        seen = metrics_text(a_ports)
        assert metric_sum(seen, 'cmdbus_ha_role{role="primary"}') == 1
        assert metric_sum(seen, "cmdbus_ha_in_sync") == 1
        assert metric_sum(metrics_text(b_ports), 'cmdbus_ha_role{role="standby"}') == 1
        acked: set[int] = set()
        with IngestClient(a_ports["cmd_ingest"]) as ingest:
            for n in range(200):
                record = {"execution_id": n, "payload": json.dumps({"n": n})}
                acked.add(ingest.publish(record).sort_key)
            first = ingest.publish({"execution_id": 1, "payload": "{}"}, msg_id="once")
        a.send_signal(signal.SIGKILL)
        a.wait()
        took = until(lambda: ha(b_ports)["role"] == "primary")
        assert took < LEASE_MS / 1000 + 3
        assert claimed_keys(b_ports) >= acked
        assert ha(b_ports)["epoch"] == 2
        with IngestClient(b_ports["cmd_ingest"]) as ingest:  # its msg_id is known there
            again = ingest.publish({"execution_id": 1, "payload": "{}"}, msg_id="once")
        assert again.duplicate and again.sort_key == first.sort_key
        seen = metrics_text(b_ports)
        assert metric_sum(seen, "cmdbus_ha_failovers_total") == 1
        assert metric_sum(seen, "cmdbus_ha_epoch") == 2


def test_a_standby_answers_unavailable_naming_the_primary(tmp_path: Path) -> None:
    with ExitStack() as stack:
        _, a_ports, _, b_ports = in_sync_pair(tmp_path, stack)
        with (
            IngestClient(b_ports["cmd_ingest"], reconnect_for=0) as ingest,
            pytest.raises(Unavailable) as refused,
        ):
            ingest.publish({"execution_id": 1, "payload": "{}"})
        assert a_ports["cmd_ingest"] in str(refused.value)


def test_sigterm_hands_the_lease_over_within_a_second(tmp_path: Path) -> None:
    with ExitStack() as stack:
        a, a_ports, _, b_ports = in_sync_pair(tmp_path, stack)
        with IngestClient(a_ports["cmd_ingest"]) as ingest:
            key = ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key
        a.send_signal(signal.SIGTERM)
        took = until(lambda: ha(b_ports)["role"] == "primary")
        assert a.wait(10) == 0
        assert took < 1.5  # (the signal's delivery and the drain included)
        assert key in claimed_keys(b_ports)


def test_a_client_given_both_members_rides_through_a_failover(tmp_path: Path) -> None:
    """The blocking client, given the two members' addresses: it goes to the primary
    (the standby's answer names it), and when the primary is killed mid-stream it goes
    on with the new one; every record it was answered for is there."""
    with ExitStack() as stack:
        a, a_ports, _, b_ports = in_sync_pair(tmp_path, stack)
        members = f"{b_ports['cmd_ingest']},{a_ports['cmd_ingest']}"  # the standby first
        acked: set[int] = set()
        with IngestClient(members) as ingest:
            for n in range(100):
                if n == 50:
                    a.send_signal(signal.SIGKILL)
                record = {"execution_id": n, "payload": json.dumps({"n": n})}
                acked.add(ingest.publish(record, timeout=30).sort_key)
            assert ingest.address == b_ports["cmd_ingest"]
            assert ingest.reconnect.statistics().outages >= 1
        assert len(acked) == 100
        assert claimed_keys(b_ports) >= acked


async def test_the_trio_client_follows_the_primary_too(tmp_path: Path) -> None:
    from cmdbus_trio.client.trio import IngestClient as TrioIngestClient

    with ExitStack() as stack:
        a, a_ports, _, b_ports = await trio.to_thread.run_sync(in_sync_pair, tmp_path, stack)
        members = f"{b_ports['cmd_ingest']},{a_ports['cmd_ingest']}"
        acked: set[int] = set()
        async with TrioIngestClient(members) as ingest:
            with trio.fail_after(60):
                for n in range(60):
                    if n == 30:
                        a.send_signal(signal.SIGKILL)
                    record = {"execution_id": n, "payload": json.dumps({"n": n})}
                    acked.add((await ingest.publish(record, timeout=30)).sort_key)
        assert len(acked) == 60
        assert await trio.to_thread.run_sync(claimed_keys, b_ports) >= acked


async def test_a_subscriber_given_both_members_follows_the_primary_without_a_gap(
    tmp_path: Path,
) -> None:
    """A push subscription opened through the standby (which names the primary) goes
    on through a kill of the primary, on the new one, after the last record it got."""
    from cmdbus_trio.client.trio import IngestClient as TrioIngestClient
    from cmdbus_trio.client.trio import SubscribeClient

    with ExitStack() as stack:
        a, a_ports, _, b_ports = await trio.to_thread.run_sync(in_sync_pair, tmp_path, stack)
        events, pushes = (
            f"{b_ports[face]},{a_ports[face]}" for face in ("evt_ingest", "evt_subscribe")
        )
        published: list[int] = []
        seen: list[int] = []
        with trio.fail_after(60):
            async with (
                TrioIngestClient(events) as ingest,
                SubscribeClient(pushes) as subscriber,
                trio.open_nursery() as nursery,
            ):

                async def follow() -> None:
                    async for batch in subscriber.subscribe(0):
                        seen.extend(record.sort_key for record in batch)
                        if len(seen) >= 40:
                            return

                nursery.start_soon(follow)
                for n in range(40):
                    if n == 20:
                        while len(seen) < 20:  # live on the primary, not waiting at b
                            await trio.sleep(0.05)
                        a.send_signal(signal.SIGKILL)
                    record = {"execution_id": n, "payload": '{"event_type": "e"}'}
                    published.append((await ingest.publish(record, timeout=30)).sort_key)
        assert seen == published == list(range(1, 41))


def test_the_readme_pair_starts_a_primary_and_its_standby(tmp_path: Path) -> None:
    """examples/pair.sh, as the README runs it (on free ports here)."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("CMDBUS_")}
    env["CMDBUS_PAIR_BASE"] = "0"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    root = Path(__file__).resolve().parents[2]
    pair = subprocess.Popen(
        ["sh", str(root / "examples" / "pair.sh"), str(tmp_path / "pair")],
        env=env, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        files = [tmp_path / "pair" / name / "ports.json" for name in ("a", "b")]
        until(lambda: all(f.exists() for f in files))
        a_ports, b_ports = (json.loads(f.read_text()) for f in files)
        until(lambda: ha(a_ports)["role"] == "primary" and ha(b_ports)["role"] == "standby")
        assert ha(b_ports)["primary"] == "a"
    finally:
        os.killpg(pair.pid, signal.SIGTERM)
        assert pair.wait(30) is not None
