"""Disk faults poison only the store they hit: its writes answer `unavailable`, its reads
go on, `/readyz` turns 503, the other stores keep serving; after a restart on a healthy
disk the store opens clean and nothing acknowledged is lost."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.client import Unavailable
from cmdbus_trio.client.blocking import ClaimClient, IngestClient, TierClient

from ..helpers import serving


def get(ports: dict[str, str], path: str, method: str = "GET") -> tuple[int, Any]:
    request = urllib.request.Request(f"http://{ports['control']}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def command(n: int) -> dict[str, Any]:
    return {"execution_id": n, "payload": json.dumps({"n": n})}


@pytest.mark.once
def test_an_ack_that_could_not_be_made_durable_is_refused_and_redelivered(
    tmp_path: Path,
) -> None:
    with serving(tmp_path, CMDBUS_DEBUG_HOOKS="true") as (process, ports):
        with IngestClient.connect(ports["cmd_ingest"]) as ingest:
            sort_key = ingest.publish(command(1)).sort_key
        with ClaimClient.connect(ports["cmd_claim"]) as claim:
            delivery = claim.next("commands.>", wait=1)
            assert delivery is not None and delivery.sort_key == sort_key
            assert get(ports, "/debug/fail-writes?store=commands&error=eio", "POST")[0] == 202
            with pytest.raises(Unavailable, match="commands store is poisoned"):
                claim.ack(sort_key)  # not durable: not acked
            again = claim.next("commands.>", wait=1)  # back in the claim index at once
            assert again is not None and again.sort_key == sort_key and again.redelivered
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    with serving(tmp_path) as (_, ports), ClaimClient.connect(ports["cmd_claim"]) as claim:
        after_restart = claim.next("commands.>", wait=1)
        assert after_restart is not None and after_restart.sort_key == sort_key


@pytest.mark.parametrize("error", ["eio", "enospc"])
@pytest.mark.once
def test_a_failing_bus_store_is_poisoned_alone(tmp_path: Path, error: str) -> None:
    hooks = {"CMDBUS_DEBUG_HOOKS": "true"}
    with serving(tmp_path, **hooks) as (process, ports):
        with IngestClient.connect(ports["cmd_ingest"]) as ingest:
            acknowledged = [ingest.publish(command(n)).sort_key for n in range(5)]
            status, _ = get(ports, f"/debug/fail-writes?store=commands&error={error}", "POST")
            assert status == 202
            with pytest.raises(Unavailable, match="commands store is poisoned"):
                ingest.publish(command(99))
            with pytest.raises(Unavailable):  # and it stays so
                ingest.publish(command(100))
        status, ready = get(ports, "/readyz")
        assert status == 503 and any("store commands poisoned" in r for r in ready["reasons"])
        # Reads of the poisoned store, and the other stores, keep working.
        with ClaimClient.connect(ports["cmd_claim"]) as claim:
            assert claim.lag().total == 5
            delivery = claim.next("commands.>", wait=1)
            assert delivery is not None and delivery.record == command(0)
        with TierClient.connect(ports["tier"]) as tier:
            assert tier.append("e", "{}").global_sequence == 1
        with IngestClient.connect(ports["evt_ingest"]) as events:
            assert events.publish(command(1)).sort_key == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    with serving(tmp_path) as (_, ports):
        assert get(ports, "/readyz")[0] == 200
        with ClaimClient.connect(ports["cmd_claim"]) as claim:
            delivered = []
            while (delivery := claim.next("commands.>", wait=0.5)) is not None:
                delivered.append(delivery.sort_key)
                claim.ack(delivery.sort_key)
        assert delivered == acknowledged  # the refused publishes were never stored
        with IngestClient.connect(ports["cmd_ingest"]) as ingest:
            assert ingest.publish(command(6)).sort_key > acknowledged[-1]


@pytest.mark.once
def test_a_full_disk_poisons_the_tier_store_and_a_restart_recovers(tmp_path: Path) -> None:
    """A real write failure: the kernel refuses to grow a file past RLIMIT_FSIZE (EFBIG),
    as a full disk would; the bus files stay small and keep working."""
    acknowledged: dict[int, str] = {}
    # A tier append of 8 KB writes about 32 KB of WAL (pointer-map pages included since
    # auto_vacuum): a 1 MiB limit fails one after some thirty.
    with serving(tmp_path, file_size_limit=1024 * 1024) as (process, ports):
        with TierClient.connect(ports["tier"]) as tier:
            for n in range(1000):
                payload = json.dumps({"n": n, "pad": "x" * 8000})
                try:
                    acknowledged[tier.append("big", payload, timeout=10).global_sequence] = payload
                except Unavailable as exc:
                    assert "tier store is poisoned" in str(exc)
                    break
            else:
                raise AssertionError("the file-size limit never failed a write")
            with pytest.raises(Unavailable):
                tier.append("other", "{}")
            page = tier.read_execution("big", limit=5)  # reads go on
            assert [r.global_sequence for r in page.records] == sorted(acknowledged)[:5]
        status, ready = get(ports, "/readyz")
        assert status == 503 and any("store tier poisoned" in r for r in ready["reasons"])
        with IngestClient.connect(ports["cmd_ingest"]) as ingest:
            assert ingest.publish(command(1)).sort_key == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    assert len(acknowledged) > 10
    with serving(tmp_path) as (_, ports):
        assert get(ports, "/readyz")[0] == 200
        with TierClient.connect(ports["tier"]) as tier:
            stored = {r.global_sequence: r.payload for r in tier.read_all("big")}
            assert all(stored.get(seq) == payload for seq, payload in acknowledged.items())
            assert tier.append("big", "{}").global_sequence > max(acknowledged)


@pytest.mark.once
def test_the_fault_hook_is_off_by_default_and_checks_its_input(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, ports):
        assert get(ports, "/debug/fail-writes?store=commands", "POST")[0] == 404
    with serving(tmp_path, CMDBUS_DEBUG_HOOKS="true") as (_, ports):
        status, body = get(ports, "/debug/fail-writes?store=nope", "POST")
        assert status == 400 and "commands" in body["error"]
        assert get(ports, "/debug/fail-writes?store=tier&error=x", "POST")[0] == 400
        assert get(ports, "/debug/fail-writes?store=tier")[0] == 405
