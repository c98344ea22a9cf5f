"""The claim coordinator: competing consumers with leases, for one consumer group.

All in memory, on the loop; the store is only told what must survive a crash (acks and
dead letters, group-committed by the face) and asked for record bodies. Memory follows
the backlog (records not yet acked or dead), never the history.

Fresh records are held one of two ways. The command bus's single group keeps a queue per
subject (a worker's filter names its pool, so a ``next`` finds its pool's oldest record
without walking other pools). An event group is a cursor into the bus's shared
:class:`~cmdbus_trio.bus.tail.Tail` plus what it has in flight, so its memory does not
grow with the number of subjects (event types) and creating one copies nothing.

A record is *fresh* until first delivered, then *leased* to one owner (a connection)
until it is acked, nacked, its lease expires (``ack_wait``) or its owner goes away; then
it waits to be *redelivered*, which goes before fresh records. A record whose lease ends
after ``max_deliver`` deliveries is parked as *dead* instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import GateClosed
from cmdbus_trio.loop import turns
from cmdbus_trio.protocol.claim import Delivery

from ._cursor import SCAN_STEP, TailCursor
from ._leases import Leases, Token, Tokens, new_token
from ._owed import STUCK_AFTER, BacklogCount, Owing, SettledPosition, TailBacklog
from ._queues import FilterIndex, SubjectQueues
from ._waiters import Parked

if TYPE_CHECKING:
    from .tail import Tail

__all__ = ["STUCK_AFTER", "Claims", "Delivery"]


DRAINING = "the writer is draining"
"""Why a group closes when the writer drains (the other reason: it was deleted)."""


class Claims(Owing):
    """One consumer group's view of a bus. ``on_dead`` is called with
    ``(sort_key, subject, deliveries)`` for each record parked as dead, to make it durable;
    ``on_count`` with ``(sort_key, deliveries)`` for each delivery that ended without an
    ack (nacked, its lease expired, its consumer gone), to make the count durable, so
    that ``max_deliver`` holds across a restart (a delivery still leased when the writer
    dies is the one that may go uncounted). The happy path, delivered then acked, writes
    no count.

    Nothing here costs in proportion to the crowd: a record goes to the oldest waiter
    whose filter matches it (one waiter, found through the filters, not by visiting the
    waiters), a ``next`` finds its record through its filter's index, a closing
    connection's release walks its own leases, a lease has one timer entry however often
    it is extended, and the backlog total is kept as it changes."""

    def __init__(
        self,
        group: str,
        *,
        ack_wait: float,
        max_deliver: int = 0,
        on_dead: Callable[[int, str, int], None] = lambda *_: None,
        on_count: Callable[[int, int], None] = lambda *_: None,
        tail: Tail | None = None,
        start_after: int = 0,
        stuck_after: float = STUCK_AFTER,
    ) -> None:
        self.group = group
        self.start_after = start_after
        self._settled = SettledPosition(stuck_after)
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self._on_dead = on_dead
        self._on_count = on_count
        self._queues = SubjectQueues()
        self._leases = Leases()
        self._settling: dict[int, str] = {}  # acks being made durable: not redeliverable
        self._deliveries: dict[int, int] = {}
        self._backlog = BacklogCount(per_subject=True) if tail is None else TailBacklog(tail)
        self._closed = False
        self._why_closed = DRAINING
        self.deleted = False
        self._last_added = 0
        self._parked = Parked(self._queues)
        self._cursor = None if tail is None else TailCursor(tail)
        self.persisted_low_water = start_after + 1
        """The settled position last made durable (see ``durable.persist_low_water``):
        every record below it is settled or recorded as owed."""
        self.evicted_through = 0
        """Every record up to this sort key was evicted from the store for space (see
        :meth:`evict_through`): none is delivered any more."""

    # --- records arriving ----------------------------------------------------------------

    def add(self, sort_key: int, subject: str) -> None:
        """A new record (committed, or reloaded at start): fresh, in sort-key order."""
        self.add_many([(sort_key, subject)])

    def add_many(self, records: Iterable[tuple[int, str]], *, seen_through: int = 0) -> None:
        """New records in sort-key order; each goes to a waiting consumer whose filter
        matches, if there is one. ``seen_through``: every record up to it has now been
        offered to the group (those not among ``records`` were settled already), so the
        low-water mark may pass it."""
        arrived: set[str] = set()
        for sort_key, subject in records:
            self._queues.add_fresh(sort_key, subject)
            self._backlog.count(subject, +1)
            self._last_added = max(self._last_added, sort_key)
            arrived.add(subject)
        self._last_added = max(self._last_added, seen_through)
        for subject in arrived:
            self._hand_over(subject)

    def requeue(self, records: Iterable[tuple[int, str]]) -> int:
        """Dead letters back in the backlog (``requeue``, durable already), as
        ``(sort_key, subject)``: delivered again before fresh records, with a fresh
        delivery count. Returns how many of them were evicted meanwhile (forgotten, their
        requeue committed before the store deleted them): those are not queued."""
        gone = 0
        for sort_key, subject in records:
            if sort_key <= self.evicted_through:
                gone += 1
                continue
            self._deliveries.pop(sort_key, None)
            self._backlog.count(subject, +1)
            self._redeliver(sort_key, subject)
        return gone

    def restore_owed(self, owed: Iterable[tuple[int, str, int]]) -> None:
        """Records owed below the settled position, as ``(sort_key, subject,
        deliveries)``, at start: delivered before fresh ones, their counts kept."""
        owed = list(owed)
        self.requeue((sort_key, subject) for sort_key, subject, _ in owed)
        self.restore_deliveries((sort_key, count) for sort_key, _, count in owed)

    def restore_deliveries(self, counts: Iterable[tuple[int, int]]) -> None:
        """Deliveries recorded before a restart, as ``(sort_key, deliveries)``."""
        self._deliveries.update((key, count) for key, count in counts if count)

    # --- on a tail (an event group) --------------------------------------------------------

    def attach(self, after: int, settled: Iterable[int]) -> None:
        """Start on the tail after sort key ``after``; ``settled``: the records after it
        that are acked or dead already. The tail must hold every record after ``after``."""
        cursor = self._require_cursor()
        self._backlog.total = cursor.attach(after, settled)
        cursor.tail.groups[self] = None
        cursor.tail.listening[self] = None  # until its floor is passed

    def delete(self) -> None:
        """The group is gone (``delete_group``): its waiters are told so, its timers
        stop, its leases end (their connections hold nothing: they may idle out), and
        the tail no longer feeds it (nor waits for it to trim)."""
        self.deleted = True
        self.close("the group was deleted")
        if self._cursor is not None:
            self._cursor.tail.groups.pop(self, None)
            self._cursor.tail.listening.pop(self, None)
        self._leases.wake()
        self._leases = Leases()

    def evict_through(self, through: int) -> int:
        """Forget every record up to ``through``, delivered or not (the store deletes them
        for ``CMDBUS_EVT_MAX_BYTES``); returns how many were not settled. An ack under
        way completes as usual; one of a lease dropped here answers as for an expired one."""
        if through <= self.evicted_through:
            return 0
        self.evicted_through = through
        dropped = self._queues.drop_through(through, self._backlog.count)
        for subject in self._leases.drop_through(through):
            self._backlog.count(subject, -1)
            dropped += 1
        self._deliveries = {k: n for k, n in self._deliveries.items() if k > through}
        self._last_added = max(self._last_added, through)
        if self._cursor is not None:
            untaken = self._cursor.drop_through(through)
            self._backlog.total -= untaken
            dropped += untaken
        return dropped

    def arrived(self, start: int) -> None:
        """The tail has new records from position ``start`` (in the backlog already:
        it counts from the tail's end)."""
        cursor = self._require_cursor()
        if cursor.floor_pending:
            self._backlog.total -= cursor.skip_below_floor(start)
        if self._parked.count:
            for subject in cursor.subjects_from(start):
                self._hand_over(subject)
        if not cursor.floor_pending and not self._parked.count:
            cursor.tail.listening.pop(self, None)  # told again once a consumer parks

    @property
    def cursor(self) -> int:
        """On a tail: every record before this position has been taken (and is kept)."""
        return 0 if self._cursor is None else self._cursor.position

    def _require_cursor(self) -> TailCursor:
        if self._cursor is None:
            raise TypeError(f"{self.group}: not a group on a tail")
        return self._cursor

    def _index(self, filter_tokens: tuple[str, ...]) -> FilterIndex:
        return self._queues.index(filter_tokens, self.cursor)

    # --- delivering ----------------------------------------------------------------------

    def has(self, filter_tokens: tuple[str, ...]) -> bool:
        """A record matching the filter can be taken now (found within a scan step)."""
        index = self._index(filter_tokens)
        if self._queues.has(index):
            return True
        return self._cursor is not None and self._cursor.oldest(index, SCAN_STEP) is not None

    def next_nowait(
        self, filter_tokens: tuple[str, ...], owner: object, scan: int | None = SCAN_STEP
    ) -> Delivery | None:
        """Lease the next matching record to ``owner``: records to redeliver first (oldest
        first), then fresh ones (oldest first), found on a tail within ``scan`` records
        (all: None). ``None`` when none matches (or none within them)."""
        leased = self.next_many_nowait(filter_tokens, owner, 1, scan)
        return leased[0] if leased else None

    def next_many_nowait(
        self,
        filter_tokens: tuple[str, ...],
        owner: object,
        most: int,
        scan: int | None = SCAN_STEP,
    ) -> list[Delivery]:
        """Lease up to ``most`` matching records to ``owner``, each as :meth:`next_nowait`
        would, in that order (each on a tail within ``scan`` records of its own). What a
        batch shares (the filter's index, the clock, the metric series) is looked up
        once for the batch, not once a record."""
        index = self._index(filter_tokens)
        taken = self._queues.take_oldest(index, most)  # redeliveries first
        while self._cursor is not None and len(taken) < most:  # then the tail's fresh ones
            fresh = self._cursor.oldest(index, scan)
            if fresh is None:
                break
            self._cursor.take(index, fresh[0])
            taken.append(fresh)
        if not taken:
            return []
        counts = self._deliveries
        leased: list[Delivery] = []
        for sort_key, subject in taken:
            deliveries = counts.get(sort_key, 0) + 1
            counts[sort_key] = deliveries
            # Redelivered: not a record given back undelivered.
            token = new_token()
            leased.append(Delivery(sort_key, subject, deliveries > 1, deliveries, lease=token))
        self._leases.grant_many(owner, leased, trio.current_time() + self.ack_wait)
        for subject, count in Counter(delivery.subject for delivery in leased).items():
            label = metrics.SUBJECTS.label(subject)  # bounded: child() may remember it
            metrics.child(metrics.DELIVERIES, label).inc(count)
        again = Counter(delivery.subject for delivery in leased if delivery.redelivered)
        for subject, count in again.items():
            metrics.child(metrics.REDELIVERIES, metrics.SUBJECTS.label(subject)).inc(count)
        return leased

    async def next(self, filter_tokens: tuple[str, ...], owner: object) -> Delivery:
        """Wait for a matching record, leased to ``owner`` when it is handed over. Waiting
        costs no thread, no polling and no visit per record: a record goes to the oldest
        waiter whose filter matches it.

        Cancellation: nothing is leased when cancelled while waiting (a record handed
        over just before is given back).

        Error handling: raises :class:`GateClosed` once :meth:`close` was called (the
        writer is draining): a waiting consumer must not hold up the drain.
        """
        if self._closed:
            raise self._closed_error()
        delivery = self.next_nowait(filter_tokens, owner)
        with trio.CancelScope(shield=True):  # a look under way ends: "none now" is true
            while (
                delivery is None
                and self._cursor
                and not self._cursor.scanned(self._index(filter_tokens))
            ):
                await turns.current().wait()  # the data plane's share of a turn
                delivery = self.next_nowait(filter_tokens, owner)
        if delivery is not None:
            return delivery
        if self._cursor is not None:
            self._cursor.tail.listening[self] = None  # told of what arrives from now
        waiter = self._parked.park(self._index(filter_tokens), owner)
        try:
            await waiter.woken.wait()
        except BaseException:
            self._parked.leave(waiter)
            if waiter.delivery is not None:
                self.give_back(waiter.delivery.sort_key, owner)
            raise
        if waiter.delivery is None:
            raise self._closed_error()
        return waiter.delivery

    def _hand_over(self, subject: str) -> None:
        self._parked.hand_over(subject, self._take)

    def _take(self, filter_tokens: tuple[str, ...], owner: object) -> Delivery | None:
        # For a parked waiter, whose look went through the tail before it parked: what is
        # left to look through came since, so the look is not bounded.
        return self.next_nowait(filter_tokens, owner, None)

    def give_back(self, sort_key: int, owner: object, *, offer: bool = True) -> bool:
        """Undo a :meth:`next_nowait` whose record never reached its consumer (no Gate slot for
        it, its body could not be read, its consumer left): the record is queued again,
        and that delivery does not count. ``offer=False`` (its consumer was shed): a new
        ``next`` may take it, but parked consumers are offered it only by
        :meth:`offer_held`, once the Gate has room (offered now, it would go to the next
        parked consumer, be shed again, and so on: every one answered ``busy``)."""
        lease = self._leases.end(sort_key, owner)
        if lease is None:
            return False
        deliveries = self._deliveries.pop(sort_key, 1) - 1
        if deliveries:
            self._deliveries[sort_key] = deliveries
        if offer:
            self._redeliver(sort_key, lease.subject)
        else:  # queued for a new ``next``; the parked consumers wait for offer_held
            self._queues.add_again(sort_key, lease.subject)
            self._parked.hold(lease.subject)
        return True

    def offer_held(self) -> None:
        """Offer the records given back with ``offer=False`` to the parked consumers."""
        self._parked.offer_held(self._take)

    @property
    def closed(self) -> bool:
        return self._closed

    def _closed_error(self) -> GateClosed:
        draining = self._why_closed == DRAINING
        return GateClosed(f"{self.group}: {self._why_closed}", draining=draining)

    def close(self, why: str = DRAINING) -> None:
        """Lease nothing more; waiting consumers get :class:`GateClosed` at once."""
        self._closed = True
        self._why_closed = why
        self._parked.wake_all()

    # --- settling --------------------------------------------------------------------------

    def holds(self, owner: object) -> bool:
        return self._leases.holds(owner)

    def refusal(self, sort_key: int, owner: object, token: Token = None) -> str:
        return self._leases.refusal(sort_key, owner, token)  # (its docstring says why)

    def begin_ack(self, sort_key: int, owner: object) -> bool:
        """Start an ack by the record's lease owner; the caller makes it durable, then
        calls :meth:`finish_ack` (or :meth:`abort_ack` if that failed)."""
        return self.begin_acks([sort_key], owner)[0]

    def begin_acks(self, keys: Sequence[int], owner: object, tokens: Tokens = None) -> list[bool]:
        """:meth:`begin_ack` of each key, in order (only the lease its token names, where
        ``tokens`` names one); one settled by :meth:`finish_acks` (or :meth:`abort_ack`)."""
        ended = self._leases.end_many(keys, owner, tokens)
        for sort_key, lease in zip(keys, ended, strict=True):
            if lease is not None:
                self._settling[sort_key] = lease.subject
        return [lease is not None for lease in ended]

    def finish_ack(self, sort_key: int) -> None:
        self.finish_acks([sort_key])

    def finish_acks(self, sort_keys: Sequence[int]) -> None:
        """The acks begun of these records are durable: the group forgets them."""
        subjects = [self._settling.pop(sort_key) for sort_key in sort_keys]
        deliveries = self._deliveries
        for sort_key in sort_keys:
            deliveries.pop(sort_key, None)
        for subject, count in Counter(subjects).items():
            self._backlog.count(subject, -count)

    def abort_ack(self, sort_key: int) -> None:
        subject = self._settling.pop(sort_key)
        if sort_key <= self.evicted_through:  # gone from the store meanwhile
            self._deliveries.pop(sort_key, None)
            self._backlog.count(subject, -1)
        else:
            self._redeliver(sort_key, subject)

    def nack(self, sort_key: int, owner: object, delay: float = 0.0, token: Token = None) -> bool:
        lease = self._leases.end(sort_key, owner, token)
        if lease is None:
            return False
        self._end_delivery(sort_key, lease.subject, delay)
        return True

    def extend(self, sort_key: int, owner: object, token: Token = None) -> bool:
        return self._leases.extend(sort_key, owner, trio.current_time() + self.ack_wait, token)

    def release(self, owner: object) -> int:
        """Every lease of ``owner`` (a connection that closed) ends now; the cost is its
        own leases, not everyone's."""
        mine = self._leases.release(owner)
        for sort_key, subject in mine:
            self._end_delivery(sort_key, subject)
        return len(mine)

    def _end_delivery(self, sort_key: int, subject: str, delay: float = 0.0) -> None:
        """A delivery ended without an ack: its count made durable now, then redelivered
        (``delay`` seconds later: a nack's), or parked as dead after max_deliver. Counted
        when it ends, not when its delay does: a restart during the delay would
        otherwise hand it out again as a first delivery, past max_deliver for good."""
        deliveries = self._deliveries.get(sort_key, 0)
        if self.max_deliver and deliveries >= self.max_deliver:
            self._deliveries.pop(sort_key, None)
            self._backlog.count(subject, -1)
            metrics.DEAD.labels(subject=metrics.SUBJECTS.label(subject)).inc()
            self._on_dead(sort_key, subject, deliveries)
            return
        if deliveries:
            self._on_count(sort_key, deliveries)
        if delay > 0:
            self._leases.delay(sort_key, subject, trio.current_time() + delay)
        else:
            self._redeliver(sort_key, subject)

    def _redeliver(self, sort_key: int, subject: str) -> None:
        self._queues.add_again(sort_key, subject)
        self._hand_over(subject)

    # --- timers ----------------------------------------------------------------------------

    async def run_timers(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Expire leases and release delayed nacks, on time (in the background nursery)."""
        task_status.started()
        while not self.deleted:
            for sort_key, subject, expired in self._leases.due(trio.current_time()):
                if expired:  # a lease ran out: its delivery ends now
                    self._end_delivery(sort_key, subject)
                else:  # a nack's delay is over: counted when it was nacked
                    self._redeliver(sort_key, subject)
            await self._leases.wait_due()
