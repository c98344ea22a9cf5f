"""The writer process: the nursery tree, start-up, and the graceful drain.

::

    Writer.run
    └── control nursery        heartbeat, control face             (stops last)
        └── background nursery Gate timers, committers (buses, tier), body
            │                  readers, claim timers, lag samplers, consumer groups
            └── data nursery   one supervised child nursery per data face
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sqlite3
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import trio

from . import __version__, control, metrics
from .admission import ByteBudget, Gate, run_in_thread
from .bus import Bus
from .bus.retention import Eviction, retention_for, run_retention
from .commands._addresses import write_ports_file
from .config import DATA_FACE_NAMES, LAG_PORT_NAMES, Bind, Config, descriptors
from .control import _debug
from .control.health import FaceState, Health
from .faces import (
    FaceContext,
    FaceServe,
    cmd_claim,
    cmd_ingest,
    evt_claim,
    evt_ingest,
    evt_subscribe,
)
from .faces import tier as tier_face
from .faces.gates import gate_for, lanes_for
from .logs import event
from .loop.heartbeat import Heartbeat
from .loop.interpreter import collector_tuned, switch_interval
from .measures import measure_stores
from .member import Member
from .protocol.bus import BusKind
from .storage.datadir import DataDirError
from .storage.tier import TierStore
from .supervision import StartFn, supervised
from .supervision import StartupError as StartupError
from .tier.committer import Tier
from .tier.retention import run_tier_retention, tier_windows

log = logging.getLogger(__name__)


DATA_FACES: Mapping[str, FaceServe] = {
    "tier": tier_face.serve,
    "cmd_ingest": cmd_ingest.serve,
    "cmd_claim": cmd_claim.serve,
    "evt_ingest": evt_ingest.serve,
    "evt_claim": evt_claim.serve,
    "evt_subscribe": evt_subscribe.serve,
}
"""The data faces this build implements: all of docs/protocol.md's."""


class Writer:
    """One writer: its faces, gates and health. :meth:`run` serves until
    :meth:`request_drain`, then drains."""

    def __init__(self, config: Config, *, faces: Mapping[str, FaceServe] = DATA_FACES) -> None:
        self.config = config
        self.heartbeat = Heartbeat(
            threshold=config.liveness_threshold_ms / 1000,
            window=config.liveness_window_ms / 1000,
        )
        self.health = Health(self.heartbeat)
        self._faces = faces
        self._drain_requested = trio.Event()
        self._draining = trio.Event()  # seen by the faces
        self._control_stop = trio.Event()
        # Store open/close: a limiter of its own, never trio's default one.
        self._maintenance = trio.CapacityLimiter(1)
        self._stores: dict[str, Tier | Bus] = {}
        self._binds: dict[str, Bind] = {}  # each face's, its port fixed once bound

    def request_drain(self) -> None:
        """Start the graceful drain (what SIGTERM does). Idempotent."""
        self._drain_requested.set()

    async def run(
        self, *, task_status: trio.TaskStatus[dict[str, str]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve, then drain when asked.

        Reports ``{face: "host:port"}`` once every enabled face listens.

        Cancellation: in-flight work is cancelled, but worker threads are waited for.

        Error handling: a face that cannot start raises :class:`StartupError` (in an
        exception group); a face that crashes later is logged, counted and marked
        crashed (``/readyz`` names it) while everything else keeps serving.
        """
        config = self.config
        metrics.BUILD_INFO.info({"version": __version__})
        metrics.SUBJECTS.limit = config.subject_series
        wanted = [face for face in DATA_FACE_NAMES if config.bind(face) is not None]
        if missing := [face for face in wanted if face not in self._faces]:
            event(log, logging.WARNING, "faces_not_built", faces=missing)
        with switch_interval(config.switch_interval_ms / 1000), collector_tuned():
            async with trio.open_nursery() as control_nursery:
                await control_nursery.start(self.heartbeat.run)
                if config.control_bind is not None:
                    await self._start(
                        control_nursery, "control", config.control_bind, self._serve_control
                    )
                for port in LAG_PORT_NAMES:  # NoETL's old scrape ports, if asked for
                    if (bind := config.bind(port)) is not None:
                        serve_lag = partial(self._serve_lag_port, port, bind)
                        await self._start(control_nursery, port, bind, serve_lag)
                if config.ha_lease is None:
                    await self.serve(wanted, task_status.started)
                else:  # a member of a pair: primary or standby, as the lease says
                    await Member(self, wanted).run(control_nursery, task_status.started)
                event(log, logging.INFO, "stopped")
                self._control_stop.set()
                control_nursery.cancel_scope.cancel()

    @property
    def drain_requested(self) -> trio.Event:
        return self._drain_requested

    async def serve(
        self,
        faces: list[str],
        started: Callable[[dict[str, str]], None],
        *,
        until: trio.Event | None = None,
        until_budget: Callable[[], float] | None = None,
        replicate: Replicate | None = None,
        before_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Open the stores, serve the ``faces`` until a drain is asked (or ``until`` is
        set: a primary deposed or switching over; ``until_budget`` says its drain's
        budget), drain them, and close the stores. ``replicate`` is handed the open stores
        first; ``before_close`` is awaited once nothing writes to them (a primary's)."""
        self._draining = trio.Event()  # (a member may serve again after a standby spell)
        self.health.draining = False
        await self._open_stores(faces)
        settled = None
        try:
            async with trio.open_nursery() as background:
                if replicate is not None:
                    settled = await replicate(self._stores, background)
                await self._start_background(background)
                async with trio.open_nursery() as data:
                    for face in faces:
                        if face in self._faces:
                            await self.start_face(data, background, face, self._faces[face])
                    self.listening()
                    started(dict(self.health.addresses))
                    await _first_of(self._drain_requested, until)
                    budget = None  # (a drain asked: the shutdown budget)
                    if until_budget is not None and not self._drain_requested.is_set():
                        budget = until_budget()
                    self._begin_drain(data, budget)
                if data.cancel_scope.cancelled_caught:
                    event(log, logging.WARNING, "shutdown_budget_exhausted")
                if settled is not None:
                    await settled()
                background.cancel_scope.cancel()
            if before_close is not None:
                await before_close()
        finally:
            await self._close_stores()  # every face has returned: no thread uses them

    async def _start_background(self, background: trio.Nursery) -> None:
        """Start the stores' background tasks, each supervised (:meth:`_start_task`)."""
        config = self.config
        interval = config.retention_interval_ms / 1000
        for name, store in self._stores.items():
            for task, run in store.tasks().items():
                await self._start_task(background, f"{name}.{task}", run)
            if not isinstance(store, Bus):
                continue
            # The command bus's fixed group is not among the log's (persisted) groups.
            groups = store.groups
            consumers = {groups.fixed: 0} if groups.fixed is not None else None
            eviction = None
            if groups.named and config.evt_max_bytes:
                eviction = Eviction(store.log, store.groups, store.bodies, config.evt_max_bytes)
            retain = partial(
                run_retention,
                name,
                store.log,
                retention_for(name, config),
                consumers=consumers,
                eviction=eviction,
            )
            await self._start_task(background, f"{name}.retention", retain)
        tier = self._stores.get("tier")
        if isinstance(tier, Tier) and (windows := tier_windows(config)):
            retain_tier = partial(run_tier_retention, tier.store, windows, interval)
            await self._start_task(background, "tier.retention", retain_tier)
        if self._stores:  # else there is no data dir to measure
            measure = partial(
                measure_stores,
                self.health.stores,
                config.data_dir,
                interval,
                config.wal_ceiling_bytes,
            )
            await self._start_task(background, "store_sizes", measure)

    async def _start(self, nursery: trio.Nursery, face: str, bind: Bind, serve: StartFn) -> None:
        self.health.faces[face] = FaceState.STARTING
        try:
            address = await nursery.start(serve)
        except Exception as exc:
            raise StartupError(face, bind, exc) from exc
        self.health.addresses[face] = address
        if self.health.faces[face] is FaceState.STARTING:
            self.health.faces[face] = FaceState.LISTENING

    async def start_face(
        self, data: trio.Nursery, background: trio.Nursery, face: str, serve: FaceServe
    ) -> None:
        """Start a data face (``serve``: the face's own, or a standby's answer) in
        ``data``, its Gate timers in ``background``. Its port, once bound, is kept for
        the next time it starts (port 0 picks one, once)."""
        bind = self._binds.get(face) or self.config.bind(face)
        assert bind is not None
        gate = gate_for(face, self.config)
        lanes = lanes_for(face, self.config)
        metrics.FACE_CRASHES.labels(face=face)  # the series exist from the start, at 0
        metrics.UNSENT_WAITS.labels(face=face)
        for each in (gate, *dict.fromkeys(lanes.values())):
            self.health.gates[each.name] = each
            await self._start_task(background, f"{each.name}.timers", each.run_timers)
        pending_bytes = self.health.budgets[face] = ByteBudget(face, self.config.face_pending_bytes)
        ctx = FaceContext(
            face,
            bind,
            self.config,
            gate,
            self._draining,
            self._stores,
            pending_bytes=pending_bytes,
            lanes=lanes,
        )
        await self._start(data, face, bind, partial(self._supervise, ctx, serve))
        self._binds[face] = Bind(bind.host, int(self.health.addresses[face].rsplit(":", 1)[1]))

    async def _open_stores(self, faces: list[str]) -> None:
        """Open the stores the ``faces`` need.

        Error handling: a store SQLite cannot open or set up (not this user's, on a full
        or read-only volume, not a database) raises :class:`DataDirError` naming it."""
        for name, users in descriptors.STORE_FACES.items():
            if not users & {face for face in faces if face in self._faces}:
                continue
            try:
                await self._open_store(name)
            except (sqlite3.Error, OSError) as exc:
                why = f"{name}.sqlite3: {exc}"
                raise DataDirError(self.config.data_dir, why) from exc

    async def _open_store(self, name: str) -> None:
        config = self.config
        if name == "tier":
            path = config.data_dir / "tier.sqlite3"
            tier = await run_in_thread(
                partial(
                    TierStore.open,
                    path,
                    synchronous=config.sync,
                    checkpoints=config.checkpoints,
                    pool_size=descriptors.store_pool_size(config, name),
                ),
                limiter=self._maintenance,
            )
            self._stores[name] = Tier.of(tier)
            self.health.add_store(name, tier)
            metrics.RETAINED.labels(store=name, kind="records")  # 0 from the start
            return
        bus = await Bus.open(
            BusKind(name),
            config,
            limiter=self._maintenance,
            pool_size=descriptors.store_pool_size(config, name),
        )
        self._stores[name] = bus
        self.health.add_store(name, bus.log)

    async def _close_stores(self) -> None:
        with trio.CancelScope(shield=True):
            for name, store in list(self._stores.items()):
                await store.close(limiter=self._maintenance)
                del self._stores[name]
                self.health.stores.pop(name, None)

    async def _supervise(
        self,
        ctx: FaceContext,
        serve: FaceServe,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run one face in its own nursery; a crash after start-up stays inside it."""
        run: Callable[..., Awaitable[None]] = partial(serve, ctx)
        if self.config.debug_hooks:
            run = partial(_debug.crashable, run, self.health, ctx.name)
        if await supervised(run, task_status, "face", ctx.name):
            self.health.faces[ctx.name] = FaceState.STOPPED
            return
        metrics.FACE_CRASHES.labels(face=ctx.name).inc()
        self.health.face_crashed(ctx.name)

    async def _start_task(self, nursery: trio.Nursery, name: str, run: StartFn) -> None:
        """Start a background task, supervised like a face: a crash after start-up is
        logged, counted (``cmdbus_task_crashes_total``), named by ``/readyz``, fails
        ``/livez`` after the liveness window, and takes nothing else down (the control
        face goes on answering). Nothing restarts it: the pod's restart does."""
        metrics.TASK_CRASHES.labels(task=name)  # the series exists from the start, at 0

        async def supervise(*, task_status: trio.TaskStatus[None]) -> None:
            if not await supervised(run, task_status, "task", name):
                metrics.TASK_CRASHES.labels(task=name).inc()
                self.health.task_crashed(name)

        await nursery.start(supervise)

    async def _serve_control(
        self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        assert self.config.control_bind is not None
        await control.serve(
            self.health,
            self.config.control_bind,
            keepalive=self.config.control_keepalive_ms / 1000,
            debug_hooks=self.config.debug_hooks,
            auth_token=self.config.auth_token,
            shutdown=self._control_stop,
            task_status=task_status,
        )

    async def _serve_lag_port(
        self, port: str, bind: Bind, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await control.serve_lag_port(
            port,
            bind,
            keepalive=self.config.control_keepalive_ms / 1000,
            shutdown=self._control_stop,
            task_status=task_status,
        )

    def listening(self) -> None:
        """Every face listens: the ports file is written, and the start is logged."""
        # What exists now (modules, stores, faces, metric families) lives as long as the
        # writer: a full collection need not walk it again and again.
        gc.freeze()
        if self.config.ports_file is not None:
            write_ports_file(self.config.ports_file, self.health.addresses)
        self.health.serving = True
        event(
            log,
            logging.INFO,
            "started",
            version=__version__,
            pid=os.getpid(),
            addresses=dict(self.health.addresses),
            gates={face: _limits(gate) for face, gate in self.health.gates.items()},
            settings=self.config.redacted(changed_only=self.config.log_format != "json"),
        )

    def _begin_drain(self, data: trio.Nursery, budget: float | None = None) -> None:
        if budget is None:
            budget = self.config.shutdown_timeout_ms / 1000
        self.health.draining = True
        event(
            log,
            logging.INFO,
            "drain_started",
            budget_s=budget,
            inflight={face: gate.statistics().inflight for face, gate in self.health.gates.items()},
        )
        for gate in self.health.gates.values():
            gate.close()
        for store in self._stores.values():
            if isinstance(store, Bus):
                store.stop_consumers()
        self._draining.set()
        data.cancel_scope.deadline = trio.current_time() + budget


Replicate = Callable[[Mapping[str, Any], trio.Nursery], Awaitable[Callable[[], Awaitable[None]]]]
"""What a primary does with its stores once open, before it serves (:mod:`.member`);
what it returns is awaited once the faces have drained, before the committers stop: until
the last commits (a drain's lease releases) are settled."""


async def _first_of(first: trio.Event, second: trio.Event | None) -> None:
    """Until either event is set."""
    if second is None:
        await first.wait()
        return
    async with trio.open_nursery() as nursery:
        for each in (first, second):

            async def wait(each: trio.Event = each) -> None:
                await each.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait)


def _limits(gate: Gate) -> dict[str, Any]:
    return {
        "max_inflight": gate.max_inflight,
        "max_waiters": gate.max_waiters,
        "shed_after_s": gate.shed_after,
        "default_budget_s": gate.default_budget,
    }


async def serve_until_signalled(config: Config) -> None:
    """Run a :class:`Writer` in the main thread: the first SIGTERM or SIGINT drains it,
    a second one cancels what is left at once (worker threads are still waited for)."""
    writer = Writer(config)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if not writer._drain_requested.is_set():
                        event(log, logging.INFO, "signal", signal=name, action="drain")
                        writer.request_drain()
                    else:
                        event(log, logging.WARNING, "signal", signal=name, action="cancel")
                        nursery.cancel_scope.cancel()

            nursery.start_soon(on_signals)
            await writer.run()
            nursery.cancel_scope.cancel()
