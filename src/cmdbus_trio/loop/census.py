"""What the event loop does, counted: its turns by what ended each wait, each task's
steps, and the thread hops. For measuring what a record costs (``benchmarks/cpu.py``,
through the control face's ``POST /debug/loop-census``), not for serving: a census is a
trio instrument with a hook on every task step, so it is installed only while one is
asked for.

A turn begins when the loop stops waiting (``after_io_wait``). What ended the wait:

- ``ready``: the loop did not wait at all (a task was runnable: something yielded, or
  was woken by another task in the turn before);
- ``timer``: the wait lasted its whole timeout (a deadline or a sleep expired);
- ``woken``: something arrived first (a socket's bytes, or a thread's ``run_sync_soon``
  through trio's wakeup socket: those are the steps of ``<TrioToken.run_sync_soon task>``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio

from ..admission import thread_calls

__all__ = ["LoopCensus", "swap"]

_TIMER_SLACK = 0.0005
"""Seconds short of its timeout a wait may end and still count as the timer's: the
clock the loop's wait reads is not quite the one timed here."""


class LoopCensus(trio.abc.Instrument):
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._waited_from = 0.0
        self.started = clock()
        self.turns: Counter[str] = Counter()
        """Turns by what ended the wait before them (``ready``, ``timer``, ``woken``)."""
        self.steps: Counter[str] = Counter()
        """Steps run, by task name."""
        self.spawned = 0
        """Tasks started."""
        self._hops_before = thread_calls()

    def before_io_wait(self, timeout: float) -> None:
        self._waited_from = self._clock()

    def after_io_wait(self, timeout: float) -> None:
        if timeout <= 0:
            self.turns["ready"] += 1
        elif self._clock() - self._waited_from >= timeout - _TIMER_SLACK:
            self.turns["timer"] += 1
        else:
            self.turns["woken"] += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] += 1

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1

    def report(self) -> dict[str, Any]:
        """What was counted, as JSON: seconds, turns by cause, steps by task (most
        first), tasks spawned, thread hops (calls into a worker thread)."""
        return {
            "seconds": round(self._clock() - self.started, 6),
            "turns": dict(self.turns),
            "steps": dict(self.steps.most_common()),
            "spawned": self.spawned,
            "thread_hops": thread_calls() - self._hops_before,
        }


_CURRENT: trio.lowlevel.RunVar[LoopCensus | None] = trio.lowlevel.RunVar(
    "cmdbus_loop_census", default=None
)


def swap(*, again: bool) -> dict[str, Any] | None:
    """End this run's census, if one counts, and return its report; with ``again``,
    start a new one at once (so that consecutive calls count consecutive windows)."""
    ended = _CURRENT.get()
    if ended is not None:
        trio.lowlevel.remove_instrument(ended)
    census = LoopCensus() if again else None
    if census is not None:
        trio.lowlevel.add_instrument(census)
    _CURRENT.set(census)
    return None if ended is None else ended.report()
