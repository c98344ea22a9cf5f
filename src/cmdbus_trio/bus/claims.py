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

import heapq
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import GateClosed
from cmdbus_trio.protocol.subjects import matches

if TYPE_CHECKING:
    from .tail import Tail


@attrs.frozen
class Delivery:
    sort_key: int
    subject: str
    redelivered: bool
    deliveries: int


@attrs.define
class _Lease:
    owner: object
    subject: str
    deadline: float


@attrs.define(eq=False)
class _Waiter:
    """A consumer parked in :meth:`Claims.next`: a record is leased to it and handed
    over (``delivery``), or it is woken by :meth:`Claims.close` (``delivery`` None)."""

    seq: int
    owner: object
    filter: tuple[str, ...]
    woken: trio.Event = attrs.field(factory=trio.Event)
    delivery: Delivery | None = None
    gone: bool = False  # cancelled while parked: skipped, and dropped when met


@attrs.define
class _Index:
    """One filter's view of the subjects with records to deliver: heaps of
    ``(head sort key, subject)``, pushed whenever a matching subject's head changes and
    checked against the subject's real head when popped (an old entry is skipped), so
    taking the oldest matching record never walks every subject. On a tail (an event
    group), fresh records are found from ``position`` instead: every record before it
    that the filter matches has been taken, so each record is looked at once."""

    filter: tuple[str, ...]
    again: list[tuple[int, str]] = attrs.field(factory=list)
    fresh: list[tuple[int, str]] = attrs.field(factory=list)
    waiters: deque[_Waiter] = attrs.field(factory=deque)
    position: int = 0
    matched: dict[str, bool] = attrs.field(factory=dict)  # subject -> filter matches it


STUCK_AFTER = 60.0
"""Seconds a record may stay unsettled before it stops holding its group's settled
position back (CMDBUS_STUCK_AFTER_MS)."""
MAX_MATCHED = 1024
"""Subjects whose match against a filter is remembered (per filter, on a tail)."""
MAX_IDLE_FILTERS = 256
"""Filters with no waiter whose index is kept (the most recently used); one used again
after it was dropped has its index rebuilt once (a walk of the subjects with records)."""


class Claims:
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
        self.stuck_after = stuck_after
        self._frontiers: deque[tuple[float, int]] = deque()  # (when, newest seen then)
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self._on_dead = on_dead
        self._on_count = on_count
        # Per subject, only while it has records to deliver:
        self._fresh: dict[str, deque[int]] = {}
        self._again: dict[str, list[int]] = {}  # heaps: oldest first
        self._leases: dict[int, _Lease] = {}
        self._owned: dict[object, set[int]] = {}  # owner -> its leased sort keys
        self._settling: dict[int, str] = {}  # acks being made durable: not redeliverable
        self._deliveries: dict[int, int] = {}
        self._delayed: list[tuple[float, int, str]] = []  # (ready_at, sort_key, subject)
        self._expiries: list[tuple[float, int]] = []  # (deadline, sort_key): one per lease
        self._backlog: dict[str, int] = {}
        self._total = 0
        self._changed: set[str] = set()  # subjects whose backlog changed since sampled
        self._indexes: dict[tuple[str, ...], _Index] = {}  # most recently used last
        self._matching: dict[str, list[_Index]] = {}  # subject -> the indexes it matches
        self._seq = 0
        self._timers_changed = trio.Event()
        self._timers_at = float("inf")  # when the timers task wakes next, unless woken
        self._closed = False
        self._why_closed = "the writer is draining"
        self.deleted = False
        self._last_added = 0
        self._parked = 0  # waiters not yet handed a record (nor gone)
        self._tail = tail
        self.cursor = 0
        """On a tail: every record before this position has been taken (leased, and
        maybe settled or back for redelivery since)."""
        self._taken: set[int] = set()  # sort keys taken past the cursor
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
            queue = self._fresh.get(subject)
            if queue is None:
                self._fresh[subject] = deque([sort_key])
                self._indexed(subject, "fresh", sort_key)
            else:
                queue.append(sort_key)
            self._count(subject, +1)
            self._last_added = max(self._last_added, sort_key)
            arrived.add(subject)
        self._last_added = max(self._last_added, seen_through)
        for subject in arrived:
            self._hand_over(subject)

    def requeue(self, records: Iterable[tuple[int, str]]) -> None:
        """Dead letters back in the backlog (``requeue``, durable already), as
        ``(sort_key, subject)``: delivered again before fresh records, with a fresh
        delivery count."""
        for sort_key, subject in records:
            self._deliveries.pop(sort_key, None)
            self._count(subject, +1)
            self._redeliver(sort_key, subject)

    def restore_owed(self, owed: Iterable[tuple[int, str, int]]) -> None:
        """Records owed below the settled position, as ``(sort_key, subject,
        deliveries)``, at start: delivered before fresh ones, their counts kept."""
        owed = list(owed)
        self.requeue((sort_key, subject) for sort_key, subject, _ in owed)
        self.restore_deliveries((sort_key, count) for sort_key, _, count in owed)

    def restore_deliveries(self, counts: Iterable[tuple[int, int]]) -> None:
        """Deliveries recorded before a restart, as ``(sort_key, deliveries)``."""
        self._deliveries.update((key, count) for key, count in counts if count)

    def _count(self, subject: str, change: int) -> None:
        self._total += change
        if self._tail is None:  # an event group counts its per-subject backlog on request
            backlog = self._backlog.get(subject, 0) + change
            if backlog:
                self._backlog[subject] = backlog
            else:  # memory follows the subjects with a backlog, not every subject seen
                del self._backlog[subject]
            self._changed.add(subject)

    # --- on a tail (an event group) --------------------------------------------------------

    def attach(self, after: int, settled: Iterable[int]) -> None:
        """Start on the tail after sort key ``after``; ``settled``: the records after it
        that are acked or dead already. The tail must hold every record after ``after``."""
        tail = self._require_tail()
        self.cursor = tail.position(after)
        self._taken = {key for key in settled if key > after}
        self._total = tail.end - self.cursor - len(self._taken)
        self._advance()
        tail.groups[self] = None

    def delete(self) -> None:
        """The group is gone (``delete_group``): its waiters are told so, its timers
        stop, and the tail no longer feeds it (nor waits for it to trim)."""
        self.deleted = True
        self.close("the group was deleted")
        if self._tail is not None:
            self._tail.groups.pop(self, None)
        self._timers_changed.set()

    def evict_through(self, through: int) -> int:
        """Every record up to ``through`` is being deleted from the store whatever this
        group did with it (``CMDBUS_EVT_MAX_BYTES``): forget each, delivered or not, so
        none is leased from now on. Returns how many the group had not settled (fresh,
        leased, or waiting to be redelivered); an ack under way completes as usual, and
        an ack of a lease dropped here answers as for an expired one."""
        if through <= self.evicted_through:
            return 0
        self.evicted_through = through
        dropped = self._drop_queued(self._fresh, "fresh", through)
        dropped += self._drop_queued(self._again, "again", through)
        for sort_key in [key for key in self._leases if key <= through]:
            lease = self._end_lease(sort_key)
            assert lease is not None
            self._count(lease.subject, -1)
            dropped += 1
        kept: list[tuple[float, int, str]] = []
        for entry in self._delayed:
            if entry[1] > through:
                kept.append(entry)
            else:
                self._count(entry[2], -1)
                dropped += 1
        heapq.heapify(kept)
        self._delayed = kept
        self._deliveries = {k: n for k, n in self._deliveries.items() if k > through}
        self._last_added = max(self._last_added, through)
        if self._tail is not None:
            tail = self._tail
            past = tail.position(through)
            if past > self.cursor:
                keys, base, taken = tail.keys, tail.base, self._taken
                untaken = sum(1 for at in range(self.cursor, past) if keys[at - base] not in taken)
                self._total -= untaken
                dropped += untaken
                self._taken = {key for key in self._taken if key > through}
                self.cursor = past
                self._advance()
        return dropped

    def _drop_queued(self, queues: dict[str, Any], kind: str, through: int) -> int:
        """Drop the records up to ``through`` from fresh queues or redelivery heaps."""
        dropped = 0
        # A fresh queue's oldest is first, a heap's smallest too.
        for subject in [s for s, queued in queues.items() if queued[0] <= through]:
            queued = queues.pop(subject)
            kept = sorted(key for key in queued if key > through)
            dropped += len(queued) - len(kept)
            self._count(subject, len(kept) - len(queued))
            if kept:  # a sorted list is a heap, and ordered like a fresh queue
                queues[subject] = deque(kept) if kind == "fresh" else kept
                self._indexed(subject, kind, kept[0])
        return dropped

    def arrived(self, start: int) -> None:
        """The tail has new records from position ``start``."""
        tail = self._require_tail()
        self._total += tail.end - start
        if self._parked:
            for subject in dict.fromkeys(tail.subjects[start - tail.base :]):
                self._hand_over(subject)

    def _require_tail(self) -> Tail:
        if self._tail is None:
            raise TypeError(f"{self.group}: not a group on a tail")
        return self._tail

    def _advance(self) -> None:
        tail = self._require_tail()
        keys, base, end, taken = tail.keys, tail.base, tail.end, self._taken
        while self.cursor < end and keys[self.cursor - base] in taken:
            taken.discard(keys[self.cursor - base])
            self.cursor += 1

    def _oldest_on_tail(self, index: _Index) -> tuple[int, str] | None:
        """The oldest fresh record the filter matches; ``index.position`` is left on it."""
        tail = self._require_tail()
        keys, subjects, base, end = tail.keys, tail.subjects, tail.base, tail.end
        taken, matched, tokens = self._taken, index.matched, index.filter
        position = max(index.position, self.cursor)
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

    def _take_from_tail(self, index: _Index, sort_key: int) -> None:
        if index.position == self.cursor:
            self.cursor += 1
            self._advance()
        else:
            self._taken.add(sort_key)
        index.position += 1

    # --- the per-filter indexes --------------------------------------------------------------

    def _index(self, filter_tokens: tuple[str, ...]) -> _Index:
        """The filter's index, built on first use (one walk of the subjects with
        records), kept while used."""
        index = self._indexes.pop(filter_tokens, None)
        if index is None:
            index = _Index(filter_tokens, position=self.cursor)
            for subject, keys in self._fresh.items():
                if matches(filter_tokens, subject):
                    index.fresh.append((keys[0], subject))
            for subject, heap in self._again.items():
                if matches(filter_tokens, subject):
                    index.again.append((heap[0], subject))
            heapq.heapify(index.fresh)
            heapq.heapify(index.again)
            self._matching.clear()  # subjects learn of the new filter when next met
            self._forget_idle_filters()
        self._indexes[filter_tokens] = index  # most recently used last
        return index

    def _forget_idle_filters(self) -> None:
        idle = [f for f, index in self._indexes.items() if not index.waiters]
        for filter_tokens in idle[: max(0, len(idle) - MAX_IDLE_FILTERS)]:
            del self._indexes[filter_tokens]
            self._matching.clear()

    def _indexes_of(self, subject: str) -> list[_Index]:
        found = self._matching.get(subject)
        if found is None:
            if len(self._matching) > 4 * (len(self._fresh) + len(self._again)) + 1024:
                self._matching.clear()  # bounded by the subjects with records
            found = self._matching[subject] = [
                index for f, index in self._indexes.items() if matches(f, subject)
            ]
        return found

    def _indexed(self, subject: str, kind: str, head: int) -> None:
        """``subject``'s head of ``kind`` (fresh or again) is now ``head``."""
        for index in self._indexes_of(subject):
            heap = index.fresh if kind == "fresh" else index.again
            heapq.heappush(heap, (head, subject))
            if len(heap) > 2 * (len(self._fresh) + len(self._again)) + 64:
                self._compact(heap, self._fresh if kind == "fresh" else self._again)

    @staticmethod
    def _compact(heap: list[tuple[int, str]], queues: dict[str, Any]) -> None:
        """Drop the entries that no longer are a subject's head (kept in place)."""
        heap[:] = [(key, s) for key, s in heap if s in queues and queues[s][0] == key]
        heapq.heapify(heap)

    def _oldest(self, index: _Index) -> tuple[int, str, bool] | None:
        """The oldest record the index's filter matches: redeliveries first."""
        for heap, queues, again in (
            (index.again, self._again, True),
            (index.fresh, self._fresh, False),
        ):
            while heap:
                key, subject = heap[0]
                queue = queues.get(subject)
                if queue is not None and queue[0] == key:
                    return key, subject, again
                heapq.heappop(heap)  # an old head
        if self._tail is not None:
            fresh = self._oldest_on_tail(index)
            if fresh is not None:
                return fresh[0], fresh[1], False
        return None

    # --- delivering ----------------------------------------------------------------------

    def has(self, filter_tokens: tuple[str, ...]) -> bool:
        """A record matching the filter can be taken now."""
        return self._oldest(self._index(filter_tokens)) is not None

    def next_nowait(self, filter_tokens: tuple[str, ...], owner: object) -> Delivery | None:
        """Lease the next matching record to ``owner``: records to redeliver first (oldest
        first), then fresh ones (oldest first). ``None`` when none matches."""
        index = self._index(filter_tokens)
        oldest = self._oldest(index)
        if oldest is None:
            return None
        sort_key, subject, again = oldest
        if not again and self._tail is not None:
            self._take_from_tail(index, sort_key)
        else:
            queues: dict[str, Any] = self._again if again else self._fresh
            queue = queues[subject]
            if again:
                heapq.heappop(queue)
            else:
                queue.popleft()
            if queue:
                self._indexed(subject, "again" if again else "fresh", queue[0])
            else:
                del queues[subject]
        deliveries = self._deliveries.get(sort_key, 0) + 1
        self._deliveries[sort_key] = deliveries
        deadline = trio.current_time() + self.ack_wait
        self._leases[sort_key] = _Lease(owner, subject, deadline)
        self._owned.setdefault(owner, set()).add(sort_key)
        heapq.heappush(self._expiries, (deadline, sort_key))
        self._timer_added(deadline)
        label = metrics.SUBJECTS.label(subject)  # not child(): subjects are input
        metrics.DELIVERIES.labels(subject=label).inc()
        redelivered = deliveries > 1  # not a record given back undelivered
        if redelivered:
            metrics.REDELIVERIES.labels(subject=label).inc()
        return Delivery(sort_key, subject, redelivered, deliveries)

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
            raise GateClosed(f"{self.group}: {self._why_closed}")
        delivery = self.next_nowait(filter_tokens, owner)
        if delivery is not None:
            return delivery
        self._seq += 1
        waiter = _Waiter(self._seq, owner, filter_tokens)
        self._index(filter_tokens).waiters.append(waiter)
        self._parked += 1
        try:
            await waiter.woken.wait()
        except BaseException:
            waiter.gone = True
            if waiter.delivery is not None:
                self.give_back(waiter.delivery.sort_key, owner)
            elif not waiter.woken.is_set():
                self._parked -= 1
            raise
        if waiter.delivery is None:
            raise GateClosed(f"{self.group}: {self._why_closed}")
        return waiter.delivery

    def _hand_over(self, subject: str) -> None:
        """``subject`` has records: lease them to waiting consumers whose filter matches,
        oldest waiter first, while both last."""
        while self._parked:
            oldest: _Waiter | None = None
            its_queue: deque[_Waiter] | None = None
            for index in self._indexes_of(subject):
                while index.waiters and index.waiters[0].gone:
                    index.waiters.popleft()
                if index.waiters and (oldest is None or index.waiters[0].seq < oldest.seq):
                    oldest, its_queue = index.waiters[0], index.waiters
            if oldest is None or its_queue is None:
                return
            delivery = self.next_nowait(oldest.filter, oldest.owner)
            if delivery is None:  # the subject's records are taken: the waiter stays
                return
            its_queue.popleft()
            self._parked -= 1
            oldest.delivery = delivery
            oldest.woken.set()

    def give_back(self, sort_key: int, owner: object) -> bool:
        """Undo a :meth:`next_nowait` whose record never reached its consumer (no Gate slot for
        it, its body could not be read, its consumer left): the record is offered again,
        and that delivery does not count."""
        lease = self._end_lease(sort_key, owner)
        if lease is None:
            return False
        deliveries = self._deliveries.pop(sort_key, 1) - 1
        if deliveries:
            self._deliveries[sort_key] = deliveries
        self._redeliver(sort_key, lease.subject)
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, why: str = "the writer is draining") -> None:
        """Lease nothing more; waiting consumers get :class:`GateClosed` at once."""
        self._closed = True
        self._why_closed = why
        self._parked = 0
        for index in self._indexes.values():
            while index.waiters:
                index.waiters.popleft().woken.set()

    # --- settling --------------------------------------------------------------------------

    def _end_lease(self, sort_key: int, owner: object | None = None) -> _Lease | None:
        """Remove the record's lease (only if ``owner`` holds it, when given)."""
        lease = self._leases.get(sort_key)
        if lease is None or (owner is not None and lease.owner is not owner):
            return None
        del self._leases[sort_key]
        owned = self._owned[lease.owner]
        owned.discard(sort_key)
        if not owned:
            del self._owned[lease.owner]
        return lease

    def holds(self, owner: object) -> bool:
        """``owner`` holds a lease."""
        return owner in self._owned

    def begin_ack(self, sort_key: int, owner: object) -> bool:
        """Start an ack by the record's lease owner; the caller makes it durable, then
        calls :meth:`finish_ack` (or :meth:`abort_ack` if that failed)."""
        lease = self._end_lease(sort_key, owner)
        if lease is None:
            return False
        self._settling[sort_key] = lease.subject
        return True

    def finish_ack(self, sort_key: int) -> None:
        subject = self._settling.pop(sort_key)
        self._deliveries.pop(sort_key, None)
        self._count(subject, -1)

    def abort_ack(self, sort_key: int) -> None:
        subject = self._settling.pop(sort_key)
        if sort_key <= self.evicted_through:  # gone from the store meanwhile
            self._deliveries.pop(sort_key, None)
            self._count(subject, -1)
        else:
            self._redeliver(sort_key, subject)

    def nack(self, sort_key: int, owner: object, delay: float = 0.0) -> bool:
        lease = self._end_lease(sort_key, owner)
        if lease is None:
            return False
        if delay > 0:
            ready_at = trio.current_time() + delay
            heapq.heappush(self._delayed, (ready_at, sort_key, lease.subject))
            self._timer_added(ready_at)
        else:
            self._end_delivery(sort_key, lease.subject)
        return True

    def extend(self, sort_key: int, owner: object) -> bool:
        lease = self._leases.get(sort_key)
        if lease is None or lease.owner is not owner:
            return False
        # The lease keeps its one timer entry: when that comes due, a lease that was
        # extended meanwhile is pushed again for its new deadline (one entry a lease,
        # however often a client extends it).
        lease.deadline = trio.current_time() + self.ack_wait
        return True

    def release(self, owner: object) -> int:
        """Every lease of ``owner`` (a connection that closed) ends now; the cost is its
        own leases, not everyone's."""
        mine = self._owned.pop(owner, set())
        for sort_key in sorted(mine):
            self._end_delivery(sort_key, self._leases.pop(sort_key).subject)
        return len(mine)

    def _end_delivery(self, sort_key: int, subject: str) -> None:
        """A delivery ended without an ack: redeliver, or park as dead after max_deliver."""
        deliveries = self._deliveries.get(sort_key, 0)
        if self.max_deliver and deliveries >= self.max_deliver:
            self._deliveries.pop(sort_key, None)
            self._count(subject, -1)
            metrics.DEAD.labels(subject=metrics.SUBJECTS.label(subject)).inc()
            self._on_dead(sort_key, subject, deliveries)
            return
        if deliveries:
            self._on_count(sort_key, deliveries)
        self._redeliver(sort_key, subject)

    def _redeliver(self, sort_key: int, subject: str) -> None:
        heap = self._again.setdefault(subject, [])
        heapq.heappush(heap, sort_key)
        if heap[0] == sort_key:
            self._indexed(subject, "again", sort_key)
        self._hand_over(subject)

    # --- timers ----------------------------------------------------------------------------

    def _timer_added(self, at: float) -> None:
        # Wake the timers task only when it would sleep past ``at``: with a fixed ack_wait
        # a new lease's expiry is never the soonest, and a wake-up per delivery was a
        # task switch per `next` for nothing.
        if at < self._timers_at:
            self._timers_changed.set()

    async def run_timers(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Expire leases and release delayed nacks, on time (in the background nursery)."""
        task_status.started()
        while not self.deleted:
            self._timers_changed = trio.Event()
            now = trio.current_time()
            while self._expiries and self._expiries[0][0] <= now:
                _, sort_key = heapq.heappop(self._expiries)
                lease = self._leases.get(sort_key)
                if lease is None:
                    continue  # acked, nacked or released meanwhile
                if lease.deadline > now:  # extended: its one entry goes back in
                    heapq.heappush(self._expiries, (lease.deadline, sort_key))
                    continue
                self._end_lease(sort_key)
                self._end_delivery(sort_key, lease.subject)
            while self._delayed and self._delayed[0][0] <= now:
                _, sort_key, subject = heapq.heappop(self._delayed)
                self._end_delivery(sort_key, subject)
            self._timers_at = min(
                (heap[0][0] for heap in (self._expiries, self._delayed) if heap),
                default=float("inf"),
            )
            with trio.move_on_at(self._timers_at):
                await self._timers_changed.wait()

    # --- what is owed ----------------------------------------------------------------------

    def lag(self, filter_tokens: tuple[str, ...] | None = None) -> dict[str, int]:
        """Backlog per subject: undelivered + leased-unacked (dead letters are not
        backlog), for the subjects that have one, sorted. On a tail this walks the
        group's backlog: see :meth:`backlog`."""
        if self._tail is not None:
            counts = self._in_flight()
            for _ in self._walk_tail(counts, max(1, len(self._tail.keys))):
                pass
            backlog = counts
        else:
            backlog = self._backlog
        return {
            subject: count
            for subject, count in sorted(backlog.items())
            if filter_tokens is None or matches(filter_tokens, subject)
        }

    async def backlog(
        self, filter_tokens: tuple[str, ...] | None = None, *, step: int = 20_000
    ) -> dict[str, int]:
        """:meth:`lag` for a request: an event group's walk of its backlog lets the loop
        run every ``step`` records (records settled meanwhile may count or not: it is
        a sample, like the gauges)."""
        if self._tail is None:
            return self.lag(filter_tokens)
        counts = self._in_flight()
        for _ in self._walk_tail(counts, step):
            await trio.lowlevel.checkpoint()
        return {
            subject: count
            for subject, count in sorted(counts.items())
            if filter_tokens is None or matches(filter_tokens, subject)
        }

    def _in_flight(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for lease in self._leases.values():
            counts[lease.subject] += 1
        for subject in self._settling.values():
            counts[subject] += 1
        for subject, heap in self._again.items():
            counts[subject] += len(heap)
        for _, _, subject in self._delayed:
            counts[subject] += 1
        return counts

    def _walk_tail(self, counts: dict[str, int], step: int) -> Iterable[None]:
        """Count the untaken records from the cursor on, yielding every ``step``."""
        tail = self._require_tail()
        position = self.cursor
        while position < tail.end:
            position = max(position, self.cursor, tail.base)
            stop = min(tail.end, position + step)
            keys, subjects, base, taken = tail.keys, tail.subjects, tail.base, self._taken
            for at in range(position - base, stop - base):
                if keys[at] not in taken:
                    counts[subjects[at]] += 1
            position = stop
            yield

    @property
    def total(self) -> int:
        """The whole backlog (kept as it changes: no walk of the subjects)."""
        return self._total

    def changed_backlog(self) -> dict[str, int]:
        """The backlog of each subject whose backlog changed since the last call (a
        sampler sets only those gauges)."""
        changed, self._changed = self._changed, set()
        return {subject: self._backlog.get(subject, 0) for subject in changed}

    def backlog_of(self, subject: str) -> int:
        """One subject's backlog (0 on a tail, where it is not kept: see :meth:`lag`)."""
        return self._backlog.get(subject, 0)

    @property
    def leased(self) -> int:
        return len(self._leases)

    def position(self, now: float) -> tuple[int, int]:
        """The settled position to make durable, and the newest sort key it passes
        unsettled (0: none). Called about once a second.

        It is the low-water mark while that is recent. A record unsettled for longer than
        ``stuck_after`` (a pool with no workers, a lease extended forever, a nack with a
        long delay) would hold the mark back for ever: the acks table would never be
        pruned and every restart would rescan everything after it. So the position never
        trails what the group had seen ``stuck_after`` ago: the records it passes that
        are still unsettled are recorded as owed (and reloaded from there)."""
        seen = self._tail.newest if self._tail is not None else self._last_added
        frontiers = self._frontiers
        frontiers.append((now, seen))
        old: tuple[float, int] | None = None
        while frontiers and frontiers[0][0] <= now - self.stuck_after:
            old = frontiers.popleft()
        if old is not None:
            frontiers.appendleft(old)  # the newest one old enough, kept for next time
        mark = self.low_water()
        stuck_through = old[1] if old is not None else 0
        if mark > stuck_through:
            return mark, 0
        return stuck_through + 1, stuck_through

    def low_water(self) -> int:
        """The lowest sort key not yet settled (acked or dead) by this group: every record
        below it is settled. Only known records count, so it never passes a record the
        group has not seen."""
        pending = [keys[0] for keys in self._fresh.values()]
        pending += [keys[0] for keys in self._again.values()]
        pending += self._leases.keys()
        pending += self._settling.keys()
        pending += [sort_key for _, sort_key, _ in self._delayed]
        last_seen = self._last_added
        if self._tail is not None:
            tail = self._tail
            if self.cursor < tail.end:
                pending.append(tail.keys[self.cursor - tail.base])
            last_seen = tail.newest
        return min(pending, default=last_seen + 1)
