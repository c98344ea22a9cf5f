"""The data plane's share of each turn of the event loop.

The control face shares the loop with the data plane. trio runs, in each turn, every
task that was ready when the turn began; a probe's tasks are among them, so a probe
waits about as many turns as its request takes steps, and each of those turns lasts as
long as the work the data plane found ready. Under a pipelined flood that was 2-7 ms a
turn and a `/healthz` p99 of 58-109 ms (`benchmarks/bus.py`, pipelined).

So the data plane's loops (each connection's reader and dispatcher, the settling steps)
ask a :class:`TurnBudget` before each unit of work. Once this turn's data-plane work has
run for ``share`` seconds, they wait for the next turn; every other task, the control
face's included, still runs in this one. The first unit of each turn is let through
(but in a turn that favours the control face, below), so the data plane is never
starved, however long the rest of the turn was.

The control face goes first (:meth:`TurnBudget.put_first`): in a turn in which one of its
tasks is ready, the data plane waits. A probe through hypercorn takes ~17 turns (7
before the app sees the request, 10 in it and after), so it is answered in ~17 short
turns instead of ~17 full ones: under the overload soak the `/healthz` p99 went from
37-46 ms to 12-14 ms, and under a pipelined flood from 29-37 ms to 9-13 ms (letting
each favoured turn run one unit of the data plane still left 24-30 ms there). The
favour is bounded: at most :data:`CONTROL_FIRST_SHARE` of the loop's busy time goes to
turns that favour the control face (`benchmarks/soak.py`).

That bounds the turns in which the data plane waits, not the control face's own work,
which runs in every turn: 32 clients looping ``GET /metrics`` left the data plane 3% of
its throughput. So the control face's requests are paced as well
(:class:`ControlShare`): the budget times every step of a control task (CPU time), and once the
control face has used :data:`CONTROL_SHARE` of the loop's time (after a burst), its next
request waits its turn, probes ahead of scrapes. While requests wait so, no turn favours
the control face: its flood is not urgent, and a probe is let through ahead of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import trio

DATA_PLANE_SHARE = 0.001
"""Seconds of data-plane work per turn of the loop. 1 ms about halved the `/healthz` p99
under a pipelined flood for ~5% of its throughput; 2 ms kept less of the gain, 0.5 ms
and less cost more throughput for little more (docs/benchmarks.md)."""

CONTROL_FIRST_SHARE = 0.25
"""At most this share of the loop's time is in turns that favour the control face. A
kubelet's probes take ~0.1% of it; the benchmarks' (20 a second) ~15%."""
CONTROL_FIRST_BURST = 0.1
"""Seconds of favoured turns the control face may take at once, when it has not lately."""


CONTROL_SHARE = 0.1
"""At most this share of the loop's time goes to the control face's requests, once its
burst (:data:`CONTROL_BURST`) is spent: the buses keep the rest under a scrape flood."""
CONTROL_BURST = 0.05
"""Seconds of control-face work taken at once without waiting, when none was lately: a
kubelet's probes and a Prometheus scrape never wait."""
PROBE_OVERDRAFT = 0.02
"""Seconds the control face's share may be overdrawn by probes: a probe is let through
at once, ahead of a scrape waiting for the share, unless probes alone spent this much."""
MAX_DEBT = 0.05
"""Seconds the control face's share may owe, at most. Work that no request admitted
(accepting and closing a flood of connections, parsing a request before it is admitted)
runs whatever the share says: owing more for it would hold the probes back long after a
flood ends, and take nothing more from it (at most MAX_DEBT / CONTROL_SHARE of waiting)."""


@attrs.frozen
class TurnStatistics:
    turns: int
    """Turns of the loop since the budget was made."""
    deferred: int
    """Times a unit of data-plane work waited a turn because the turn's share was spent:
    non-zero means the data plane alone could fill the loop."""
    busy: float
    """Seconds the loop spent running tasks rather than waiting for I/O or a deadline.
    Its rate is how full the loop is: near 1, every further request waits for a turn."""
    control_first: float
    """Seconds of turns in which the data plane gave way to a ready control task."""
    control: float
    """CPU seconds the control face's tasks ran (every step of each timed)."""
    control_waited: float
    """Seconds control-face requests waited because the control face's share was spent."""


class TurnBudget(trio.abc.Instrument):
    """Lets ``share`` seconds of data-plane work run in each turn of the loop.

    It is a trio instrument: trio calls :meth:`after_io_wait` as each turn begins, and
    :meth:`before_io_wait` as it ends, which also gives the time the loop was busy; and
    :meth:`task_scheduled` as a task becomes ready, which shows it the control face's
    (:meth:`put_first`). Get the run's own with :func:`current`.

    A control task's steps are timed by ``step_clock``, the loop thread's CPU time: a
    step's wall time also holds the time the thread was preempted or waited for the GIL
    (a worker thread's), which is not the control face's work. Charged for it, a
    kubelet and a Prometheus were paced on a busy machine as a flood would be.
    """

    def __init__(
        self,
        share: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        step_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.share = share
        self._clock = clock
        self._step_clock = step_clock
        self._began = clock()
        self._admitted = 0  # units let through in this turn
        self._next_turn = trio.lowlevel.ParkingLot()
        self._pacing = False  # a waiter keeps the loop from sleeping
        self._turns = 0
        self._deferred = 0
        self._busy = 0.0
        self._control: set[trio.lowlevel.Task] = set()  # the control face's tasks
        self._control_scheduled = -2  # the turn in which one of them was last scheduled
        self._favoured = False  # this turn gives way to the control face
        self._favour_left = CONTROL_FIRST_BURST  # seconds of favoured turns it may take now
        self._control_first = 0.0
        self._control_time = 0.0  # seconds in the control tasks' steps
        self._stepping: trio.lowlevel.Task | None = None  # the control task in its step
        self._step_began = 0.0
        self._at_end: list[Callable[[], None]] = []  # see at_turn_end
        self.control = ControlShare(self)

    def at_turn_end(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, as this turn of the loop ends (before the loop looks
        for I/O). It must not raise."""
        self._at_end.append(callback)

    def before_io_wait(self, timeout: float) -> None:
        if self._at_end:
            callbacks, self._at_end = self._at_end, []
            for callback in callbacks:
                callback()
        now = self._clock()
        turn = now - self._began
        self._busy += turn
        # Each turn refills the favour (CONTROL_FIRST_SHARE of its time) and a favoured
        # one spends it all, so favoured turns stay within that share of the loop's time.
        self._favour_left = min(CONTROL_FIRST_BURST, self._favour_left + turn * CONTROL_FIRST_SHARE)
        if self._favoured:
            self._favour_left -= turn
            self._control_first += turn

    def after_io_wait(self, timeout: float) -> None:
        self._began = self._clock()
        self._admitted = 0
        self._turns += 1
        self._favoured = (
            self._control_scheduled >= self._turns - 1
            and self._favour_left > 0
            and not self.control.pacing
        )
        if self._next_turn and not self._favoured:
            # Woken now, before trio takes this turn's batch: they run in this turn. In a
            # favoured turn no unit does: woken, they would only park again.
            self._next_turn.unpark_all()

    def has_room(self) -> bool:
        """Whether this turn's share has time left: a loop doing many small units in one
        go asks this between them, and waits (:meth:`wait`) once it says no."""
        return not self._favoured and self._clock() - self._began < self.share

    # --- the control face first -----------------------------------------------------------

    def put_first(self, task: trio.lowlevel.Task) -> None:
        """While ``task``, or any task it spawns later, is ready to run, the data plane
        waits: a probe's every step waits one turn, and the turns it waits then hold
        none of the data plane's units (within :data:`CONTROL_FIRST_SHARE`)."""
        self._control.add(task)

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        nursery = task.parent_nursery
        if nursery is not None and nursery.parent_task in self._control:
            self._control.add(task)

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._control.discard(task)

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        # A control task scheduled in this turn or the last runs in this one or the next;
        # the turns between are favoured. Not counted exactly: a hook on every task step,
        # to see it run, about doubled what following costs each step of every task.
        if task in self._control:
            self._control_scheduled = self._turns
            if self._favour_left > 0 and not self.control.pacing:
                self._favoured = True  # woken by I/O: it runs in this turn

    # A set lookup and, for the control face's tasks, a clock read each step: measured
    # within the noise of the data plane's throughput (docs/benchmarks.md).
    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task in self._control:
            self._stepping, self._step_began = task, self._step_clock()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self._stepping:  # not one made a control task during its step
            self._control_time += self._step_clock() - self._step_began
            self._stepping = None

    @property
    def control_time(self) -> float:
        """CPU seconds the control face's tasks have run."""
        return self._control_time

    async def wait(self) -> None:
        """Wait until this turn may run one more unit of data-plane work.

        Returns at once while the turn's share has time left, or when no unit has run in
        this turn yet and the turn does not favour the control face; otherwise in a
        later turn.

        Cancellation: a cancelled wait raises ``Cancelled`` and leaves nothing behind.
        It is not a checkpoint when it returns at once.
        """
        while (self._admitted or self._favoured) and not self.has_room():
            self._deferred += 1
            if self._pacing:
                await self._next_turn.park()
            else:
                # A parked task is not ready, so with nothing else ready the loop would
                # sleep until the next I/O or deadline, seconds maybe. One waiter stays
                # ready instead: the next turn comes at once, and wakes the rest.
                self._pacing = True
                try:
                    await trio.lowlevel.checkpoint()
                finally:
                    self._pacing = False
        self._admitted += 1

    def statistics(self) -> TurnStatistics:
        return TurnStatistics(
            turns=self._turns,
            deferred=self._deferred,
            busy=self._busy,
            control_first=self._control_first,
            control=self._control_time,
            control_waited=self.control.waited,
        )


class ControlShare:
    """Paces the control face's requests to :data:`CONTROL_SHARE` of the loop's time.

    A token bucket of loop seconds: it fills at that share a second, up to
    :data:`CONTROL_BURST`, and empties by what the control face's tasks ran (its budget
    times each of their steps: hypercorn's parsing and writing as much as a handler's
    work). While it is empty, requests wait (:meth:`admit`), one at a time, probes
    (``first``) ahead of the others; a probe is let through at once while the bucket is
    less than :data:`PROBE_OVERDRAFT` in debt, so under a scrape flood a kubelet's probe
    does not wait. A client looping on a keep-alive connection sends its next
    request only once answered, so pacing the answers paces all of its cost.
    """

    def __init__(self, budget: TurnBudget) -> None:
        self._budget = budget
        self._clock = budget._clock
        self._tokens = CONTROL_BURST
        self._filled_at = self._clock()
        self._spent = 0.0  # the budget's control time when last counted
        self._admitting = False  # a request is being admitted (maybe waiting for tokens)
        self._probes = trio.lowlevel.ParkingLot()
        self._others = trio.lowlevel.ParkingLot()
        self.pacing = False
        """Requests wait for their share (no turn favours the control face meanwhile)."""
        self.waited = 0.0
        """Seconds requests have waited for their share, in all."""

    @property
    def pressed(self) -> bool:
        """Requests wait, or the share is spent: a render may be reused (``/metrics``)."""
        return self._admitting or self._fill() < 0

    async def admit(self, *, first: bool = False) -> None:
        """Wait until the control face may run one more request.

        Cancellation: a cancelled wait takes nothing and lets the next one through.
        """
        if first and not self._probes and self._fill() > -PROBE_OVERDRAFT:
            return  # a probe goes ahead of the scrapes waiting (their debt grows a little)
        if self._admitting:
            self.pacing = True
            await (self._probes if first else self._others).park()  # handed the turn
        else:
            self._admitting = True
        try:
            while (deficit := -self._fill()) > 0:
                self.pacing = True
                started = self._clock()
                # At least a millisecond: a debt of a rounding error must not spin.
                await trio.sleep(max(deficit / CONTROL_SHARE, 0.001))
                self.waited += self._clock() - started
        finally:  # the turn passes on: a probe first
            if self._probes:
                self._probes.unpark()
            elif self._others:
                self._others.unpark()
            else:
                self._admitting = self.pacing = False

    def _fill(self) -> float:
        now, spent = self._clock(), self._budget.control_time
        refill = (now - self._filled_at) * CONTROL_SHARE
        tokens = min(CONTROL_BURST, self._tokens + refill) - (spent - self._spent)
        self._tokens = max(-MAX_DEBT, tokens)
        self._filled_at, self._spent = now, spent
        return self._tokens


_BUDGET: trio.lowlevel.RunVar[TurnBudget] = trio.lowlevel.RunVar("cmdbus_turn_budget")


def current() -> TurnBudget:
    """This run's budget, made and installed as an instrument on first use."""
    try:
        return _BUDGET.get()
    except LookupError:
        budget = TurnBudget(DATA_PLANE_SHARE)
        trio.lowlevel.add_instrument(budget)
        _BUDGET.set(budget)
        return budget
