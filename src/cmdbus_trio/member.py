"""A writer that is one member of a pair (``CMDBUS_HA_LEASE``): primary or standby as the
lease says, and the moves between the two without a restart.

::

    Member.run                           (in the writer's control nursery)
    ├── the lease keeper                 renews or watches the lease, all along
    ├── the replication face             a standby's connection, while primary
    └── one role after another:
        standby   data faces answer `unavailable` + `primary`; the follower copies
        primary   the writer serves (Writer.serve), its stores' commits replicated and
                  its acknowledgements held for the standby (CMDBUS_HA_SYNC)

A standby whose lease comes (the primary gone, or handing over) folds its replicas and
serves them as any writer serves its data dir. A primary that loses the lease stops
serving at once (nothing it still had was acknowledged: the standby had not confirmed
it), and follows the new primary from a base copy: what it wrote since is discarded.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from . import metrics
from .admission import run_in_thread
from .bus import Bus
from .faces import standby as standby_face
from .ha import Elector, Role, SyncMode, open_lease_store, while_primary
from .ha import face as replication_face
from .ha._kube_lease import KubernetesLeaseStore
from .ha._kube_pods import PodLabels, keep_labelled
from .ha.follower import Deposed, Follower, Refused
from .ha.keeper import LeaseKeeper
from .ha.source import Source
from .ha.sync import Synchronizer
from .logs import event, leaf, why
from .storage import datadir
from .storage.restores import jump_keys
from .storage.tier import TierStore
from .tier.committer import Tier

if TYPE_CHECKING:
    from .app import Writer

log = logging.getLogger(__name__)

RECONNECT_EVERY = 0.2
"""Seconds between a standby's attempts to reach the primary's replication face."""
DEPOSED_DRAIN_S = 1.0
"""The drain of a primary that lost its lease: what it still holds cannot be
acknowledged, so its in-flight work gets a second, not the shutdown budget."""
HAND_OVER_WAIT_S = 1.0
"""How long a primary handing over waits for its standby to confirm its last commits
(the lease passes then anyway: what was not confirmed was never acknowledged)."""


class Member:
    def __init__(self, writer: Writer, faces: list[str]) -> None:
        config = writer.config
        assert config.ha_lease is not None
        self.writer = writer
        self.config = config
        self.faces = faces
        self.name = config.ha_name
        self._limiter = trio.CapacityLimiter(2)  # the replication's I/O (copies, journals)
        # The lease's own thread: a renewal never waits behind a base copy (it did, and
        # the primary lost its lease while it copied its stores to a standby).
        self._lease_limiter = trio.CapacityLimiter(1)
        # The pod labels' own thread too: a label waits behind neither a base copy nor a
        # renewal (and a hung API call of theirs never delays one).
        self._labels_limiter = trio.CapacityLimiter(1)
        self.mode = SyncMode(config.ha_sync)
        empty = not any((config.data_dir / name).exists() for name in datadir.STORE_FILES)
        self.elector = Elector(self.name, config.ha_lease_ms / 1000, self.mode, empty=empty)
        lease_io = partial(run_in_thread, limiter=self._lease_limiter)
        store = open_lease_store(config.ha_lease, config.ha_kube_service_account)
        self.keeper = LeaseKeeper(self.elector, store, lease_io)
        self.role = Role.STARTING
        self._role_changed = trio.Event()
        self.source: Source | None = None
        self.sync: Synchronizer | None = None
        self.follower: Follower | None = None
        self._announced = False
        self._switching = trio.Event()  # asked to hand over and follow (POST /ha/switchover)
        writer.health.ha_actions = {"switchover": self._switchover, "promote": self._promote}
        writer.health.role_not_ready = self._not_ready_because
        metrics.HA_EPOCH.set_function(lambda: self.elector.epoch)
        metrics.HA_IN_SYNC.set_function(lambda: 1 if self._in_sync() else 0)
        metrics.HA_LAG_RECORDS.set_function(self._lag_records)
        metrics.HA_LAG_SECONDS.set_function(
            lambda: self.source.lag_seconds() if self.source is not None else 0.0
        )

    async def _offload(self, fn: Callable[[], Any]) -> Any:
        return await run_in_thread(fn, limiter=self._limiter)

    async def run(self, control: trio.Nursery, started: Callable[[dict[str, str]], None]) -> None:
        """Serve as the lease says until the writer drains."""
        writer = self.writer
        assert self.config.ha_bind is not None
        serve_replication = partial(replication_face.serve, self.config.ha_bind,
                                    lambda: self.source, self.elector)  # fmt: skip
        await writer._start(control, "ha", self.config.ha_bind, serve_replication)
        self.elector.faces = {"ha": self._advertised("ha")}
        writer.health.ha = self.report
        await control.start(self.keeper.run)
        if self.config.ha_pod_labels:
            store = self.keeper.store
            assert isinstance(store, KubernetesLeaseStore)  # (the settings check it)
            labels = PodLabels(store.api, store.namespace)
            labels_io = partial(run_in_thread, limiter=self._labels_limiter)
            control.start_soon(
                keep_labelled, labels, self.name, self._labels_wanted,
                self._role_change, labels_io,
            )  # fmt: skip

        def once(addresses: dict[str, str]) -> None:
            if not self._announced:
                self._announced = True
                started(addresses)

        while not writer.drain_requested.is_set():
            if self.keeper.is_primary():
                await self._as_primary(once)
            else:
                await self._as_standby(once)
        self._set_role(Role.DRAINING)

    # --- the roles -----------------------------------------------------------------------

    async def _as_standby(self, started: Callable[[dict[str, str]], None]) -> None:
        self._set_role(Role.STARTING)  # a standby once it holds a copy of the primary's
        self.elector.resume()  # (after a switchover: it may take the lease again later)
        follower = Follower(
            self.name,
            self.config.data_dir,
            [name.removesuffix(".sqlite3") for name in datadir.STORE_FILES],
            offload=self._offload,
            token=self.config.auth_token,
        )
        await follower.open()
        self.follower = follower
        writer = self.writer
        try:
            async with (
                trio.open_nursery() as nursery,
                trio.open_nursery() as background,
                trio.open_nursery() as data,
            ):
                for face in self.faces:
                    where = partial(self._primary_face, face)
                    answer = partial(standby_face.serve, primary=where)
                    await writer.start_face(data, background, face, answer)
                writer.listening()
                started(dict(writer.health.addresses))
                nursery.start_soon(self._follow, follower)
                while not (self.keeper.is_primary() or writer.drain_requested.is_set()):
                    if follower.replicas and follower.caught_up and self.role is Role.STARTING:
                        self.elector.empty = False  # it holds the shard now (a tick confirmed)
                        self._set_role(Role.STANDBY)
                    with trio.move_on_after(min(self.elector.renew_every, 0.2)):
                        await self.keeper.wait_changed()
                nursery.cancel_scope.cancel()
        finally:
            self.follower = None
            with trio.CancelScope(shield=True):
                await follower.close()  # its journals folded: the stores are whole
        if self.keeper.is_primary():
            await self._taking_over()

    async def _taking_over(self) -> None:
        """Before a member that was a standby serves: its replicas become its stores."""
        data_dir = self.config.data_dir
        stale = [p for p in data_dir.iterdir() if p.name.endswith(("-replica", "-replica.json"))]
        for path in stale:  # served now: they describe a copy no longer kept
            await self._offload(partial(path.unlink, missing_ok=True))
        before = self.elector.taken_from
        if before is not None and self.name not in (before.in_sync, before.last_primary):
            # Not in sync (CMDBUS_HA_SYNC=off, or forced): the primary may have given keys
            # this copy lacks, so none of them is given again.
            stores = [n for n in datadir.STORE_FILES if (data_dir / n).exists()]
            jump = await self._offload(partial(jump_keys, data_dir, stores))
            why = "taking over without being in sync: the last records may be lost"
            event(log, logging.WARNING, "keys_moved_on", jump=jump, why=why)
        metrics.HA_FAILOVERS.inc()

    async def _as_primary(self, started: Callable[[dict[str, str]], None]) -> None:
        self._set_role(Role.PRIMARY)
        self.elector.empty = False  # what it serves now is the shard's
        writer = self.writer
        deposed = trio.Event()

        epoch = self.elector.epoch
        self._switching = trio.Event()

        async def watch_lease() -> None:  # (lost, even if taken again: a new epoch)
            while self.keeper.is_primary() and self.elector.epoch == epoch:
                await self.keeper.wait_changed()
            deposed.set()

        async def watch_switchover() -> None:
            await self._switching.wait()
            deposed.set()

        def budget() -> float:  # deposed: a second; handing over: the usual drain
            return (
                self.config.shutdown_timeout_ms / 1000
                if self._switching.is_set()
                else DEPOSED_DRAIN_S
            )

        async def truncate_wals() -> None:  # (the stores are open: it runs once serving)
            if self.source is not None:
                await while_primary.truncate_wals(self.source.stores, self._offload)

        command = None
        if self.config.ha_while_primary:  # stopped once deposed, or before the stores close
            command = while_primary.WhilePrimary(
                self.config.ha_while_primary,
                before_start=truncate_wals if self.config.checkpoints == "litestream" else None,
            )

        def serving(addresses: dict[str, str]) -> None:
            self.elector.faces = {face: self._advertised(face) for face in addresses}
            started(addresses)
            if command is not None:
                nursery.start_soon(command.run, deposed)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_lease)
            nursery.start_soon(watch_switchover)
            await writer.serve(
                self.faces, serving, until=deposed, until_budget=budget,
                replicate=self._replicate, before_close=None if command is None else command.stop,
            )  # fmt: skip
            nursery.cancel_scope.cancel()
        handing_over = writer.drain_requested.is_set() or self._switching.is_set()
        if handing_over and self.keeper.is_primary():
            self._set_role(Role.DRAINING)
            if self.source is not None:  # the standby has every commit before it serves
                with trio.move_on_after(HAND_OVER_WAIT_S):
                    await self.source.wait_confirmed(self.source.sequence)
            await self.keeper.hand_over()  # the standby in sync (if any) takes it at once
        if self.source is not None:  # then its stream ends, and it reads the lease
            self.source.close()
        if self.sync is not None:
            self.keeper.listeners.remove(self.sync.poke)
        self.source = self.sync = None
        # (The term that ended: the elector may hold the next one's epoch by now.)
        if self._switching.is_set():
            event(log, logging.WARNING, "switched_over", epoch=epoch)
        elif deposed.is_set() and not writer.drain_requested.is_set():
            event(log, logging.WARNING, "deposed", epoch=epoch)

    async def _replicate(
        self, stores: Mapping[str, Any], background: trio.Nursery
    ) -> Callable[[], Awaitable[None]]:
        """The open stores' commits numbered, streamed, and waited for (as the mode says);
        returns what settles the last of them."""
        logs = {
            name: store.log if isinstance(store, Bus) else store.store
            for name, store in stores.items()
        }
        source = Source(
            logs, self.elector.epoch, token=self.config.auth_token, primary=self.name,
            offload=self._offload,
        )  # fmt: skip
        sync = Synchronizer(self.mode, source, self.keeper)
        source.listeners.append(sync.poke)
        self.keeper.listeners.append(sync.poke)
        for store in logs.values():
            await self._offload(partial(store.attach_tap, source.committed, self._tap_failed))
            if isinstance(store, TierStore) and self.mode is not SyncMode.OFF:
                await self._offload(store.hold_back)  # reads wait for the acknowledgement
        committers = [store.committer for store in stores.values() if isinstance(store, Bus | Tier)]
        for committer in committers:
            committer.wait_for(sync)
        await background.start(sync.run)
        self.source, self.sync = source, sync
        return partial(sync.settled, committers)

    def _tap_failed(self, exc: Exception) -> None:
        event(log, logging.ERROR, "replication_tap_failed", error=str(exc))

    # --- operations (POST /ha/...) ---------------------------------------------------------

    def _switchover(self, force: bool) -> tuple[int, dict[str, object]]:
        if not (self.role is Role.PRIMARY and self.keeper.is_primary()):
            return 409, {"error": "this member is not primary: ask the primary (GET /ha)"}
        if self.sync is None or not self.sync.in_sync:
            why = "no standby is in sync: the shard would have no primary until this one came back"
            return 409, {"error": why}
        self._switching.set()
        return 202, {"switching_over": True, "to": self.sync.counting_on}

    def _promote(self, force: bool) -> tuple[int, dict[str, object]]:
        """A forced promotion: take the lease once it expires, in sync or not."""
        record = self.elector.seen.record if self.elector.seen else None
        if self.role is Role.PRIMARY:
            return 409, {"error": "this member is primary already"}
        if self.elector.empty:
            return 409, {"error": "this member holds no copy of the shard yet"}
        in_sync = record is not None and record.in_sync == self.name
        loses = "nothing: the lease names this member in sync" if in_sync else (
            "what the primary acknowledged since the lease last named this member in sync "
            f"(it is {self._lag_records()} transactions behind, as far as it knows)"
        )  # fmt: skip
        if not force:
            return 400, {"error": f"a forced promotion may lose {loses}; ask with force=1"}
        self.elector.forced = True
        return 202, {
            "promoting": True,
            "may_lose": loses,
            "when": "once the lease expires: while a primary renews it, never",
        }

    # --- the standby's side ----------------------------------------------------------------

    async def _follow(self, follower: Follower) -> None:
        """Follow whichever member the lease names primary, until cancelled."""
        while True:
            record = self.elector.seen.record if self.elector.seen else None
            address = record.faces.get("ha") if record and record.holder != self.name else None
            if address is None:
                await trio.sleep(RECONNECT_EVERY)
                continue
            host, _, port = address.rpartition(":")
            try:
                stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
            except OSError:
                await trio.sleep(RECONNECT_EVERY)
                continue
            async with stream:
                try:
                    await follower.follow(stream, lambda: self.elector.epoch)
                except Exception as exc:  # the stream's end, whatever ended it: start again
                    level = logging.INFO if _expected(exc) else logging.WARNING
                    event(log, level, "replication_ended", primary=address, why=why(exc))
            await self.keeper.turn_now()  # the primary may have handed the lease over
            await trio.sleep(RECONNECT_EVERY)

    # --- what it says ----------------------------------------------------------------------

    def _advertised(self, face: str) -> str:
        """The address the other member and the clients reach ``face`` at."""
        address = self.writer.health.addresses[face]
        port = address.rpartition(":")[2]
        advertise = self.config.ha_advertise
        if not advertise:
            return address
        host, _, advertised_port = (
            advertise.rpartition(":") if ":" in advertise else (advertise, "", "")
        )
        if face == "ha" and advertised_port:
            return advertise
        return f"{host or advertise}:{port}"

    def _primary_face(self, face: str) -> str | None:
        record = self.elector.seen.record if self.elector.seen else None
        if record is None or record.holder in (None, self.name):
            return None
        return record.faces.get(face)

    def _set_role(self, role: Role) -> None:
        self.role = role
        self._role_changed.set()
        self._role_changed = trio.Event()
        for each in Role:
            metrics.HA_ROLE.labels(role=each.value).set(1 if each is role else 0)

    def _lag_records(self) -> int:
        source, follower = self.source, self.follower
        if source is not None:
            return max(0, source.sequence - max(source.confirmed, 0))
        return follower.behind if follower is not None else 0

    async def _role_change(self) -> None:
        """Until the role changes (the event of the moment: each change makes a new one)."""
        await self._role_changed.wait()

    def _not_ready_because(self) -> str | None:
        """Ready is serving its role: a primary holding its lease, a standby that has a
        copy and (unless CMDBUS_HA_SYNC=off) is named in sync, so a rollout that waits
        for readiness never stops a primary before its standby could take over."""
        if self.role is Role.PRIMARY:
            return None if self.keeper.is_primary() else "primary: its lease lapsed"
        if self.role is Role.STANDBY and (self.mode is SyncMode.OFF or self._in_sync()):
            return None
        if self.role is Role.STANDBY:
            return "standby: the primary does not count on it yet (not in sync)"
        if self.role is Role.STARTING:
            return "starting: no copy of the primary's stores yet"
        return "draining: it hands the lease over and stops"

    def _labels_wanted(self) -> tuple[str, tuple[str, int] | None]:
        """The role for this member's pod label, and the member it took the lease
        from (with the epoch it took it in) while primary."""
        role = str(self.report()["role"])
        before = self.elector.taken_from
        replaced = before and (before.holder or before.last_primary)
        if role != Role.PRIMARY.value or not replaced or replaced == self.name:
            return role, None
        return role, (replaced, self.elector.epoch)

    def _in_sync(self) -> bool:
        """A primary: its acknowledgements wait for a standby in sync; a standby: the
        lease names it in sync."""
        if self.role is Role.PRIMARY and self.keeper.is_primary():
            return self.sync is not None and self.sync.in_sync
        record = self.elector.seen.record if self.elector.seen else None
        return record is not None and record.in_sync == self.name

    def report(self) -> dict[str, object]:
        """``GET /ha``."""
        record = self.elector.seen.record if self.elector.seen else None
        primary = self.role is Role.PRIMARY and self.keeper.is_primary()
        follower = self.follower
        in_sync = self._in_sync()
        behind = follower.behind if follower is not None else 0
        holder = record.holder if record is not None else None
        role = self.role.value
        if self.role is Role.PRIMARY and not primary:
            role = Role.DRAINING.value  # its lease lapsed: it stops serving
        return {
            "role": role,
            "name": self.name,
            "epoch": self.elector.epoch,
            "primary": holder,
            "in_sync": in_sync,
            "behind_records": 0 if primary else behind,
            "primary_faces": dict(record.faces) if record is not None and holder else {},
        }


def _expected(exc: BaseException) -> bool:
    """A stream's ordinary end: the other member went, or the lease moved on."""
    ended = (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError)
    return isinstance(leaf(exc), (*ended, Deposed, Refused))
