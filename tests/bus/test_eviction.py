"""The event log's byte cap (issue 17, ``CMDBUS_EVT_MAX_BYTES``): the oldest events are
evicted whatever the groups did, the groups forget them before the store deletes them (no
delivery without its body), what a group had not acked is counted per group, and readers
are told where the log now starts."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cmdbus_trio import metrics
from cmdbus_trio.bus.bodies import BodyReader
from cmdbus_trio.bus.claims import Claims
from cmdbus_trio.bus.committer import GroupCommitter, Ticket
from cmdbus_trio.bus.groups import ConsumerGroups
from cmdbus_trio.bus.retention import Eviction
from cmdbus_trio.faces.evt_subscribe import _Gaps
from cmdbus_trio.protocol.bus import BusKind, SubjectRule
from cmdbus_trio.storage.buslog import RETENTION_BATCH, BusEntry, BusLog, Settlements

from ..helpers import (
    frame_client,
    metric_sum,
    metrics_text,
    publish_through,
    publish_to_log,
    server_log,
    serving,
)

CAP = 1 << 20
EVENTS = ("events", ">")


def publish(log: BusLog, count: int, size: int) -> list[int]:
    return publish_to_log(log, count, subject="events.e", size=size)


def kept(log: BusLog) -> list[int]:
    return [r.sort_key for r in log.read_after(0, 100_000)]


def test_the_oldest_events_go_until_the_log_is_within_its_cap(tmp_path: Path) -> None:
    log = BusLog.open(tmp_path / "events.sqlite3", name="events")
    log.create_group("g", 0)
    published = publish(log, 400, 8000)  # about 3.3 MiB
    log.commit(done=Settlements(dead=[("g", 1, 3)], counts=[("g", 3, 2)], acks=[("g", 4)]))
    log.commit(done=Settlements(dead=[("g", 2, 3)]))
    log.commit(done=Settlements(dead_moves=[("g", 2, True)]))  # requeued: owed
    assert log.used_bytes() > 3 * CAP
    steps = []
    while through := log.eviction_floor(CAP):
        evicted = log.evict(through)
        assert 0 < evicted.records <= RETENTION_BATCH
        steps.append(evicted)
    assert log.used_bytes() <= CAP
    assert steps[0].dead_letters == {"g": 1}
    assert sum(step.dead_letters.get("g", 0) for step in steps[1:]) == 0
    remaining = kept(log)
    assert remaining == published[-len(remaining) :]  # the newest are kept
    assert 0 < len(remaining) < 150
    assert log.deleted_through == remaining[0] - 1 == steps[-1].through
    assert log.records == len(remaining)
    assert log.owed("g", remaining[0]) == [] and list(log.iter_dead("g")) == []
    assert log.group_state("g", 0) == ([], [])  # its acks and counts went too
    assert log.create_group("late", 0) == log.deleted_through  # starts after the gap
    log.close()
    reopened = BusLog.open(tmp_path / "events.sqlite3", name="events")
    assert reopened.deleted_through == remaining[0] - 1
    assert publish(reopened, 1, 10) == [published[-1] + 1]  # sort keys never reused
    reopened.close()


def test_a_log_within_its_cap_evicts_nothing(tmp_path: Path) -> None:
    log = BusLog.open(tmp_path / "events.sqlite3", name="events")
    publish(log, 50, 8000)
    assert log.used_bytes() < CAP
    assert log.eviction_floor(CAP) == 0
    assert log.eviction_floor(log.used_bytes() - 1) > 0  # its twin: one byte over
    log.close()


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[BusLog]:
    opened = await trio.to_thread.run_sync(BusLog.open, tmp_path / "events.sqlite3")
    yield opened
    await trio.to_thread.run_sync(opened.close)


@pytest.fixture
async def groups(log: BusLog) -> AsyncIterator[ConsumerGroups]:
    """The event bus's groups over ``log``, its committer running."""
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    async with trio.open_nursery() as nursery:
        await nursery.start(committer.run)
        yield ConsumerGroups(
            log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(1)
        )
        nursery.cancel_scope.cancel()


async def publish_events(committer: GroupCommitter, count: int) -> None:
    await publish_through(committer, [json.dumps({"event_type": "e"})] * count)


def evicted_unconsumed(group: str) -> float:
    value = metrics.REGISTRY.get_sample_value("cmdbus_evicted_unconsumed_total", {"group": group})
    return value or 0.0


async def test_a_group_forgets_evicted_records_in_every_state_and_counts_the_unacked(
    groups: ConsumerGroups,
) -> None:
    before = evicted_unconsumed("forgets")
    with trio.fail_after(20):
        await publish_events(groups.committer, 10)
        claims = await groups.get("forgets", "beginning")
        worker = object()
        taken = [claims.next_nowait(EVENTS, worker) for _ in range(4)]
        assert [d.sort_key for d in taken if d] == [1, 2, 3, 4]
        assert claims.nack(2, worker)  # waiting for a redelivery
        assert claims.nack(3, worker, delay=60)  # delayed
        assert claims.begin_ack(4, worker)  # an ack under way
        # 1 leased, 2 again, 3 delayed, 5 and 6 fresh: five the group never acked.
        assert groups.evict_through(6) == {"forgets": 5}
        assert evicted_unconsumed("forgets") - before == 5
        assert claims.total == 5  # 7 to 10, and 4 until its ack is durable
        assert not claims.begin_ack(1, worker)  # its lease went with it
        claims.finish_ack(4)
        assert claims.total == 4
        delivery = claims.next_nowait(EVENTS, worker)
        assert delivery is not None and delivery.sort_key == 7
        assert claims.low_water() == 7
        assert groups.evict_through(6) == {}  # once


async def test_an_ack_that_fails_after_its_record_was_evicted_does_not_redeliver_it() -> None:
    claims = Claims("commands", ack_wait=30)
    claims.add_many((key, "commands.shared.x") for key in range(1, 7))
    worker = object()
    for _ in range(2):
        claims.next_nowait(("commands", ">"), worker)
    assert claims.begin_ack(1, worker) and claims.nack(2, worker)
    assert claims.evict_through(3) == 2  # 2 (to redeliver) and 3 (fresh); 1 is settling
    claims.abort_ack(1)  # its commit failed: it would be redelivered, but it is gone
    assert claims.total == 3
    delivery = claims.next_nowait(("commands", ">"), worker)
    assert delivery is not None and delivery.sort_key == 4


async def test_a_group_loading_while_an_eviction_begins_skips_what_it_evicts(
    groups: ConsumerGroups,
) -> None:
    with trio.fail_after(20):
        await publish_events(groups.committer, 10)
        groups.evict_through(4)  # before the group exists; the store still has 1-4
        claims = await groups.get("late", "beginning")
        delivery = claims.next_nowait(EVENTS, object())
        assert delivery is not None and delivery.sort_key == 5


async def test_an_eviction_deletes_only_after_the_bodies_asked_for_are_read(
    groups: ConsumerGroups,
) -> None:
    """A ``next`` that leased a record just before the eviction gets its body: the
    eviction waits for the reads already asked for. Without that wait the store deletes
    the record first (the reader is not even running when the eviction starts)."""
    log = groups.log
    bodies = BodyReader(log)
    with trio.fail_after(20):
        await publish_events(groups.committer, 400)
        claims = await groups.get("reader", "beginning")
        delivery = claims.next_nowait(EVENTS, object())
        assert delivery is not None and delivery.sort_key == 1
        read: list[object] = []

        async def consumer() -> None:
            read.append(await bodies.read(delivery.sort_key))

        used = await trio.to_thread.run_sync(log.used_bytes)
        eviction = Eviction(log, groups, bodies, max_bytes=used // 2)
        stepped = trio.Event()

        async def step() -> None:
            assert await eviction.step(trio.CapacityLimiter(1))
            stepped.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            await trio.testing.wait_all_tasks_blocked()  # asked for before the eviction
            nursery.start_soon(step)
            await trio.sleep(0.2)  # the eviction waits for the read
            assert not stepped.is_set() and log.deleted_through == 0
            await nursery.start(bodies.run)
            await stepped.wait()
            nursery.cancel_scope.cancel()
        assert read and not isinstance(read[0], Exception)
        assert log.deleted_through >= 1
        assert groups.evicted_through == log.deleted_through


async def test_a_burst_evicts_to_its_margin_below_the_cap_and_is_logged_once(
    groups: ConsumerGroups, caplog: pytest.LogCaptureFixture
) -> None:
    """Over the cap, a burst goes down to the low-water mark (not just under the cap, which
    made a step every few milliseconds at a steady rate); between the two, nothing goes."""
    log = groups.log
    await trio.to_thread.run_sync(publish, log, 400, 8000)
    eviction = Eviction(log, groups, BodyReader(log), max_bytes=2 * CAP)
    assert eviction.low_water == 2 * CAP - 2 * CAP // 16
    limiter = trio.CapacityLimiter(1)
    with caplog.at_level(logging.WARNING, logger="cmdbus_trio.bus.retention"):
        while await eviction.step(limiter):
            pass
    assert await trio.to_thread.run_sync(log.used_bytes) <= eviction.low_water
    assert [r.getMessage() for r in caplog.records].count("events_evicted") == 1
    await trio.to_thread.run_sync(publish, log, 10, 8000)  # back above the low water
    used = await trio.to_thread.run_sync(log.used_bytes)
    assert eviction.low_water < used <= eviction.max_bytes
    assert not await eviction.step(limiter)  # within the cap: nothing goes


def test_a_subscriber_is_told_of_each_new_floor_below_its_cursor_once() -> None:
    class Log:
        deleted_through = 0

    class Bus:
        log = Log()

    gaps = _Gaps(Bus(), b'{"id":1,"ok":true,"records":[')  # type: ignore[arg-type]
    assert gaps.notice(0) is None  # nothing deleted
    Bus.log.deleted_through = 10
    assert gaps.notice(10) is None  # at the floor: nothing missed
    notice = gaps.notice(3)
    assert notice is not None and notice.endswith(b'"records":[],"deleted_through":10}')
    assert gaps.notice(3) is None  # told once
    Bus.log.deleted_through = 20
    assert gaps.notice(15) is not None  # overtaken again while catching up


EVICTING = {
    "CMDBUS_TIER_BIND": "",
    "CMDBUS_EVT_MAX_BYTES": str(CAP),
    "CMDBUS_RETENTION_INTERVAL_MS": "50",
    "CMDBUS_EVT_GROUPS": "fast,slow",
}


@pytest.mark.once
async def test_a_capped_writer_evicts_the_oldest_events_and_counts_what_a_group_missed(
    tmp_path: Path,
) -> None:
    """The deployment's case: one group keeps up, one holds a lease and reads nothing
    more. The log stays within its cap (the file too, once vacuumed), only the lagging
    group counts what it missed, its lease is gone, and readers start after the gap."""
    pad = "x" * 10_000
    with trio.fail_after(60), serving(tmp_path, **EVICTING) as (_, ports):
        async with (
            frame_client(ports["evt_ingest"]) as ingest,
            frame_client(ports["evt_claim"]) as fast,
            frame_client(ports["evt_claim"]) as slow,
        ):
            first = {"execution_id": 0, "payload": json.dumps({"event_type": "e", "pad": pad})}
            await ingest.request("publish_batch", records=[first])
            held = (await slow.request("next", filter=">", group="slow", timeout_ms=2000))[
                "delivery"
            ]
            for batch in range(30):  # about 3 MiB, the fast group acking as it goes
                records = [
                    {"execution_id": n, "payload": json.dumps({"event_type": "e", "pad": pad})}
                    for n in range(batch * 10, batch * 10 + 10)
                ]
                await ingest.request("publish_batch", records=records)
                while (
                    delivery := (
                        await fast.request("next", filter=">", group="fast", timeout_ms=50)
                    )["delivery"]
                ) is not None:
                    await fast.request("ack", group="fast", sort_key=delivery["sort_key"])
            await trio.sleep(1.0)  # twenty retention intervals
            text = metrics_text(ports)
            evicted = metric_sum(
                text, 'cmdbus_retention_deleted_total{kind="evicted",store="events"}'
            )
            assert evicted > 150
            assert metric_sum(text, 'cmdbus_evicted_unconsumed_total{group="slow"}') == evicted
            assert metric_sum(text, 'cmdbus_evicted_unconsumed_total{group="fast"}') == 0
            assert (tmp_path / "data" / "events.sqlite3").stat().st_size < 2 * CAP
            acked = await slow.request("ack", group="slow", sort_key=held["sort_key"])
            assert acked == {
                "id": 2,
                "ok": True,
                "acked": False,
                "why": "not_leased",
            }  # its lease went too
            after = (await slow.request("next", filter=">", group="slow", timeout_ms=2000))[
                "delivery"
            ]
            assert after["sort_key"] == evicted + 1  # the oldest kept
        async with frame_client(ports["evt_subscribe"]) as subscriber:
            notice = await subscriber.request("subscribe", **{"from": 0})
            assert notice == {"id": 1, "ok": True, "records": [], "deleted_through": evicted}
            page = await subscriber.receive_json()
            assert page["records"][0]["sort_key"] == evicted + 1
    lines = [line for line in server_log(tmp_path).splitlines() if "events_evicted" in line]
    assert lines and '"slow"' in lines[0] and '"fast"' not in lines[0]


def test_a_msg_id_retry_of_an_evicted_record_says_so(tmp_path: Path) -> None:
    """Issue 38: the retry of a publish whose record was evicted since answered
    ``duplicate`` with a sort key that no longer exists, so the loss was invisible to the
    publisher. It now says ``evicted``; a retry of a record still kept does not."""
    log = BusLog.open(tmp_path / "events.sqlite3", name="events")
    first, kept_one = log.publish(
        [BusEntry("events.e", "{}", msg_id="first"), BusEntry("events.e", "{}", msg_id="kept")]
    )
    log.evict(first.sort_key)
    again, still = log.publish(
        [BusEntry("events.e", "{}", msg_id="first"), BusEntry("events.e", "{}", msg_id="kept")]
    )
    assert (again.sort_key, again.duplicate, again.evicted) == (first.sort_key, True, True)
    assert (still.sort_key, still.duplicate, still.evicted) == (kept_one.sort_key, True, False)
    log.close()
    reopened = BusLog.open(tmp_path / "events.sqlite3", name="events")  # kept across restarts
    [after] = reopened.publish([BusEntry("events.e", "{}", msg_id="first")])
    assert after.evicted
    reopened.close()


async def test_requeues_dead_letters_and_an_eviction_at_once_leave_no_phantom(
    groups: ConsumerGroups,
) -> None:
    """Issue 38: a requeue committed between an eviction's forget and its delete put the
    deleted record back at the head of the redeliveries (with max_deliver=0 for ever:
    its body gone, its lag never 0). A dead letter parked just before an eviction could
    commit after the delete, leaving a row for a record that no longer exists, counted
    nowhere: the eviction now waits for what was settled before it (the next test
    forces that order; this one checks that nothing is left behind and each evicted
    unsettled record is counted once)."""
    group = "phantoms"
    before = evicted_unconsumed(group)
    worker = object()
    with trio.fail_after(20):
        await publish_events(groups.committer, 12)
        claims = await groups.get(group, "beginning")
        claims.max_deliver = 1
        for key in (1, 2):  # two dead letters, durable
            assert claims.next_nowait(EVENTS, worker) is not None
            assert claims.nack(key, worker)
        settled = Ticket()
        groups.committer.enqueue(settled)
        await settled.settled.wait()
        # A requeue of dead letter 1 whose commit settles after the groups forgot it.
        requeued = Ticket(dead_moves=[(group, 1, True)])
        groups.committer.enqueue(requeued)
        await requeued.settled.wait()
        assert groups.evict_through(4) == {group: 2}  # 3 and 4, fresh
        assert claims.requeue([(1, "events.e")]) == 1  # evicted meanwhile: not queued
        groups.count_evicted(group, 1)  # as the claim face does with what requeue says
        # A dead letter parked (its ticket queued) just before an eviction: the eviction
        # waits for what was settled before it, so its delete takes and counts the row.
        used = await trio.to_thread.run_sync(groups.log.used_bytes)
        delivery = claims.next_nowait(EVENTS, worker)
        assert delivery is not None and delivery.sort_key == 5
        assert claims.nack(5, worker)  # dead: its ticket is queued, not committed
        bodies = BodyReader(groups.log)
        async with trio.open_nursery() as nursery:
            await nursery.start(bodies.run)
            eviction = Eviction(groups.log, groups, bodies, max_bytes=1)
            eviction.low_water = used  # evicts one batch: up to what the floor says
            while groups.log.deleted_through < 5:
                assert await eviction.step(trio.CapacityLimiter(1))
            nursery.cancel_scope.cancel()
        with sqlite3.connect(groups.log.path) as connection:
            orphans = connection.execute(
                "SELECT sort_key FROM dead WHERE sort_key NOT IN (SELECT sort_key FROM records)"
            ).fetchall()
        assert orphans == []  # no dead row for a record the store deleted
        floor = groups.log.deleted_through
        assert claims.total == 12 - floor  # what is left, fresh; no phantom counted
        delivery = claims.next_nowait(EVENTS, worker)
        assert delivery is None or delivery.sort_key > floor
    # 3 and 4 (fresh), 1 (requeued as it went), 2 and 5 (dead letters), and every other
    # record up to the floor: each counted once.
    assert evicted_unconsumed(group) - before == groups.log.deleted_through


async def test_a_dead_letter_parked_before_an_eviction_is_deleted_and_counted_with_it(
    groups: ConsumerGroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The order the previous test cannot force: a dead letter's commit is held back
    (its batch taken by the committer, its transaction not begun) while an eviction of
    its record runs. The eviction's delete waits for what was settled before it, so it
    takes the dead letter's row and counts it. Deleting at once, it ran before the dead
    letter's commit: an orphan row, counted nowhere."""
    import threading

    group = "held"
    before = evicted_unconsumed(group)
    worker = object()
    log = groups.log
    with trio.fail_after(20):
        await publish_events(groups.committer, 12)
        claims = await groups.get(group, "beginning")
        claims.max_deliver = 1
        used = await trio.to_thread.run_sync(log.used_bytes)
        release, holding = threading.Event(), threading.Event()
        commit = log.commit

        def held_once(*args: Any) -> Any:
            monkeypatch.setattr(log, "commit", commit)
            holding.set()
            release.wait(timeout=10)
            return commit(*args)

        monkeypatch.setattr(log, "commit", held_once)
        delivery = claims.next_nowait(EVENTS, worker)
        assert delivery is not None and delivery.sort_key == 1
        assert claims.nack(1, worker)  # dead: its batch is held before its transaction
        assert await trio.to_thread.run_sync(holding.wait, 10)
        bodies = BodyReader(log)
        async with trio.open_nursery() as nursery:
            await nursery.start(bodies.run)
            eviction = Eviction(log, groups, bodies, max_bytes=1)
            eviction.low_water = used  # one batch, through at least record 1
            nursery.start_soon(eviction.step, trio.CapacityLimiter(1))
            await trio.sleep(0.2)  # the eviction goes as far as it may
            release.set()
            while log.deleted_through < 1:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        settled = Ticket()
        groups.committer.enqueue(settled)
        await settled.settled.wait()
        with sqlite3.connect(log.path) as connection:
            orphans = connection.execute(
                "SELECT sort_key FROM dead WHERE sort_key NOT IN (SELECT sort_key FROM records)"
            ).fetchall()
        assert orphans == []
    assert evicted_unconsumed(group) - before == log.deleted_through  # 1 among them, once
