"""What a group owes: its backlog counted as it changes, and the settled position it
makes durable; and a group's reports of both (:class:`Owing`)."""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

import trio

from cmdbus_trio.protocol.subjects import matches

if TYPE_CHECKING:
    from ._cursor import TailCursor
    from ._leases import Leases
    from ._queues import SubjectQueues
    from .tail import Tail

STUCK_AFTER = 60.0
"""Seconds a record may stay unsettled before it stops holding its group's settled
position back (CMDBUS_STUCK_AFTER_MS)."""
MAX_OWED = 1024
"""A group with a larger backlog keeps its settled position at its oldest unsettled
record: it owes nothing (see :class:`SettledPosition`)."""


class BacklogCount:
    """The group's backlog (records neither acked nor dead): the total always, and per
    subject where it is kept (the command bus's group; an event group's per-subject
    backlog is walked on request instead, so its memory does not follow the subjects).
    Memory follows the subjects with a backlog, not every subject seen."""

    def __init__(self, *, per_subject: bool) -> None:
        self.total = 0
        self.per_subject = per_subject
        self.by_subject: dict[str, int] = {}
        self._changed: set[str] = set()  # subjects whose backlog changed since sampled

    def count(self, subject: str, change: int) -> None:
        self.total += change
        if self.per_subject:
            backlog = self.by_subject.get(subject, 0) + change
            if backlog:
                self.by_subject[subject] = backlog
            else:
                del self.by_subject[subject]
            self._changed.add(subject)

    def changed(self) -> dict[str, int]:
        """The backlog of each subject whose backlog changed since the last call (a
        sampler sets only those gauges)."""
        changed, self._changed = self._changed, set()
        return {subject: self.by_subject.get(subject, 0) for subject in changed}


class TailBacklog(BacklogCount):
    """An event group's backlog on the bus's tail, counted from the tail's end: each
    record the tail takes in is in every group's backlog at once, so the tail need not
    tell every group of every commit (100 lagging groups made each commit 100 updates).
    A change counted here moves the point it is counted from."""

    def __init__(self, tail: Tail) -> None:
        self._tail = tail
        super().__init__(per_subject=False)  # a total of 0: counted from the end now

    @property
    def total(self) -> int:
        return self._tail.end - self._from

    @total.setter
    def total(self, value: int) -> None:
        self._from = self._tail.end - value


class SettledPosition:
    """The settled position to make durable, from the low-water mark.

    It is the low-water mark while that is recent. A record unsettled for longer than
    ``stuck_after`` (a pool with no workers, a lease extended forever, a nack with a long
    delay) would hold the mark back for ever: the acks table would never be pruned and
    every restart would rescan everything after it. So the position never trails what
    the group had seen ``stuck_after`` ago: the records it passes that are still
    unsettled are recorded as owed (and reloaded from there).

    Only while the group's backlog is at most :data:`MAX_OWED`, so that it owes at most
    that many: a group that lags (no consumer, or too few) would otherwise owe a row
    for every record it has not consumed, written in the group commit every publish
    and ack waits for, and all loaded at a restart: a cost of groups x records, and
    clients create groups. A lagging group keeps its position where its backlog
    starts, which costs nothing: its records are read at a restart whatever the
    position, and it has no acks to prune."""

    def __init__(self, stuck_after: float) -> None:
        self.stuck_after = stuck_after
        self._frontiers: deque[tuple[float, int]] = deque()  # (when, newest seen then)

    def at(self, now: float, seen: int, low_water: int, *, backlog: int = 0) -> tuple[int, int]:
        """The position, and the newest sort key it passes unsettled (0: none);
        ``seen``: the newest record the group has been offered; ``backlog``: the
        group's records not settled."""
        frontiers = self._frontiers
        frontiers.append((now, seen))
        old: tuple[float, int] | None = None
        while frontiers and frontiers[0][0] <= now - self.stuck_after:
            old = frontiers.popleft()
        if old is not None:
            frontiers.appendleft(old)  # the newest one old enough, kept for next time
        stuck_through = old[1] if old is not None else 0
        if low_water > stuck_through or backlog > MAX_OWED:
            return low_water, 0
        return stuck_through + 1, stuck_through


def matching(backlog: dict[str, int], filter_tokens: tuple[str, ...] | None) -> dict[str, int]:
    """The backlog of the subjects ``filter_tokens`` matches (all: None), sorted."""
    return {
        subject: count
        for subject, count in sorted(backlog.items())
        if filter_tokens is None or matches(filter_tokens, subject)
    }


class Owing:
    """What a consumer group (:class:`~cmdbus_trio.bus.claims.Claims`) owes, read from
    its state: its backlog, per subject and in all, and its settled position."""

    group: str
    _cursor: TailCursor | None
    _leases: Leases
    _settling: dict[int, str]
    _queues: SubjectQueues
    _backlog: BacklogCount
    _settled: SettledPosition
    _last_added: int

    def lag(self, filter_tokens: tuple[str, ...] | None = None) -> dict[str, int]:
        """Backlog per subject: undelivered + leased-unacked (dead letters are not
        backlog), for the subjects that have one, sorted, as kept; on a tail, where it
        is not kept, :meth:`backlog` walks it."""
        if self._cursor is not None:
            raise TypeError(f"{self.group}: an event group's lag is walked: backlog()")
        return matching(self._backlog.by_subject, filter_tokens)

    async def backlog(
        self, filter_tokens: tuple[str, ...] | None = None, *, step: int = 20_000
    ) -> dict[str, int]:
        """:meth:`lag` for a request: an event group's walk of its backlog lets the loop
        run every ``step`` records (records settled meanwhile may count or not: it is
        a sample, like the gauges)."""
        if self._cursor is None:
            return self.lag(filter_tokens)
        counts = self._in_flight()
        for _ in self._cursor.walk(counts, step):
            await trio.lowlevel.checkpoint()
        return matching(counts, filter_tokens)

    def _in_flight(self) -> dict[str, int]:
        counts = Counter(self._leases.subjects())
        counts.update(self._settling.values())
        for subject, heap in self._queues.again.items():
            counts[subject] += len(heap)
        return counts

    @property
    def total(self) -> int:
        """The whole backlog (kept as it changes: no walk of the subjects)."""
        return self._backlog.total

    def changed_backlog(self) -> dict[str, int]:
        """The backlog of each subject whose backlog changed since the last call (a
        sampler sets only those gauges)."""
        return self._backlog.changed()

    def backlog_of(self, subject: str) -> int:
        """One subject's backlog (0 on a tail, where it is not kept: see :meth:`lag`)."""
        return self._backlog.by_subject.get(subject, 0)

    @property
    def leased(self) -> int:
        return len(self._leases)

    def position(self, now: float) -> tuple[int, int]:
        """The settled position to make durable, and the newest sort key it passes
        unsettled (0: none): see :class:`SettledPosition`. Called about once a second."""
        seen = self._last_added if self._cursor is None else self._cursor.tail.newest
        return self._settled.at(now, seen, self.low_water(), backlog=self.total)

    def low_water(self) -> int:
        """The lowest sort key not yet settled (acked or dead) by this group: every record
        below it is settled. Only known records count, so it never passes a record the
        group has not seen."""
        pending = self._queues.heads()
        pending += self._leases.keys()
        pending += self._settling.keys()
        last_seen = self._last_added
        if self._cursor is not None:
            head = self._cursor.head()
            if head is not None:
                pending.append(head)
            last_seen = self._cursor.tail.newest
        return min(pending, default=last_seen + 1)
