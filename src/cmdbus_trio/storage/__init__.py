"""Synchronous storage engines. Never imports trio; every entry point refuses the loop thread."""

from ._common import (
    VACUUM_PAGES,
    CheckpointWatch,
    FailedCommits,
    Store,
    StoreState,
    StoreUnavailable,
    WalState,
)
from ._guard import LoopThreadError, on_loop_thread, refuses_loop_thread

__all__ = [
    "VACUUM_PAGES",
    "CheckpointWatch",
    "FailedCommits",
    "LoopThreadError",
    "Store",
    "StoreState",
    "StoreUnavailable",
    "WalState",
    "on_loop_thread",
    "refuses_loop_thread",
]
