"""The buses' retention: the bus logs delete what no one needs any more, in bounded steps.

The command bus is a work queue: an acked command is kept ``CMDBUS_CMD_KEEP_ACKED_MS`` (for
inspection), then deleted. The event bus keeps an event until every group has settled it
*and* it is older than ``CMDBUS_EVT_RETENTION_MS`` (the subscribers' replay window). On
both, a dead letter is kept ``CMDBUS_DEAD_RETENTION_MS`` unless requeued or purged first.
Sort keys are never reused (the log's ``AUTOINCREMENT`` remembers the largest). (The tier's
retention: :mod:`cmdbus_trio.tier.retention`.)

With ``CMDBUS_EVT_MAX_BYTES`` set, the event log is also kept under that many bytes of
pages in use whatever the groups did: the oldest events are evicted, and what a group had
not acked is counted in ``cmdbus_evicted_unconsumed_total{group}`` and logged once per
burst (:class:`Eviction`).

Each step is one short write transaction of at most ``RETENTION_BATCH`` rows in a worker
thread, followed by a bounded incremental vacuum that gives the freed pages back to the
file system. While there is more to delete, the task rests as long as its last step took
before the next, so it holds the store's write lock at most half the time and a publish
waits for at most one step."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Mapping
from functools import partial

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.bus.bodies import BodyReader
from cmdbus_trio.bus.committer import Ticket
from cmdbus_trio.bus.groups import ConsumerGroups
from cmdbus_trio.config import Config
from cmdbus_trio.logs import event
from cmdbus_trio.loop.paced import in_steps
from cmdbus_trio.storage import VACUUM_PAGES, StoreUnavailable
from cmdbus_trio.storage.buslog import BusLog, Windows

log = logging.getLogger(__name__)

EVICT_MARGIN = 1 / 16
"""An eviction burst goes this fraction of the cap below it (the cap's low-water mark)."""
MARKS_PER_WINDOW = 1000
"""Marks kept over the longest window at most: a record's age is known to 1/1000 of it."""


@attrs.frozen(kw_only=True)
class RetentionPolicy:
    """How long a bus log keeps what; seconds. ``keep_settled``: a record settled by every
    consumer (None: no such window); ``keep_published``: any record, from its publish
    (None: none); ``keep_dead``: a dead letter, from its death; ``interval``: between
    passes."""

    keep_settled: float | None
    keep_published: float | None
    keep_dead: float
    interval: float

    @property
    def mark_every(self) -> float:
        windows = [w for w in (self.keep_settled, self.keep_published) if w is not None]
        return max(self.interval, max(windows, default=0.0) / MARKS_PER_WINDOW)

    def windows(self, consumers: Mapping[str, int] | None) -> Windows:
        """What one retention step of a bus log with ``consumers`` keeps."""
        return Windows(
            consumers=consumers,
            keep_settled=self.keep_settled,
            keep_published=self.keep_published,
            keep_dead=self.keep_dead,
            mark_every=self.mark_every,
        )


class Eviction:
    """Keeps an event log's pages in use under ``max_bytes``, oldest events first,
    whatever the groups did (``CMDBUS_EVT_MAX_BYTES``).

    A step asks the store how far to evict (:meth:`BusLog.eviction_floor`), has every
    group forget those records (:meth:`ConsumerGroups.evict_through`, counting what each
    had not acked), waits until the bodies already asked for are read, then deletes the
    records (:meth:`BusLog.evict`): no delivery is handed out without its body.

    A burst starts when the log passes its cap and evicts, step after step, down to
    :data:`EVICT_MARGIN` below it, then is logged once. Evicting only what one pass
    found over the cap made a step (three commits) every few milliseconds at a steady
    publish rate, each one a wait for the publishes' commits."""

    def __init__(
        self, log: BusLog, groups: ConsumerGroups, bodies: BodyReader, max_bytes: int
    ) -> None:
        self.log = log
        self.groups = groups
        self.bodies = bodies
        self.max_bytes = max_bytes
        self.low_water = max_bytes - int(max_bytes * EVICT_MARGIN)
        self._burst_records = 0
        self._burst_unconsumed: Counter[str] = Counter()

    async def step(self, limiter: trio.CapacityLimiter) -> bool:
        """Evict one batch if the log is over its cap; True when it did (there may be
        more).

        Cancellation: between the groups forgetting the records and their deletion, the
        records stay in the store and are delivered again after a restart.

        Error handling: a store error propagates (as from :meth:`BusLog.evict`); the
        groups have forgotten the records, which the restart that a poisoned store needs
        reloads."""
        over = self.low_water if self._burst_records else self.max_bytes
        floor = partial(self.log.eviction_floor, over, self.low_water)
        through = await run_in_thread(floor, limiter=limiter)
        if not through:
            self._end_burst()
            return False
        self._burst_unconsumed.update(self.groups.evict_through(through))
        self.bodies.forget_through(through)
        await self.bodies.caught_up()
        # What the groups settled before they forgot (a dead letter parked, a requeue) is
        # in the store before the delete: the delete counts the dead letters it takes,
        # and leaves no row behind for a record it deleted.
        settled_before = Ticket()
        self.groups.committer.enqueue(settled_before)
        await settled_before.settled.wait()
        evicted = await run_in_thread(self.log.evict, through, limiter=limiter)
        for group, letters in evicted.dead_letters.items():
            self.groups.count_evicted(group, letters)
            self._burst_unconsumed[group] += letters
        metrics.RETAINED.labels(store=self.log.name, kind="evicted").inc(evicted.records)
        self._burst_records += evicted.records
        return True

    def _end_burst(self) -> None:
        if not self._burst_records:
            return
        event(
            log,
            logging.WARNING,
            "events_evicted",
            records=self._burst_records,
            through=self.log.deleted_through,
            max_bytes=self.max_bytes,
            unconsumed=dict(sorted(self._burst_unconsumed.items())),
        )
        self._burst_records = 0
        self._burst_unconsumed.clear()


async def run_retention(
    store: str,
    log: BusLog,
    policy: RetentionPolicy,
    *,
    consumers: Mapping[str, int] | None,
    eviction: Eviction | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run retention on ``log`` (named ``store`` in metrics) for ever. ``consumers``: as
    :meth:`BusLog.retain` (None: the log's groups). ``eviction``: the log's byte cap, if
    it has one (a step of it follows each step of retention).

    Cancellation: between steps, or while a step's thread runs (the step completes; its
    transaction is whole either way).

    Error handling: a poisoned (or closed) store is skipped until the next pass: its
    state already fails readiness, and the restart that reopens it is the operator's (a
    crashed task would fail liveness and restart a writer still serving reads). Any
    other error propagates to the supervisor."""
    limiter = trio.CapacityLimiter(1)  # its own: never waits behind a group's load

    async def step() -> bool:
        retained = await run_in_thread(
            lambda: log.retain(policy.windows(consumers)),
            limiter=limiter,
        )
        metrics.RETAINED.labels(store=store, kind="records").inc(retained.records)
        metrics.RETAINED.labels(store=store, kind="dead_letters").inc(retained.dead_letters)
        more = retained.more
        if eviction is not None:
            more = await eviction.step(limiter) or more
        with contextlib.suppress(StoreUnavailable):  # poisoned since: the next step says so
            await run_in_thread(log.vacuum_step, VACUUM_PAGES, limiter=limiter)
        return more

    task_status.started()
    await in_steps(step, policy.interval, over=StoreUnavailable)


def retention_for(bus: str, config: Config) -> RetentionPolicy:
    """The command bus keeps an acked command ``cmd_keep_acked_ms``; the event bus keeps an
    event ``evt_retention_ms`` from its publish, and until every group settled it."""
    commands = bus == "commands"
    return RetentionPolicy(
        keep_settled=config.cmd_keep_acked_ms / 1000 if commands else None,
        keep_published=None if commands else config.evt_retention_ms / 1000,
        keep_dead=config.dead_retention_ms / 1000,
        interval=config.retention_interval_ms / 1000,
    )
