"""The loop-thread guard of the storage layer.

Storage work blocks: on the event-loop thread it would stall every face, the probes and
the metrics scrape (the incident of DESIGN.md). So every storage entry point is wrapped in
:func:`refuses_loop_thread`, which counts and refuses a call made on a loop thread.

The storage layer cannot ask trio which thread runs the loop (it never imports trio), so
the async side registers a detector (see ``cmdbus_trio.admission``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from cmdbus_trio.metrics import LOOP_BLOCKING_CALLS

P = ParamSpec("P")
R = TypeVar("R")

_detectors: list[Callable[[], bool]] = []


class LoopThreadError(RuntimeError):
    """A storage entry point was called on the event-loop thread."""


def register_loop_detector(detector: Callable[[], bool]) -> None:
    """Add a function that answers True on an event-loop thread. Idempotent."""
    if detector not in _detectors:
        _detectors.append(detector)


def on_loop_thread() -> bool:
    return any(detector() for detector in _detectors)


def refuses_loop_thread(func: Callable[P, R]) -> Callable[P, R]:
    """Decorate a storage entry point: on a loop thread it is counted in
    ``cmdbus_loop_blocking_calls_total{entry}`` and raises :class:`LoopThreadError`."""
    entry = func.__qualname__

    @functools.wraps(func)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        if on_loop_thread():
            LOOP_BLOCKING_CALLS.labels(entry=entry).inc()
            raise LoopThreadError(
                f"{entry} was called on the event-loop thread; run it through the offload "
                "helper (Lease.run_cancellable / run_to_completion)"
            )
        return func(*args, **kwargs)

    return guarded
