"""Admission control: the Gate, its slots, and the one offload helper.

A request arrives (its clock starts), asks its face's :class:`Gate` for a :class:`Slot`,
does its work through the slot (in a worker thread when it blocks), and releases the
slot when that work has truly returned. The Gate sheds what it cannot serve in time,
with a reason, instead of letting a queue grow without bound.

Only :func:`run_in_thread` enters a worker thread (``batcher.ThreadBatcher`` is built on
it); it never abandons one (so a slot can never be released, nor a store closed,
under a running thread).
"""

from __future__ import annotations

from ._bursts import ShedBursts, ShedReason
from ._bytes import ByteBudget
from ._gate import Gate, GateClosed, GateStatistics, Shed
from ._slot import DeadlineExceeded, Slot
from ._threads import checked_pages, each_checked, run_in_thread, thread_calls

__all__ = [
    "ByteBudget",
    "DeadlineExceeded",
    "Gate",
    "GateClosed",
    "GateStatistics",
    "Shed",
    "ShedBursts",
    "ShedReason",
    "Slot",
    "checked_pages",
    "each_checked",
    "run_in_thread",
    "thread_calls",
]
