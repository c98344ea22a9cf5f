"""Clients ride through a writer's restart by default (docs/clients.md, "Through a
writer's restart"): a call that cannot connect, loses its connection or is answered
`unavailable` waits and reconnects within the client's reconnect window, and raises
once the window is over; what is sent again is safe to send again."""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.client import CannotConnect, ConnectionLost, blocking
from cmdbus_trio.client.trio import ClaimClient, IngestClient, SubscribeClient, TierClient

from ..helpers import serving

RECORD = {"execution_id": 1, "payload": "{}"}


def same_ports(ports: dict[str, str]) -> dict[str, str]:
    """Settings that start a writer on the faces' ports of an earlier one."""
    return {f"CMDBUS_{face.upper()}_BIND": address for face, address in ports.items()}


def restart_in_background(
    tmp_path: Path, process: Any, ports: dict[str, str], how: signal.Signals, after: float
) -> tuple[threading.Thread, list[Any]]:
    """Stop the writer with ``how`` after ``after`` s, then start it again on the same
    ports; the new writer's process lands in the list (the caller stops it)."""
    started: list[Any] = []

    def restart() -> None:
        time.sleep(after)
        process.send_signal(how)
        process.wait()
        context = serving(tmp_path, **same_ports(ports))
        started.append((context, context.__enter__()))

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    return thread, started


def stop(started: list[Any]) -> None:
    for context, _ in started:
        context.__exit__(None, None, None)


@pytest.mark.slow  # started again on the same ports: one at a time (noxfile.IN_PARALLEL)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_a_worker_and_a_publisher_ride_through_a_restart(
    tmp_path: Path, how: signal.Signals
) -> None:
    """A worker parked in `next` and a publisher publishing one record every 20 ms,
    with default options, while the writer stops (drain or kill) and starts again on the
    same ports: no error reaches either; every record published is delivered once
    acknowledged, none is stored twice (the client's msg_ids)."""
    with trio.fail_after(90), serving(tmp_path) as (process, ports):
        published: list[int] = []
        delivered: set[int] = set()
        done = trio.Event()
        thread, started = restart_in_background(tmp_path, process, ports, how, after=0.5)
        try:

            async def publish() -> None:
                async with IngestClient(ports["cmd_ingest"]) as ingest:
                    for _ in range(100):
                        published.append((await ingest.publish(RECORD)).sort_key)
                        await trio.sleep(0.02)
                done.set()

            async def work() -> None:
                async with ClaimClient(ports["cmd_claim"]) as claim:
                    while not (done.is_set() and delivered >= set(published)):
                        delivery = await claim.next("commands.>", wait=0.5)
                        if delivery is not None:
                            delivered.add(delivery.sort_key)
                            await claim.ack(delivery.sort_key)  # False after a reconnect

            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish)
                nursery.start_soon(work)
            await trio.to_thread.run_sync(thread.join)
            assert started, "the writer was not started again"
            assert len(published) == 100 and len(set(published)) == 100
            assert delivered == set(published)
        finally:
            await trio.to_thread.run_sync(thread.join)
            stop(started)


@pytest.mark.slow  # started again on the same ports: one at a time (noxfile.IN_PARALLEL)
async def test_a_subscriber_resumes_after_the_last_record_it_received(tmp_path: Path) -> None:
    """Through a drain and a start on the same ports, a subscription goes on after the
    last record it received: every record once, in order, no gap."""
    with trio.fail_after(90), serving(tmp_path) as (process, ports):
        async with IngestClient(ports["evt_ingest"]) as ingest:
            for n in range(50):
                await ingest.publish({"execution_id": n, "payload": '{"event_type": "e"}'})
        thread, started = restart_in_background(tmp_path, process, ports, signal.SIGTERM, after=0.3)
        try:
            seen: list[int] = []
            async with SubscribeClient(ports["evt_subscribe"]) as subscriber:
                async for batch in subscriber.subscribe(0):
                    seen += [record.sort_key for record in batch]
                    if len(seen) == 50:
                        await trio.to_thread.run_sync(thread.join)  # restarted meanwhile
                        async with IngestClient(ports["evt_ingest"]) as again:
                            for n in range(50):
                                record = {"execution_id": n, "payload": '{"event_type": "e"}'}
                                await again.publish(record)
                    if len(seen) >= 100:
                        break
            assert seen == list(range(1, 101))
        finally:
            await trio.to_thread.run_sync(thread.join)
            stop(started)


async def test_a_writer_that_stays_away_is_named_once_the_window_ends() -> None:
    """Nothing listens at the address: the call waits out its window (0.5 s here),
    pausing between attempts, then raises, naming the address and the window."""
    tier = TierClient("127.0.0.1:1", reconnect_for=0.5)
    started = trio.current_time()
    with trio.fail_after(10), pytest.raises(CannotConnect, match=r"127\.0\.0\.1:1") as raised:
        await tier.health()
    assert trio.current_time() - started >= 0.5
    assert "the writer was away for the whole 0.5 s window" in raised.value.__notes__
    stats = tier.reconnect.statistics()
    assert stats.outages == 1 and stats.pauses >= 3 and stats.gave_up == 1
    with pytest.raises(CannotConnect):  # with no window, at once
        blocking.TierClient("127.0.0.1:1", reconnect_for=0).health()


def test_what_is_sent_again_while_the_writer_is_away() -> None:
    """A call is sent again after a lost connection only if that is safe (an append
    without expected_version may have been stored: it raises, as before); after a
    connection that was never made, or a draining writer's `unavailable` (it refused the
    call unread), any call is (nothing was done). A poisoned store's `unavailable` is
    raised. A client closed by its application, or a window of 0, sends nothing again."""
    from cmdbus_trio.client import ClientClosed, Unavailable, _calls
    from cmdbus_trio.client._retry import Reconnect

    window = Reconnect(60)
    unsafe = _calls.append("x", "{}")
    safe = [
        _calls.append("x", "{}", expected_version=0),
        _calls.publish(RECORD),
        _calls.publish_batch([RECORD]),
        _calls.next_delivery("commands.>"),
        _calls.ack(1),
        _calls.subscribe(0),
    ]
    draining = Unavailable("the writer is draining", retry_after_ms=1000)
    for error in (ConnectionLost("x"), draining, CannotConnect("x")):
        assert all(window.covers(call, error) for call in safe)
    assert not window.covers(unsafe, ConnectionLost("x"))
    assert window.covers(unsafe, draining)
    assert window.covers(unsafe, CannotConnect("x"))
    poisoned = Unavailable("commands store is poisoned")  # refuses writes until a restart
    assert not any(window.covers(call, poisoned) for call in [unsafe, *safe])
    assert not window.covers(safe[0], ClientClosed("x"))
    assert not Reconnect(0).covers(safe[0], CannotConnect("x"))


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, "60", True])
def test_a_bad_reconnect_window_is_refused_naming_the_option(bad: Any) -> None:
    with pytest.raises(ValueError, match="reconnect_for"):
        blocking.IngestClient("127.0.0.1:1", reconnect_for=bad)
    with pytest.raises(ValueError, match="reconnect_for"):
        IngestClient("127.0.0.1:1", reconnect_for=bad)


@pytest.mark.slow  # started again on the same ports: one at a time (noxfile.IN_PARALLEL)
async def test_a_sharded_claim_goes_on_with_the_writers_that_are_there(tmp_path: Path) -> None:
    """Two shards, one writer killed: a sharded `next` is served by the other at once
    (a writer that is away is skipped, not waited for), and once the killed one is back
    on its ports its records are claimed too."""
    from contextlib import ExitStack

    from cmdbus_trio.client import ShardMap
    from cmdbus_trio.client.trio import ShardedClaimClient

    with ExitStack() as stack:
        writers = []
        for shard in (0, 1):
            env = {"CMDBUS_SHARD": str(shard), "CMDBUS_SHARD_COUNT": "2"}
            (tmp_path / f"w{shard}").mkdir()
            writers.append(stack.enter_context(serving(tmp_path / f"w{shard}", **env)))
        claims = ShardMap.parse(",".join(f"{i}@{w[1]['cmd_claim']}" for i, w in enumerate(writers)))
        for shard, (_, ports) in enumerate(writers):
            async with IngestClient(ports["cmd_ingest"]) as ingest:
                execution = next(n for n in range(100) if claims.shard_for(n) == shard)
                await ingest.publish({"execution_id": execution, "payload": "{}"})
        killed, ports = writers[0]  # the first a round asks
        killed.kill()
        killed.wait()
        async with ShardedClaimClient(claims) as cluster:
            with trio.fail_after(10):
                first = await cluster.next("commands.>", wait=5)
            assert first is not None and first.shard == 1
            await cluster.ack(first)
            env = {"CMDBUS_SHARD": "0", "CMDBUS_SHARD_COUNT": "2", **same_ports(ports)}
            stack.enter_context(serving(tmp_path / "w0", **env))
            with trio.fail_after(20):
                second = await cluster.next("commands.>", wait=10)
            assert second is not None and second.shard == 0
