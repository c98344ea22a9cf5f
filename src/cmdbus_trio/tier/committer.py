"""Group commit of the tier's appends: every append waiting when the store is free goes
in one worker-thread call and one transaction (one fsync).

Each append was a thread hop and a transaction of its own, and its statements, each
giving up the GIL and then waiting to take it back from a busy loop, made most of its
~2 ms of service time (`benchmarks/lane_gil.py`). Now an append is
queued as a :class:`AppendTicket`, and the committer takes what is queued (in arrival
order, up to ``max_records``) into :meth:`TierStore.append_many`. A request refused
(a bad payload, ``expected_version``) fails alone; a failure of the store fails the
batch.

Admission is the tier's write Gate (``tier_writes``): an append holds a Gate slot from
before it is queued until its ticket is settled, so the Gate bounds the queue (full:
``busy``), and a drain, which waits for every slot, flushes it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import Gate, Slot, run_in_thread
from cmdbus_trio.loop import Task
from cmdbus_trio.loop.batcher import Durability, ThreadBatcher, take_up_to
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.loop.steps import MAX_SETTLE_STEP, Steps
from cmdbus_trio.storage import FailedCommits
from cmdbus_trio.storage.tier import Appending, AppendResult, TierStore

log = logging.getLogger(__name__)

__all__ = ["AppendTicket", "Tier", "TierCommitter"]

MAX_RECORDS = 1000
"""Records one transaction appends at most (always at least one request)."""


@attrs.define(eq=False)
class AppendTicket:
    """One append request, made and answered in the commit thread; once settled (its
    ``on_settled`` called), its reply (``replied``) or the error to answer with
    (``error``: a ``FieldError`` naming the bad payload, a :class:`VersionConflict`, or
    the store's ``StoreUnavailable``).

    ``request`` makes the :class:`Appending` (checking the payloads: a ``FieldError``
    refuses this ticket alone); ``reply`` encodes the reply from the results. Both run
    in the commit thread, off the loop."""

    request: Callable[[], Appending]
    reply: Callable[[list[AppendResult]], bytes]
    records: int = 1
    """How many records the request has (its weight in a batch)."""
    on_settled: Callable[[AppendTicket], None] | None = None
    """Called on the loop once the ticket is settled: a connection's deferred reply, not
    a task (no ``trio.Event`` per append: nothing parks on a ticket). It must not raise;
    if it does, that is logged and the other tickets are settled all the same."""
    replied: bytes | None = None
    error: Exception | None = None
    waited: float = 0.0
    """Seconds it waited for its place in the write lane (set once admitted)."""


class TierCommitter:
    def __init__(self, store: TierStore, *, max_records: int = MAX_RECORDS) -> None:
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        self.store = store
        self.max_records = max_records
        self._batches = ThreadBatcher(
            self._take, self._commit, self._settle, name=f"commit:{store.name}"
        )
        self._commit_seconds = metrics.COMMIT_SECONDS.labels(store=store.name)
        # Settled a few at a time, as the buses' tickets are: a commit of 64 appends woke
        # 64 tasks in one turn of the loop, and every probe waited for each such turn.
        self._unsettled = Steps(self._settle_one, max_step=MAX_SETTLE_STEP, name="tier_settle")
        self._batch_records = metrics.COMMIT_BATCH.labels(store=store.name)
        self._failures = FailedCommits(store.name, log)

    def wait_for(self, durability: Durability | None) -> None:
        """Settle each batch (reply, tell consumers) only once ``durability`` says it
        may be acknowledged: a standby confirmed it (None: at once, as without one)."""
        self._batches.durability = durability

    async def wait_quiet(self) -> None:
        """Until every ticket enqueued so far is committed and handed to the durability
        (see :meth:`ThreadBatcher.wait_quiet`)."""
        await self._batches.wait_quiet()

    def enqueue(self, ticket: AppendTicket) -> None:
        """Queue a ticket; never blocks (the caller's Gate slot bounds the queue)."""
        self._batches.put(ticket)

    def append(
        self,
        ticket: AppendTicket,
        lane: Gate,
        op: str,
        *,
        budget: float | None,
        arrival: float,
    ) -> Deferred[bytes]:
        """Admit an append by the write ``lane`` (its place waited for as a callback, or
        shed), queue it for the group commit once admitted, in admission order, and
        complete by the commit's callback: the reply, or the error to answer with (a
        :class:`Shed` or :class:`GateClosed`, a ``FieldError``, a ``VersionConflict``,
        the store's). No task, even while it waits in line: under overload most appends
        wait, and a task each was a third of the loop's time. The slot is held until the
        ticket is settled, so a drain waits for it and nothing admitted is dropped; an
        admitted append is committed even if its client has gone."""
        reply: Deferred[bytes] = Deferred()

        def admitted(slot: Slot | Exception) -> None:
            if isinstance(slot, Exception):  # shed, or the Gate closed
                reply.settle(slot)
                return
            ticket.waited = slot.admitted_at - slot.arrival

            def settled(ticket: AppendTicket) -> None:
                slot.release()  # which may admit the next append in line
                if ticket.error is not None:
                    reply.settle(ticket.error)
                else:
                    assert ticket.replied is not None
                    reply.settle(ticket.replied)

            ticket.on_settled = settled
            self.enqueue(ticket)

        lane.acquire_later(op, admitted, budget=budget, arrival=arrival)
        return reply

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Commit queued tickets until cancelled (in the background nursery); batches
        that started finish even if the writer stops."""
        await self._batches.run(task_status=task_status)

    def _take(self, queue: deque[AppendTicket]) -> list[AppendTicket]:
        return take_up_to(queue, self.max_records, lambda ticket: ticket.records)

    def _commit(self, batch: list[AppendTicket]) -> dict[str, int]:
        """In the thread: make each ticket's request, append them all, encode replies;
        per tier, the newest record the batch appended (or found a duplicate of)."""
        accepted: list[AppendTicket] = []
        requests: list[Appending] = []
        for ticket in batch:
            try:
                requests.append(ticket.request())
            except Exception as exc:  # FieldError, or a bug met by this input alone
                ticket.error = exc
            else:
                accepted.append(ticket)
        newest: dict[str, int] = {}
        if not accepted:
            return newest
        started = time.monotonic()
        outcomes = self.store.append_many(requests)
        self._commit_seconds.observe(time.monotonic() - started)
        self._batch_records.observe(sum(ticket.records for ticket in accepted))
        held_back = self.store.visible_through is not None  # (a standby: reads wait)
        for ticket, request, outcome in zip(accepted, requests, outcomes, strict=True):
            if isinstance(outcome, Exception):
                ticket.error = outcome
                continue
            if held_back:
                top = max((result.global_sequence for result in outcome), default=0)
                newest[request.tier] = max(newest.get(request.tier, 0), top)
            try:
                ticket.replied = ticket.reply(outcome)
            except Exception as exc:  # committed, but its reply could not be made
                ticket.error = exc
        return newest

    def _settle(self, batch: list[AppendTicket], outcome: dict[str, int] | Exception) -> None:
        """On the loop, as a plain callback: it must not raise. A batch that may be
        acknowledged may be read too (with a standby, reads wait for that)."""
        visible = self.store.visible_through
        if visible is not None and not isinstance(outcome, Exception):
            for tier, newest in outcome.items():
                visible[tier] = max(visible.get(tier, 0), newest)
        if isinstance(outcome, Exception):  # refused, or the store failed: all learn it
            self._failures.log(outcome)
            for ticket in batch:
                ticket.error = ticket.error or outcome
        self._unsettled.push_now(batch)

    def _settle_one(self, ticket: AppendTicket) -> None:
        if ticket.on_settled is not None:
            ticket.on_settled(ticket)  # if it raises, Steps logs it and goes on


@attrs.frozen
class Tier:
    """The tier as the faces see it: its store, and the committer that appends to it.

    Lifecycle: opened with the store; :meth:`tasks` run in the background while it
    serves; :meth:`close` once no face uses it."""

    store: TierStore
    committer: TierCommitter

    @classmethod
    def of(cls, store: TierStore) -> Tier:
        return cls(store, TierCommitter(store))

    def tasks(self) -> dict[str, Task]:
        """The background tasks the tier needs while it serves, by name."""
        return {"committer": self.committer.run}

    async def close(self, *, limiter: trio.CapacityLimiter) -> None:
        """Cancellation: shielded; the store is closed whatever is cancelled."""
        with trio.CancelScope(shield=True):
            await run_in_thread(self.store.close, limiter=limiter)
