"""The one way into a worker thread."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar, TypeVarTuple

import trio

T = TypeVar("T")
P = TypeVar("P")
Ts = TypeVarTuple("Ts")


_calls = 0


def thread_calls() -> int:
    """Calls of :func:`run_in_thread` so far, in this process: thread hops (the loop
    census reports them, :mod:`cmdbus_trio.loop.census`)."""
    return _calls


async def run_in_thread(
    fn: Callable[[*Ts], T], *args: *Ts, limiter: trio.CapacityLimiter, name: str | None = None
) -> T:
    """Run ``fn(*args)`` in a worker thread and return its result.

    This is the only way into a thread. ``limiter`` must be a dedicated limiter, never
    trio's global default, so that data-plane work cannot starve other thread users.
    ``name`` names the thread while it runs ``fn`` (the OS sees its first 15 characters:
    ``benchmarks/cpu.py`` tells the commit thread's CPU by it).

    Cancellation: the thread is never abandoned. When the caller is cancelled this waits
    until ``fn`` returns; ``fn`` sees the cancellation when it calls
    ``trio.from_thread.check_cancelled()`` (long work does so between pages).
    """
    global _calls
    _calls += 1
    return await trio.to_thread.run_sync(
        fn, *args, limiter=limiter, abandon_on_cancel=False, thread_name=name
    )


def checked_pages(pages: Iterable[P]) -> Iterator[P]:
    """``pages``, read in a worker thread, with a cancellation check before each: an
    expired budget or a vanished client stops the thread within one page."""
    for page in pages:
        trio.from_thread.check_cancelled()
        yield page


def each_checked(pages: Iterable[Iterable[T]]) -> Iterator[T]:
    """The items of :func:`checked_pages`."""
    for page in checked_pages(pages):
        yield from page
