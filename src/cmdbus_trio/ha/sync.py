"""When the primary may acknowledge: ``CMDBUS_HA_SYNC``'s rules, over the standby's
confirmations and the lease.

The source and the keeper call :meth:`Synchronizer.poke` when something changes. A
commit asks :meth:`Synchronizer.when_durable` with the replication's sequence number
after it, and is told once it may be acknowledged (``None``) or that it may not (an
:class:`Unavailable`): a callback, not a task, as the group committers settle theirs.

- ``on``: while a standby is counted on, an acknowledgement waits for its confirmation.
  When it does not confirm within :data:`SYNC_TIMEOUT` (or its connection ends), the
  lease is first made to say that no standby is in sync, and only then is everything
  waiting acknowledged alone. A primary that cannot write that to the lease (deposed,
  or the store unreachable) acknowledges nothing.
- ``strict``: the same, but without a standby counted on nothing is acknowledged.
- ``off``: nothing waits.

A standby that has caught up (it confirmed all there is) is counted on first, so that
acknowledgements wait for it, and then recorded in sync in the lease: never the other
way round, or a standby the lease names in sync could lack an acknowledged record.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from cmdbus_trio.logs import event
from cmdbus_trio.storage import StoreUnavailable

from .elector import SyncMode

log = logging.getLogger(__name__)

SYNC_TIMEOUT = 1.0
"""Seconds an acknowledgement waits for the standby before the primary goes on alone."""
CATCH_UP_WITHIN = 16
"""Transactions a standby may be behind when acknowledgements start to wait for it: the
ones on their way (it is recorded in sync once it has confirmed them)."""

Done = Callable[[Exception | None], None]


class Unavailable(StoreUnavailable):
    """The primary may not acknowledge this commit; ``str()`` says why (the faces
    answer ``unavailable``). It may have been stored: a client sends it again (with the
    same msg_id) to whichever member serves next, so it says when to ask again."""

    retry_after_ms = 500


class Committer(Protocol):
    async def wait_quiet(self) -> None: ...


class _Source(Protocol):
    sequence: int
    confirmed: int
    standby: str | None
    epoch: int


class _Keeper(Protocol):
    def is_primary(self) -> bool: ...

    @property
    def epoch(self) -> int: ...

    async def record_sync(self, standby: str | None) -> bool: ...


class Synchronizer:
    def __init__(
        self, mode: SyncMode, source: _Source, keeper: _Keeper, *, timeout: float = SYNC_TIMEOUT
    ) -> None:
        self.mode = mode
        self.source = source
        self.keeper = keeper
        self.timeout = timeout
        self.counting_on: str | None = None
        """The standby acknowledgements wait for (once it has confirmed what was
        acknowledged without it, the lease names it in sync)."""
        self._alone_through: int | None = None  # counting on it: not yet recorded
        self._given_up_at = -1  # what it had confirmed when last given up on
        self._waiting: list[tuple[int, int, float, Done]] = []  # heap: sequence, order, since
        self._order = itertools.count()
        self._changed = trio.Event()
        self._emptied = trio.Event()  # set each time the last waiting commit is settled

    @property
    def in_sync(self) -> bool:
        return self.counting_on is not None and self._alone_through is None

    def sequence(self) -> int:
        """The newest commit numbered (read in a committer's thread after its commit)."""
        return self.source.sequence

    def when_durable(self, sequence: int, done: Done) -> None:
        """``done(None)`` once the commits through ``sequence`` may be acknowledged,
        ``done(Unavailable(...))`` if they may not; maybe before this returns."""
        if self.mode is SyncMode.OFF:
            done(None)
        elif not self._primary():
            done(Unavailable("this member is not primary"))
        elif self.counting_on is None:
            done(None if self.mode is SyncMode.ON else Unavailable("no standby is in sync"))
        elif sequence <= self.source.confirmed:
            done(None)
        else:
            since = trio.current_time()
            heapq.heappush(self._waiting, (sequence, next(self._order), since, done))
            self._wake()

    async def settled(self, committers: Sequence[Committer] = ()) -> None:
        """Until no commit waits: each confirmed, or settled as the mode says once the
        standby is given up on (within :attr:`timeout`). A stopping primary's last
        commits (its drain's lease releases), before its committers and this stop; the
        ``committers`` are waited for first (:meth:`Committer.wait_quiet`), as a commit
        still in a committer's thread does not wait here yet."""
        with trio.move_on_after(self.timeout * 2):
            for committer in committers:
                await committer.wait_quiet()
            while self._waiting:
                await self._emptied.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Settle the waiting commits as the standby confirms, go on without it when it
        stops, count on it again when it has caught up. Runs until cancelled; waiting
        commits are then told they may not be acknowledged."""
        task_status.started()
        try:
            while True:
                await self._step()
        finally:
            self._fail_all(Unavailable("the writer stops"))

    async def _step(self) -> None:
        self._settle_confirmed()
        if not self._primary():
            self.counting_on = self._alone_through = None
            self._fail_all(Unavailable("this member is not primary"))
        elif self.counting_on is not None and self.source.standby != self.counting_on:
            await self._go_on_alone("the standby's connection ended")
        elif trio.current_time() >= self._next_deadline():
            # (the very sum the wait below sleeps until: `now - since >= timeout` can be
            # false at that instant by a rounding, and this loop would spin)
            await self._go_on_alone(f"the standby confirmed nothing for {self.timeout} s")
        elif self._caught_up():
            # First: acknowledgements wait for it from now on. Then, once it has confirmed
            # all that may have been acknowledged alone, the lease may say so. (Waiting for
            # an instant when it has confirmed every commit made would, under a steady
            # load, wait for ever: a commit is always on its way.)
            self.counting_on, self._alone_through = self.source.standby, self.source.sequence
        if self._alone_through is not None and self.source.confirmed >= self._alone_through:
            standby = self.counting_on
            if await self.keeper.record_sync(standby):
                self._alone_through = None
                event(log, logging.WARNING, "standby_in_sync", standby=standby)
        changed = self._changed
        with trio.move_on_at(self._next_deadline()):
            await changed.wait()

    def poke(self) -> None:
        """Something changed (a confirmation, the standby's connection, the role): the
        source and the keeper call this. Confirmed commits are settled at once."""
        self._settle_confirmed()
        self._wake()

    def _primary(self) -> bool:
        """Primary in the epoch its source streams: a member that lost its lease and
        took it again is primary in another, with another source and synchronizer."""
        return self.keeper.is_primary() and self.keeper.epoch == self.source.epoch

    def _caught_up(self) -> bool:
        source = self.source
        return (
            self.mode is not SyncMode.OFF
            and self.counting_on is None
            and source.standby is not None
            and source.confirmed >= 0  # (it confirmed on this connection: copies are done)
            and source.confirmed > self._given_up_at  # (not one that stopped, again)
            and source.sequence - source.confirmed <= CATCH_UP_WITHIN
        )

    async def _go_on_alone(self, why: str) -> None:
        """The standby stopped: the lease says so first, then what waits is settled."""
        standby, through = self.counting_on, self._alone_through
        self.counting_on = self._alone_through = None
        self._given_up_at = self.source.confirmed
        if not await self.keeper.record_sync(None):
            self.counting_on, self._alone_through = standby, through  # (the lease may name it)
            self._fail_all(Unavailable("cannot record in the lease that no standby is in sync"))
            return
        event(log, logging.WARNING, "standby_out_of_sync", standby=standby, why=why)
        if self.mode is SyncMode.ON:
            self._settle_all(None)
        else:
            self._fail_all(Unavailable("no standby is in sync"))

    def _settle_confirmed(self) -> None:
        confirmed = self.source.confirmed
        while self._waiting and self._waiting[0][0] <= confirmed:
            heapq.heappop(self._waiting)[3](None)
        if not self._waiting:
            self._now_empty()

    def _settle_all(self, outcome: Exception | None) -> None:
        waiting, self._waiting = self._waiting, []
        for _, _, _, done in sorted(waiting):
            done(outcome)
        self._now_empty()

    def _now_empty(self) -> None:
        if self._emptied.statistics().tasks_waiting:  # (at a drain only: no event a commit)
            self._emptied.set()
            self._emptied = trio.Event()

    def _fail_all(self, error: Exception) -> None:
        self._settle_all(error)

    def _oldest_since(self) -> float:
        return min(since for _, _, since, _ in self._waiting)

    def _next_deadline(self) -> float:
        return self._oldest_since() + self.timeout if self._waiting else float("inf")

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
