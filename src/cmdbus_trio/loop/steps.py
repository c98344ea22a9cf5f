"""Work handed over by callbacks, done on the loop in short steps by one task.

A group commit settles hundreds of pipelined requests at once, and each settled request
queues a reply to write. Done in the callback that learns of the commit, that held the
loop for up to ~10-20 ms (measured under the pipelined flood of ``bus.py``), and every
other task, a probe among them, waited that long: a task runs once per pass of the loop,
and a control-face request takes ~18 passes. Rescheduling the callback with
``run_sync_soon`` bounded it, but each call writes to trio's wakeup socket, a tenth of
settling's time; a task yields for the price of a checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import trio

from ..logs import event
from . import turns

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["Steps"]


MAX_SETTLE_STEP = 0.0003
"""Seconds of settling a group commit does (listeners told, replies queued) before the
loop's other tasks run: the step of the buses' and the tier's committers."""


_FOLLOWERS: trio.lowlevel.RunVar[list[Steps[Any]] | None] = trio.lowlevel.RunVar(
    "cmdbus_steps_push_now", default=None
)
"""While a :meth:`Steps.push_now` runs: the ``Steps`` pushed to, done after it."""


class Steps(Generic[T]):
    """Items done in order by ``do``, in steps of at most ``max_step`` seconds (and at
    least one item): between steps, every other runnable task runs. A step also ends
    when the turn's data-plane share is spent, and the next waits for a turn with room
    (:mod:`cmdbus_trio.loop.turns`).

    :meth:`push` never blocks and may be called from plain callbacks on the loop
    (``run_sync_soon``) and from ``do`` itself, not from other threads.

    :meth:`push_now` does the first step in the caller's own step instead, when the turn
    has room: the callback that learns of a group commit settles it at once, rather than
    waking a task for a turn of its own (a turn is the loop's dearest unit at a steady
    rate: docs/benchmarks.md, "What a record costs"). What the step pushes to other
    ``Steps`` (the replies it queued) is done in the same step too, after it, so the
    replies one step settled still go out in one write per connection.

    Cancellation: the items are done by a system task, which only the end of the run
    cancels: a nursery that drains (the writer stopping) never leaves an item undone.
    Items pushed once that task has ended, or once the run is ending (no task can be
    started: a commit settled as the writer's run ends), are done at once.

    Error handling: ``do`` should not raise; an item that does is logged as
    ``step_failed`` with ``name``, and the next goes on.
    """

    def __init__(self, do: Callable[[T], None], *, max_step: float, name: str) -> None:
        self._do = do
        self.max_step = max_step
        self.name = name
        self._items: deque[T] = deque()
        self._idle: trio.lowlevel.ParkingLot | None = None  # None: no task yet
        self._ended = False

    def push(self, item: T) -> None:
        self._items.append(item)
        followers = None if self._ended else _FOLLOWERS.get()  # (ended: maybe no run)
        if followers is None:
            self._wake()
        elif self not in followers:
            followers.append(self)  # done by the push_now under way, or woken after it

    def push_now(self, items: Iterable[T]) -> None:
        """Queue ``items`` and, when nothing was queued before them (the task is idle)
        and the turn's data-plane share has room, do the first step now, in the
        caller's own step: at most ``max_step`` seconds of items, then whatever they
        pushed to other ``Steps`` meanwhile, each within its own ``max_step``. What is
        left is done by the task, as pushed items are. Items already waiting keep their
        one step a pass: this only spares an idle task a turn of its own. Call it from a
        callback or a task on the loop, never from ``do``.

        Error handling: as the task's, an item that raises is logged and the next goes
        on."""
        idle = not self._items
        self._items.extend(items)
        if self._ended:
            self._do_all()
            return
        budget = turns.current()
        if not (idle and self._items) or _FOLLOWERS.get() is not None or not budget.has_room():
            self._wake()
            return
        followers: list[Steps[Any]] = [self]
        token = _FOLLOWERS.set(followers)
        try:
            for steps in followers:  # grows while the items push to other Steps
                steps._do_until(time.perf_counter() + steps.max_step, budget)
        finally:
            _FOLLOWERS.reset(token)
        for steps in followers:
            if steps._items:
                steps._wake()

    def _wake(self) -> None:
        if self._ended:
            self._do_all()
        elif self._idle is None:
            self._idle = trio.lowlevel.ParkingLot()
            try:
                trio.lowlevel.spawn_system_task(self._run, name=f"steps:{self.name}")
            except RuntimeError:  # the run is ending: its system nursery takes no task
                self._ended = True
                self._do_all()
        else:
            self._idle.unpark()

    async def _run(self) -> None:
        assert self._idle is not None
        items = self._items
        budget = turns.current()
        try:
            while True:
                while not items:
                    await self._idle.park()
                await budget.wait()
                self._do_until(time.perf_counter() + self.max_step, budget)
                if items:  # else parking yields: a checkpoint would cost a turn of its own
                    await trio.lowlevel.checkpoint()
        finally:
            self._ended = True
            self._do_all()  # only the run's end stops the task: nothing is left undone

    def _do_until(self, until: float, budget: turns.TurnBudget) -> None:
        """At least one item (if any), then more while ``until`` is not reached and the
        turn has room."""
        items = self._items
        while items:
            self._do_one(items.popleft())
            # (>=: max_step 0 is an item a step)
            if time.perf_counter() >= until or not budget.has_room():
                break

    def _do_all(self) -> None:
        while self._items:
            self._do_one(self._items.popleft())

    def _do_one(self, item: T) -> None:
        try:
            self._do(item)
        except Exception as exc:
            event(log, logging.ERROR, "step_failed", steps=self.name, exc_info=exc)
