"""Synchronous storage engines. Never imports trio; every entry point refuses the loop thread."""

from ._common import VACUUM_PAGES, Store, StoreState, StoreUnavailable
from ._guard import LoopThreadError, on_loop_thread, refuses_loop_thread

__all__ = [
    "VACUUM_PAGES",
    "LoopThreadError",
    "Store",
    "StoreState",
    "StoreUnavailable",
    "on_loop_thread",
    "refuses_loop_thread",
]
