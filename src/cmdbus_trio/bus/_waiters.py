"""Consumers parked in :meth:`Claims.next <cmdbus_trio.bus.claims.Claims.next>`, each
in its filter's index, and how a record finds the oldest of them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from cmdbus_trio.protocol.claim import Delivery

from ._queues import FilterIndex, SubjectQueues, Waiter

Take = Callable[[tuple[str, ...], object], Delivery | None]
"""Lease the oldest record a filter matches to an owner (``Claims.next_nowait``)."""


class Parked:
    """The waiters of a group, queued in their filters' indexes: a record goes to the
    oldest waiter whose filter matches it, found through the filters that match its
    subject, not by visiting the waiters."""

    def __init__(self, queues: SubjectQueues) -> None:
        self._queues = queues
        self._seq = 0
        self.count = 0
        """Waiters not yet handed a record (nor gone)."""

    def park(self, index: FilterIndex, owner: object) -> Waiter:
        self._seq += 1
        waiter = Waiter(self._seq, owner, index.filter)
        index.waiters.append(waiter)
        self.count += 1
        return waiter

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` was cancelled: it is skipped from now on (and dropped when met)."""
        waiter.gone = True
        if not waiter.woken.is_set():
            self.count -= 1

    def hand_over(self, subject: str, take: Take) -> None:
        """``subject`` has records: lease them to the waiters whose filter matches,
        oldest waiter first, while both last."""
        while self.count:
            oldest: Waiter | None = None
            its_queue: deque[Waiter] | None = None
            for index in self._queues.indexes_of(subject):
                while index.waiters and index.waiters[0].gone:
                    index.waiters.popleft()
                if index.waiters and (oldest is None or index.waiters[0].seq < oldest.seq):
                    oldest, its_queue = index.waiters[0], index.waiters
            if oldest is None or its_queue is None:
                return
            delivery = take(oldest.filter, oldest.owner)
            if delivery is None:  # the subject's records are taken: the waiter stays
                return
            its_queue.popleft()
            self.count -= 1
            oldest.delivery = delivery
            oldest.woken.set()

    def wake_all(self) -> None:
        """Wake every waiter empty-handed (the group closed)."""
        self.count = 0
        for index in self._queues.indexes.values():
            while index.waiters:
                index.waiters.popleft().woken.set()
