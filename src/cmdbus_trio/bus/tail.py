"""The event bus's tail: the records some consumer group may still need, as (sort key,
subject) in sort-key order, held once for every group. A group is a cursor into it plus
what it has in flight (see :class:`~cmdbus_trio.bus.claims.Claims`), so a group's memory
does not grow with the number of subjects, and a new group costs no copy of the backlog.

Positions are absolute: a record keeps its position while the tail grows at either end
or is trimmed, so a group's cursor never has to be rewritten.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.storage.buslog import BusLog

from .committer import Committed


class Reader(Protocol):
    """A group reading the tail (a :class:`~cmdbus_trio.bus.claims.Claims`)."""

    @property
    def cursor(self) -> int:
        """The group needs nothing before this position."""
        ...

    def arrived(self, start: int) -> None:
        """The tail has new records from position ``start``."""
        ...


LOAD_PAGE = 10_000
"""Records per query when the tail is extended back into the store's history."""
TRIM_AT_LEAST = 1024
"""Records no group needs that are kept until they are dropped in one go (a trim moves
what is left, so it runs only when it frees at least half)."""


class Tail:
    """Every record after :attr:`after` up to the newest committed, fed by the committer
    (it is one of its listeners) and extended back from the store when a group that
    starts earlier is loaded (:meth:`cover`)."""

    def __init__(self, log: BusLog, *, limiter: trio.CapacityLimiter) -> None:
        self._log = log
        self._limiter = limiter
        self.keys = array("q")
        self.subjects: list[str] = []
        self.base = 0
        """The position of ``keys[0]``."""
        self.after = log.last_sort_key
        """Every record with a greater sort key is held."""
        self.newest = self.after
        """The newest sort key the tail has been fed."""
        self.groups: dict[Reader, None] = {}  # the groups fed (ordered, for determinism)
        self.listening: dict[Reader, None] = {}
        """The groups told of each commit: one of their consumers is parked, or their
        start floor is pending (:meth:`TailCursor.skip_below_floor`). The others need not
        be: their backlogs count from the tail's end."""
        self._pins = 0
        self._covering = trio.Lock()

    @property
    def end(self) -> int:
        """The position after the newest record."""
        return self.base + len(self.keys)

    def position(self, after: int) -> int:
        """The position of the first record with a sort key greater than ``after``."""
        return self.base + bisect.bisect_right(self.keys, after)

    def __call__(self, committed: list[Committed]) -> None:
        """The committer's listener: append, then tell the groups listening."""
        start = self.end
        for record in committed:
            # A record committed just before the tail read ``last_sort_key`` is also in
            # the next listener call: taken once.
            if record.sort_key > self.newest:
                self.keys.append(record.sort_key)
                self.subjects.append(record.subject)
                self.newest = record.sort_key
        if self.end > start:
            for group in list(self.listening):  # a group told may stop listening
                group.arrived(start)

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """Nothing is trimmed meanwhile (a group being loaded has no cursor yet)."""
        self._pins += 1
        try:
            yield
        finally:
            self._pins -= 1

    async def cover(self, after: int) -> None:
        """Hold every record after ``after``, reading the older ones from the store.

        Cancellation: the tail is left as it was. Call it pinned (:meth:`pinned`), so
        that what it loaded is still there when the caller attaches its group.
        """
        async with self._covering:
            if after >= self.after:
                return
            keys = array("q")
            subjects: list[str] = []
            names: dict[str, str] = {}  # one string per distinct subject, not per record
            last = after
            while page := await run_in_thread(
                self._log.subjects_between, last, self.after, LOAD_PAGE, limiter=self._limiter
            ):
                for sort_key, subject in page:
                    keys.append(sort_key)
                    subjects.append(names.setdefault(subject, subject))
                last = page[-1][0]
            metrics.GROUPS_TAIL_LOADED.inc(len(keys))
            self.keys = keys + self.keys
            self.subjects = subjects + self.subjects
            self.base -= len(keys)
            self.after = after

    def trim(self) -> None:
        """Drop the records every group has passed (cheap unless it frees half)."""
        if self._pins:
            return
        low = min((group.cursor for group in self.groups), default=self.end)
        drop = low - self.base
        if drop < TRIM_AT_LEAST or drop < len(self.keys) // 2:
            return
        self.after = self.keys[drop - 1]
        del self.keys[:drop]
        del self.subjects[:drop]
        self.base = low
