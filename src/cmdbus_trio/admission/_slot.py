"""A Gate slot: held on behalf of one request, its blocking work run through it."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, TypeVar, TypeVarTuple

import trio

from ._threads import run_in_thread

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class Holder(Protocol):
    """What a slot needs of the Gate it was taken from (the Gate is one)."""

    face: str
    _thread_limiter: trio.CapacityLimiter

    def _release(self, slot: Slot) -> None: ...


class DeadlineExceeded(Exception):
    """The request's budget ran out while its read work was running; the work stopped."""


class Slot:
    """A Gate slot held on behalf of one request, until :meth:`release`.

    Use it as a context manager (``with await gate.acquire(op) as slot:``); do blocking
    work through :meth:`run_cancellable` or :meth:`run_to_completion`.
    """

    def __init__(self, gate: Holder, op: str, arrival: float, deadline: float) -> None:
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
        and the slot stays held until it has (docs/architecture.md, "Decisions": writes finish)."""
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
