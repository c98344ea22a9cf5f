"""The loop-thread guard of the storage layer.

Storage work blocks: on the event-loop thread it would stall every face, the probes and
the metrics scrape (docs/architecture.md tells the incident). So every storage entry point
is wrapped in :func:`refuses_loop_thread`, which counts and refuses a call made on a loop
thread.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from cmdbus_trio.metrics import LOOP_BLOCKING_CALLS

P = ParamSpec("P")
R = TypeVar("R")


class LoopThreadError(RuntimeError):
    """A storage entry point was called on the event-loop thread."""


def on_loop_thread() -> bool:
    """True when a trio loop runs on this thread.

    The storage layer never imports trio: if trio is not loaded, no loop can be running;
    if it is, it knows (its run state is thread-local, so worker threads answer False).
    """
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()  # works on every trio we support, unlike in_trio_run
    except RuntimeError:
        return False
    return True


def refuses_loop_thread(func: Callable[P, R]) -> Callable[P, R]:
    """Decorate a storage entry point: on a loop thread it is counted in
    ``cmdbus_loop_blocking_calls_total{entry}`` and raises :class:`LoopThreadError`."""
    entry = func.__qualname__
    LOOP_BLOCKING_CALLS.labels(entry=entry)  # every entry point's series exists, at 0

    @functools.wraps(func)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        if on_loop_thread():
            LOOP_BLOCKING_CALLS.labels(entry=entry).inc()
            raise LoopThreadError(
                f"{entry} was called on the event-loop thread; run it through the offload "
                "helper (Slot.run_cancellable / run_to_completion)"
            )
        return func(*args, **kwargs)

    return guarded
