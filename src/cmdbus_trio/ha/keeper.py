"""The lease keeper: an :class:`~.elector.Elector` run against a lease store.

Every third of the lease's duration the keeper reads the lease (a standby) or renews it
(the primary, on the version it wrote last, without reading first: a conflict means
another member wrote, and the next turn reads). Each turn's outcome goes to the elector;
:meth:`LeaseKeeper.wait_changed` wakes whoever follows the role (the writer's role
machine) when this member becomes primary or stops being it, including when its own
deadline passes with no renewal: the keeper wakes for that instant, not a turn later.

Writes are one at a time (a lock), so a sync change asked by the replication
(:meth:`LeaseKeeper.record_sync`) and a renewal never race each other.

Cancellation: cancelling :meth:`LeaseKeeper.run` stops renewing and writes nothing; the
lease then expires as if the member had died. :meth:`LeaseKeeper.hand_over` is the
graceful way out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from cmdbus_trio.logs import event

from .elector import Elector, Intent
from .lease import LeaseConflict, LeaseError, LeaseStore, Versioned

log = logging.getLogger(__name__)
Offload = Callable[[Callable[[], Any]], Awaitable[Any]]
"""How the keeper runs a blocking store call: in a worker thread (the offload helper)."""


class LeaseKeeper:
    def __init__(self, elector: Elector, store: LeaseStore, offload: Offload) -> None:
        self.elector = elector
        self.store = store
        self._offload = offload
        self._lock = trio.Lock()
        self._changed = trio.Event()
        self._was_primary = False
        self.listeners: list[Callable[[], None]] = []
        """Called whenever :meth:`wait_changed` would wake (the synchronizer)."""
        self.last_error: str | None = None
        """Why the last read or write of the lease failed (None: it succeeded)."""

    @property
    def epoch(self) -> int:
        """The lease's epoch as last seen."""
        return self.elector.epoch

    def is_primary(self) -> bool:
        """This member holds the lease now, by its own deadline."""
        return self.elector.holds(trio.current_time())

    async def wait_changed(self) -> None:
        """Until this member becomes primary or stops being it (or the lease it sees
        changes holder or sync), from the moment of the call."""
        await self._changed.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the lease: a first turn, then started, then a turn every renew period,
        waking too at this member's own deadline. Runs until cancelled."""
        await self._turn()
        task_status.started()
        while True:
            now = trio.current_time()
            wake = now + self.elector.renew_every
            if self.is_primary():
                wake = min(wake, self.elector.held_until)
            await trio.sleep_until(wake)
            self._announce()  # a deadline passed, maybe
            await self._turn()

    async def turn_now(self) -> None:
        """A turn at once (a standby whose primary's stream ended: it may have handed
        the lease over), not at the next renew period."""
        await self._turn()

    async def record_sync(self, standby: str | None) -> bool:
        """Record in the lease that ``standby`` is in sync (None: that none is), now.
        True once written while this member holds the lease; False when it does not
        hold it or the write failed: then it must not act as if it had written."""
        async with self._lock:
            intent = self.elector.change_sync(trio.current_time(), time.time(), standby)
            return intent is not None and await self._write(intent)

    async def hand_over(self) -> bool:
        """Release the lease (a switchover, a stop): the standby in sync, or this member
        when none is, may take it at once. True once the lease, as last written or
        read, no longer names this member (a turn may have written the release)."""
        self.elector.release()
        async with self._lock:
            intent = self.elector.intent(trio.current_time(), time.time())
            if intent is not None:
                await self._write(intent)
            seen = self.elector.seen
            return seen is not None and seen.record.holder != self.elector.name

    async def _turn(self) -> None:
        async with self._lock:
            if not self.is_primary():  # a holder renews on what it wrote, unread
                try:
                    current: Versioned | None = await self._offload(self.store.read)
                except LeaseError as exc:
                    self._failed("lease_read_failed", exc)
                    return
                self.elector.observe(current, trio.current_time())
            intent = self.elector.intent(trio.current_time(), time.time())
            if intent is not None:
                await self._write(intent)
        self._announce()

    async def _write(self, intent: Intent) -> bool:
        started = trio.current_time()
        try:
            version: str = await self._offload(
                lambda: self.store.write(intent.record, intent.version)
            )
        except LeaseConflict as exc:
            self.elector.conflicted()
            self._failed("lease_conflict", exc)
            return False
        except LeaseError as exc:
            self._failed("lease_write_failed", exc)
            return False
        self.last_error = None
        took = trio.current_time() - started
        if took > self.elector.margin / 2:  # (the margin: what a primary keeps in hand)
            event(log, logging.WARNING, "lease_write_slow", store=self.store.describe(),
                  seconds=round(took, 3), margin_s=self.elector.margin)  # fmt: skip
        self.elector.wrote(intent, version, started, trio.current_time())
        if intent.acquiring:
            event(log, logging.WARNING, "lease_acquired", store=self.store.describe(),
                  epoch=intent.record.epoch)  # fmt: skip
        self._announce()
        return True

    def _failed(self, name: str, exc: LeaseError) -> None:
        self.last_error = str(exc)
        event(log, logging.WARNING, name, store=self.store.describe(), error=str(exc))
        self._announce()

    def _announce(self) -> None:
        primary = self.is_primary()
        if primary != self._was_primary:
            self._was_primary = primary
            if not primary:
                event(log, logging.WARNING, "lease_lost", store=self.store.describe(),
                      epoch=self.elector.epoch)  # fmt: skip
        self._changed.set()
        self._changed = trio.Event()
        for listener in self.listeners:
            listener()
