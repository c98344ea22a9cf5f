"""The Gate: admission by requests, with shedding, for one face."""

from __future__ import annotations

import math
from collections import Counter as _Tally
from collections import OrderedDict
from collections.abc import Callable, Iterable

import attrs
import trio

from cmdbus_trio import metrics

from ._bursts import ShedBursts, ShedReason
from ._slot import Slot


class Shed(Exception):
    """The Gate refused the request. ``reason`` says why; a client may retry after
    ``retry_after_ms`` (except for ``deadline``, whose budget is gone)."""

    def __init__(self, face: str, op: str, reason: ShedReason, retry_after_ms: int) -> None:
        super().__init__(f"{face} {op}: shed ({reason.value})")
        self.face = face
        self.op = op
        self.reason = reason
        self.retry_after_ms = retry_after_ms


class GateClosed(Exception):
    """The Gate is draining: it admits nothing more (answer ``unavailable``).
    ``draining`` False: closed for good instead (a consumer group deleted), so asking
    again later, of this writer or the next, will not help."""

    def __init__(self, message: str = "", *, draining: bool = True) -> None:
        super().__init__(message)
        self.draining = draining


@attrs.frozen
class GateStatistics:
    """A snapshot of a :class:`Gate`, as :meth:`Gate.statistics` returns it."""

    face: str
    capacity: int
    inflight: int
    waiters: int
    intake: int
    """Requests connections have handed to the face and that have not finished (admitted
    or waiting; compared with capacity + max_waiters to hold floods back)."""
    max_waiters: int
    shed_after: float
    default_budget: float
    closed: bool
    admitted_total: int
    shed_total: dict[str, int]
    """Sheds since start, by reason (every reason present, 0 when none)."""


Admitted = Callable[["Slot | Shed | GateClosed"], None]
"""What :meth:`Gate.acquire_later` calls, once: with the slot, or with why there is none."""


class _Waiter:
    """A request waiting for a slot: a task parked in :meth:`Gate.acquire`, or a
    callback queued by :meth:`Gate.acquire_later`."""

    __slots__ = ("expires", "expiry_reason", "slot", "task", "then")

    def __init__(
        self,
        slot: Slot,
        expires: float,
        expiry_reason: ShedReason,
        task: trio.lowlevel.Task | None = None,
        then: Admitted | None = None,
    ) -> None:
        self.slot = slot
        self.expires = expires
        self.expiry_reason = expiry_reason
        self.task = task
        self.then = then


class Gate:
    """Admission control for one face.

    At most ``max_inflight`` slots are held at once; at most ``max_waiters`` requests
    wait for one, first come first served. A request waits at most ``min(shed_after,
    remaining budget)``. Outcomes: admitted, or :class:`Shed` with reason
    ``waiters_full`` (at once, the queue is full), ``queue_timeout`` (waited
    ``shed_after``) or ``deadline`` (the budget ran out first, or was already spent on
    arrival). Each is counted under the face and op.

    A request waits in a task (:meth:`acquire`) or, without one, as a callback
    (:meth:`acquire_later`): one queue holds both, in arrival order. The callbacks'
    timers are the Gate's own task's (:meth:`run_timers`).

    ``ops``: the ops that ask this Gate for slots, whose shed counters exist from the
    start (at 0), so that a dashboard's ``sum()`` reads 0 rather than no data.

    At most ``max_threads`` (default: ``max_inflight``) slots run a worker thread at
    once; a face whose slots are mostly not threads (the claim faces: deliveries whose
    body a batched read fetches) keeps its thread work to the CPU quota this way.
    """

    def __init__(
        self,
        face: str,
        *,
        max_inflight: int,
        max_waiters: int,
        shed_after: float,
        default_budget: float,
        max_threads: int | None = None,
        ops: Iterable[str] = (),
        name: str | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if max_threads is not None and not 1 <= max_threads <= max_inflight:
            raise ValueError(f"max_threads must be 1..max_inflight, got {max_threads}")
        if max_waiters < 0:
            raise ValueError(f"max_waiters must be >= 0, got {max_waiters}")
        if not shed_after > 0 or not default_budget > 0:
            raise ValueError("shed_after and default_budget must be > 0 seconds")
        self.face = face
        self.name = name or face
        """The Gate's own name, for its gauges and /healthz (a face's lane: ``tier_writes``);
        the per-op series are the face's."""
        self.max_inflight = max_inflight
        self.max_threads = max_threads or max_inflight
        self.max_waiters = max_waiters
        self.shed_after = shed_after
        self.default_budget = default_budget
        self._inflight = 0
        self._queue: OrderedDict[_Waiter, None] = OrderedDict()  # first come, first served
        self._timer: trio.CancelScope | None = None  # run_timers' sleep, while it runs
        # A slot runs at most one thread: with the default, an admitted request never
        # waits for one; with fewer, it may (after admission, inside its service time).
        self._thread_limiter = trio.CapacityLimiter(self.max_threads)
        self._room = trio.lowlevel.ParkingLot()  # connections holding a client back
        self._intake = 0
        self._when_free: dict[Callable[[], None], None] = {}  # see when_free()
        self._closed = False
        self._admitted_total = 0
        self._shed_total: _Tally[str] = _Tally({reason.value: 0 for reason in ShedReason})
        self._bursts = ShedBursts(self.name)
        for op in ops:  # every shed series exists from the start, at 0
            for reason in ShedReason:
                metrics.SHED.labels(face=face, op=op, reason=reason.value)
        metrics.CAPACITY.labels(face=self.name).set(max_inflight)
        metrics.INFLIGHT.labels(face=self.name).set_function(lambda: self._inflight)
        metrics.WAITERS.labels(face=self.name).set_function(lambda: len(self._queue))

    # --- admission ---------------------------------------------------------------------

    async def acquire(
        self, op: str, *, budget: float | None = None, arrival: float | None = None
    ) -> Slot:
        """Admit one request of ``op``, or shed it.

        ``arrival`` is when the request arrived (default: now); ``budget`` is the time the
        client still has (default: the Gate's ``default_budget``).

        Cancellation: if cancelled while waiting, nothing is held and nothing is counted.

        Error handling: raises :class:`Shed` or :class:`GateClosed`.
        """
        now = trio.current_time()
        slot = self._arrive(op, now, budget, arrival)
        if self.can_admit_now:
            return self._take(slot)
        waiter = self._enqueue(slot, now, task=trio.lowlevel.current_task())

        def abort(_: object) -> trio.lowlevel.Abort:
            del self._queue[waiter]  # still queued: admission and close reschedule it
            return trio.lowlevel.Abort.SUCCEEDED

        with trio.CancelScope(deadline=waiter.expires):
            await trio.lowlevel.wait_task_rescheduled(abort)
            if math.isnan(slot.admitted_at):  # woken by close(), not by a released slot
                raise GateClosed(f"{self.face} is draining")
            return slot
        raise self._refuse(slot, waiter.expiry_reason)

    def acquire_nowait(
        self, op: str, *, budget: float | None = None, arrival: float | None = None
    ) -> Slot:
        """Admit at once or shed: never queues (a free slot or ``waiters_full``)."""
        slot = self._arrive(op, trio.current_time(), budget, arrival)
        if not self.can_admit_now:
            raise self._refuse(slot, ShedReason.WAITERS_FULL)
        return self._take(slot)

    def acquire_later(
        self,
        op: str,
        then: Admitted,
        *,
        budget: float | None = None,
        arrival: float | None = None,
    ) -> None:
        """As :meth:`acquire`, without a task: ``then`` is called exactly once, on the
        loop, with the :class:`Slot` once admitted (at once, before this returns, if one
        is free) or with the :class:`Shed` or :class:`GateClosed` that refused it (at
        once, or when the request's wait ends). ``then`` must not raise: it runs inside
        whatever released the slot.

        A request that waits no task for its slot costs the loop nothing while it waits:
        under overload most of them wait.

        Error handling: raises ``RuntimeError`` if it would have to wait while
        :meth:`run_timers` is not running (nothing would end the wait).
        """
        now = trio.current_time()
        try:
            slot = self._arrive(op, now, budget, arrival)
            if self.can_admit_now:
                then(self._take(slot))
                return
            waiter = self._enqueue(slot, now, then=then)
        except (Shed, GateClosed) as refused:
            then(refused)
            return
        if self._timer is None:
            del self._queue[waiter]
            raise RuntimeError(f"{self.name}: acquire_later needs run_timers running")
        self._timer.deadline = min(self._timer.deadline, waiter.expires)

    @property
    def can_admit_now(self) -> bool:
        """Open, a slot free and nobody waiting for one: :meth:`acquire_nowait` admits
        (unless the request's budget is spent). Lets a caller that must not be shed, only
        wait, take a fast path without a task."""
        return not self._closed and not self._queue and self._inflight < self.max_inflight

    def _arrive(self, op: str, now: float, budget: float | None, arrival: float | None) -> Slot:
        """The checks made before queueing: closed, or a budget already spent."""
        arrival = now if arrival is None else arrival
        budget = self.default_budget if budget is None else budget
        slot = Slot(self, op, arrival, arrival + budget)
        if self._closed:
            raise GateClosed(f"{self.face} is draining")
        if slot.deadline <= now:
            raise self._refuse(slot, ShedReason.DEADLINE)
        return slot

    def _enqueue(
        self,
        slot: Slot,
        now: float,
        task: trio.lowlevel.Task | None = None,
        then: Admitted | None = None,
    ) -> _Waiter:
        """Queue ``slot``'s request, or shed it (``waiters_full``)."""
        if len(self._queue) >= self.max_waiters:
            raise self._refuse(slot, ShedReason.WAITERS_FULL)
        remaining = slot.deadline - now
        # Which ran out first names the reason: the client's budget, or the Gate's patience.
        reason = ShedReason.DEADLINE if remaining <= self.shed_after else ShedReason.QUEUE_TIMEOUT
        waiter = _Waiter(slot, now + min(self.shed_after, remaining), reason, task, then)
        self._queue[waiter] = None
        return waiter

    def _take(self, slot: Slot) -> Slot:
        self._inflight += 1
        self._admit(slot)
        return slot

    def _admit(self, slot: Slot) -> None:
        slot.admitted_at = trio.current_time()
        self._admitted_total += 1
        metrics.child(metrics.QUEUE_WAIT, self.face, slot.op).observe(
            slot.admitted_at - slot.arrival
        )

    def _refuse(self, slot: Slot, reason: ShedReason) -> Shed:
        """Count a shed request; the caller raises (or hands over) what this returns."""
        self._shed_total[reason.value] += 1
        metrics.SHED.labels(face=self.face, op=slot.op, reason=reason.value).inc()
        self._bursts.shed(reason, trio.current_time())
        return Shed(self.face, slot.op, reason, self.retry_after_ms(reason))

    def retry_after_ms(self, reason: ShedReason) -> int:
        """A hint for a shed client: one ``shed_after`` (by then the queue has turned over
        at least once); 0 for ``deadline``, whose budget is gone anyway."""
        return 0 if reason is ShedReason.DEADLINE else max(1, round(self.shed_after * 1000))

    def when_free(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, on the loop, when a slot is next freed with nobody
        queued for it (a callback already waiting is not added again). A claim face
        offers the records its shed consumers gave back then: a slot frees as surely as
        one was taken when they were shed. ``callback`` must not raise: it runs inside
        whatever released the slot."""
        self._when_free[callback] = None

    def _release(self, slot: Slot) -> None:
        metrics.child(metrics.SERVICE, self.face, slot.op).observe(
            trio.current_time() - slot.admitted_at
        )
        if not self._queue:
            self._inflight -= 1
            if self._when_free:
                callbacks, self._when_free = self._when_free, {}
                for callback in callbacks:
                    callback()
            return
        waiter, _ = self._queue.popitem(last=False)  # the slot passes to the first in line
        self._admit(waiter.slot)
        if waiter.task is not None:
            trio.lowlevel.reschedule(waiter.task)
        else:
            assert waiter.then is not None
            waiter.then(waiter.slot)

    # --- intake: how connections hold back a flood --------------------------------------

    @property
    def intake_full(self) -> bool:
        """Requests taken in by connections and not finished fill every slot and every
        queue place: one more would be shed at once."""
        return self.room == 0

    @property
    def room(self) -> int:
        """How many more requests connections may take in before :attr:`intake_full`."""
        return max(0, self.max_inflight + self.max_waiters - self._intake)

    def take_in(self) -> None:
        """A connection hands a request for this Gate to its handler."""
        self._intake += 1

    def taken_out(self) -> None:
        """That request finished (admitted and done, shed, or failed before the Gate)."""
        self._intake -= 1
        if not self.intake_full:
            self._room.unpark()  # one connection per place: the others would shed

    async def wait_for_room(self) -> None:
        """Return once one more request would find a slot or a queue place (or the Gate
        closed). A connection calls it, under a timeout of ``shed_after``, before it
        takes a pipelining or just-refused client's next request while the intake is
        full: the flood then waits in the client's socket (TCP backpressure) instead of
        costing the loop a parse and a refusal per request, which left too little of it
        for the admitted work.

        Cancellation: safe; nothing is held.
        """
        while self.intake_full and not self._closed:
            await self._room.park()

    # --- drain -------------------------------------------------------------------------

    def close(self) -> None:
        """Admit nothing more; requests still waiting get :class:`GateClosed`."""
        self._closed = True
        waiting, self._queue = self._queue, OrderedDict()
        for waiter in waiting:
            if waiter.task is not None:
                trio.lowlevel.reschedule(waiter.task)  # not admitted: it raises GateClosed
            else:
                assert waiter.then is not None
                waiter.then(GateClosed(f"{self.face} is draining"))
        self._room.unpark_all()

    # --- timers ------------------------------------------------------------------------

    async def run_timers(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """End the waits of :meth:`acquire_later`'s callbacks when their time comes, and
        log the end of each shed burst (its start is logged when it happens). Runs in the
        background nursery, outliving the faces, so that a drain's waiters still end.

        It sleeps until the earliest callback's time, which :meth:`acquire_later` brings
        forward; a callback admitted before its time leaves the sleep early, and the next
        wake looks again. Each wake scans the queue, at most ``max_waiters`` long: under
        overload about once per ``shed_after``, as the queue turns over well within it
        (a heap of expiry times, kept lazily, had thousands of admitted entries to drop
        per wake)."""
        task_status.started()
        tick = trio.current_time() + self._bursts.quiet_period
        try:
            while True:
                now = trio.current_time()
                expired = [w for w in self._queue if w.then is not None and w.expires <= now]
                for waiter in expired:
                    del self._queue[waiter]
                    assert waiter.then is not None
                    waiter.then(self._refuse(waiter.slot, waiter.expiry_reason))
                if now >= tick:
                    self._bursts.tick(now)
                    tick = now + self._bursts.quiet_period
                wake = min((w.expires for w in self._queue if w.then is not None), default=tick)
                self._timer = trio.CancelScope(deadline=min(tick, wake))
                with self._timer:
                    await trio.sleep_forever()
        finally:
            self._timer = None

    # --- statistics --------------------------------------------------------------------

    def statistics(self) -> GateStatistics:
        return GateStatistics(
            face=self.name,
            capacity=self.max_inflight,
            inflight=self._inflight,
            waiters=len(self._queue),
            intake=self._intake,
            max_waiters=self.max_waiters,
            shed_after=self.shed_after,
            default_budget=self.default_budget,
            closed=self._closed,
            admitted_total=self._admitted_total,
            shed_total=dict(self._shed_total),
        )
