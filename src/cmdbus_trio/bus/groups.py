"""A bus's consumer groups: every record goes to every group; the members of one group
compete for it (one :class:`Claims` per group).

The event bus's groups are *named*. A group is a cursor into the bus's shared
:class:`~cmdbus_trio.bus.tail.Tail` plus what it has in flight: its memory does not grow
with the number of subjects, and creating one copies no backlog (the tail is extended back
from the store once, for the earliest start). Groups are persisted with the position they
start after, so a restart keeps them and their acks. A group is created from the
configured defaults at start (from the beginning) or by a v2 client naming it with
``from``: ``beginning`` or ``tail`` (only records published after its creation).

The command bus has one *fixed* group, ``commands``, that requests never name: its
records are queued per subject (a worker's filter names its pool, and a pool with no
workers holds only its own records), and its lag is exported per subject (NoETL's
``ehdb_feed_*`` families) where a named group's is one gauge.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import GateClosed, run_in_thread
from cmdbus_trio.protocol import FieldError
from cmdbus_trio.protocol.bus import GROUP_NAME, GROUP_NAME_RULE
from cmdbus_trio.storage.buslog import BusLog

from .claims import STUCK_AFTER, Claims
from .committer import GroupCommitter, Ticket
from .durable import durable_settlements, open_claims, persist_low_water
from .tail import Tail


@attrs.define(eq=False)
class _Creation:
    done: trio.Event = attrs.field(factory=trio.Event)
    error: Exception | None = None


class ConsumerGroups:
    """The groups of one bus: named ones, or only ``fixed`` (see the module).

    Lifecycle: :meth:`open` loads them; :meth:`run` runs every group's timers and the
    lag sampler (every ``sample_every`` seconds; ``shard`` labels the fixed group's
    per-shard series); :meth:`close` is the drain."""

    def __init__(
        self,
        log: BusLog,
        committer: GroupCommitter,
        *,
        ack_wait: float,
        max_deliver: int,
        limiter: trio.CapacityLimiter,
        max_groups: int = 1000,
        stuck_after: float = STUCK_AFTER,
        fixed: str | None = None,
        shard: int = 0,
        sample_every: float = 1.0,
    ) -> None:
        self.fixed = fixed
        self.stuck_after = stuck_after
        self.log = log
        self.max_groups = max_groups
        self.committer = committer
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self._limiter = limiter
        self.claims: dict[str, Claims] = {}
        self.tail = Tail(log, limiter=limiter)
        if fixed is None:
            # No await since the tail read the newest sort key: it gets every record after.
            committer.listeners.append(self.tail)
        self._shard = str(shard)
        self._sample_every = sample_every
        self._creating: dict[str, _Creation] = {}  # groups whose history is loading
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._configured: frozenset[str] = frozenset()  # the operator's: not a client's to delete
        self.evicted_through = 0
        """Records up to this sort key are evicted (see :meth:`evict_through`)."""

    async def open(self, defaults: tuple[str, ...] = ()) -> None:
        """Load the persisted groups and create the configured ones that are missing; or
        load the fixed group, with every record it has not settled."""
        if self.fixed is not None:
            self.claims[self.fixed] = await open_claims(
                self.log,
                self.committer,
                self.fixed,
                start_after=0,
                ack_wait=self.ack_wait,
                max_deliver=self.max_deliver,
                limiter=self._limiter,
                stuck_after=self.stuck_after,
            )
            return
        persisted = await run_in_thread(self.log.groups, limiter=self._limiter)
        # Each from where it resumes, its settled position (not where it started: every
        # configured group starts at the beginning, and covering from there read the key
        # and subject of every retained record at each restart).
        resume = {name: await self._resume_after(name, start) for name, start in persisted.items()}
        with self.tail.pinned():
            if resume:  # the earliest first: one read of the store for all
                await self.tail.cover(min(resume.values()))
            for name, start_after in persisted.items():
                await self._load(name, start_after, resume[name])
        self._configured = frozenset(defaults)
        for name in defaults:
            if name not in self.claims:
                await self.get(name, "beginning")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every group's timers and the lag sampler (in the background nursery)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for claims in self.claims.values():
                nursery.start_soon(claims.run_timers)
            nursery.start_soon(self._sample_lag)
            task_status.started()

    @property
    def named(self) -> bool:
        """Requests name their group (and may create and delete one)."""
        return self.fixed is None

    async def resolve(self, group: Any, start: Any) -> Claims:
        """The coordinator a request's ``group`` and ``from`` fields name (see
        :meth:`get`); with a fixed group, a request names none.

        Error handling: :class:`FieldError` naming the field."""
        if self.fixed is not None:
            if group is not None:
                raise FieldError("group", "the command bus has no consumer groups")
            if start is not None:
                raise FieldError("from", "the command bus has no consumer groups")
            return self.claims[self.fixed]
        if not isinstance(group, str):
            raise FieldError("group", "expected the name of a consumer group")
        return await self.get(group, start)

    def known(self, group: Any) -> Claims | None:
        """The coordinator a request's ``group`` names, without waiting: for the requests
        that create no group (``ack``, ``nack``, ``extend``). None while the group is
        being created or deleted: nothing of it can be held yet, or any more.

        Error handling: :class:`FieldError` naming the field, as :meth:`resolve`."""
        if self.fixed is not None:
            if group is not None:
                raise FieldError("group", "the command bus has no consumer groups")
            return self.claims[self.fixed]
        if not isinstance(group, str):
            raise FieldError("group", "expected the name of a consumer group")
        claims = self.claims.get(group)
        if claims is None and group not in self._creating:
            _check_name(group)
            raise _unknown(group)
        return claims

    async def get(self, name: str, start: str | None = None) -> Claims:
        """The group's coordinator; created when ``start`` is ``beginning`` or ``tail``.

        A creation loads the group's history in a thread; it holds up no other group and
        no other request, and a second request for the same group waits for it.

        Cancellation: only the wait stops; a creation that started completes (in the
        groups' nursery once :meth:`run` runs), so the group exists for the next request.

        Error handling: :class:`FieldError` for a bad name, an unknown group without
        ``start``, or a bad ``start``; the store's error if the creation failed.
        """
        while (claims := self.claims.get(name)) is None and name in self._creating:
            await self._creating[name].done.wait()
        if claims is not None:
            return claims
        _check_name(name)
        if start is None:
            raise _unknown(name)
        if start not in ("beginning", "tail"):
            raise FieldError("from", "expected beginning or tail")
        if len(self.claims) + len(self._creating) >= self.max_groups:
            metrics.GROUPS_REFUSED.inc()
            raise FieldError(
                "group",
                f"the writer keeps at most {self.max_groups} consumer groups "
                "(CMDBUS_EVT_MAX_GROUPS); delete one with delete_group first",
            )
        created = self._creating[name] = _Creation()
        wanted = 0 if start == "beginning" else self.log.last_sort_key
        if self._nursery is None:  # at start-up, before run(): nobody else to wait
            await self._create(name, wanted, created)
        else:
            self._nursery.start_soon(self._create, name, wanted, created)
            await created.done.wait()
        if created.error is not None:
            raise created.error
        if (claims := self.claims.get(name)) is None:  # cancelled: the writer is stopping
            raise GateClosed(f"group {name!r}: the writer is draining")
        return claims

    async def _create(self, name: str, wanted: int, created: _Creation) -> None:
        try:
            start_after = await run_in_thread(
                self.log.create_group, name, wanted, limiter=self._limiter
            )
            await self._load(name, start_after)
        except Exception as exc:  # the requesters answer with it; the writer goes on
            created.error = exc
        finally:
            del self._creating[name]
            created.done.set()

    async def _resume_after(self, name: str, start_after: int) -> int:
        """The sort key after which the group ``name`` (started after ``start_after``)
        has records to load: every one up to it is settled, or evicted."""
        settled_below = await run_in_thread(self.log.settled_below, name, limiter=self._limiter)
        return max(start_after, settled_below - 1, self.evicted_through)

    async def _load(self, name: str, start_after: int, after: int | None = None) -> None:
        on_dead, on_count = durable_settlements(self.committer, name)
        claims = Claims(
            name,
            ack_wait=self.ack_wait,
            max_deliver=self.max_deliver,
            on_dead=on_dead,
            on_count=on_count,
            tail=self.tail,
            start_after=start_after,
            stuck_after=self.stuck_after,
        )
        with self.tail.pinned():  # nothing after ``after`` is trimmed until attached
            if after is None:
                after = await self._resume_after(name, start_after)
            await self.tail.cover(after)
            settled, counts = await run_in_thread(
                self.log.group_state, name, after, limiter=self._limiter
            )
            owed = await run_in_thread(self.log.owed, name, after, limiter=self._limiter)
            claims.restore_deliveries(counts)
            claims.attach(after, settled)
            claims.restore_owed(owed)
            claims.persisted_low_water = after + 1
        # An eviction that began while this group loaded: what it loaded of it goes too.
        evicted = claims.evict_through(self.evicted_through)
        self.claims[name] = claims
        metrics.EVICTED_UNCONSUMED.labels(group=name)  # 0 from the start
        self.count_evicted(name, evicted)
        if self._closed:  # created while draining: it leases nothing
            claims.close()
        if self._nursery is not None:
            self._nursery.start_soon(claims.run_timers)

    async def delete(self, name: str) -> bool:
        """Delete the group and all it recorded (acks, dead letters, counts, position),
        durably before returning; False when there is no such group, :class:`FieldError`
        for a configured one (``CMDBUS_EVT_GROUPS``). Its waiting
        consumers are told at once; a request naming it afterwards is ``invalid``
        (unknown group) unless it creates the group anew.

        Cancellation: once started, the deletion completes (it is committed in order
        with the group's last acks); only the wait for it stops.
        """
        if name in self._configured:
            # A restart would re-create it from the beginning and deliver every retained
            # event to its consumers again.
            raise FieldError(
                "group",
                f"{name!r} is configured (CMDBUS_EVT_GROUPS): take it out of the setting "
                "and restart the writer before deleting it",
            )
        while name in self._creating:  # a creation (or deletion) under way ends first
            await self._creating[name].done.wait()
        claims = self.claims.pop(name, None)
        if claims is None:
            return False
        claims.delete()
        metrics.GROUPS_DELETED.inc()
        for series in (metrics.EVENTS_GROUP_LAG, metrics.EVICTED_UNCONSUMED):
            with contextlib.suppress(KeyError):  # no series yet if never sampled
                series.remove(name)
        deleting = self._creating[name] = _Creation()  # a re-creation waits for this
        ticket = Ticket(dropped=[name])
        self.committer.enqueue(ticket)  # after any ack of the group already enqueued
        if self._nursery is None:
            await self._drop(name, ticket, deleting)
        else:  # the marker outlives a requester that leaves: see _drop
            self._nursery.start_soon(self._drop, name, ticket, deleting)
            await deleting.done.wait()
        if deleting.error is not None:
            raise deleting.error
        return True

    async def _drop(self, name: str, ticket: Ticket, deleting: _Creation) -> None:
        # Until the drop is committed, a creation of the same name must wait: made
        # earlier, its row would be deleted by this drop.
        try:
            await ticket.wait()
        except Exception as exc:
            deleting.error = exc
        finally:
            del self._creating[name]
            deleting.done.set()

    def evict_through(self, through: int) -> dict[str, int]:
        """Records up to ``through`` are about to be deleted whatever the groups did
        (``CMDBUS_EVT_MAX_BYTES``): every group forgets them now, before the store
        deletes them, so none is delivered without its body. Returns, per group, how
        many it had not settled (also counted in ``cmdbus_evicted_unconsumed_total``)."""
        self.evicted_through = max(self.evicted_through, through)
        unconsumed = {}
        for name, claims in self.claims.items():
            if dropped := claims.evict_through(through):
                unconsumed[name] = dropped
                self.count_evicted(name, dropped)
        return unconsumed

    def count_evicted(self, group: str, unconsumed: int) -> None:
        """Count ``unconsumed`` events of ``group`` evicted (unless the group is gone)."""
        if unconsumed and group in self.claims:
            metrics.EVICTED_UNCONSUMED.labels(group=group).inc(unconsumed)

    def release(self, owner: object) -> None:
        for claims in self.claims.values():
            claims.release(owner)

    def close(self) -> None:
        self._closed = True
        for claims in self.claims.values():
            claims.close()

    async def _sample_lag(self) -> None:
        """Publish each group's lag, so a scrape never computes it, and make its settled
        position durable when it moved."""
        while True:
            for name, claims in sorted(self.claims.items()):
                if claims.deleted:  # while this pass went on
                    continue
                persist_low_water(claims, self.committer)
                self._export_lag(name, claims)
                await trio.lowlevel.checkpoint()  # many groups: one at a time per loop turn
            self.tail.trim()
            await trio.sleep(self._sample_every)

    def _export_lag(self, name: str, claims: Claims) -> None:
        if self.fixed is None:
            metrics.EVENTS_GROUP_LAG.labels(group=name).set(claims.total)
        else:
            export_feed_lag(claims, self._shard)


def _check_name(name: str) -> None:
    if not GROUP_NAME.fullmatch(name):
        raise FieldError("group", f"expected {GROUP_NAME_RULE}")


def _unknown(name: str) -> FieldError:
    return FieldError(
        "group", f"unknown group {name!r}; name it with from (beginning or tail) to create it"
    )


def export_feed_lag(claims: Claims, shard: str) -> None:
    """The fixed group's backlog: the gauge of each subject whose backlog changed (one
    that empties stays, at 0), and the total. Subjects past the exported ones
    (:class:`metrics.SubjectSeries`) are summed into the ``_other`` series. NoETL's
    per-shard families (``shard``: this writer's) are set alongside."""
    folded = False
    for subject, count in claims.changed_backlog().items():
        label = metrics.SUBJECTS.label(subject)
        if label == metrics.OTHER_SUBJECTS:
            folded = True
        else:
            metrics.FEED_SUBJECT_LAG.labels(subject=label).set(count)
    if folded:
        named = sum(claims.backlog_of(subject) for subject in metrics.SUBJECTS.named)
        metrics.FEED_SUBJECT_LAG.labels(subject=metrics.OTHER_SUBJECTS).set(claims.total - named)
    metrics.FEED_TOTAL_LAG.set(claims.total)
    metrics.FEED_SHARD_LAG.labels(shard=shard).set(claims.total)
    metrics.FEED_SHARD_INFLIGHT.labels(shard=shard).set(claims.leased)
    metrics.FEED_TOTAL_INFLIGHT.set(claims.leased)
    metrics.FEED_SHARD_COMMITTED.labels(shard=shard).set(claims.persisted_low_water - 1)
