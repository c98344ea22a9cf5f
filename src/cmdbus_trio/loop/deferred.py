"""A result that a callback on the loop settles, for work that needs no task of its own.

The group committers and the Gate's callback waits settle work this way: under pipelined
load a task and a wake-up per request were most of the loop's time. An op that completes
by a callback returns a :class:`Deferred`; its face maps the result to a reply
(:meth:`Deferred.map`); a dialect that answers from a task awaits :meth:`outcome`. The
op has that one way to complete, whoever waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import trio

T = TypeVar("T")
U = TypeVar("U")


class Deferred(Generic[T]):
    """A value, or the exception to answer with, settled once by a callback on the loop."""

    __slots__ = ("_callback", "_outcome", "_settled")

    def __init__(self) -> None:
        self._callback: Callable[[T | Exception], None] | None = None
        self._outcome: T | Exception | None = None
        self._settled = False

    @classmethod
    def of(cls, outcome: T | Exception) -> Deferred[T]:
        """Settled already (an op that had nothing to wait for)."""
        settled = cls()
        settled.settle(outcome)
        return settled

    def settle(self, outcome: T | Exception) -> None:
        """The result, or the exception to answer with (as a handler would raise).

        Error handling: :class:`RuntimeError` when settled twice (a bug of the settler)."""
        if self._settled:
            raise RuntimeError("a deferred result is settled once")
        self._settled = True
        self._outcome = outcome
        if self._callback is not None:
            self._callback(outcome)

    def when_settled(self, callback: Callable[[T | Exception], None]) -> None:
        """Call ``callback`` with the outcome, now if it is settled already. There is one
        callback: a second replaces the first."""
        self._callback = callback
        if self._settled:
            callback(self._outcome)  # type: ignore[arg-type]  # set when settled

    def map(self, convert: Callable[[T], U]) -> Deferred[U]:
        """The outcome converted (an exception passes as it is; one raised by ``convert``
        becomes the outcome)."""
        mapped: Deferred[U] = Deferred()

        def settled(outcome: T | Exception) -> None:
            if isinstance(outcome, Exception):
                mapped.settle(outcome)
                return
            try:
                converted = convert(outcome)
            except Exception as exc:
                mapped.settle(exc)
            else:
                mapped.settle(converted)

        self.when_settled(settled)
        return mapped

    def observed(self, observe: Callable[[T | Exception], None]) -> Deferred[T]:
        """The same outcome, once ``observe`` has seen it (a span's end). ``observe`` must
        not raise."""
        seen: Deferred[T] = Deferred()

        def settled(outcome: T | Exception) -> None:
            observe(outcome)
            seen.settle(outcome)

        self.when_settled(settled)
        return seen

    async def outcome(self) -> T:
        """Wait in a task for the outcome: the value, or the exception raised. Takes the
        one callback :meth:`when_settled` holds.

        Cancellation: safe; the work goes on and is settled all the same, for nobody."""
        if not self._settled:
            settled = trio.Event()
            self.when_settled(lambda _: settled.set())
            await settled.wait()
        if isinstance(self._outcome, Exception):
            raise self._outcome
        return self._outcome  # type: ignore[return-value]  # settled with a T
