"""The tier face under load and faults: shedding, disconnects, SIGKILL, poisoning."""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.config import Config
from cmdbus_trio.protocol.pages import Fragments
from cmdbus_trio.storage.tier import NewRecord, TierStore

from ..helpers import frame_client, get, running_writer, serving


@pytest.mark.once
async def test_overload_sheds_busy_while_healthz_answers_within_1s(tmp_path: Path) -> None:
    tiny_gate = {
        "CMDBUS_TIER_MAX_INFLIGHT": "1",
        "CMDBUS_TIER_MAX_WAITERS": "1",
        "CMDBUS_TIER_SHED_AFTER_MS": "50",
        "CMDBUS_TIER_MAX_PENDING_WRITES": "1",
    }
    with serving(tmp_path, **tiny_gate) as (_, ports):
        outcomes: dict[str, int] = {}
        busy_replies: list[dict[str, object]] = []
        probes: list[int] = []

        async def client(n: int) -> None:
            async with frame_client(ports["tier"]) as tier:
                for i in range(40):
                    reply = await tier.request(
                        "append", execution_id=f"load-{n}", payload=json.dumps({"i": i})
                    )
                    code = "ok" if reply["ok"] else reply["error"]["code"]
                    outcomes[code] = outcomes.get(code, 0) + 1
                    if code == "busy":
                        busy_replies.append(reply["error"])

        async def probe(done: trio.Event) -> None:
            while not done.is_set():
                with trio.fail_after(1):  # the point of the whole design
                    probes.append((await get(ports["control"], "/healthz")).status)
                await trio.sleep(0.02)

        with trio.fail_after(60):
            done = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(probe, done)
                async with trio.open_nursery() as clients:
                    for n in range(12):
                        clients.start_soon(client, n)
                done.set()
        assert outcomes.get("busy", 0) > 0, outcomes
        assert outcomes.get("ok", 0) > 0, outcomes
        assert set(outcomes) <= {"ok", "busy"}, outcomes
        assert all(error["message"] in ("waiters_full", "queue_timeout") for error in busy_replies)
        assert all(error["retry_after_ms"] == 50 for error in busy_replies)
        assert probes and set(probes) == {200}
        text = (await get(ports["control"], "/metrics")).body.decode()
        assert 'cmdbus_shed_total{face="tier",op="append",reason=' in text
        assert 'outcome="busy"' in text


async def test_a_client_leaving_mid_read_frees_its_slot_within_a_page(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(tier_bind="127.0.0.1:0", tier_max_inflight=1)
    pages_served: list[int] = []
    with trio.fail_after(30):
        async with running_writer(config) as (writer, addresses):
            store = writer._stores["tier"].store
            await slow_big_execution(store, 4000, seconds_a_page=0.3, served=pages_served)
            gate = writer.health.gates["tier"]
            async with frame_client(addresses["tier"]) as client:
                await client.send(b'{"id": 1, "op": "read_execution", "execution_id": "big"}')
                while gate.statistics().inflight == 0:
                    await trio.sleep(0.01)
            left_at = trio.current_time()
            while gate.statistics().inflight:
                await trio.sleep(0.01)
            freed_after = trio.current_time() - left_at
    assert len(pages_served) < 4  # a full read needs 4 pages of 256 records (limit 1000)
    assert freed_after < 2.0


@pytest.mark.once
async def test_sigkill_after_acknowledged_appends_loses_nothing(tmp_path: Path) -> None:
    acked: dict[str, list[int]] = {}
    killed = trio.Event()

    async def writer_client(n: int, address: str) -> None:
        execution = f"durable-{n}"
        acked[execution] = []
        try:
            async with frame_client(address) as client:
                for i in range(1000):
                    reply = await client.request(
                        "append", execution_id=execution, payload=json.dumps({"i": i})
                    )
                    assert reply["ok"], reply
                    acked[execution].append(reply["global_sequence"])
        except (trio.BrokenResourceError, AssertionError):
            assert killed.is_set()  # only the kill may stop a client

    with serving(tmp_path) as (process, ports), trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(writer_client, n, ports["tier"])
            while sum(map(len, acked.values())) < 200:
                await trio.sleep(0.01)
            killed.set()
            process.send_signal(signal.SIGKILL)
        process.wait()
    total = sum(map(len, acked.values()))
    assert total >= 200
    with serving(tmp_path) as (_, ports), trio.fail_after(30):
        async with frame_client(ports["tier"]) as client:
            for execution, sequences in acked.items():
                stored: list[int] = []
                after = 0
                while after is not None:
                    page = await client.request(
                        "read_execution", execution_id=execution, after=after
                    )
                    stored += [record["global_sequence"] for record in page["records"]]
                    after = page["next_after"]
                missing = set(sequences) - set(stored)
                assert not missing, f"{execution}: acknowledged but lost: {sorted(missing)[:10]}"
            # Sequences keep ascending after the restart: none is reused.
            reply = await client.request("append", execution_id="after-restart", payload="{}")
            assert reply["global_sequence"] > max(max(s) for s in acked.values() if s)


async def test_a_poisoned_store_refuses_writes_and_the_writer_turns_unready(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(tier_bind="127.0.0.1:0")
    with trio.fail_after(30):
        async with running_writer(config) as (writer, addresses):
            control = addresses["control"]
            store: TierStore = writer._stores["tier"].store
            async with frame_client(addresses["tier"]) as client:
                assert (await client.request("append", execution_id="p", payload="{}"))["ok"]

                def io_error() -> None:
                    error = sqlite3.OperationalError("disk I/O error")
                    error.sqlite_errorcode = 10  # type: ignore[attr-defined]
                    raise error

                store.before_commit = io_error
                failed = await client.request("append", execution_id="p", payload="{}")
                store.before_commit = None
                assert failed["error"]["code"] == "unavailable"
                assert "poisoned" in failed["error"]["message"]
                again = await client.request("append", execution_id="p", payload="{}")
                assert again["error"]["code"] == "unavailable"
                read = await client.request("read_execution", execution_id="p")
                assert read["record_count"] == 1  # reads keep working
                assert (await client.request("health"))["ok"]
            async with frame_client(addresses["tier"], v2=False) as v1:
                reply = await v1.v1({"op": "append", "execution_id": "p", "payload": "{}"})
                assert reply is not None and reply.startswith(b"unavailable tier store is poisoned")
            readyz = await get(control, "/readyz")
            assert readyz.status == 503
            assert readyz.json()["reasons"] == [
                "store tier poisoned: OperationalError: disk I/O error"
            ]
            health = (await get(control, "/healthz")).json()
            assert health["stores"]["tier"]["state"] == "poisoned"
            state = metrics.REGISTRY.get_sample_value(
                "cmdbus_store_state", {"store": "tier", "state": "poisoned"}
            )
            assert state == 1


async def test_a_started_write_finishes_when_its_client_leaves(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(tier_bind="127.0.0.1:0")
    with trio.fail_after(30):
        async with running_writer(config) as (writer, addresses):
            store: TierStore = writer._stores["tier"].store
            gate = writer.health.gates["tier_writes"]  # appends have their own lane
            store.before_commit = lambda: time.sleep(0.5)  # a slow fsync
            async with frame_client(addresses["tier"]) as client:
                await client.send(
                    b'{"id": 1, "op": "append", "execution_id": "left", "payload": "{}"}'
                )
                while gate.statistics().inflight == 0:
                    await trio.sleep(0.01)
            # The client is gone; the write is still running and holds its Gate slot.
            assert gate.statistics().inflight == 1
            while gate.statistics().inflight:
                await trio.sleep(0.01)
            store.before_commit = None
            count = await run_in_thread(
                store.execution_count, "eventlog", "left", limiter=trio.CapacityLimiter(1)
            )
            assert count == 1


async def test_appends_waiting_for_the_store_commit_together_and_the_lane_sheds_past_its_slots(
    make_config: Callable[..., Config],
) -> None:
    """SQLite takes one writer: appends that arrive while a commit runs wait in the lane
    (seen, sheddable), not in threads behind the write lock, and the next transaction
    takes them all. Past ``tier_max_pending_writes`` they wait, then are shed."""
    config = make_config(
        tier_bind="127.0.0.1:0",
        tier_max_inflight=4,
        tier_max_pending_writes=6,
        tier_max_waiters=2,
        tier_shed_after_ms=10_000,
    )
    with trio.fail_after(30):
        async with running_writer(config) as (writer, addresses):
            store: TierStore = writer._stores["tier"].store
            gate = writer.health.gates["tier_writes"]
            assert gate.statistics().capacity == 6
            commits_before = tier_commits()
            store.before_commit = lambda: time.sleep(0.3)  # a slow fsync
            replies: list[dict[str, Any]] = []

            async def append(n: int) -> None:
                async with frame_client(addresses["tier"]) as client:
                    replies.append(
                        await client.request("append", execution_id=f"e{n}", payload="{}")
                    )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(append, 0)
                while gate.statistics().inflight == 0:  # the first one's commit runs
                    await trio.sleep(0.01)
                for n in range(1, 10):
                    nursery.start_soon(append, n)
                while gate.statistics().waiters < 2:
                    await trio.sleep(0.01)
                assert gate.statistics().inflight == 6
            codes = sorted("ok" if reply["ok"] else reply["error"]["message"] for reply in replies)
            assert codes == ["ok"] * 8 + ["waiters_full"] * 2, codes
            # The first alone, the five queued behind it together, then the two waiters
            # (together or not): one commit per append would be eight.
            assert tier_commits() - commits_before in (3, 4)
            sequences = {reply["global_sequence"] for reply in replies if reply["ok"]}
            assert len(sequences) == 8


async def test_an_append_waiting_for_the_lane_past_shed_after_is_shed_and_one_left_commits(
    make_config: Callable[..., Config],
) -> None:
    """An append waits for its lane slot as a callback, with no task: the Gate's timers
    shed it once it has waited shed_after (0.2 s: the commit ahead waits for longer). One whose
    client left while it waited is still committed once admitted, and frees its slot."""
    config = make_config(
        tier_bind="127.0.0.1:0",
        tier_max_pending_writes=1,
        tier_max_waiters=2,
        tier_shed_after_ms=200,
    )
    with trio.fail_after(30):
        async with running_writer(config) as (writer, addresses):
            store: TierStore = writer._stores["tier"].store
            gate = writer.health.gates["tier_writes"]
            fsynced = threading.Event()
            store.before_commit = lambda: fsynced.wait(10)  # a slow fsync, until set
            async with (
                frame_client(addresses["tier"]) as first,
                frame_client(addresses["tier"]) as second,
            ):
                await first.send(
                    b'{"id": 1, "op": "append", "execution_id": "first", "payload": "{}"}'
                )
                while gate.statistics().inflight == 0:
                    await trio.sleep(0.01)
                reply = await second.request("append", execution_id="shed", payload="{}")
                assert not reply["ok"] and "queue_timeout" in reply["error"]["message"], reply
                async with frame_client(addresses["tier"]) as leaving:
                    await leaving.send(
                        b'{"id": 1, "op": "append", "execution_id": "left", "payload": "{}"}'
                    )
                    while gate.statistics().waiters == 0:
                        await trio.sleep(0.01)
                store.before_commit = None
                fsynced.set()  # "left" is admitted well within its 0.2 s
                assert (await first.receive_json())["ok"]
            while gate.statistics().inflight or gate.statistics().waiters:
                await trio.sleep(0.01)
            counts = [
                await run_in_thread(
                    store.execution_count, "eventlog", name, limiter=trio.CapacityLimiter(1)
                )
                for name in ("first", "shed", "left")
            ]
    assert counts == [1, None, 1]


def tier_commits() -> float:
    name = "cmdbus_commit_batch_records_count"
    return metrics.REGISTRY.get_sample_value(name, {"store": "tier"}) or 0.0


async def test_appends_keep_flowing_while_reads_hold_every_read_slot(
    make_config: Callable[..., Config],
) -> None:
    """Issue 16 item 1: the tier's writes have their own lane. Reads that hold the read
    slot and fill its queue (each page slow) shed further reads, never an append; with
    one shared Gate (CMDBUS_TIER_WRITES=shared) the same appends are shed."""
    outcomes: dict[str, dict[str, int]] = {}
    for mode in ("lane", "shared"):
        config = make_config(
            tier_bind="127.0.0.1:0",
            tier_max_inflight=1,
            tier_max_waiters=1,
            tier_shed_after_ms=50,
            tier_writes=mode,
        )
        seen = outcomes[mode] = {}
        with trio.fail_after(60):
            async with running_writer(config) as (writer, addresses):
                store = writer._stores["tier"].store
                await slow_big_execution(store, 600, seconds_a_page=0.2)  # reads hold a slot

                async def reader(stop: trio.Event) -> None:
                    async with frame_client(addresses["tier"]) as client:
                        while not stop.is_set():
                            await client.request("read_execution", execution_id="big")

                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    for _ in range(3):
                        nursery.start_soon(reader, stop)
                    await trio.sleep(0.3)  # the read slot and its queue are taken
                    async with frame_client(addresses["tier"]) as appender:
                        for i in range(20):
                            reply = await appender.request(
                                "append", execution_id="small", payload=json.dumps({"i": i})
                            )
                            code = "ok" if reply["ok"] else reply["error"]["code"]
                            seen[code] = seen.get(code, 0) + 1
                    stop.set()
                if mode == "lane":
                    gates = writer.health.gates
                    assert gates["tier_writes"].statistics().admitted_total >= 20
                    assert gates["tier"].statistics().shed_total["waiters_full"] > 0
    assert outcomes["lane"] == {"ok": 20}, outcomes
    assert outcomes["shared"].get("busy", 0) > 0, outcomes


async def slow_big_execution(
    store: TierStore, records: int, *, seconds_a_page: float, served: list[int] | None = None
) -> None:
    """Store an execution "big" of ``records`` records, and make every page of its reads
    take ``seconds_a_page`` in the reading thread (each page's size noted in ``served``)."""
    batch = [NewRecord(json.dumps({"i": i})) for i in range(records)]
    await run_in_thread(
        store.append_batch, "eventlog", "big", batch, limiter=trio.CapacityLimiter(1)
    )
    original = store.iter_execution_encoded

    def slow_pages(tier: str, execution_id: str, *, after: int = 0) -> Iterator[Fragments]:
        for page in original(tier, execution_id, after=after):
            if served is not None:
                served.append(len(page))
            time.sleep(seconds_a_page)
            yield page

    store.iter_execution_encoded = slow_pages  # type: ignore[method-assign]
