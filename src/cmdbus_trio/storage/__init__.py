"""Synchronous storage engines. Never imports trio; every entry point refuses the loop thread."""

from ._common import (
    VACUUM_PAGES,
    CheckpointWatch,
    Store,
    StoreState,
    StoreUnavailable,
    WalState,
    refused,
)
from ._guard import LoopThreadError, on_loop_thread, refuses_loop_thread

__all__ = [
    "VACUUM_PAGES",
    "CheckpointWatch",
    "LoopThreadError",
    "Store",
    "StoreState",
    "StoreUnavailable",
    "WalState",
    "on_loop_thread",
    "refused",
    "refuses_loop_thread",
]
