"""A group's records to deliver, per subject, and per filter the index that finds the
oldest one a consumer's filter matches without walking every subject (and keeps the
consumers parked with that filter: see ``_waiters.py``)."""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Literal

import attrs
import trio

from cmdbus_trio.protocol.claim import Delivery
from cmdbus_trio.protocol.subjects import matches

Kind = Literal["fresh", "again"]

MAX_MATCHED = 1024
"""Subjects whose match against a filter is remembered (per filter, on a tail)."""
MAX_IDLE_FILTERS = 256
"""Filters with no waiter whose index is kept (the most recently used); one used again
after it was dropped has its index rebuilt once (a walk of the subjects with records)."""


@attrs.define(eq=False)
class Waiter:
    """A parked consumer: a record is leased to it and handed over (``delivery``), or
    it is woken when the group closes (``delivery`` None)."""

    seq: int
    owner: object
    index: FilterIndex
    woken: trio.Event = attrs.field(factory=trio.Event)
    delivery: Delivery | None = None


@attrs.define
class FilterIndex:
    """One filter's view of the subjects with records to deliver: heaps of
    ``(head sort key, subject)``, pushed whenever a matching subject's head changes and
    checked against the subject's real head when popped (an old entry is skipped), so
    taking the oldest matching record never walks every subject. On a tail (an event
    group), fresh records are found from ``position`` instead: every record before it
    that the filter matches has been taken, so each record is looked at once."""

    filter: tuple[str, ...]
    again: list[tuple[int, str]] = attrs.field(factory=list)
    fresh: list[tuple[int, str]] = attrs.field(factory=list)
    waiters: OrderedDict[int, Waiter] = attrs.field(factory=OrderedDict)
    """Parked here, oldest first, by ``seq``: one that leaves (its ``next`` timed out or
    was cancelled) is removed at once, so the index can become idle and be dropped."""
    position: int = 0
    matched: dict[str, bool] = attrs.field(factory=dict)  # subject -> filter matches it


class SubjectQueues:
    """Per subject, only while it has some: fresh records in arrival order (the command
    bus's; an event group's fresh records are on its tail) and records to redeliver,
    oldest first. Memory follows the subjects with records, not every subject seen."""

    def __init__(self) -> None:
        self.fresh: dict[str, deque[int]] = {}
        self.again: dict[str, list[int]] = {}  # heaps
        self.indexes: dict[tuple[str, ...], FilterIndex] = {}  # most recently used last
        self._matching: dict[str, list[FilterIndex]] = {}  # subject -> indexes matching it

    def add_fresh(self, sort_key: int, subject: str) -> None:
        queue = self.fresh.get(subject)
        if queue is None:
            self.fresh[subject] = deque([sort_key])
            self._indexed(subject, "fresh", sort_key)
        else:
            queue.append(sort_key)

    def add_again(self, sort_key: int, subject: str) -> None:
        heap = self.again.setdefault(subject, [])
        heapq.heappush(heap, sort_key)
        if heap[0] == sort_key:
            self._indexed(subject, "again", sort_key)

    def has(self, index: FilterIndex) -> bool:
        """A queued record (to redeliver, or fresh) matches the index's filter."""
        return (
            _live_head(index.again, self.again) is not None
            or _live_head(index.fresh, self.fresh) is not None
        )

    def take_oldest(self, index: FilterIndex, most: int) -> list[tuple[int, str]]:
        """Remove and return up to ``most`` of the oldest queued records the index's
        filter matches, redeliveries first, oldest first: ``(sort_key, subject)``.

        What a record taken costs is one heap step on this index (its entry replaced by
        the subject's new head) and a push on each other index matching the subject,
        not a push here and a pop of the old head on the next look."""
        taken: list[tuple[int, str]] = []
        kinds: tuple[tuple[Kind, list[tuple[int, str]], dict[str, Any]], ...] = (
            ("again", index.again, self.again),
            ("fresh", index.fresh, self.fresh),
        )
        for kind, heap, queues in kinds:
            while len(taken) < most and (head := _live_head(heap, queues)) is not None:
                taken.append(head)
                subject = head[1]
                queue = queues[subject]
                if kind == "again":
                    heapq.heappop(queue)
                else:
                    queue.popleft()
                if queue:
                    heapq.heapreplace(heap, (queue[0], subject))
                    self._indexed(subject, kind, queue[0], besides=index)
                else:
                    del queues[subject]
                    heapq.heappop(heap)
        return taken

    def drop_through(self, through: int, count: Callable[[str, int], None]) -> int:
        """Drop every queued record up to ``through``; ``count(subject, -n)`` for each
        subject that lost some. Returns how many were dropped."""
        dropped = 0
        kinds: tuple[tuple[Kind, dict[str, Any]], ...] = (
            ("fresh", self.fresh),
            ("again", self.again),
        )
        for kind, queues in kinds:
            # A fresh queue's oldest is first, a heap's smallest too.
            for subject in [s for s, queued in queues.items() if queued[0] <= through]:
                queued = queues.pop(subject)
                kept = sorted(key for key in queued if key > through)
                dropped += len(queued) - len(kept)
                count(subject, len(kept) - len(queued))
                if kept:  # a sorted list is a heap, and ordered like a fresh queue
                    queues[subject] = deque(kept) if kind == "fresh" else kept
                    self._indexed(subject, kind, kept[0])
        return dropped

    def heads(self) -> list[int]:
        """The oldest queued record of each subject."""
        return [keys[0] for keys in self.fresh.values()] + [keys[0] for keys in self.again.values()]

    def index(self, filter_tokens: tuple[str, ...], position: int = 0) -> FilterIndex:
        """The filter's index, built on first use (one walk of the subjects with
        records), kept while used. ``position``: where a new index starts on the tail."""
        index = self.indexes.pop(filter_tokens, None)
        if index is None:
            index = FilterIndex(filter_tokens, position=position)
            for subject, keys in self.fresh.items():
                if matches(filter_tokens, subject):
                    index.fresh.append((keys[0], subject))
            for subject, heap in self.again.items():
                if matches(filter_tokens, subject):
                    index.again.append((heap[0], subject))
            heapq.heapify(index.fresh)
            heapq.heapify(index.again)
            self._matching.clear()  # subjects learn of the new filter when next met
            self._forget_idle_filters()
        self.indexes[filter_tokens] = index  # most recently used last
        return index

    def indexes_of(self, subject: str) -> list[FilterIndex]:
        """The indexes whose filter matches ``subject``."""
        found = self._matching.get(subject)
        if found is None:
            if len(self._matching) > 4 * (len(self.fresh) + len(self.again)) + 1024:
                self._matching.clear()  # bounded by the subjects with records
            found = self._matching[subject] = [
                index for f, index in self.indexes.items() if matches(f, subject)
            ]
        return found

    def _forget_idle_filters(self) -> None:
        idle = [f for f, index in self.indexes.items() if not index.waiters]
        for filter_tokens in idle[: max(0, len(idle) - MAX_IDLE_FILTERS)]:
            del self.indexes[filter_tokens]
            self._matching.clear()

    def _indexed(
        self, subject: str, kind: Kind, head: int, besides: FilterIndex | None = None
    ) -> None:
        """``subject``'s head of ``kind`` is now ``head`` (``besides``: told already)."""
        queues: dict[str, Any] = self.fresh if kind == "fresh" else self.again
        for index in self.indexes_of(subject):
            if index is besides:
                continue
            heap = index.fresh if kind == "fresh" else index.again
            heapq.heappush(heap, (head, subject))
            if len(heap) > 2 * (len(self.fresh) + len(self.again)) + 64:
                # Drop the entries that no longer are a subject's head (kept in place).
                heap[:] = [(key, s) for key, s in heap if s in queues and queues[s][0] == key]
                heapq.heapify(heap)


def _live_head(heap: list[tuple[int, str]], queues: dict[str, Any]) -> tuple[int, str] | None:
    """The index heap's top entry that is still its subject's head, ``(sort_key,
    subject)``, the old heads above it popped; None when there is none."""
    while heap:
        key, subject = heap[0]
        queue = queues.get(subject)
        if queue is not None and queue[0] == key:
            return key, subject
        heapq.heappop(heap)  # an old head
    return None
