"""A group's records out of its queues for a time: leased to a consumer until a
deadline, or nacked with a delay until they may be delivered again."""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
from collections.abc import Iterator, Sequence

import attrs
import trio

from cmdbus_trio.protocol.claim import LEASE_MAX, Delivery, LeaseTokens

_TOKENS = itertools.count(secrets.randbelow(LEASE_MAX // 2))
"""Lease tokens: counted from a random start in each process, so a token of a writer
before its restart names no lease of the writer after it (the odds that two starts'
ranges meet are the grants over 2^52)."""


Token = int | None
"""The lease a settle names (None: whichever lease of the record the owner holds)."""
Tokens = LeaseTokens
"""A token for each record a settle names, or None for none (as the protocol reads them)."""


def with_tokens(sort_keys: Sequence[int], tokens: Tokens) -> Iterator[tuple[int, Token]]:
    """Each key with the lease token a settle names for it (None: none named)."""
    return zip(sort_keys, tokens or [None] * len(sort_keys), strict=True)


def new_token() -> int:
    """The token of a new lease (:attr:`Delivery.lease`)."""
    return next(_TOKENS)


@attrs.define
class Lease:
    owner: object
    subject: str
    deadline: float
    token: int | None = None


def _held(lease: Lease, owner: object, token: Token) -> bool:
    """``lease`` is ``owner``'s, and the one named by ``token`` if one is given."""
    return lease.owner is owner and (token is None or token == lease.token)


class Leases:
    """Leased records by sort key and by owner (a connection), each with one timer entry
    however often it is extended (shared by the records leased together; when that entry
    comes due, a lease extended meanwhile is pushed again for its new deadline); and the
    delayed nacks, by when they are ready.

    :meth:`due` and :meth:`wait_due` are the group's timers task; a timer added sooner
    than the task means to wake wakes it."""

    def __init__(self) -> None:
        self.by_key: dict[int, Lease] = {}
        self.delayed: list[tuple[float, int, str]] = []  # heap: (ready_at, sort_key, subject)
        self._owned: dict[object, set[int]] = {}  # owner -> its leased sort keys
        self._expiries: list[tuple[float, tuple[int, ...]]] = []  # heap: (deadline, sort keys)
        self._changed = trio.Event()
        self._due_at = math.inf  # when the timers task wakes next, unless woken

    def __len__(self) -> int:
        return len(self.by_key)

    def grant_many(self, owner: object, leased: Sequence[Delivery], deadline: float) -> None:
        """Lease the records to ``owner`` until ``deadline``, with one timer entry for
        them all (a batch of ``next`` shares its deadline)."""
        by_key = self.by_key
        for delivery in leased:
            by_key[delivery.sort_key] = Lease(owner, delivery.subject, deadline, delivery.lease)
        keys = [delivery.sort_key for delivery in leased]
        self._owned.setdefault(owner, set()).update(keys)
        heapq.heappush(self._expiries, (deadline, tuple(keys)))
        self._timer_added(deadline)

    def delay(self, sort_key: int, subject: str, ready_at: float) -> None:
        """A nacked record to deliver again from ``ready_at`` on."""
        heapq.heappush(self.delayed, (ready_at, sort_key, subject))
        self._timer_added(ready_at)

    def end(self, sort_key: int, owner: object | None = None, token: Token = None) -> Lease | None:
        """Remove the record's lease (only if ``owner`` holds it, when given, and only
        the lease ``token`` names, when given)."""
        lease = self.by_key.get(sort_key)
        if lease is None or (owner is not None and not _held(lease, owner, token)):
            return None
        del self.by_key[sort_key]
        owned = self._owned[lease.owner]
        owned.discard(sort_key)
        if not owned:
            del self._owned[lease.owner]
        return lease

    def end_many(
        self, sort_keys: Sequence[int], owner: object, tokens: Tokens = None
    ) -> list[Lease | None]:
        """:meth:`end` of each record that ``owner`` holds (by the lease of its token in
        ``tokens``, where one is given), in order (None: not held)."""
        owned = self._owned.get(owner)
        if owned is None:
            return [None for _ in sort_keys]
        by_key = self.by_key
        ended: list[Lease | None] = []
        for sort_key, token in with_tokens(sort_keys, tokens):
            lease = by_key.get(sort_key)
            if lease is not None and _held(lease, owner, token):
                del by_key[sort_key]
                owned.discard(sort_key)
                ended.append(lease)
            else:
                ended.append(None)
        if not owned:
            del self._owned[owner]
        return ended

    def holds(self, owner: object) -> bool:
        return owner in self._owned

    def refusal(self, sort_key: int, owner: object, token: Token = None) -> str:
        """Why a settle of the record by ``owner`` (of the lease ``token`` names, where
        given) was refused, as the protocol's ``why`` says it: ``not_leased`` (nobody
        holds it: settled already, its lease ran out, or no such record),
        ``leased_elsewhere`` (another connection holds it) or ``lease_replaced`` (this
        connection holds it by a newer lease than the one named)."""
        lease = self.by_key.get(sort_key)
        if lease is None:
            return "not_leased"
        if lease.owner is not owner:
            return "leased_elsewhere"
        return "not_leased" if token in (None, lease.token) else "lease_replaced"

    def extend(self, sort_key: int, owner: object, deadline: float, token: Token = None) -> bool:
        lease = self.by_key.get(sort_key)
        if lease is None or not _held(lease, owner, token):
            return False
        lease.deadline = deadline  # its one timer entry stays (see the class)
        return True

    def release(self, owner: object) -> list[tuple[int, str]]:
        """End every lease of ``owner``, oldest first: ``(sort_key, subject)``. The cost
        is its own leases, not everyone's."""
        mine = sorted(self._owned.pop(owner, set()))
        return [(sort_key, self.by_key.pop(sort_key).subject) for sort_key in mine]

    def drop_through(self, through: int) -> list[str]:
        """End every lease and drop every delayed record up to ``through``; returns
        their subjects."""
        ended = [self.end(key) for key in [key for key in self.by_key if key <= through]]
        subjects = [lease.subject for lease in ended if lease is not None]
        kept = [entry for entry in self.delayed if entry[1] > through]
        subjects += [entry[2] for entry in self.delayed if entry[1] <= through]
        heapq.heapify(kept)
        self.delayed = kept
        return subjects

    def keys(self) -> list[int]:
        """The sort keys of the leased and the delayed records."""
        return [*self.by_key, *(sort_key for _, sort_key, _ in self.delayed)]

    def subjects(self) -> Iterator[str]:
        """The subject of each leased and each delayed record."""
        yield from (lease.subject for lease in self.by_key.values())
        yield from (subject for _, _, subject in self.delayed)

    def due(self, now: float) -> Iterator[tuple[int, str, bool]]:
        """End and yield, as ``(sort_key, subject, True)``, each lease whose deadline has
        passed, then, as ``(sort_key, subject, False)``, each delayed record now ready."""
        self._changed = trio.Event()
        came_due: list[tuple[float, int]] = []
        while self._expiries and self._expiries[0][0] <= now:
            deadline, sort_keys = heapq.heappop(self._expiries)
            came_due += ((deadline, sort_key) for sort_key in sort_keys)
        for _, sort_key in sorted(came_due):  # soonest first, then oldest, as granted
            lease = self.by_key.get(sort_key)
            if lease is None:
                continue  # acked, nacked or released meanwhile
            if lease.deadline > now:  # extended: its one entry goes back in
                heapq.heappush(self._expiries, (lease.deadline, (sort_key,)))
                continue
            self.end(sort_key)
            yield sort_key, lease.subject, True
        while self.delayed and self.delayed[0][0] <= now:
            _, sort_key, subject = heapq.heappop(self.delayed)
            yield sort_key, subject, False

    async def wait_due(self) -> None:
        """Sleep until the soonest timer, a sooner one added, or :meth:`wake`."""
        self._due_at = min(
            self._expiries[0][0] if self._expiries else math.inf,
            self.delayed[0][0] if self.delayed else math.inf,
        )
        with trio.move_on_at(self._due_at):
            await self._changed.wait()

    def wake(self) -> None:
        self._changed.set()

    def _timer_added(self, at: float) -> None:
        # Wake the timers task only when it would sleep past ``at``: with a fixed ack_wait
        # a new lease's expiry is never the soonest, and a wake-up per delivery was a
        # task switch per `next` for nothing.
        if at < self._due_at:
            self._changed.set()
