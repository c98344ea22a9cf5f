"""Event groups on the shared tail: a cursor plus what is in flight. The same claims, fed
the same records and asked the same things, answer exactly as the per-subject queues of
the command bus do; the tail is trimmed behind the slowest group and read back from the
store for a group that starts earlier; and many subjects times many groups cost neither
memory nor time."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from cmdbus_trio.bus.claims import Claims, Delivery
from cmdbus_trio.bus.committer import Committed, GroupCommitter, Ticket
from cmdbus_trio.bus.groups import ConsumerGroups
from cmdbus_trio.bus.tail import TRIM_AT_LEAST, Tail
from cmdbus_trio.loop import turns as turns_budget
from cmdbus_trio.protocol.bus import BusKind, PublishRecord, SubjectRule
from cmdbus_trio.protocol.subjects import parse_filter
from cmdbus_trio.storage.buslog import BusLog

SUBJECTS = ["events.a", "events.b", "events.c_x", "events.d"]
FILTERS = [parse_filter(f) for f in (">", "events.>", "events.a", "events.b", "events.*")]
OWNERS = [object(), object(), object()]


@attrs.define
class _NoLog:
    last_sort_key: int = 0


def _tail() -> Tail:
    return Tail(_NoLog(), limiter=trio.CapacityLimiter(1))  # type: ignore[arg-type]


operations = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.lists(st.sampled_from(SUBJECTS), max_size=4)),
        st.tuples(st.just("take"), st.sampled_from(range(len(FILTERS))), st.integers(0, 2)),
        st.tuples(st.just("ack"), st.integers(0, 30), st.integers(0, 2)),
        st.tuples(st.just("nack"), st.integers(0, 30), st.integers(0, 2)),
        st.tuples(st.just("give_back"), st.integers(0, 30), st.integers(0, 2)),
        st.tuples(st.just("release"), st.integers(0, 2)),
        st.tuples(st.just("expire"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300)
@given(operations)
def test_a_group_on_the_tail_answers_as_per_subject_queues_do(ops: list[Any]) -> None:
    trio.run(_same_answers, ops, clock=trio.testing.MockClock(autojump_threshold=0))


async def _same_answers(ops: list[Any]) -> None:
    tail = _tail()
    queues = Claims("queues", ack_wait=5.0, max_deliver=3)
    cursor = Claims("cursor", ack_wait=5.0, max_deliver=3, tail=tail)
    cursor.attach(0, [])
    both = (queues, cursor)
    sort_key = 0
    async with trio.open_nursery() as nursery:
        for claims in both:
            await nursery.start(claims.run_timers)
        for op in ops:
            answers: list[Any] = []
            if op[0] == "publish":
                records = []
                for subject in op[1]:
                    sort_key += 1
                    records.append((sort_key, subject))
                queues.add_many(records)
                tail([Committed(key, subject, "{}") for key, subject in records])
                continue
            for claims in both:
                if op[0] == "take":
                    answers.append(claims.next_nowait(FILTERS[op[1]], OWNERS[op[2]]))
                elif op[0] == "ack":
                    began = claims.begin_ack(op[1], OWNERS[op[2]])
                    if began:
                        claims.finish_ack(op[1])
                    answers.append(began)
                elif op[0] == "nack":
                    answers.append(claims.nack(op[1], OWNERS[op[2]]))
                elif op[0] == "give_back":
                    answers.append(claims.give_back(op[1], OWNERS[op[2]]))
                elif op[0] == "release":
                    answers.append(claims.release(OWNERS[op[1]]))
            if op[0] == "expire":
                await trio.sleep(6)  # past ack_wait: every lease ends
            assert answers[:1] == answers[1:], op
            assert queues.lag() == await cursor.backlog()
            assert queues.total == cursor.total
            assert queues.low_water() == cursor.low_water()
        nursery.cancel_scope.cancel()


async def test_a_waiting_next_on_the_tail_gets_the_first_matching_record() -> None:
    tail = _tail()
    claims = Claims("g", ack_wait=30.0, tail=tail)
    claims.attach(0, [])
    owner = object()
    got: list[Delivery] = []

    async def wait() -> None:
        got.append(await claims.next(parse_filter("events.b"), owner))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            tail([Committed(1, "events.a", "{}"), Committed(2, "events.b", "{}")])
    assert got == [Delivery(2, "events.b", False, 1)]
    assert claims.next_nowait(parse_filter(">"), owner) == Delivery(1, "events.a", False, 1)


async def test_only_a_group_with_a_consumer_parked_is_told_of_a_commit() -> None:
    """Issue 38: a group that lags (no consumer parked) costs a commit nothing: its
    backlog counts from the tail's end. One whose consumer parks is told again."""
    tail = _tail()
    lagging, waiting = (Claims(name, ack_wait=30.0, tail=tail) for name in ("lag", "wait"))
    for claims in (lagging, waiting):
        claims.attach(0, [])
    assert list(tail.listening) == [lagging, waiting]  # until a record above the floor
    tail([Committed(1, "events.a", "{}")])
    assert not tail.listening
    got: list[Delivery] = []

    async def wait() -> None:
        got.append(await waiting.next(parse_filter("events.b"), object()))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert list(tail.listening) == [waiting]
            tail([Committed(2, "events.b", "{}"), Committed(3, "events.a", "{}")])
    assert got == [Delivery(2, "events.b", False, 1)]
    assert not tail.listening  # its consumer has its record: none parked
    assert (lagging.total, waiting.total) == (3, 3)  # 2 is leased, not settled
    waiting.delete()
    assert waiting not in tail.groups


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[BusLog]:
    opened = await trio.to_thread.run_sync(BusLog.open, tmp_path / "events.sqlite3")
    yield opened
    await trio.to_thread.run_sync(opened.close)


async def _publish(committer: GroupCommitter, event_types: list[str]) -> None:
    tickets = [
        Ticket([(PublishRecord(n, f'{{"event_type": "{t}"}}'), None, "record")])
        for n, t in enumerate(event_types)
    ]
    for ticket in tickets:
        committer.enqueue(ticket)
    for ticket in tickets:
        await ticket.wait()


def _drain(claims: Claims, owner: object) -> list[int]:
    taken = []
    while (delivery := claims.next_nowait(parse_filter(">"), owner)) is not None:
        claims.begin_ack(delivery.sort_key, owner)
        claims.finish_ack(delivery.sort_key)
        taken.append(delivery.sort_key)
    return taken


async def test_the_tail_is_trimmed_behind_the_slowest_group_and_read_back_for_an_earlier_one(
    log: BusLog,
) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    groups = ConsumerGroups(
        log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(1)
    )
    owner = object()
    count = 3 * TRIM_AT_LEAST
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            fast = await groups.get("fast", "beginning")
            slow = await groups.get("slow", "beginning")
            await _publish(committer, [f"t{n % 7}" for n in range(count)])
            assert len(groups.tail.keys) == count
            assert _drain(fast, owner) == list(range(1, count + 1))
            groups.tail.trim()
            assert len(groups.tail.keys) == count  # the slow group has not moved
            half = [slow.next_nowait(parse_filter(">"), owner) for _ in range(count // 2)]
            for delivery in half:
                assert delivery is not None
                slow.begin_ack(delivery.sort_key, owner)
                slow.finish_ack(delivery.sort_key)
            groups.tail.trim()
            assert groups.tail.base == count // 2  # what both groups passed is dropped
            assert groups.tail.after == count // 2
            late = await groups.get("late", "beginning")  # before the trimmed part
            assert groups.tail.base == 0 and groups.tail.after == 0
            assert _drain(late, owner) == list(range(1, count + 1))
            assert _drain(slow, owner) == list(range(count // 2 + 1, count + 1))
            nursery.cancel_scope.cancel()


async def test_a_restarted_group_resumes_past_its_acks_with_its_delivery_counts(
    log: BusLog,
) -> None:
    """Acks out of order, a dead letter and a recorded delivery count survive a restart;
    the tail is read back once for every group."""
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            await _publish(committer, ["a"] * 10)
            done = Ticket(
                acks=[("g", 1), ("g", 2), ("g", 5), ("h", 9)],
                dead=[("g", 7, 3)],
                counts=[("g", 3, 2)],
                positions=[("g", 3)],
            )
            committer.enqueue(done)
            await done.wait()
            await trio.to_thread.run_sync(log.create_group, "g", 0)
            await trio.to_thread.run_sync(log.create_group, "h", 0)
            groups = ConsumerGroups(
                log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(1)
            )
            await groups.open(())
            nursery.cancel_scope.cancel()
    owner = object()
    g, h = groups.claims["g"], groups.claims["h"]
    assert g.total == 6 and h.total == 9
    assert g.next_nowait(parse_filter(">"), owner) == Delivery(3, "events.a", True, 3)
    assert _drain(g, owner) == [4, 6, 8, 9, 10]
    assert _drain(h, owner) == [1, 2, 3, 4, 5, 6, 7, 8, 10]


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def test_ten_thousand_event_types_and_a_hundred_groups_cost_little(log: BusLog) -> None:
    """Issue 16's measure: per-subject state in every group grew the writer by ~880 MiB
    here and took ~100 ms a group. A group is now a cursor plus what is in flight."""
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    groups = ConsumerGroups(
        log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(1)
    )
    owner = object()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            await nursery.start(groups.run)
            await _publish(committer, [f"type{n}" for n in range(10_000)])
            before = _rss_mib()
            started = time.monotonic()
            created = [await groups.get(f"g{n}", "beginning") for n in range(100)]
            elapsed = time.monotonic() - started
            for claims in created:  # each group in use: a filter index, leases, a lag
                assert claims.next_nowait(parse_filter("events.type5"), owner) is not None
                assert claims.next_nowait(parse_filter(">"), owner) is not None
                assert len(await claims.backlog()) == 10_000
            grown = _rss_mib() - before
            nursery.cancel_scope.cancel()
    assert all(claims.total == 10_000 for claims in created)
    assert grown <= 60, f"100 groups over 10,000 event types grew RSS by {grown:.0f} MiB"
    assert elapsed < 5, f"100 groups took {elapsed:.1f} s to create"


def test_a_group_from_tail_never_gets_a_record_at_or_below_its_start() -> None:
    """Issue 38: a group created ``from: tail`` starts after the newest sort key handed
    out; records committed just before (up to that key) can reach the tail only after
    the group attached. They are not the group's: never delivered, never its backlog."""

    async def main() -> None:
        tail = _tail()
        tail([Committed(n, "events.a", "{}") for n in (1, 2)])
        claims = Claims("late", ack_wait=30.0, tail=tail)
        claims.attach(4, [])  # created after sort key 4, which the tail has not seen yet
        tail([Committed(n, "events.a", "{}") for n in (3, 4, 5)])
        assert claims.total == 1
        owner = object()
        assert claims.next_nowait(parse_filter(">"), owner) == Delivery(5, "events.a", False, 1)
        assert claims.next_nowait(parse_filter(">"), owner) is None
        tail([Committed(6, "events.b", "{}")])
        assert claims.total == 2  # 5 leased and 6 fresh

    trio.run(main)


def test_a_new_filter_looks_through_a_long_backlog_a_step_per_turn() -> None:
    """Issue 38: a new filter on a group far behind looked through the whole backlog in
    one go, on the loop (0.18 s per filter for a million records). A look now goes
    through at most SCAN_STEP records; ``next`` takes steps within the data plane's
    share of each turn until it is through, letting every other task run between, and
    still finds the record."""
    from cmdbus_trio.bus._cursor import SCAN_STEP

    async def main() -> None:
        tail = _tail()
        claims = Claims("behind", ack_wait=30.0, tail=tail)
        claims.attach(0, [])
        backlog = 20 * SCAN_STEP
        tail([Committed(n, "events.a", "{}") for n in range(1, backlog + 1)])
        tail([Committed(backlog + 1, "events.b", "{}")])
        wanted = parse_filter("events.b")
        owner = object()
        assert claims.next_nowait(wanted, owner) is None  # one step: not there yet
        assert not claims.has(wanted)
        turns = 0

        async def other_work() -> None:
            nonlocal turns
            while True:
                turns += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_work)
            with trio.fail_after(10):
                delivery = await claims.next(wanted, owner)
            nursery.cancel_scope.cancel()
        assert delivery == Delivery(backlog + 1, "events.b", False, 1)
        # The look took the data plane's share of several turns (its 80,000 records are
        # ~15 ms of the loop here), and the other task ran in each.
        assert turns_budget.current().statistics().deferred > 0
        assert turns >= 3

    trio.run(main)


def test_a_parked_waiter_gets_its_record_from_a_batch_longer_than_a_step() -> None:
    """A waiter parks once its look is through the tail; a record for it that comes in
    a batch longer than SCAN_STEP is still handed over (the look for a parked waiter goes
    through what came, however much)."""
    from cmdbus_trio.bus._cursor import SCAN_STEP

    async def main() -> None:
        tail = _tail()
        claims = Claims("g", ack_wait=30.0, tail=tail)
        claims.attach(0, [])
        got: list[Delivery] = []

        async def consumer() -> None:
            got.append(await claims.next(parse_filter("events.b"), object()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            await trio.testing.wait_all_tasks_blocked()
            batch = [Committed(n, "events.a", "{}") for n in range(1, 2 * SCAN_STEP + 1)]
            tail([*batch, Committed(2 * SCAN_STEP + 1, "events.b", "{}")])
            await trio.testing.wait_all_tasks_blocked()
        assert [d.sort_key for d in got] == [2 * SCAN_STEP + 1]

    trio.run(main)
