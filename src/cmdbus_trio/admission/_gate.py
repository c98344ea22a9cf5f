"""The Gate: admission by requests, with shedding, for one face."""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter as _Tally
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import NoReturn, TypeVar, TypeVarTuple

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.logs import event

from ._threads import run_in_thread

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

log = logging.getLogger(__name__)


class ShedReason(enum.StrEnum):
    WAITERS_FULL = "waiters_full"
    QUEUE_TIMEOUT = "queue_timeout"
    DEADLINE = "deadline"


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
    """The Gate is draining: it admits nothing more (answer ``unavailable``)."""


class DeadlineExceeded(Exception):
    """The request's budget ran out while its read work was running; the work stopped."""


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


class Slot:
    """A Gate slot held on behalf of one request, until :meth:`release`.

    Use it as a context manager (``with await gate.acquire(op) as slot:``); do blocking
    work through :meth:`run_cancellable` or :meth:`run_to_completion`.
    """

    def __init__(self, gate: Gate, op: str, arrival: float, deadline: float) -> None:
        self._gate = gate
        self.op = op
        self.arrival = arrival
        self.deadline = deadline
        self.admitted_at = math.nan
        self._released = False
        self._running = False

    async def run_cancellable(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run read work in a thread, stopping it when the budget runs out.

        Cancellation: the thread observes cancellation, from the caller or the budget,
        at its next ``trio.from_thread.check_cancelled()``; this returns only once the
        thread has.

        Error handling: raises :class:`DeadlineExceeded` if the budget stopped the work.
        """
        with trio.CancelScope(deadline=self.deadline):
            return await self._run(fn, *args)
        raise DeadlineExceeded(f"{self._gate.face} {self.op}: budget ran out")

    async def run_to_completion(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run write work in a thread; once started it finishes, whatever is cancelled,
        and the slot stays held until it has (DESIGN.md: "Writes finish")."""
        with trio.CancelScope(shield=True):
            result = await self._run(fn, *args)
        return result

    async def _run(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        if self._released:
            raise RuntimeError("this slot was released")
        if self._running:
            raise RuntimeError("one thread per request: this slot is already running work")
        self._running = True
        try:
            return await run_in_thread(fn, *args, limiter=self._gate._thread_limiter)
        finally:
            self._running = False

    def release(self) -> None:
        if self._released:
            raise RuntimeError("slot released twice")
        self._released = True
        self._gate._release(self)

    def __enter__(self) -> Slot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Gate:
    """Admission control for one face.

    At most ``max_inflight`` slots are held at once; at most ``max_waiters`` requests
    wait for one. A request waits at most ``min(shed_after, remaining budget)``. Outcomes:
    admitted, or :class:`Shed` with reason ``waiters_full`` (at once, the queue is full),
    ``queue_timeout`` (waited ``shed_after``) or ``deadline`` (the budget ran out first,
    or was already spent on arrival). Each is counted under the face and op.

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
        self._limiter = trio.CapacityLimiter(max_inflight)
        # A slot runs at most one thread: with the default, an admitted request never
        # waits for one; with fewer, it may (after admission, inside its service time).
        self._thread_limiter = trio.CapacityLimiter(self.max_threads)
        self._waiting: set[trio.CancelScope] = set()
        self._room = trio.lowlevel.ParkingLot()  # connections holding a client back
        self._intake = 0
        self._closed = False
        self._admitted_total = 0
        self._shed_total: _Tally[str] = _Tally({reason.value: 0 for reason in ShedReason})
        self._bursts = ShedBursts(self.name)
        for op in ops:  # every shed series exists from the start, at 0
            for reason in ShedReason:
                metrics.SHED.labels(face=face, op=op, reason=reason.value)
        metrics.CAPACITY.labels(face=self.name).set(max_inflight)
        metrics.INFLIGHT.labels(face=self.name).set_function(lambda: self._limiter.borrowed_tokens)
        metrics.WAITERS.labels(face=self.name).set_function(lambda: len(self._waiting))

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
        remaining = slot.deadline - now
        try:
            self._limiter.acquire_on_behalf_of_nowait(slot)
        except trio.WouldBlock:
            if len(self._waiting) >= self.max_waiters:
                self._shed(slot, ShedReason.WAITERS_FULL)
            with trio.CancelScope(deadline=now + min(self.shed_after, remaining)) as waiting:
                self._waiting.add(waiting)
                try:
                    await self._limiter.acquire_on_behalf_of(slot)
                finally:
                    self._waiting.discard(waiting)
            if waiting.cancelled_caught:
                if self._closed:
                    raise GateClosed(f"{self.face} is draining") from None
                budget_first = remaining <= self.shed_after
                self._shed(slot, ShedReason.DEADLINE if budget_first else ShedReason.QUEUE_TIMEOUT)
        self._admit(slot)
        return slot

    def acquire_nowait(
        self, op: str, *, budget: float | None = None, arrival: float | None = None
    ) -> Slot:
        """Admit at once or shed: never queues (a free slot or ``waiters_full``)."""
        slot = self._arrive(op, trio.current_time(), budget, arrival)
        try:
            self._limiter.acquire_on_behalf_of_nowait(slot)
        except trio.WouldBlock:
            self._shed(slot, ShedReason.WAITERS_FULL)
        self._admit(slot)
        return slot

    @property
    def can_admit_now(self) -> bool:
        """Open, a slot free and nobody waiting for one: :meth:`acquire_nowait` admits
        (unless the request's budget is spent). Lets a caller that must not be shed, only
        wait, take a fast path without a task."""
        return not self._closed and not self._waiting and self._limiter.available_tokens > 0

    def _arrive(self, op: str, now: float, budget: float | None, arrival: float | None) -> Slot:
        """The checks made before queueing: closed, or a budget already spent."""
        arrival = now if arrival is None else arrival
        budget = self.default_budget if budget is None else budget
        slot = Slot(self, op, arrival, arrival + budget)
        if self._closed:
            raise GateClosed(f"{self.face} is draining")
        if slot.deadline <= now:
            self._shed(slot, ShedReason.DEADLINE)
        return slot

    def _admit(self, slot: Slot) -> None:
        slot.admitted_at = trio.current_time()
        self._admitted_total += 1
        metrics.child(metrics.QUEUE_WAIT, self.face, slot.op).observe(
            slot.admitted_at - slot.arrival
        )

    def _shed(self, slot: Slot, reason: ShedReason) -> NoReturn:
        self._shed_total[reason.value] += 1
        metrics.SHED.labels(face=self.face, op=slot.op, reason=reason.value).inc()
        self._bursts.shed(reason, trio.current_time())
        raise Shed(self.face, slot.op, reason, self.retry_after_ms(reason))

    def retry_after_ms(self, reason: ShedReason) -> int:
        """A hint for a shed client: one ``shed_after`` (by then the queue has turned over
        at least once); 0 for ``deadline``, whose budget is gone anyway."""
        return 0 if reason is ShedReason.DEADLINE else max(1, round(self.shed_after * 1000))

    def _release(self, slot: Slot) -> None:
        self._limiter.release_on_behalf_of(slot)
        metrics.child(metrics.SERVICE, self.face, slot.op).observe(
            trio.current_time() - slot.admitted_at
        )

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
        for waiting in self._waiting:
            waiting.cancel()
        self._room.unpark_all()

    async def watch_sheds(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Log the end of each shed burst (its start is logged when it happens). Runs in
        the background nursery."""
        task_status.started()
        while True:
            await trio.sleep(self._bursts.quiet_period)
            self._bursts.tick(trio.current_time())

    # --- statistics --------------------------------------------------------------------

    def statistics(self) -> GateStatistics:
        return GateStatistics(
            face=self.name,
            capacity=self.max_inflight,
            inflight=self._limiter.borrowed_tokens,
            waiters=len(self._waiting),
            intake=self._intake,
            max_waiters=self.max_waiters,
            shed_after=self.shed_after,
            default_budget=self.default_budget,
            closed=self._closed,
            admitted_total=self._admitted_total,
            shed_total=dict(self._shed_total),
        )


class ShedBursts:
    """Logs one line when shedding starts and one when it has stopped for
    ``quiet_period`` seconds, instead of a line per shed request."""

    quiet_period = 1.0

    def __init__(self, face: str) -> None:
        self.face = face
        self._started: float | None = None
        self._last = 0.0
        self._reasons: _Tally[str] = _Tally()

    def shed(self, reason: ShedReason, now: float) -> None:
        if self._started is None:
            self._started = now
            event(log, logging.WARNING, "shed_burst_started", face=self.face, reason=reason.value)
        self._last = now
        self._reasons[reason.value] += 1

    def tick(self, now: float) -> None:
        if self._started is not None and now - self._last >= self.quiet_period:
            event(
                log,
                logging.WARNING,
                "shed_burst_ended",
                face=self.face,
                duration_s=round(self._last - self._started, 3),
                shed=dict(self._reasons),
            )
            self._started = None
            self._reasons.clear()
