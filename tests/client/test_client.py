"""The trio and blocking clients against real `cmdbus-trio serve` subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.client import (
    Busy,
    CannotConnect,
    Conflict,
    ConnectionLost,
    DeadlineExceeded,
    Invalid,
    RetryBudget,
    RetryPolicy,
    ShardMap,
    Unsupported,
    blocking,
)
from cmdbus_trio.client.trio import (
    ClaimClient,
    Connection,
    IngestClient,
    Router,
    ShardedClaimClient,
    SubscribeClient,
    TierClient,
)
from cmdbus_trio.protocol.subjects import shard_of

from ..helpers import metric_sum, metrics_text, serving

WRITER_SETTINGS = {"CMDBUS_TIER_MAX_WAITERS": "256", "CMDBUS_MAX_DELIVER": "1"}  # `server`'s


@pytest.fixture(scope="module")
def tiny_gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One tier slot and no queue: a second concurrent request is shed at once."""
    gate = {
        "CMDBUS_TIER_MAX_INFLIGHT": "1",
        "CMDBUS_TIER_MAX_PENDING_WRITES": "1",
        "CMDBUS_TIER_MAX_WAITERS": "0",
    }
    with serving(tmp_path_factory.mktemp("tiny"), **gate) as (_, ports):
        yield ports


counter = iter(range(1, 1 << 30))


def new_execution() -> str:
    return f"client-{next(counter)}"


def command(execution_id: Any, pool: str = "shared") -> dict[str, Any]:
    return {"execution_id": execution_id, "payload": json.dumps({"execution_pool": pool})}


# --- trio client ------------------------------------------------------------------------


async def test_tier_ops(server: dict[str, str]) -> None:
    execution = new_execution()
    with trio.fail_after(20):
        async with await TierClient.connect(server["tier"]) as tier:
            assert tier.server is not None and tier.server.face == "tier"
            assert (await tier.health())["status"] == "ok"
            first = await tier.append(execution, '{"event_id": "a"}', timeout=5)
            assert not first.deduplicated
            again = await tier.append(execution, '{"event_id": "a"}')
            assert again.deduplicated and again.global_sequence == first.global_sequence
            batch = await tier.append_batch(execution, [f'{{"n": {n}}}' for n in range(5)])
            assert (batch.appended, batch.requested, len(batch.results)) == (5, 5, 5)
            with pytest.raises(Conflict):
                await tier.append(execution, "{}", expected_version=0)
            assert (await tier.append(execution, "{}", expected_version=6)).log_record_count
            page = await tier.read_execution(execution, limit=3)
            assert page.exists and page.record_count == 7 and len(page.records) == 3
            assert page.next_after == page.records[-1].global_sequence
            records = [record async for record in tier.read_all(execution)]
            assert [r.payload for r in records][:2] == ['{"event_id": "a"}', '{"n": 0}']
            assert len(records) == 7 and records[0].execution_id == execution
            scanned = await tier.scan(after=records[-1].global_sequence - 1, limit=10)
            assert scanned.records[0].global_sequence == records[-1].global_sequence
            other = await tier.read_execution(execution, tier="projection")
            assert not other.exists and other.records == ()
            assert await tier.delete_execution(execution, timeout=5) == 7
            assert not (await tier.read_execution(execution)).exists
            assert await tier.delete_execution(execution, tier="projection") == 0


async def test_errors_are_typed_and_name_the_field(server: dict[str, str]) -> None:
    with trio.fail_after(20):
        async with await TierClient.connect(server["tier"]) as tier:
            with pytest.raises(Invalid, match="payload"):
                await tier.append(new_execution(), "not json")
            with pytest.raises(Unsupported):
                await tier.call(tier_call("nope"))
            assert (await tier.health())["status"] == "ok"  # the connection stays usable


def tier_call(op: str) -> Any:
    from cmdbus_trio.client import Call

    return Call(op, {}, dict, idempotent=True)


async def test_ingest_claim_and_dead(server: dict[str, str]) -> None:
    execution = new_execution()
    with trio.fail_after(20):
        async with (
            await IngestClient.connect(server["cmd_ingest"]) as ingest,
            await ClaimClient.connect(server["cmd_claim"]) as claim,
        ):
            published = await ingest.publish(command(execution, "clienttest"), msg_id=execution)
            assert published.subject == "commands.clienttest.shard.0"
            repeat = await ingest.publish(command(execution, "clienttest"), msg_id=execution)
            assert repeat.duplicate and repeat.sort_key == published.sort_key
            keys = await ingest.publish_batch([command(execution, "clienttest")] * 2)
            assert keys == [published.sort_key + 1, published.sort_key + 2]
            with pytest.raises(Invalid, match="records"):
                await ingest.publish_batch([])

            lag = await claim.lag("commands.clienttest.>")
            assert lag.subjects == {"commands.clienttest.shard.0": 3} and lag.total == 3
            delivery = await claim.next("commands.clienttest.>", wait=1)
            assert delivery is not None and delivery.sort_key == published.sort_key
            assert delivery.record["execution_id"] == execution and delivery.deliveries == 1
            assert await claim.extend(delivery.sort_key)
            assert await claim.ack(delivery.sort_key)
            assert not await claim.ack(delivery.sort_key)
            second = await claim.next("commands.clienttest.>", wait=1)
            assert second is not None
            assert await claim.nack(second.sort_key)  # max_deliver 1: parked as dead
            third = await claim.next("commands.clienttest.>", wait=1)
            assert third is not None and await claim.ack(third.sort_key)
            assert await claim.next("commands.clienttest.>", wait=0.05) is None
            dead = await claim.dead("commands.clienttest.>")
            assert [d.sort_key for d in dead.records] == [second.sort_key]
            assert dead.next_after is None
            with pytest.raises(Invalid, match="group"):
                await claim.lag(group="nope")


async def test_event_groups_and_subscribe(server: dict[str, str]) -> None:
    execution = new_execution()
    event = {"execution_id": execution, "payload": json.dumps({"event_type": "client.test"})}
    with trio.fail_after(20):
        async with (
            await IngestClient.connect(server["evt_ingest"]) as ingest,
            await ClaimClient.connect(server["evt_claim"]) as claim,
            await SubscribeClient.connect(server["evt_subscribe"]) as subscriber,
        ):
            first = await ingest.publish(event)
            delivery = await claim.next("events.client_test", group="g1", start="beginning", wait=1)
            assert delivery is not None and delivery.sort_key == first.sort_key
            assert await claim.ack(delivery.sort_key, group="g1")
            stream = subscriber.subscribe(first.sort_key - 1, filter="events.client_test")
            seen = (await anext(stream))[0]
            assert (seen.sort_key, seen.subject) == (first.sort_key, "events.client_test")
            live = await ingest.publish(event)
            batch = await anext(stream)
            assert [r.sort_key for r in batch] == [live.sort_key]
            await stream.aclose()


async def test_pipelining_many_tasks_share_one_connection(server: dict[str, str]) -> None:
    executions = [new_execution() for _ in range(40)]
    results: dict[str, int] = {}

    async def append_twice(tier: TierClient, execution: str) -> None:
        await tier.append(execution, "{}")
        results[execution] = (
            await tier.append(execution, "{}", expected_version=1)
        ).global_sequence

    with trio.fail_after(30):
        async with await TierClient.connect(server["tier"]) as tier:
            async with trio.open_nursery() as nursery:
                for execution in executions:
                    nursery.start_soon(append_twice, tier, execution)
            for execution in executions:
                page = await tier.read_execution(execution)
                assert page.record_count == 2
                assert page.records[-1].global_sequence == results[execution]


async def test_a_late_reply_after_a_cancelled_call_is_dropped(server: dict[str, str]) -> None:
    with trio.fail_after(20):
        async with await ClaimClient.connect(server["cmd_claim"]) as claim:
            with trio.move_on_after(0.05):
                await claim.next("commands.nothing-here.>", wait=0.3)
            await trio.sleep(0.4)  # its null delivery arrives now, for nobody
            assert (await claim.lag("commands.nothing-here.>")).total == 0


async def test_deadline_is_sent_and_answered(tiny_gate: dict[str, str]) -> None:
    prefix = 'cmdbus_shed_total{face="tier",op="read_execution",reason="deadline"}'
    before = metric_sum(metrics_text(tiny_gate), prefix)
    with trio.fail_after(20):
        async with await TierClient.connect(tiny_gate["tier"]) as tier:
            with pytest.raises(DeadlineExceeded):
                await tier.read_execution(new_execution(), timeout=0.0005)  # deadline_ms 0
            await tier.read_execution(new_execution(), timeout=5)  # still usable
        while True:
            shed = metric_sum(await trio.to_thread.run_sync(metrics_text, tiny_gate), prefix)
            if shed == before + 1:
                break
            await trio.sleep(0.02)


async def append_from_many_connections(
    address: str, clients: int, policy: RetryPolicy | None = None
) -> list[Busy | None]:
    """One append on each of ``clients`` connections at once: lone requests, which a
    full Gate sheds at once (a pipelining client is held back instead)."""
    outcomes: list[Busy | None] = []

    async def append(tier: TierClient) -> None:
        try:
            await tier.append(new_execution(), "{}")
            outcomes.append(None)
        except Busy as error:
            outcomes.append(error)

    connections = [await TierClient.connect(address, retry=policy) for _ in range(clients)]
    async with trio.open_nursery() as nursery:
        for tier in connections:
            nursery.start_soon(append, tier)
    for tier in connections:
        await tier.aclose()
    return outcomes


async def test_busy_carries_retry_after(tiny_gate: dict[str, str]) -> None:
    with trio.fail_after(30):
        errors = [e for e in await append_from_many_connections(tiny_gate["tier"], 30) if e]
    assert errors, "one slot and no queue: concurrent appends must be shed"
    assert all(e.retry_after_ms and e.retry_after_ms > 0 for e in errors)
    assert "waiters_full" in errors[0].message


async def test_a_pipelining_client_is_held_back_not_shed(tiny_gate: dict[str, str]) -> None:
    """With the Gate full, a client's further requests wait in its socket for room (up to
    shed_after) instead of being read only to be refused."""
    prefix = 'cmdbus_shed_total{face="tier",op="append"'
    before = metric_sum(await trio.to_thread.run_sync(metrics_text, tiny_gate), prefix)
    done: list[int] = []

    async def append(tier: TierClient) -> None:
        done.append((await tier.append(new_execution(), "{}")).global_sequence)

    with trio.fail_after(30):
        async with (
            await TierClient.connect(tiny_gate["tier"]) as tier,
            trio.open_nursery() as nursery,
        ):
            for _ in range(30):
                nursery.start_soon(append, tier)
    assert len(done) == 30
    after = metric_sum(await trio.to_thread.run_sync(metrics_text, tiny_gate), prefix)
    assert after - before <= 1  # at most its first request, shed before it was held back


async def test_retries_honour_the_budget(tiny_gate: dict[str, str]) -> None:
    prefix = 'cmdbus_request_duration_seconds_count{face="tier",op="append"'
    before = metric_sum(await trio.to_thread.run_sync(metrics_text, tiny_gate), prefix)
    budget = RetryBudget(ratio=0.1, initial=2)
    policy = RetryPolicy(attempts=20, base_delay=0.001, max_delay=0.005, budget=budget)
    with trio.fail_after(60):
        outcomes = await append_from_many_connections(tiny_gate["tier"], 60, policy)
    stats = budget.statistics()
    assert stats.requests == 60 and len(outcomes) == 60
    assert 0 < stats.retries <= 0.1 * stats.requests + 2
    assert stats.refused > 0 and any(outcomes)  # the budget stopped retries
    after = metric_sum(await trio.to_thread.run_sync(metrics_text, tiny_gate), prefix)
    assert after - before == stats.requests + stats.retries  # what the server saw


async def test_connection_lost_then_reconnect(tmp_path: Path) -> None:
    """With no reconnect window, a lost writer raises at once, and the next call after
    it is back reconnects (tests/client/test_reconnect.py: the window)."""
    with serving(tmp_path) as (process, ports):
        async with await TierClient.connect(ports["tier"], reconnect_for=0) as tier:
            await tier.health()
            process.kill()
            process.wait()
            with trio.fail_after(10), pytest.raises(ConnectionLost):
                await tier.health()
            with trio.fail_after(10), pytest.raises(ConnectionLost, match="cannot connect"):
                await tier.health()
    with serving(tmp_path, f"--tier-bind={ports['tier']}") as (_, again):
        with trio.fail_after(10):
            await tier_connect_health(again["tier"])


async def tier_connect_health(address: str) -> None:
    async with await TierClient.connect(address) as tier:
        assert (await tier.health())["status"] == "ok"


async def test_router_sends_each_record_to_its_shard(tmp_path: Path) -> None:
    for shard in range(3):
        (tmp_path / f"w{shard}").mkdir()
    with (
        serving(tmp_path / "w0", CMDBUS_SHARD="0", CMDBUS_SHARD_COUNT="3") as (_, w0),
        serving(tmp_path / "w1", CMDBUS_SHARD="1", CMDBUS_SHARD_COUNT="3") as (_, w1),
        serving(tmp_path / "w2", CMDBUS_SHARD="2", CMDBUS_SHARD_COUNT="3") as (_, w2),
    ):
        writers = [w0, w1, w2]
        shards = ShardMap.parse(",".join(f"{i}@{w['cmd_ingest']}" for i, w in enumerate(writers)))
        ids: list[Any] = [*range(40), *(f"exec-{n}" for n in range(20))]
        with trio.fail_after(30):
            async with Router(shards) as router:
                for execution_id in ids:
                    published = await router.publish(command(execution_id))
                    assert published.subject.endswith(f".{shard_of(execution_id, 3)}")
            for shard, writer in enumerate(writers):
                async with await ClaimClient.connect(writer["cmd_claim"]) as claim:
                    lag = await claim.lag()
                expected = sum(1 for e in ids if shard_of(e, 3) == shard)
                assert lag.total == expected > 0
        # A writer refuses what belongs to another shard: the router's shard function is
        # the server's.
        wrong = next(e for e in ids if shard_of(e, 3) != 0)
        async with await IngestClient.connect(w0["cmd_ingest"]) as ingest:
            with pytest.raises(Invalid, match="shard"):
                await ingest.publish(command(wrong))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "at least one"),
        ("0@127.0.0.1:1,2@127.0.0.1:3", "shards 1 of 0..2 have no writer"),
        ("0@127.0.0.1:1,0@127.0.0.1:1", "'0@127.0.0.1:1' is listed twice"),
        ("x@127.0.0.1:1", "expected SHARD@HOST:PORT"),
        ("0@127.0.0.1", "expected HOST:PORT"),
        ("0@127.0.0.1:99999", "expected HOST:PORT"),
    ],
)
def test_shard_map_refuses_what_does_not_cover_every_shard(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ShardMap.parse(text)


def test_shard_map_parses() -> None:
    shards = ShardMap.parse(" 1@[::1]:2, 0@h:1 ")
    assert shards.addresses == ("h:1", "[::1]:2") and shards.shard_count == 2
    pair = ShardMap.parse("0@a:1,1@c:3,0@b:2")  # shard 0: two members of a pair
    assert pair.addresses == ("a:1,b:2", "c:3") and pair.shard_count == 2


def test_retry_delay_honours_retry_after_and_jitters() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    assert all(0.5 <= policy.delay(Busy("x", retry_after_ms=500), 1) <= 0.6 for _ in range(50))
    delays = {policy.delay(Busy("x"), 3) for _ in range(50)}
    assert all(0 <= d <= 0.4 for d in delays) and len(delays) > 1
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="ratio"):
        RetryBudget(ratio=2)


def test_retry_only_what_is_safe() -> None:
    from cmdbus_trio.client import Unavailable, _calls

    policy = RetryPolicy(attempts=3, budget=RetryBudget(initial=100))
    plain = _calls.append(1, "{}")  # no expected_version: not safe to send twice
    keyed = _calls.publish({"execution_id": 1, "payload": "{}"}, msg_id="m")
    unkeyed = _calls.publish({"execution_id": 1, "payload": "{}"})
    assert unkeyed.fields["msg_id"] != keyed.fields["msg_id"]  # one of the client's own
    assert policy.should_retry(unkeyed, ConnectionLost("x"), 1)
    assert policy.should_retry(plain, Busy("x"), 1)
    assert not policy.should_retry(plain, Busy("x"), 3)  # attempts spent
    assert not policy.should_retry(plain, Unavailable("x"), 1)
    assert not policy.should_retry(plain, ConnectionLost("x"), 1)
    assert policy.should_retry(keyed, ConnectionLost("x"), 1)
    assert not policy.should_retry(keyed, Invalid("x"), 1)
    assert policy.should_retry(plain, CannotConnect("x"), 1)  # nothing was sent


async def test_connect_refused_is_cannot_connect_in_both_clients() -> None:
    """A connection never made (nothing sent) is CannotConnect, a ConnectionLost: any
    call may be retried (a writer that is starting); a broken one is not."""
    from cmdbus_trio.client import blocking

    with trio.fail_after(10), pytest.raises(CannotConnect, match="cannot connect"):
        await Connection.connect("127.0.0.1:1")
    with pytest.raises(CannotConnect, match="cannot connect"):
        blocking.Connection.connect("127.0.0.1:1")


# --- blocking client --------------------------------------------------------------------


def test_blocking_every_face(server: dict[str, str]) -> None:
    execution = new_execution()
    with blocking.TierClient.connect(server["tier"]) as tier:
        tier.append(execution, "{}", timeout=5)
        tier.append_batch(execution, ["{}"] * 1200)
        assert len(list(tier.read_all(execution))) == 1201  # two pages
        assert tier.read_execution(execution, limit=1).next_after is not None
        assert tier.scan(limit=1).records
        with pytest.raises(Conflict):
            tier.append(execution, "{}", expected_version=0)
        results = tier.call_many([_append(execution, n) for n in range(3)] + [_bad()])
        counts = sorted(r.log_record_count for r in results[:3])  # the tier face may reorder
        assert counts == [counts[0], counts[0] + 1, counts[0] + 2]
        assert isinstance(results[3], Invalid)
    with (
        blocking.IngestClient.connect(server["cmd_ingest"]) as ingest,
        blocking.ClaimClient.connect(server["cmd_claim"]) as claim,
    ):
        published = ingest.publish(command(execution, "blocking"))
        assert ingest.publish_batch([command(execution, "blocking")]) == [published.sort_key + 1]
        assert claim.lag("commands.blocking.>").total == 2
        delivery = claim.next("commands.blocking.>", wait=1)
        assert delivery is not None and claim.ack(delivery.sort_key)
        nxt = claim.next("commands.blocking.>", wait=1)
        assert nxt is not None and claim.extend(nxt.sort_key) and claim.ack(nxt.sort_key)
        assert claim.next("commands.blocking.>", wait=0.05) is None
        assert claim.dead("commands.blocking.>").records == ()
    event = {"execution_id": execution, "payload": json.dumps({"event_type": "blocking"})}
    with (
        blocking.IngestClient.connect(server["evt_ingest"]) as ingest,
        blocking.SubscribeClient.connect(server["evt_subscribe"]) as subscriber,
    ):
        key = ingest.publish(event).sort_key
        batch = next(subscriber.subscribe(key - 1, filter="events.blocking"))
        assert [r.sort_key for r in batch] == [key]


def _append(execution: str, n: int) -> Any:
    from cmdbus_trio.client import _calls

    return _calls.append(execution, f'{{"n": {n}}}')


def _bad() -> Any:
    from cmdbus_trio.client import _calls

    return _calls.append("", "{}")


def test_blocking_deadline_and_router(tiny_gate: dict[str, str]) -> None:
    with blocking.TierClient.connect(tiny_gate["tier"]) as tier:
        with pytest.raises(DeadlineExceeded):
            tier.read_execution("x", timeout=0.0005)
        assert tier.health()["status"] == "ok"
    with blocking.Router(ShardMap.parse(f"0@{tiny_gate['cmd_ingest']}")) as router:
        assert router.publish(command(new_execution())).subject == "commands.shared.shard.0"
    with pytest.raises(ConnectionLost, match="cannot connect"):
        blocking.Connection.connect("127.0.0.1:1")


def test_blocking_client_never_imports_trio(server: dict[str, str]) -> None:
    script = f"""
import sys
sys.modules["trio"] = None  # any import of trio now fails
from cmdbus_trio.client.blocking import TierClient
with TierClient.connect({server["tier"]!r}) as tier:
    print(tier.health()["status"])
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


async def test_the_sharded_trio_claim_client_claims_acks_and_waits(
    server: dict[str, str],
) -> None:
    # One shard is enough for the I/O of the loop; its policy is tests/client/test_claim_rounds.py.
    execution = new_execution()
    shards = ShardMap.parse(f"0@{server['cmd_claim']}")
    with trio.fail_after(20):
        async with await IngestClient.connect(server["cmd_ingest"]) as ingest:
            published = await ingest.publish(command(execution, "shardedtrio"))
        async with ShardedClaimClient(shards) as cluster:
            claimed = await cluster.next("commands.shardedtrio.>", wait=1)
            assert claimed is not None and claimed.shard == 0
            assert claimed.delivery.sort_key == published.sort_key
            assert await cluster.ack(claimed)
            assert await cluster.next("commands.shardedtrio.>", wait=0.05) is None
            with pytest.raises(Invalid) as raised:
                await cluster.next("commands..shard", wait=0)  # an empty token
            assert raised.value.shard == 0


async def test_batches_in_the_trio_and_sharded_clients(server: dict[str, str]) -> None:
    execution = new_execution()
    shards = ShardMap.parse(f"0@{server['cmd_claim']}")
    with trio.fail_after(20):
        async with await IngestClient.connect(server["cmd_ingest"]) as ingest:
            keys = await ingest.publish_batch([command(execution, "batchtrio")] * 5)
        async with await ClaimClient.connect(server["cmd_claim"]) as claim:
            batch = await claim.next_batch("commands.batchtrio.>", 3, wait=1)
            assert [d.sort_key for d in batch] == keys[:3]
            assert batch[0].record["execution_id"] == execution
            assert await claim.extend_many([keys[0], 1 << 62]) == [True, False]
            assert await claim.nack_many([keys[2]]) == [True]  # after ack_wait
            assert await claim.ack_many([keys[0], keys[1], keys[2]]) == [True, True, False]
        async with ShardedClaimClient(shards) as cluster:
            claimed = await cluster.next_batch("commands.batchtrio.>", 10, wait=1)
            assert [(c.shard, c.delivery.sort_key) for c in claimed] == [(0, k) for k in keys[3:]]
            assert await cluster.ack_many(claimed) == [True, True]
            assert await cluster.next_batch("commands.batchtrio.>", 10, wait=0.05) == []


def test_batches_in_the_blocking_client(server: dict[str, str]) -> None:
    execution = new_execution()
    with (
        blocking.IngestClient.connect(server["cmd_ingest"]) as ingest,
        blocking.ClaimClient.connect(server["cmd_claim"]) as claim,
    ):
        keys = ingest.publish_batch([command(execution, "batchblocking")] * 3)
        batch = claim.next_batch("commands.batchblocking.>", 1000, wait=1)
        assert [d.sort_key for d in batch] == keys
        assert claim.ack_many(keys) == [True] * 3
        assert claim.next_batch("commands.batchblocking.>", 1, wait=0.05) == []


# --- idle gaps longer than the server's idle timeout ------------------------------------


@pytest.fixture(scope="module")
def quick_idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with serving(tmp_path_factory.mktemp("idle"), CMDBUS_IDLE_TIMEOUT_MS="300") as (_, ports):
        yield ports


async def test_the_trio_client_reconnects_after_the_server_idled_it_out(
    quick_idle: dict[str, str],
) -> None:
    """A server between bursts, a worker between executions: each call after an idle gap
    longer than the writer's idle timeout works, without a retry policy and for calls
    that are not idempotent (a publish without msg_id, a next)."""
    with trio.fail_after(10):
        async with (
            await IngestClient.connect(quick_idle["cmd_ingest"]) as ingest,
            await ClaimClient.connect(quick_idle["cmd_claim"]) as claim,
        ):
            for _ in range(2):
                await trio.sleep(0.6)  # twice the idle timeout
                published = await ingest.publish(command(new_execution(), "idle_trio"))
                await trio.sleep(0.6)
                delivery = await claim.next("commands.idle_trio.>", wait=1)
                assert delivery is not None and delivery.sort_key == published.sort_key
                assert await claim.ack(delivery.sort_key)


def test_the_blocking_client_reconnects_after_the_server_idled_it_out(
    quick_idle: dict[str, str],
) -> None:
    with (
        blocking.IngestClient.connect(quick_idle["cmd_ingest"], connect_timeout=5) as ingest,
        blocking.ClaimClient.connect(quick_idle["cmd_claim"], connect_timeout=5) as claim,
    ):
        for _ in range(2):
            time.sleep(0.6)
            published = ingest.publish(command(new_execution(), "idle_blocking"))
            time.sleep(0.6)
            delivery = claim.next("commands.idle_blocking.>", wait=1)
            assert delivery is not None and delivery.sort_key == published.sort_key
            assert claim.ack(delivery.sort_key)
