"""Consumers parked in :meth:`Claims.next <cmdbus_trio.bus.claims.Claims.next>`, each
in its filter's index, and how a record finds the oldest of them."""

from __future__ import annotations

from collections.abc import Callable

from cmdbus_trio.protocol.claim import Delivery

from ._queues import FilterIndex, SubjectQueues, Waiter

Take = Callable[[tuple[str, ...], object], Delivery | None]
"""Lease the oldest record a filter matches to an owner (``Claims.next_nowait``)."""


class Parked:
    """The waiters of a group, queued in their filters' indexes: a record goes to the
    oldest waiter whose filter matches it, found through the filters that match its
    subject, not by visiting the waiters. A waiter that leaves is removed from its index
    at once: a crowd of timed-out ``next`` calls leaves nothing behind."""

    def __init__(self, queues: SubjectQueues) -> None:
        self._queues = queues
        self._seq = 0
        self.count = 0
        """Waiters parked now (not yet handed a record, nor gone)."""
        self._held: set[str] = set()  # subjects with records not offered (see hold)

    def park(self, index: FilterIndex, owner: object) -> Waiter:
        self._seq += 1
        waiter = Waiter(self._seq, owner, index)
        index.waiters[waiter.seq] = waiter
        self.count += 1
        return waiter

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` was cancelled: it leaves its index (if still parked there)."""
        if waiter.index.waiters.pop(waiter.seq, None) is not None:
            self.count -= 1

    def hand_over(self, subject: str, take: Take) -> None:
        """``subject`` has records: lease them to the waiters whose filter matches,
        oldest waiter first, while both last."""
        while self.count:
            oldest: Waiter | None = None
            for index in self._queues.indexes_of(subject):
                if index.waiters:
                    first = next(iter(index.waiters.values()))
                    if oldest is None or first.seq < oldest.seq:
                        oldest = first
            if oldest is None:
                return
            delivery = take(oldest.index.filter, oldest.owner)
            if delivery is None:  # the subject's records are taken: the waiter stays
                return
            del oldest.index.waiters[oldest.seq]
            self.count -= 1
            oldest.delivery = delivery
            oldest.woken.set()

    def hold(self, subject: str) -> None:
        """A record of ``subject`` was queued again without being offered to the waiters
        (its consumer was shed while the Gate was full): :meth:`offer_held` offers it."""
        self._held.add(subject)

    def offer_held(self, take: Take) -> None:
        """Offer the held subjects' records to the waiters (the Gate has room now)."""
        held, self._held = self._held, set()
        for subject in held:
            self.hand_over(subject, take)

    def wake_all(self) -> None:
        """Wake every waiter empty-handed (the group closed)."""
        self.count = 0
        for index in self._queues.indexes.values():
            while index.waiters:
                index.waiters.popitem(last=False)[1].woken.set()
