"""An event group's place on the bus's shared :class:`~cmdbus_trio.bus.tail.Tail`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from cmdbus_trio.protocol.subjects import matches

from ._queues import MAX_MATCHED, FilterIndex

if TYPE_CHECKING:
    from .tail import Tail

SCAN_STEP = 4096
"""Records a filter's look for its oldest record goes through at a time (under a
millisecond): a new filter on a group far behind looks through its backlog within the
data plane's share of each turn, where one look through a million records held the loop
0.18 s."""


class TailCursor:
    """A group's fresh records are the tail's from :attr:`position` on, less those in
    :attr:`taken`: every record before the position has been taken (leased, and maybe
    settled or back for redelivery since), and the records taken past it are kept by
    sort key until the position reaches them."""

    def __init__(self, tail: Tail) -> None:
        self.tail = tail
        self.position = 0
        self.taken: set[int] = set()
        self.floor = 0
        """The group starts after this sort key: records at or below it are not its."""
        self.floor_pending = True
        """No record above the floor has arrived yet: one at or below it still may
        (:meth:`skip_below_floor`). Keys arrive ascending, so once one above it has,
        none below it can."""

    def attach(self, after: int, settled: Iterable[int]) -> int:
        """Start after sort key ``after``; ``settled``: the records after it that are
        settled already. Returns how many records after it are not."""
        self.floor = after
        self.floor_pending = True
        self.position = self.tail.position(after)
        self.taken = {key for key in settled if key > after}
        untaken = self.tail.end - self.position - len(self.taken)
        self._advance()
        return untaken

    def skip_below_floor(self, start: int) -> int:
        """Records arrived from position ``start`` on: move past those at or below the
        floor (committed before the group was created ``from: tail``, but fed to the tail
        only after it attached); returns how many."""
        tail = self.tail
        if start >= tail.end:
            return 0
        if tail.keys[start - tail.base] > self.floor:
            self.floor_pending = False  # and so are all that come after it
            return 0
        return self.drop_through(self.floor)

    def head(self) -> int | None:
        """The sort key at the position (the oldest record maybe not taken), if any."""
        tail = self.tail
        return tail.keys[self.position - tail.base] if self.position < tail.end else None

    def subjects_from(self, start: int) -> Iterable[str]:
        """The subjects of the records from position ``start`` on, each once."""
        return dict.fromkeys(self.tail.subjects[start - self.tail.base :])

    def oldest(self, index: FilterIndex, most: int | None = SCAN_STEP) -> tuple[int, str] | None:
        """The oldest untaken record the filter matches, looking through at most ``most``
        records (all: None) from where the index's last look stopped; ``index.position``
        is left on it, or where this look stopped (see :meth:`scanned`)."""
        tail = self.tail
        keys, subjects, base, end = tail.keys, tail.subjects, tail.base, tail.end
        taken, matched, tokens = self.taken, index.matched, index.filter
        position = max(index.position, self.position)
        if most is not None:
            end = min(end, position + most)
        while position < end:
            key, subject = keys[position - base], subjects[position - base]
            if key not in taken:
                hit = matched.get(subject)
                if hit is None:
                    if len(matched) >= MAX_MATCHED:
                        matched.clear()
                    hit = matched[subject] = matches(tokens, subject)
                if hit:
                    index.position = position
                    return key, subject
            position += 1
        index.position = position
        return None

    def scanned(self, index: FilterIndex) -> bool:
        """The index's looks have gone through every record on the tail."""
        return max(index.position, self.position) >= self.tail.end

    def take(self, index: FilterIndex, sort_key: int) -> None:
        """Take the record :meth:`oldest` found for ``index``."""
        if index.position == self.position:
            self.position += 1
            self._advance()
        else:
            self.taken.add(sort_key)
        index.position += 1

    def drop_through(self, through: int) -> int:
        """Move past every record up to ``through`` (evicted from the store); returns
        how many of them were not taken."""
        tail = self.tail
        past = tail.position(through)
        if past <= self.position:
            return 0
        keys, base, taken = tail.keys, tail.base, self.taken
        untaken = sum(1 for at in range(self.position, past) if keys[at - base] not in taken)
        self.taken = {key for key in taken if key > through}
        self.position = past
        self._advance()
        return untaken

    def walk(self, counts: dict[str, int], step: int) -> Iterable[None]:
        """Count the untaken records per subject into ``counts``, yielding every
        ``step`` records (the caller may let the loop run there)."""
        tail = self.tail
        position = self.position
        while position < tail.end:
            position = max(position, self.position, tail.base)
            stop = min(tail.end, position + step)
            keys, subjects, base, taken = tail.keys, tail.subjects, tail.base, self.taken
            for at in range(position - base, stop - base):
                if keys[at] not in taken:
                    counts[subjects[at]] += 1
            position = stop
            yield

    def _advance(self) -> None:
        tail = self.tail
        keys, base, end, taken = tail.keys, tail.base, tail.end, self.taken
        while self.position < end and keys[self.position - base] in taken:
            taken.discard(keys[self.position - base])
            self.position += 1
