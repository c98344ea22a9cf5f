"""Trio-side coordinators of the buses: the group committer, the body reader, claims,
consumer groups and subscriptions; and :class:`Bus`, which opens, runs and closes them
together."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.config import Config
from cmdbus_trio.protocol.bus import BusKind, SubjectRule
from cmdbus_trio.storage.buslog import BusLog

from .bodies import BodyReader
from .claims import Claims
from .committer import GroupCommitter
from .durable import open_claims, sample_lag
from .groups import ConsumerGroups
from .subscriptions import Hub

Task = Callable[..., Coroutine[Any, Any, None]]
"""A background task: ``run(*, task_status)``, started in a supervised nursery."""


@attrs.frozen
class Bus:
    """One bus as the faces see it: its log, the committer that appends to it, the reader
    of delivered bodies, and the claim coordinator of its consumers.

    Lifecycle: :meth:`open` (the log and its consumers loaded), :meth:`tasks` (what runs
    in the background while it serves), :meth:`stop_consumers` (the drain: waiting
    consumers are answered), :meth:`close` (the log, once no face uses it)."""

    log: BusLog
    committer: GroupCommitter
    bodies: BodyReader
    claims: Claims | None = None
    """The command bus's single consumer group."""
    groups: ConsumerGroups | None = None
    """The event bus's named consumer groups."""
    hub: Hub | None = None
    """The event bus's live subscriptions."""

    @classmethod
    async def open(cls, kind: BusKind, config: Config, *, limiter: trio.CapacityLimiter) -> Bus:
        """Open ``<data dir>/<kind>.sqlite3`` and load its consumers (the command bus's
        one group from its position, the event bus's named groups).

        Error handling: the store's errors (the file cannot be opened, or is corrupt)."""
        name = kind.value
        log = await run_in_thread(
            partial(
                BusLog.open,
                config.data_dir / f"{name}.sqlite3",
                name=name,
                synchronous=config.sync,
                dedup_window=config.dedup_window_ms / 1000,
            ),
            limiter=limiter,
        )
        committer = GroupCommitter(log, SubjectRule(kind, config.shard, config.shard_count))
        bodies = BodyReader(log)
        kinds = ("records", "dead_letters", *(("evicted",) if kind is BusKind.EVENTS else ()))
        for retained in kinds:  # 0 from the start
            metrics.RETAINED.labels(store=name, kind=retained)
        ack_wait, stuck_after = config.ack_wait_ms / 1000, config.stuck_after_ms / 1000
        if kind is BusKind.EVENTS:
            groups = ConsumerGroups(
                log,
                committer,
                ack_wait=ack_wait,
                max_deliver=config.max_deliver,
                limiter=limiter,
                max_groups=config.evt_max_groups,
                stuck_after=stuck_after,
            )
            await groups.open(config.evt_groups)
            hub = Hub(config.subscriber_buffer)
            committer.listeners.append(hub.feed)
            return cls(log, committer, bodies, groups=groups, hub=hub)
        claims = await open_claims(
            log,
            committer,
            name,
            start_after=0,
            ack_wait=ack_wait,
            max_deliver=config.max_deliver,
            limiter=limiter,
            stuck_after=stuck_after,
        )
        return cls(log, committer, bodies, claims)

    def tasks(self, shard: int) -> dict[str, Task]:
        """The background tasks the bus needs while it serves, by name (the writer starts
        each supervised; ``shard`` labels the command lag series)."""
        tasks: dict[str, Task] = {"committer": self.committer.run, "bodies": self.bodies.run}
        if self.claims is not None:
            tasks["claim_timers"] = self.claims.run_timers
            tasks["lag_sampler"] = partial(sample_lag, self.claims, self.committer, shard=shard)
        if self.groups is not None:
            tasks["groups"] = self.groups.run
        return tasks

    def stop_consumers(self) -> None:
        """The drain: consumers waiting in ``next`` are answered now, subscriptions end
        (their connections close); nothing more is leased."""
        if self.claims is not None:
            self.claims.close()
        if self.groups is not None:
            self.groups.close()
        if self.hub is not None:
            self.hub.close()

    async def close(self, *, limiter: trio.CapacityLimiter) -> None:
        """Close the log (once every face using it has returned: no thread uses it).

        Cancellation: shielded; the store is closed whatever is cancelled."""
        with trio.CancelScope(shield=True):
            await run_in_thread(self.log.close, limiter=limiter)
