"""Background work in short steps, paced: a task that deletes, vacuums or evicts rests
between its steps, so it never holds a store for long (retention, eviction)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def in_steps(
    step: Callable[[], Awaitable[bool]],
    interval: float,
    *,
    over: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> None:
    """Run ``step`` for ever: while it says there is more, again after resting as long as
    it took (so it holds the store's write lock at most half the time); else after
    ``interval``. A step that raises ``over`` (its store poisoned or closed) is over until
    the next pass."""
    while True:
        started = trio.current_time()
        try:
            more = await step()
        except over:
            more = False
        await trio.sleep(trio.current_time() - started if more else interval)
