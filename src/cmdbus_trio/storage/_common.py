from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final, Protocol

VACUUM_PAGES: Final = 2048
"""Free pages (8 MiB of 4 KiB pages) one retention step gives back to the file system at
most."""


class StoreState(enum.StrEnum):
    """``cmdbus_store_state``: ok; contended (a writer waited past the threshold
    recently); poisoned (a write failed with the disk state unknown: writes refused)."""

    OK = "ok"
    CONTENDED = "contended"
    POISONED = "poisoned"


class StoreUnavailable(Exception):
    """The store refuses writes: it is poisoned (or closed)."""


class Store(Protocol):
    """What the writer needs of every store to report on it, without blocking."""

    @property
    def state(self) -> StoreState: ...

    @property
    def poisoned_reason(self) -> str | None: ...

    @property
    def records(self) -> int:
        """Records held, from memory."""
        ...

    def disk_bytes(self) -> int:
        """Bytes of the store's files (blocking: call it in a worker thread)."""
        ...

    before_commit: Callable[[], None] | None
    """Test and drill hook: called inside each write transaction, before COMMIT."""
