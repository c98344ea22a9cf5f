"""Record bodies for deliveries, read in batches.

A claim's lease is decided in memory; its body is on disk. One thread hop per ``next``
cost the loop about as much as the rest of the request (a hop is ~95 µs: docs/architecture.md), so,
as the group committer does for writes, every body asked for while a read runs goes into
the next read: one query per batch, and one thread call reads batch after batch while
asks keep coming (:class:`~cmdbus_trio.loop.batcher.ThreadBatcher`).

Most of the time no read is needed at all: a worker claims a command moments after it was
published, while its body is still among the recent ones the committer handed over
(:meth:`BodyReader.remember`, bounded by :data:`RECENT_BODY_BYTES`). Such a ``next`` is
answered without a thread hop.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.loop.batcher import ThreadBatcher
from cmdbus_trio.protocol.trace import TraceContext
from cmdbus_trio.storage.buslog import MAX_READ_MANY, BusLog, StoredRecord

MAX_BATCHES_PER_HOP = 16
"""Batches one worker-thread call reads back to back before it returns to the loop."""

RECENT_BODY_BYTES = 8 << 20
"""Bytes of the newest committed bodies kept in memory to answer ``next`` without a read."""

_ENTRY_BYTES = 200
"""What a kept body costs besides its text (its object and its place in the dict)."""
_TRACE_BYTES = 200
"""What a kept body's trace context costs besides its tracestate's text."""


@attrs.define(eq=False)
class _Asked:
    """The asks of one :meth:`BodyReader.read_many`, woken together once the last of
    them is answered: an event (and a wake-up) per body cost a batched ``next`` a task
    step per record."""

    left: int = 0
    done: trio.Event = attrs.field(factory=trio.Event)

    def answered(self) -> None:
        self.left -= 1
        if not self.left:
            self.done.set()


@attrs.define(eq=False)
class _Ask:
    sort_key: int
    asked: _Asked
    record: StoredRecord | None = None
    error: Exception | None = None

    def outcome(self) -> StoredRecord | Exception:
        if self.error is not None:
            return self.error
        if self.record is None:
            return LookupError(f"no record with sort key {self.sort_key}")
        return self.record


class BodyReader:
    def __init__(
        self,
        log: BusLog,
        *,
        max_batch: int = MAX_READ_MANY,
        recent_bytes: int = RECENT_BODY_BYTES,
    ) -> None:
        if not 1 <= max_batch <= MAX_READ_MANY:
            raise ValueError(f"max_batch must be in 1..{MAX_READ_MANY}, got {max_batch}")
        if recent_bytes < 0:
            raise ValueError(f"recent_bytes must be >= 0, got {recent_bytes}")
        self.log = log
        self.max_batch = max_batch
        self.recent_bytes = recent_bytes
        # (subject, record, trace) by sort key, oldest first. Plain tuples, not the
        # committer's objects: the garbage collector stops tracking a tuple of strings
        # (and None), where tens of thousands of kept objects moving through its oldest
        # generation made full collections frequent (batched publishes ran 15-20% slower).
        # A traced record's context is an object it tracks: traced records cost that.
        self._recent: OrderedDict[int, tuple[str, str, TraceContext | None]] = OrderedDict()
        self._recent_size = 0
        self._from_memory = metrics.BODY_READS.labels(store=log.name, source="memory")
        self._from_store = metrics.BODY_READS.labels(store=log.name, source="store")
        self._batches = ThreadBatcher(
            self._take,
            self._read,
            self._settle,
            name=f"bodies:{log.name}",
            max_batches=MAX_BATCHES_PER_HOP,
        )
        self.batches = 0
        """Batches read so far (one query each; one thread call reads several in a row)."""
        self._asked = 0
        self._answered = 0  # asks are answered in the order they were made
        self._progress = trio.Event()

    async def read(self, sort_key: int) -> StoredRecord:
        """The record with ``sort_key``, read with every other one asked for meanwhile.

        Cancellation: only the wait stops; the read goes on for the others.

        Error handling: raises the store's error (e.g. ``StoreUnavailable``), and
        ``LookupError`` for a sort key that has no record (deleted by retention only once
        no one needs it, or evicted after :meth:`caught_up`: a consumer group asking for
        it is told first, so this is a bug unless the record was evicted).
        """
        (outcome,) = await self.read_many([sort_key])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def read_many(self, sort_keys: list[int]) -> list[StoredRecord | Exception]:
        """The records with ``sort_keys``, in order, each the record or the error
        :meth:`read` would raise: those not kept in memory are asked for together, so
        they go into the same batch.

        Cancellation: only the wait stops; the reads go on for the others."""
        pending: list[StoredRecord | _Ask] = []
        asked: _Asked | None = None  # made only when a body is not kept
        for sort_key in sort_keys:
            kept = self._recent.get(sort_key)
            if kept is not None:
                pending.append(StoredRecord(sort_key, *kept))
                continue
            if asked is None:
                asked = _Asked()
            asked.left += 1
            pending.append(self._ask(sort_key, asked))
        if from_memory := len(pending) - (0 if asked is None else asked.left):
            self._from_memory.inc(from_memory)
        if asked is not None:
            await asked.done.wait()
        return [item.outcome() if isinstance(item, _Ask) else item for item in pending]

    def remember(self, committed: list[StoredRecord]) -> None:
        """A committer listener: keep the newest bodies, up to :attr:`recent_bytes` (the
        oldest go first; a body larger than all of it is not kept)."""
        for record in committed:
            size = _kept_size(record.record, record.trace)
            if size > self.recent_bytes:
                continue
            self._recent[record.sort_key] = (record.subject, record.record, record.trace)
            self._recent_size += size
        while self._recent_size > self.recent_bytes:
            self._drop_oldest()

    def forget_through(self, sort_key: int) -> None:
        """Drop the kept bodies up to ``sort_key`` (evicted: a ``next`` that leased one
        before must learn it is gone, as from the store)."""
        while self._recent and next(iter(self._recent)) <= sort_key:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (_, record, trace) = self._recent.popitem(last=False)
        self._recent_size -= _kept_size(record, trace)

    def _ask(self, sort_key: int, asked: _Asked) -> _Ask:
        ask = _Ask(sort_key, asked)
        self._batches.put(ask)
        self._asked += 1
        return ask

    async def caught_up(self) -> None:
        """Wait until every body asked for so far is read (an eviction waits for this
        before it deletes the records it took from the groups).

        Cancellation: only the wait stops."""
        target = self._asked
        while self._answered < target:
            await self._progress.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read queued asks until cancelled (in the background nursery, which ends before
        the store closes; reads that started finish first)."""
        await self._batches.run(task_status=task_status)

    def _take(self, queue: deque[_Ask]) -> list[_Ask]:
        return [queue.popleft() for _ in range(min(len(queue), self.max_batch))]

    def _read(self, batch: list[_Ask]) -> dict[int, StoredRecord]:
        return self.log.read_many(list(dict.fromkeys(ask.sort_key for ask in batch)))

    def _settle(self, batch: list[_Ask], outcome: dict[int, StoredRecord] | Exception) -> None:
        self.batches += 1
        self._from_store.inc(len(batch))
        self._answered += len(batch)
        self._progress.set()
        self._progress = trio.Event()
        for ask in batch:
            if isinstance(outcome, Exception):
                ask.error = outcome
            else:
                ask.record = outcome.get(ask.sort_key)
            ask.asked.answered()


def _kept_size(record: str, trace: TraceContext | None) -> int:
    if trace is None:
        return len(record) + _ENTRY_BYTES
    return len(record) + _ENTRY_BYTES + _TRACE_BYTES + len(trace.tracestate or "")
