"""The data plane's share of each turn of the event loop.

The control face shares the loop with the data plane. trio runs, in each turn, every
task that was ready when the turn began; a probe's tasks are among them, so a probe
waits about as many turns as its request takes steps, and each of those turns lasts as
long as the work the data plane found ready. Under a pipelined flood that was 2-7 ms a
turn and a `/healthz` p99 of 58-109 ms (docs/benchmarks.md, "A share of each turn").

So the data plane's loops (each connection's reader and dispatcher, the settling steps)
ask a :class:`TurnBudget` before each unit of work. Once this turn's data-plane work has
run for ``share`` seconds, they wait for the next turn; every other task, the control
face's included, still runs in this one. The first unit of each turn is always let
through, so the data plane is never starved, however long the rest of the turn was.
"""

from __future__ import annotations

import time

import attrs
import trio

DATA_PLANE_SHARE = 0.001
"""Seconds of data-plane work per turn of the loop. 1 ms about halved the `/healthz` p99
under a pipelined flood for ~5% of its throughput; 2 ms kept less of the gain, 0.5 ms
and less cost more throughput for little more (docs/benchmarks.md)."""


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


class TurnBudget(trio.abc.Instrument):
    """Lets ``share`` seconds of data-plane work run in each turn of the loop.

    It is a trio instrument: trio calls :meth:`after_io_wait` as each turn begins, and
    :meth:`before_io_wait` as it ends, which also gives the time the loop was busy. Get
    the run's own with :func:`current`.
    """

    def __init__(self, share: float) -> None:
        self.share = share
        self._began = time.perf_counter()
        self._admitted = 0  # units let through in this turn
        self._next_turn = trio.lowlevel.ParkingLot()
        self._pacing = False  # a waiter keeps the loop from sleeping
        self._turns = 0
        self._deferred = 0
        self._busy = 0.0

    def before_io_wait(self, timeout: float) -> None:
        self._busy += time.perf_counter() - self._began

    def after_io_wait(self, timeout: float) -> None:
        self._began = time.perf_counter()
        self._admitted = 0
        self._turns += 1
        if self._next_turn:
            # Woken now, before trio takes this turn's batch: they run in this turn.
            self._next_turn.unpark_all()

    def has_room(self) -> bool:
        """Whether this turn's share has time left: a loop doing many small units in one
        go asks this between them, and waits (:meth:`wait`) once it says no."""
        return time.perf_counter() - self._began < self.share

    async def wait(self) -> None:
        """Wait until this turn may run one more unit of data-plane work.

        Returns at once while the turn's share has time left, or when no unit has run in
        this turn yet; otherwise in a later turn.

        Cancellation: a cancelled wait raises ``Cancelled`` and leaves nothing behind.
        It is not a checkpoint when it returns at once.
        """
        while self._admitted and not self.has_room():
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
        return TurnStatistics(turns=self._turns, deferred=self._deferred, busy=self._busy)


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
