from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Final, Protocol

import attrs

from cmdbus_trio.logs import OncePerBurst, event

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

    retry_after_ms: int | None = None
    """When to ask again, where that is known (a member of a pair that stopped being
    primary: the other one serves soon); None: not by waiting (a poisoned store)."""


class FailedCommits:
    """How a store's committer logs a batch that failed. A refusal that lasts a while
    (``retry_after_ms``: asking again, later or of the other member, gets it in: a member
    not primary, no standby in sync) is a ``commit_refused`` warning once per burst: its
    cause is logged once where it is found, and it comes a batch at a time. A store that
    failed is a ``commit_failed`` error with its traceback, every batch."""

    def __init__(self, store: str, logger: logging.Logger, *, refusals: OncePerBurst | None = None):
        self.store = store
        self._log = logger
        self._refusals = refusals or OncePerBurst()

    def log(self, error: Exception) -> None:
        if isinstance(error, StoreUnavailable) and error.retry_after_ms is not None:
            why = str(error)
            self._refusals.event(
                self._log, logging.WARNING, "commit_refused", store=self.store, why=why
            )
        else:
            event(self._log, logging.ERROR, "commit_failed", store=self.store, exc_info=error)


@attrs.frozen
class WalState:
    bytes: int
    """The WAL file's size (0: none)."""
    checkpoints: int | None
    """Its header's checkpoint sequence number, which moves each time a checkpoint
    copied the whole WAL back and the WAL starts again (None: no header yet)."""


class CheckpointWatch:
    """When each store's WAL was last checkpointed in full, from its :class:`WalState`
    seen now and then: its checkpoint number moved, or the WAL shrank (truncated). Until
    the first is seen, since the watch began (the writer's start)."""

    def __init__(self, now: float) -> None:
        self._began = now
        self._last: dict[str, tuple[WalState, float]] = {}  # store -> seen, checkpointed at

    def seen(self, store: str, state: WalState, now: float) -> float:
        """Note ``store``'s ``state``; the seconds since its last full checkpoint."""
        last, checkpointed_at = self._last.get(store, (state, self._began))
        if state.checkpoints != last.checkpoints or state.bytes < last.bytes:
            checkpointed_at = now
        self._last[store] = (state, checkpointed_at)
        return now - checkpointed_at


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

    def wal(self) -> WalState:
        """The WAL's size and checkpoint count (blocking: in a worker thread)."""
        ...

    def checkpoint_past(self, ceiling: int, age: float = 0.0) -> bool:
        """Checkpoint the WAL if it is over ``ceiling`` bytes, and log why (blocking)."""
        ...

    before_commit: Callable[[], None] | None
    """Test and drill hook: called inside each write transaction, before COMMIT."""
