"""Live fan-out of the event bus to its subscribers, with a bounded buffer each.

The committer hands every committed batch to the :class:`Hub`, which puts each record
(encoded once) into the buffer of every subscriber whose filter matches. A buffer is
bounded (``CMDBUS_SUBSCRIBER_BUFFER`` records and ``CMDBUS_SUBSCRIBER_BUFFER_BYTES``): a
subscriber that falls that far behind is cut off — it never makes the writer buffer
without bound, nor slows the others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.protocol import dumps_str
from cmdbus_trio.protocol.subjects import matches
from cmdbus_trio.protocol.trace import TraceContext

from .committer import Committed


def fragment(sort_key: int, subject: str, record: str, trace: TraceContext | None = None) -> bytes:
    """One pushed record, encoded: ``{"sort_key", "subject", "record"}`` (``record`` is the
    stored JSON text, inserted as it is), with ``trace``'s members before ``record`` when
    given (v2 only: v1 frames stay as NoETL's clients read them)."""
    head = f'{{"sort_key":{int(sort_key)},"subject":{dumps_str(subject)}'.encode()
    members = b"" if trace is None else trace.json_members()
    return b"".join((head, members, b',"record":', record.encode(), b"}"))


@attrs.frozen
class Pushed:
    sort_key: int
    subject: str
    fragment: bytes
    """As v1 pushes it."""
    traced: bytes
    """As v2 pushes it, with the record's trace context (``fragment`` itself when the
    record has none)."""

    def piece(self, traced: bool) -> bytes:
        return self.traced if traced else self.fragment


class Subscription:
    """One subscriber's buffer of records to push: at most ``capacity`` records and
    ``max_bytes`` of them (a record alone may be larger: it is never refused for its
    size alone). A subscriber that would pass either is cut off. ``traced``: it is sent
    the records' trace context (v2)."""

    def __init__(
        self,
        filter_tokens: tuple[str, ...] | None,
        capacity: int,
        max_bytes: int,
        traced: bool = False,
    ) -> None:
        self.filter = filter_tokens
        self.traced = traced
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._buffer: deque[Pushed] = deque()
        self._bytes = 0
        self._more = trio.lowlevel.ParkingLot()
        self._ended = False
        self.overflowed = False

    @property
    def buffered_bytes(self) -> int:
        return self._bytes

    def offer(self, pushed: Pushed) -> None:
        if self._ended:
            return
        size = len(pushed.piece(self.traced))
        if len(self._buffer) >= self.capacity or (
            self._buffer and self._bytes + size > self.max_bytes
        ):
            self.overflowed = True  # too far behind: it is cut off, the others go on
            metrics.SUBSCRIBERS_DROPPED.inc()
            self.end()
            return
        self._buffer.append(pushed)
        self._bytes += size
        self._more.unpark_all()

    def end(self) -> None:
        """No more records: what is buffered is still pushed, then :meth:`batches` ends."""
        self._ended = True
        self._more.unpark_all()

    async def batches(self, most: int) -> AsyncIterator[list[Pushed]]:
        """Everything buffered, up to ``most`` records at a time, until the subscription
        ends."""
        while True:
            if self._buffer:
                await trio.lowlevel.checkpoint()
            while not self._buffer:
                if self._ended:
                    return
                await self._more.park()
            batch = [self._buffer.popleft() for _ in range(min(most, len(self._buffer)))]
            self._bytes -= sum(len(pushed.piece(self.traced)) for pushed in batch)
            yield batch


class Hub:
    """The live subscriptions, kept by filter: a committed record is compared with the
    filters in use (once per subject, remembered), not with every subscriber, and is
    encoded only when some subscriber wants it."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._by_filter: dict[tuple[str, ...] | None, set[Subscription]] = {}
        self._matching: dict[str, list[set[Subscription]]] = {}  # subject -> its sets
        self._count = 0
        self._closed = False
        metrics.SUBSCRIBERS.set_function(lambda: self._count)

    @contextmanager
    def subscribe(
        self, filter_tokens: tuple[str, ...] | None, traced: bool = False
    ) -> Iterator[Subscription]:
        subscription = Subscription(filter_tokens, self.capacity, self.max_bytes, traced)
        if self._closed:
            subscription.end()
        same = self._by_filter.get(filter_tokens)
        if same is None:
            same = self._by_filter[filter_tokens] = set()
            self._matching.clear()  # subjects learn of the new filter when next met
        same.add(subscription)
        self._count += 1
        try:
            yield subscription
        finally:
            same.discard(subscription)
            self._count -= 1
            if not same:
                del self._by_filter[filter_tokens]
                self._matching.clear()
            subscription.end()

    def _subscribers_of(self, subject: str) -> list[set[Subscription]]:
        found = self._matching.get(subject)
        if found is None:
            if len(self._matching) > 100_000:
                self._matching.clear()  # bounded, whatever the subjects
            found = self._matching[subject] = [
                same
                for filter_tokens, same in self._by_filter.items()
                if filter_tokens is None or matches(filter_tokens, subject)
            ]
        return found

    def feed(self, committed: list[Committed]) -> None:
        """A committer listener: push each newly committed record to its subscribers."""
        if not self._count:
            return
        for record in committed:
            wanted = [same for same in self._subscribers_of(record.subject) if same]
            if not wanted:
                continue
            plain = fragment(record.sort_key, record.subject, record.record)
            traced = (
                plain
                if record.trace is None
                else fragment(record.sort_key, record.subject, record.record, record.trace)
            )
            pushed = Pushed(record.sort_key, record.subject, plain, traced)
            for same in wanted:
                for subscription in list(same):
                    subscription.offer(pushed)

    def close(self) -> None:
        """End every subscription (the writer is draining)."""
        self._closed = True
        for same in self._by_filter.values():
            for subscription in same:
                subscription.end()
