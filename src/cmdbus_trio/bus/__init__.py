"""Trio-side coordinators of the buses: the group committer, the body reader, claims,
consumer groups and subscriptions; and :class:`Bus`, which opens, runs and closes them
together."""

from __future__ import annotations

from functools import partial

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.config import Config
from cmdbus_trio.loop import Task
from cmdbus_trio.protocol.bus import BusKind, SubjectRule
from cmdbus_trio.storage.buslog import BusLog

from .bodies import BodyReader
from .committer import GroupCommitter
from .groups import ConsumerGroups
from .subscriptions import Hub


@attrs.frozen
class Bus:
    """One bus as the faces see it: its log, the committer that appends to it, the reader
    of delivered bodies, and its consumer groups (the command bus's one fixed group, the
    event bus's named ones); the event bus also has live subscriptions (``hub``).

    Lifecycle: :meth:`open` (the log and its consumers loaded), :meth:`tasks` (what runs
    in the background while it serves), :meth:`stop_consumers` (the drain: waiting
    consumers are answered), :meth:`close` (the log, once no face uses it)."""

    log: BusLog
    committer: GroupCommitter
    bodies: BodyReader
    groups: ConsumerGroups
    hub: Hub | None = None
    """The event bus's live subscriptions (the command bus has no subscribe face)."""

    @classmethod
    async def open(
        cls,
        kind: BusKind,
        config: Config,
        *,
        limiter: trio.CapacityLimiter,
        pool_size: int = 4,
    ) -> Bus:
        """Open ``<data dir>/<kind>.sqlite3`` with ``pool_size`` SQLite connections and
        load its consumer groups (the command bus's one group from its position, the event
        bus's named groups).

        Error handling: the store's errors (the file cannot be opened, or is corrupt)."""
        name = kind.value
        log = await run_in_thread(
            partial(
                BusLog.open,
                config.data_dir / f"{name}.sqlite3",
                name=name,
                synchronous=config.sync,
                checkpoints=config.checkpoints,
                dedup_window=config.dedup_window_ms / 1000,
                pool_size=pool_size,
            ),
            limiter=limiter,
        )
        committer = GroupCommitter(log, SubjectRule(kind, config.shard, config.shard_count))
        bodies = BodyReader(log)
        committer.listeners.append(bodies.remember)  # first: before any group is handed one
        kinds = ("records", "dead_letters", *(("evicted",) if kind is BusKind.EVENTS else ()))
        for retained in kinds:  # 0 from the start
            metrics.RETAINED.labels(store=name, kind=retained)
        events = kind is BusKind.EVENTS
        groups = ConsumerGroups(
            log,
            committer,
            ack_wait=config.ack_wait_ms / 1000,
            max_deliver=config.max_deliver,
            limiter=limiter,
            max_groups=config.evt_max_groups,
            stuck_after=config.stuck_after_ms / 1000,
            fixed=None if events else name,
            shard=config.shard,
        )
        await groups.open(config.evt_groups if events else ())
        hub = None
        if events:
            hub = Hub(config.subscriber_buffer, config.subscriber_buffer_bytes)
            committer.listeners.append(hub.feed)
        return cls(log, committer, bodies, groups, hub)

    def tasks(self) -> dict[str, Task]:
        """The background tasks the bus needs while it serves, by name (the writer starts
        each supervised)."""
        return {
            "committer": self.committer.run,
            "bodies": self.bodies.run,
            "groups": self.groups.run,
        }

    def stop_consumers(self) -> None:
        """The drain: consumers waiting in ``next`` are answered now, subscriptions end
        (their connections close); nothing more is leased."""
        self.groups.close()
        if self.hub is not None:
            self.hub.close()

    async def close(self, *, limiter: trio.CapacityLimiter) -> None:
        """Close the log (once every face using it has returned: no thread uses it).

        Cancellation: shielded; the store is closed whatever is cancelled."""
        with trio.CancelScope(shield=True):
            await run_in_thread(self.log.close, limiter=limiter)
