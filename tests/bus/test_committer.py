"""The group committer: batches of tickets, one transaction each, settled on the loop;
and the offload helper it is built on."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.bus import committer as committer_module
from cmdbus_trio.bus.committer import Committed, GroupCommitter, Ticket
from cmdbus_trio.logs import OncePerBurst
from cmdbus_trio.loop.batcher import ThreadBatcher, take_up_to
from cmdbus_trio.protocol import FieldError
from cmdbus_trio.protocol.bus import BusKind, PublishRecord, SubjectRule
from cmdbus_trio.storage import FailedCommits, StoreUnavailable
from cmdbus_trio.storage.buslog import BusLog

from ..helpers import Refusing, commit_lines, commit_together

GOOD = PublishRecord(1, "{}")
BAD = PublishRecord(1, "{not json")


def publish(record: PublishRecord = GOOD, **fields: object) -> Ticket:
    return Ticket([(record, None, "record")], **fields)  # type: ignore[arg-type]


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[BusLog]:
    opened = await trio.to_thread.run_sync(BusLog.open, tmp_path / "commands.sqlite3")
    yield opened
    await trio.to_thread.run_sync(opened.close)


async def settle_all(committer: GroupCommitter, tickets: list[Ticket]) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            for ticket in tickets:
                committer.enqueue(ticket)
            for ticket in tickets:
                await ticket.settled.wait()
            nursery.cancel_scope.cancel()


async def test_batches_settle_in_order_and_a_bad_ticket_only_fails_itself(log: BusLog) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS), max_batch=2)
    batches: list[list[Committed]] = []
    committer.listeners.append(batches.append)
    order: list[int] = []
    tickets = [
        publish(BAD if n == 2 else GOOD, on_settled=lambda t, n=n: order.append(n))
        for n in range(7)
    ]
    await settle_all(committer, tickets)
    assert order == list(range(7))
    # max_batch tickets a batch; the listeners get the records committed (not the bad one)
    assert [[c.sort_key for c in batch] for batch in batches] == [[1, 2], [3], [4, 5], [6]]
    assert isinstance(tickets[2].error, FieldError)
    keys = [t.published[0].sort_key for t in tickets if t.published is not None]
    assert keys == [1, 2, 3, 4, 5, 6]


async def test_a_long_settle_is_spread_over_passes_of_the_loop_in_commit_order(
    log: BusLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ticket a step and no time for a second: a task that checkpoints runs between any
    two tickets, and every ticket still settles, in commit order, across batches."""
    monkeypatch.setattr(committer_module, "MAX_SETTLE_STEP", 0.0)
    monkeypatch.setattr(committer_module, "SETTLE_STEP_COST", 1)
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    settled: list[tuple[int, int]] = []  # (ticket, passes of another task by then)
    passes = 0

    async def count_passes() -> None:
        nonlocal passes
        while True:
            await trio.lowlevel.checkpoint()
            passes += 1

    tickets = [publish(on_settled=lambda _, n=n: settled.append((n, passes))) for n in range(20)]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(count_passes)
            committer._settle(tickets[:10], None)  # two batches, as the thread settles them
            committer._settle(tickets[10:], None)
            for ticket in tickets:
                await ticket.settled.wait()
            nursery.cancel_scope.cancel()
    assert [n for n, _ in settled] == list(range(20))
    # The first is settled in the callback's own step (the settling was idle), the other
    # 19 a pass each. The counter runs once a pass (first or last: trio may reverse a
    # pass's order), so it runs at least 17 times meanwhile: in one pass, not at all.
    assert settled[0][1] == 0
    assert settled[-1][1] - settled[0][1] >= 17


async def test_a_step_settles_a_few_tickets_a_large_one_alone(
    log: BusLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of SETTLE_STEP_COST: single publishes share one, a ticket of many records
    (a reply, and records to tell of) is a step of its own, and the listeners are told
    a step's records at once."""
    monkeypatch.setattr(committer_module, "MAX_SETTLE_STEP", 0.0)
    monkeypatch.setattr(committer_module, "SETTLE_STEP_COST", 3)
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    told: list[list[int]] = []
    committer.listeners.append(lambda records: told.append([r.sort_key for r in records]))
    many = Ticket([(GOOD, None, f"records[{n}]") for n in range(16)])  # costs 1 + 16 // 8
    tickets = [publish(), publish(), publish(), publish(), many, publish()]
    steps: list[list[Ticket]] = []
    with monkeypatch.context() as patched:
        patched.setattr(committer._unsettled, "push_now", steps.extend)
        committer._settle(tickets, None)
    assert steps == [tickets[:3], [tickets[3]], [many], [tickets[5]]]
    await settle_all(committer, tickets)
    assert told == [[1, 2, 3], [4], list(range(5, 21)), [21]]


def test_tickets_left_to_settle_as_the_run_ends_are_settled_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settle spread over passes when the run ends: the settling task is a system
    task, which the run's end cancels; what it had left is settled then, not lost."""
    monkeypatch.setattr(committer_module, "MAX_SETTLE_STEP", 0.0)
    monkeypatch.setattr(committer_module, "SETTLE_STEP_COST", 1)
    log = BusLog.open(tmp_path / "commands.sqlite3")
    order: list[int] = []

    async def main() -> None:
        committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
        tickets = [publish(on_settled=lambda _, n=n: order.append(n)) for n in range(50)]
        trio.lowlevel.current_trio_token().run_sync_soon(committer._settle, tickets, None)

    try:
        trio.run(main)
    finally:
        log.close()
    assert order == list(range(50))


async def test_a_failing_listener_or_callback_stops_no_other_ticket(
    log: BusLog, caplog: pytest.LogCaptureFixture
) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    settled: list[Ticket] = []

    def broken(_: object) -> None:
        raise RuntimeError("a bug")

    committer.listeners.append(broken)
    first, second = publish(on_settled=broken), publish(on_settled=settled.append)
    await settle_all(committer, [first, second])
    assert settled == [second]
    assert first.published is not None  # committed: only its callback failed
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("commit_listener_failed" in m for m in logged)
    assert any("settle_callback_failed" in m for m in logged)


async def test_a_store_failure_reaches_every_ticket_of_the_batch(log: BusLog) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    await trio.to_thread.run_sync(log.close)
    tickets = [publish(), publish()]
    await settle_all(committer, tickets)
    assert all(isinstance(ticket.error, StoreUnavailable) for ticket in tickets)


async def test_a_thread_batcher_settles_each_batch_on_the_loop_in_order() -> None:
    loop_thread = threading.get_ident()
    worker_threads: set[int] = set()
    settled: list[tuple[list[int], object]] = []
    done = trio.Event()

    def take(queue: deque[int]) -> list[int]:
        return [queue.popleft() for _ in range(min(3, len(queue)))]

    def work(batch: list[int]) -> int:
        worker_threads.add(threading.get_ident())
        if 4 in batch:
            raise ValueError("batch with 4")
        return sum(batch)

    def settle(batch: list[int], outcome: int | Exception) -> None:
        assert threading.get_ident() == loop_thread
        settled.append((batch, outcome))
        if 9 in batch:
            done.set()

    batcher = ThreadBatcher(
        take, work, settle, name="test", max_batches=2
    )  # two thread calls for four
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            for item in range(10):
                batcher.put(item)
            await done.wait()
            nursery.cancel_scope.cancel()
    assert [batch for batch, _ in settled] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert settled[0][1] == 3 and settled[2][1] == 21 and settled[3][1] == 9
    assert isinstance(settled[1][1], ValueError)  # the work's error is its outcome
    assert worker_threads and loop_thread not in worker_threads


async def test_a_lingering_thread_takes_what_comes_after_its_queue_emptied() -> None:
    calls = 0
    settled: list[list[int]] = []
    done = trio.Event()

    def settle(batch: list[int], _outcome: object) -> None:
        settled.append(batch)
        if batch == [1]:
            batcher.put(2)  # the thread, waiting for more, takes it in the same call
        else:
            done.set()

    batcher = ThreadBatcher(
        lambda q: [q.popleft()], len, settle, name="test", max_batches=2, linger=1
    )
    batches = batcher._batches

    def counted(token: trio.lowlevel.TrioToken) -> None:
        nonlocal calls
        calls += 1
        batches(token)

    batcher._batches = counted  # type: ignore[method-assign]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            batcher.put(1)
            await done.wait()
            nursery.cancel_scope.cancel()
    assert settled == [[1], [2]] and calls == 1  # max_batches (2) ended the call


async def test_a_lingering_thread_takes_a_turns_items_together() -> None:
    """Items put in one turn of the loop go to a lingering thread in one batch, even
    when the loop lets go of the GIL between them (as a socket read does): told at
    once, the thread took the first alone and the rest waited for another commit."""
    batches: list[list[int]] = []
    settled = trio.Event()

    def take(queue: deque[int]) -> list[int]:
        return take_up_to(queue, 100, lambda _: 1)

    def settle(batch: list[int], _outcome: object) -> None:
        if batch != [0]:
            settled.set()

    batcher = ThreadBatcher(take, batches.append, settle, name="test", linger=1)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            batcher.put(0)
            while not batches:  # the thread ran it and lingers
                await trio.sleep(0.01)
            for item in (1, 2, 3):  # one turn: no checkpoint between them
                batcher.put(item)
                time.sleep(0.05)  # noqa: ASYNC251 (the GIL let go within one turn, as a read does)
            await settled.wait()
            nursery.cancel_scope.cancel()
    assert batches == [[0], [1, 2, 3]]


async def test_a_lingering_thread_told_of_an_item_it_took_already_waits_again() -> None:
    """The thread finishes a batch and takes the item queued meanwhile before the
    turn that queued it ends; the word of it then comes to a thread with nothing
    queued, which waits again instead of taking an empty batch."""
    batches: list[list[int]] = []
    first_running = threading.Event()
    release_first = threading.Event()
    done = trio.Event()

    def work(batch: list[int]) -> None:
        batches.append(batch)
        if batch == [0]:
            first_running.set()
            release_first.wait(10)

    def settle(batch: list[int], _outcome: object) -> None:
        if batch == [2]:
            done.set()

    batcher = ThreadBatcher(
        lambda q: take_up_to(q, 100, lambda _: 1), work, settle, name="test", linger=1
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            batcher.put(0)
            while not first_running.is_set():
                await trio.sleep(0.01)
            batcher.put(1)  # told as this turn ends...
            release_first.set()
            time.sleep(0.3)  # noqa: ASYNC251 (...by when the thread took it and waits, empty)
            await trio.sleep(0.3)  # the word comes; the thread must not take nothing
            batcher.put(2)
            await done.wait()
            nursery.cancel_scope.cancel()
    assert batches == [[0], [1], [2]]


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"max_batches": 0}, "max_batches must be >= 1"), ({"linger": -1}, "linger must be 0 to 1")],
)
def test_a_thread_batcher_checks_its_settings(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThreadBatcher(list, len, print, name="test", **settings)  # type: ignore[arg-type]


async def test_one_record_that_cannot_be_stored_fails_alone(
    log: BusLog, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A record whose preparation raises something unforeseen, and a record the store
    refuses in the commit itself: each fails its own ticket, and the honest records of
    the same batch commit (they used to fail with it, answered `internal`)."""
    rule = SubjectRule(BusKind.COMMANDS)

    class Buggy:  # the subject rule, meeting a bug on one record
        def subject(self, record: PublishRecord, field: str = "record") -> str:
            if record.execution_id == 2:
                raise RuntimeError("a bug this record alone meets")
            return rule.subject(record, field)

    committer = GroupCommitter(log, Buggy())  # type: ignore[arg-type]
    real_commit = log.commit

    def commit(entries: Any, *args: Any, **kwargs: Any) -> Any:
        if any("poison" in entry.record for entry in entries):
            raise ValueError("the store refuses this record")
        return real_commit(entries, *args, **kwargs)

    monkeypatch.setattr(log, "commit", commit)
    records = [PublishRecord(1, "{}"), PublishRecord(2, "{}"), PublishRecord(3, '"poison"')]
    records += [PublishRecord(n, "{}") for n in (4, 5)]
    tickets = [Ticket([(record, None, "record")]) for record in records]
    await commit_together(committer, tickets)
    assert isinstance(tickets[1].error, RuntimeError)
    assert isinstance(tickets[2].error, ValueError)
    assert [t.published[0].sort_key for t in tickets if t.published] == [1, 2, 3]
    assert [t.error for t in (tickets[0], tickets[3], tickets[4])] == [None, None, None]
    assert any("commit_isolating" in r.getMessage() for r in caplog.records)


async def test_a_failing_store_fails_the_batch_without_isolating(log: BusLog) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    await trio.to_thread.run_sync(log.close)
    tickets = [publish(), publish()]
    await commit_together(committer, tickets)
    assert all(isinstance(t.error, StoreUnavailable) for t in tickets)


async def test_refused_commits_are_a_warning_a_burst_not_an_error_a_batch(
    log: BusLog, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused while the cause lasts (logged once where it is found, the refused requests
    counted by the faces): a line a batch, with its traceback, flooded the log."""
    now = [0.0]
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS), max_batch=1)
    committer.wait_for(Refusing())
    refusals = OncePerBurst(period=10, clock=lambda: now[0])
    committer._failures = FailedCommits("commands", committer_module.log, refusals=refusals)
    tickets = [publish() for _ in range(3)]
    await settle_all(committer, tickets)  # three batches, three refusals
    assert all(isinstance(t.error, StoreUnavailable) for t in tickets)
    why = {"store": "commands", "why": "no standby is in sync", "traceback": False}
    assert commit_lines(caplog) == [("WARNING", "commit_refused", why)]
    now[0] = 9.9  # within the burst
    await settle_all(committer, [publish()])
    now[0] = 10.0  # the burst is over: the next line counts those not logged
    await settle_all(committer, [publish()])
    assert commit_lines(caplog)[1:] == [("WARNING", "commit_refused", {**why, "not_logged": 3})]


async def test_a_store_that_fails_is_an_error_every_batch(
    log: BusLog, caplog: pytest.LogCaptureFixture
) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS), max_batch=1)
    await trio.to_thread.run_sync(log.close)
    await settle_all(committer, [publish() for _ in range(3)])
    failed = ("ERROR", "commit_failed", {"store": "commands", "traceback": True})
    assert commit_lines(caplog) == [failed] * 3


def test_a_batch_takes_the_oldest_up_to_its_weight_and_never_none() -> None:
    from collections import deque

    from cmdbus_trio.loop.batcher import take_up_to

    queue = deque([3, 3, 3, 10])
    assert take_up_to(queue, 6, int) == [3, 3]
    assert take_up_to(queue, 5, int) == [3]
    assert take_up_to(queue, 5, int) == [10]  # over the limit alone: taken all the same
    assert take_up_to(queue, 5, int) == [] and not queue


async def test_a_batcher_cancelled_with_work_queued_does_it_first() -> None:
    """The drain cancels the committers once the faces are done: an ack queued by a
    connection that has ended must still be committed (docs/architecture.md, drain)."""
    from cmdbus_trio.loop.batcher import ThreadBatcher

    done: list[int] = []
    batcher: ThreadBatcher[int, list[int], None] = ThreadBatcher(
        lambda queue: [queue.popleft()], done.extend, lambda batch, outcome: None, name="test"
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            for n in range(5):
                batcher.put(n)
            nursery.cancel_scope.cancel()
    assert done == [0, 1, 2, 3, 4] and not batcher.queue
