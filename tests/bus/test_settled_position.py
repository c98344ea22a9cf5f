"""The settled position moves past what will never settle (issue 16 item 12): a record
unsettled for longer than CMDBUS_STUCK_AFTER_MS (a pool with no workers, a nack with a
long delay) no longer holds it back. The acks behind it are pruned, a restart does not
rescan everything after it, and the stuck records are still owed, with their counts."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from cmdbus_trio.bus.claims import Claims
from cmdbus_trio.bus.committer import GroupCommitter, Ticket
from cmdbus_trio.bus.durable import open_claims
from cmdbus_trio.bus.groups import ConsumerGroups
from cmdbus_trio.protocol.bus import BusKind, SubjectRule
from cmdbus_trio.protocol.subjects import parse_filter
from cmdbus_trio.storage.buslog import BusLog

from ..helpers import publish_through

STUCK_AFTER = 0.3


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[BusLog]:
    opened = await trio.to_thread.run_sync(BusLog.open, tmp_path / "bus.sqlite3")
    yield opened
    await trio.to_thread.run_sync(opened.close)


async def ack_all(claims: Claims, committer: GroupCommitter, filter: str) -> list[int]:
    owner = object()
    acked = []
    while (delivery := claims.next_nowait(parse_filter(filter), owner)) is not None:
        assert claims.begin_ack(delivery.sort_key, owner)
        ticket = Ticket(acks=[(claims.group, delivery.sort_key)])
        committer.enqueue(ticket)
        await ticket.wait()
        claims.finish_ack(delivery.sort_key)
        acked.append(delivery.sort_key)
    return acked


def rows(log: BusLog, sql: str, *args: object) -> list[tuple[object, ...]]:
    with sqlite3.connect(log.path) as connection:
        return connection.execute(sql, args).fetchall()


async def test_a_pool_with_no_workers_and_a_long_nack_no_longer_hold_the_position(
    log: BusLog,
) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    limiter = trio.CapacityLimiter(1)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            groups = ConsumerGroups(
                log, committer, ack_wait=30, max_deliver=0, limiter=limiter,
                stuck_after=STUCK_AFTER, fixed="commands", sample_every=0.05,
            )  # fmt: skip
            await groups.open()
            claims = await groups.resolve(None, None)
            (stuck,) = await publish_through(committer, ['{"execution_pool": "nobody"}'])
            busy = await publish_through(committer, ['{"execution_pool": "busy"}'] * 200)
            owner = object()
            delivery = claims.next_nowait(parse_filter("commands.busy.>"), owner)
            assert delivery is not None and delivery.sort_key == busy[0]
            assert claims.nack(busy[0], owner, delay=3600)  # back in an hour
            counted = Ticket(counts=[("commands", busy[0], 1)])  # as the face's on_count does
            committer.enqueue(counted)
            await counted.wait()
            assert await ack_all(claims, committer, "commands.busy.>") == busy[1:]
            await nursery.start(groups.run)  # its timers, and the lag sampler
            await trio.sleep(STUCK_AFTER * 4)  # well past the stuck window
            nursery.cancel_scope.cancel()
    ((position,),) = rows(log, "SELECT settled_below FROM positions WHERE consumer = 'commands'")
    assert position == busy[-1] + 1, "the position passed the two records that never settle"
    assert rows(log, "SELECT sort_key FROM owed ORDER BY sort_key") == [(stuck,), (busy[0],)]
    assert rows(log, "SELECT count(*) FROM acks") == [(0,)]  # pruned behind it
    assert rows(log, "SELECT sort_key, deliveries FROM deliveries") == [(busy[0], 1)]

    scanned: list[int] = []

    class Watched(BusLog):
        def unsettled(
            self, consumer: str, after: int, limit: int, through: int | None = None
        ) -> list[tuple[int, str, int]]:
            scanned.append(max(after, self.settled_below(consumer) - 1))
            return super().unsettled(consumer, after, limit, through)

    again = await trio.to_thread.run_sync(Watched.open, log.path)
    try:
        committer = GroupCommitter(again, SubjectRule(BusKind.COMMANDS))
        claims = await open_claims(
            again, committer, "commands", start_after=0, ack_wait=30, max_deliver=0,
            limiter=limiter, stuck_after=STUCK_AFTER,
        )  # fmt: skip
    finally:
        await trio.to_thread.run_sync(again.close)
    assert scanned and min(scanned) >= busy[-1]  # no rescan of the 200 settled ones
    owner = object()
    first = claims.next_nowait(parse_filter(">"), owner)
    second = claims.next_nowait(parse_filter(">"), owner)
    assert first is not None and (first.sort_key, first.deliveries) == (stuck, 1)
    assert second is not None and (second.sort_key, second.deliveries) == (busy[0], 2)
    assert claims.next_nowait(parse_filter(">"), owner) is None
    assert claims.total == 2


async def test_an_event_group_passes_a_type_nobody_consumes(log: BusLog) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    limiter = trio.CapacityLimiter(1)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            groups = ConsumerGroups(
                log, committer, ack_wait=30, max_deliver=0, limiter=limiter,
                stuck_after=STUCK_AFTER,
            )  # fmt: skip
            claims = await groups.get("g", "beginning")
            keys = await publish_through(
                committer, ['{"event_type": "a"}', '{"event_type": "b"}'] * 50
            )
            assert await ack_all(claims, committer, "events.a") == keys[0::2]
            await nursery.start(groups.run)
            await trio.sleep(2.5)  # the groups' sampler runs every second
            nursery.cancel_scope.cancel()
    ((position,),) = rows(log, "SELECT settled_below FROM positions WHERE consumer = 'g'")
    assert position == keys[-1] + 1
    assert rows(log, "SELECT sort_key FROM owed WHERE consumer = 'g'") == [
        (key,) for key in keys[1::2]
    ]
    assert rows(log, "SELECT count(*) FROM acks") == [(0,)]
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    groups = ConsumerGroups(log, committer, ack_wait=30, max_deliver=0, limiter=limiter)
    await groups.open(())
    restored = groups.claims["g"]
    assert restored.total == 50
    owner = object()
    taken = [restored.next_nowait(parse_filter(">"), owner) for _ in range(51)]
    assert [d.sort_key for d in taken if d is not None] == keys[1::2]


def test_a_group_with_a_backlog_over_the_owed_cap_keeps_its_position() -> None:
    """Past ``stuck_after`` a group's position passes what it has not settled, which it
    then owes, only while that backlog is small: a lagging group owes nothing."""
    from cmdbus_trio.bus._owed import MAX_OWED, SettledPosition

    settled = SettledPosition(stuck_after=1.0)
    assert settled.at(0.0, seen=100, low_water=5, backlog=95) == (5, 0)
    assert settled.at(2.0, seen=100, low_water=5, backlog=MAX_OWED + 1) == (5, 0)
    assert settled.at(3.0, seen=100, low_water=5, backlog=MAX_OWED) == (101, 100)
