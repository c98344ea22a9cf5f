"""Group commit: concurrent publishes from every connection, one transaction per hop.

A publish enqueues a :class:`Ticket` (in the order its connection sent it) and waits for
it. The committer takes everything queued, up to ``max_batch`` records, into one worker
thread call that checks each ticket's records, computes their subjects and appends the
good tickets in one transaction (one fsync). A ticket with a bad record is refused whole
and does not touch the others. Replies go out only after the commit.

Admission is the ingest face's Gate: a publish holds a Gate slot from before it is queued
until its ticket is settled, so the Gate bounds the queue (full: ``busy``) and a drain,
which waits for every slot, flushes it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeAlias

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import Slot
from cmdbus_trio.logs import event
from cmdbus_trio.loop.batcher import Durability, ThreadBatcher, take_up_to
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.loop.steps import MAX_SETTLE_STEP, Steps
from cmdbus_trio.protocol.bus import PublishRecord, SubjectRule
from cmdbus_trio.storage import FailedCommits, StoreUnavailable
from cmdbus_trio.storage.buslog import BusEntry, BusLog, Published, Settlements, StoredRecord

log = logging.getLogger(__name__)

MAX_BATCHES_PER_HOP = 16
"""Batches one worker-thread call commits back to back before it returns to the loop."""


SETTLE_STEP_COST = 16
"""What one step of settling takes on (see :func:`_settle_cost`); a costlier ticket is a
step alone. The time bound is checked between steps. Finer steps shorten the loop's
passes further but cost closed-loop clients throughput (`benchmarks/bus.py`, claim+ack x16)."""


Committed: TypeAlias = StoredRecord
"""A record a batch appended (not a duplicate), as the listeners get it: as stored, so
that the body reader can keep it and answer a ``next`` without reading it back."""


@attrs.define(eq=False)
class Ticket:
    """One publish request's records, and what became of them."""

    records: Sequence[tuple[PublishRecord, str | None, str]] = ()
    """(record, msg_id, field name for errors), in order."""
    acks: Sequence[tuple[str, int]] = ()
    """(consumer, sort_key): claim acks, durable once the ticket is settled."""
    dead: Sequence[tuple[str, int, int]] = ()
    """(consumer, sort_key, deliveries): records parked as dead letters."""
    positions: Sequence[tuple[str, int]] = ()
    """(consumer, settled_below): low-water marks of the claim groups."""
    counts: Sequence[tuple[str, int, int]] = ()
    """(consumer, sort_key, deliveries): deliveries of a record that ended without an
    ack, so that ``CMDBUS_MAX_DELIVER`` holds across a restart."""
    dropped: Sequence[str] = ()
    """Consumer groups deleted, with their acks, dead letters, counts and position."""
    dead_moves: Sequence[tuple[str, int, bool]] = ()
    """(consumer, sort_key, requeue): dead letters requeued (True) or purged (False)."""
    owe: Sequence[tuple[str, int, int]] = ()
    """(consumer, after, through): records in that range the consumer has not settled are
    owed to it (its position passes them; see :meth:`BusLog.commit`)."""
    moved: list[tuple[str, int]] = attrs.field(factory=list)
    """Of ``dead_moves``, the (consumer, sort_key) that were still dead (set in the commit
    thread): only those are requeued in memory."""
    settled: trio.Event = attrs.field(factory=trio.Event)
    on_settled: Callable[[Ticket], None] | None = None
    """Called on the loop once the ticket is settled, for a waiter that is not a task (a
    connection's deferred reply). It must not raise; if it does, that is logged and the
    other tickets are settled all the same."""
    published: list[Published] | None = None
    commit_records: int = 0
    """Records of the group commit that took this ticket (set in the commit thread)."""
    entries: list[BusEntry] = attrs.field(factory=list)
    """What the commit thread appends for the records (set there): the records as stored,
    for the listeners too."""
    error: Exception | None = None

    async def wait(self) -> list[Published]:
        """The records' sort keys, once committed.

        Cancellation: the ticket stays queued and is committed anyway (a publish that
        was accepted is not taken back); only the wait stops.

        Error handling: raises the ticket's error (a :class:`FieldError` naming the bad
        record, or the store's ``StoreUnavailable``).
        """
        await self.settled.wait()
        if self.error is not None:
            raise self.error
        assert self.published is not None
        return self.published


class GroupCommitter:
    def __init__(self, bus: BusLog, rule: SubjectRule, *, max_batch: int = 1000) -> None:
        self.bus = bus
        self.rule = rule
        self.max_batch = max_batch
        self._batches = ThreadBatcher(
            self._take,
            self._commit_in_thread,
            self._settle,
            name=f"commit:{bus.name}",
            max_batches=MAX_BATCHES_PER_HOP,
        )
        self._commit_seconds = metrics.COMMIT_SECONDS.labels(store=bus.name)
        self._batch_records = metrics.COMMIT_BATCH.labels(store=bus.name)
        self._failures = FailedCommits(bus.name, log)
        # Committed, their listeners not told and callbacks not run yet: in commit
        # order, a few tickets a step (see _settle).
        self._unsettled = Steps(self._settle_step, max_step=MAX_SETTLE_STEP, name="settle")
        self.listeners: list[Callable[[list[Committed]], None]] = []
        """Called on the loop with the records each batch committed, when it committed
        any (the claim coordinators and the subscriptions learn of new records this way:
        an in-memory signal, no polling of the database). A batch of acks alone calls
        nobody."""

    def wait_for(self, durability: Durability | None) -> None:
        """Settle each batch (reply, tell consumers) only once ``durability`` says it
        may be acknowledged: a standby confirmed it (None: at once, as without one)."""
        self._batches.durability = durability

    async def wait_quiet(self) -> None:
        """Until every ticket enqueued so far is committed and handed to the durability
        (see :meth:`ThreadBatcher.wait_quiet`)."""
        await self._batches.wait_quiet()

    def enqueue(self, ticket: Ticket) -> None:
        """Queue a ticket; never blocks (the caller's Gate slot bounds the queue)."""
        self._batches.put(ticket)

    def publish(self, ticket: Ticket, slot: Slot) -> Deferred[list[Published]]:
        """Queue a publish's ticket now (in the order its connection sent it), admitted
        by ``slot``, which is held until the commit is settled: a drain waits for it, so
        nothing accepted is dropped. Completes by the commit's callback, with no task
        (under pipelined load a task per publish was most of the loop's time): the
        records' places, or the error (a bad record, the wrong shard, the store's)."""
        published: Deferred[list[Published]] = Deferred()

        def settled(ticket: Ticket) -> None:
            slot.release()
            if ticket.error is not None:
                published.settle(ticket.error)
            else:
                assert ticket.published is not None
                published.settle(ticket.published)

        ticket.on_settled = settled
        self.enqueue(ticket)
        return published

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Commit queued tickets until cancelled (in the background nursery): batch after
        batch in one thread call while tickets keep coming, each settled on the loop as
        soon as it is durable; batches that started finish even if the writer stops."""
        await self._batches.run(task_status=task_status)

    def _take(self, queue: deque[Ticket]) -> list[Ticket]:
        return take_up_to(queue, self.max_batch, _size)

    def _settle(self, batch: list[Ticket], outcome: Exception | None) -> None:
        """On the loop, as a plain callback (not a task): it must not raise, so each
        listener and settle callback that does is logged and the others go on."""
        self._batch_records.observe(sum(len(ticket.records) for ticket in batch))
        if outcome is not None:  # refused, or the store failed: every ticket learns it
            self._failures.log(outcome)
            for ticket in batch:
                ticket.error = ticket.error or outcome
        steps: list[list[Ticket]] = [[]]
        cost = 0
        for ticket in batch:
            ticket_cost = _settle_cost(ticket)
            if steps[-1] and cost + ticket_cost > SETTLE_STEP_COST:
                steps.append([])
                cost = 0
            steps[-1].append(ticket)
            cost += ticket_cost
        self._unsettled.push_now(steps)

    def _settle_step(self, step: list[Ticket]) -> None:
        """Tell the listeners of a step's committed records, then settle its tickets."""
        committed = [
            Committed(published.sort_key, published.subject, entry.record, entry.trace)
            for ticket in step
            if ticket.published
            for published, entry in zip(ticket.published, ticket.entries, strict=True)
            if not published.duplicate
        ]
        for listener in self.listeners if committed else ():
            try:
                listener(committed)
            except Exception as exc:
                event(log, logging.ERROR, "commit_listener_failed", exc_info=exc)
        for ticket in step:
            ticket.settled.set()
            if ticket.on_settled is not None:
                try:
                    ticket.on_settled(ticket)
                except Exception as exc:
                    event(log, logging.ERROR, "settle_callback_failed", exc_info=exc)

    def _commit_in_thread(self, batch: list[Ticket]) -> None:
        """Commit the batch in one transaction. A ticket whose records cannot be stored
        fails alone (``invalid`` naming the record, or whatever else it raised); should
        the commit still fail for a reason that is not the store's (one record the store
        refuses), each ticket is committed on its own, so that only its own fails."""
        accepted = [ticket for ticket in batch if self._prepare(ticket)]
        try:
            self._commit(accepted)
        except StoreUnavailable:
            raise  # the store failed: every ticket learns it (and it is poisoned)
        except Exception:
            if len(accepted) == 1:
                raise
            event(log, logging.WARNING, "commit_isolating", tickets=len(accepted))
            for ticket in accepted:
                try:
                    self._commit([ticket])
                except StoreUnavailable:
                    raise
                except Exception as exc:
                    ticket.error = exc

    def _prepare(self, ticket: Ticket) -> bool:
        """Check the ticket's records and what will be stored of them; False (with the
        ticket's error set) when it is refused."""
        try:
            ticket.entries = [
                BusEntry(self.rule.subject(record, field), record.stored(), msg_id, record.trace)
                for record, msg_id, field in ticket.records
            ]
        except Exception as exc:  # FieldError, or a bug met by this input alone
            ticket.error = exc
            return False
        return True

    def _commit(self, tickets: list[Ticket]) -> None:
        entries = [entry for ticket in tickets for entry in ticket.entries]
        done = Settlements(
            acks=[ack for ticket in tickets for ack in ticket.acks],
            dead=[parked for ticket in tickets for parked in ticket.dead],
            positions=[mark for ticket in tickets for mark in ticket.positions],
            counts=[count for ticket in tickets for count in ticket.counts],
            dropped=[group for ticket in tickets for group in ticket.dropped],
            dead_moves=[move for ticket in tickets for move in ticket.dead_moves],
            owe=[owed for ticket in tickets for owed in ticket.owe],
        )
        if not (entries or done):
            return
        started = time.monotonic()
        moved: list[tuple[str, int]] = []
        published = self.bus.commit(entries, done, moved)
        if moved:
            still_dead = set(moved)
            for ticket in tickets:
                ticket.moved = [m[:2] for m in ticket.dead_moves if m[:2] in still_dead]
        self._commit_seconds.observe(time.monotonic() - started)
        start = 0
        for ticket in tickets:
            ticket.commit_records = len(entries)
            ticket.published = published[start : start + len(ticket.records)]
            start += len(ticket.records)


def _size(ticket: Ticket) -> int:
    """A ticket's weight in a batch: its records, acks, dead letters, positions and
    counts (at least 1)."""
    parts = (
        ticket.records,
        ticket.acks,
        ticket.dead,
        ticket.positions,
        ticket.counts,
        ticket.dead_moves,
    )
    return max(1, sum(map(len, parts)))


def _settle_cost(ticket: Ticket) -> int:
    """A ticket's share of a settling step: its reply, and a little per record the
    listeners are told of (a batch of 32 records costs five single publishes)."""
    return 1 + _size(ticket) // 8
