"""What a writer sets in the interpreter while it serves, and gives back when it stops:
the GIL switch interval and the cycle collector's thresholds. Process-wide, so the writer
enters them once, around its run (:meth:`cmdbus_trio.app.Writer.run`)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """Lower the GIL switch interval while serving (docs/architecture.md, "The GIL rule")."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


YOUNG_COLLECTION_THRESHOLD = 10_000
"""Allocations (net, of objects the collector tracks) between two collections of the
youngest generation; Python's default is 700."""


@contextmanager
def collector_tuned() -> Iterator[None]:
    """Collect garbage cycles less often while serving (docs/architecture.md, "The
    collector"). A request makes short-lived objects that reference counting frees:
    with the default threshold a flood of them started a young collection every few
    hundred requests, promoted the requests in flight to older generations, and so
    brought full collections (25-45 ms, each a loop pass that long) about twice a
    second. The objects of startup are frozen out of full collections by
    :meth:`cmdbus_trio.app.Writer._started`. The previous thresholds are restored, and the frozen
    objects given back to the collector, when serving ends."""
    previous = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *previous[1:])
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()
