"""What the writer knows about itself, in memory, for the control face to read.

Nothing here awaits a data-plane lock, limiter or store: readers get a snapshot built
from plain attributes, so a probe is answered however busy the data plane is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio

from .. import __version__, metrics
from ..admission import ByteBudget, Gate
from ..loop.heartbeat import Heartbeat
from ..storage import Store, StoreState


def _is_state(store: Store, state: StoreState) -> int:
    return 1 if store.state is state else 0


class FaceState(enum.StrEnum):
    STARTING = "starting"
    LISTENING = "listening"
    CRASHED = "crashed"
    STOPPED = "stopped"


@attrs.frozen
class Readiness:
    ready: bool
    reasons: tuple[str, ...]


class Health:
    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat
        self.started_at = trio.current_time()
        self.serving = False  # every enabled face bound and the stores open
        self.draining = False
        self.faces: dict[str, FaceState] = {}
        self.crashed_at: dict[str, float] = {}
        self.tasks_crashed_at: dict[str, float] = {}  # background tasks that crashed
        self.crash_drills: dict[str, Callable[[], None]] = {}  # /debug/crash-face, per face
        self.addresses: dict[str, str] = {}
        self.gates: dict[str, Gate] = {}
        self.budgets: dict[str, ByteBudget] = {}  # each data face's (/debug/hold-bytes)
        self.stores: dict[str, Store] = {}
        self.ha: Callable[[], dict[str, object]] = _single
        """``GET /ha``: this member's role in its pair (a writer alone: ``single``)."""
        self.ha_actions: dict[str, Callable[[bool], tuple[int, dict[str, object]]]] = {}
        """``POST /ha/<action>`` (switchover, promote): a member's operations."""
        self.role_not_ready: Callable[[], str | None] = lambda: None
        """Why a member of a pair does not serve its role yet (None: it does)."""
        # Read at scrape time, so /metrics is right without anyone calling /readyz.
        metrics.READY.set_function(lambda: 1 if self.readiness().ready else 0)

    def add_store(self, name: str, store: Store) -> None:
        """Report on ``store``: readiness, /healthz, ``cmdbus_store_state`` and
        ``cmdbus_store_records``."""
        self.stores[name] = store
        metrics.STORE_RECORDS.labels(store=name).set_function(lambda: store.records)
        for state in StoreState:
            metrics.STORE_STATE.labels(store=name, state=state.value).set_function(
                partial(_is_state, store, state)
            )

    def face_crashed(self, face: str) -> None:
        self.faces[face] = FaceState.CRASHED
        self.crashed_at[face] = trio.current_time()

    def task_crashed(self, task: str) -> None:
        self.tasks_crashed_at.setdefault(task, trio.current_time())

    def dead_faces(self) -> list[str]:
        """Faces crashed for longer than the liveness window. Readiness has failed all that
        while; failing liveness too makes Kubernetes restart the pod, which a crashed face
        needs: nothing in the process starts it again."""
        now = trio.current_time()
        return [
            f"face {face} crashed {now - at:.1f} s ago"
            for face, at in sorted(self.crashed_at.items())
            if self.faces.get(face) is FaceState.CRASHED and now - at > self.heartbeat.window
        ]

    def dead_tasks(self) -> list[str]:
        """Background tasks (committers, timers, samplers, groups) crashed for longer than
        the liveness window: as for a face, only a restart brings one back."""
        now = trio.current_time()
        return [
            f"task {task} crashed {now - at:.1f} s ago"
            for task, at in sorted(self.tasks_crashed_at.items())
            if now - at > self.heartbeat.window
        ]

    def readiness(self) -> Readiness:
        reasons: list[str] = []
        if self.draining:
            reasons.append("draining: shutting down")
        elif not self.serving:
            reasons.append("starting: faces or stores not open yet")
        elif role := self.role_not_ready():
            reasons.append(role)
        reasons += [
            f"face {face} {state.value}"
            for face, state in sorted(self.faces.items())
            if state is not FaceState.LISTENING and not self.draining
        ]
        reasons += [f"task {task} crashed" for task in sorted(self.tasks_crashed_at)]
        reasons += [
            f"store {name} poisoned: {store.poisoned_reason}"
            for name, store in sorted(self.stores.items())
            if store.state is StoreState.POISONED
        ]
        return Readiness(not reasons, tuple(reasons))

    def summary(self) -> dict[str, Any]:
        """The /healthz document."""
        readiness = self.readiness()
        loop = self.heartbeat.statistics()
        return {
            "status": "ok" if readiness.ready and not loop.stalled else "degraded",
            "version": __version__,
            "uptime_s": round(trio.current_time() - self.started_at, 3),
            "ready": readiness.ready,
            "not_ready_reasons": list(readiness.reasons),
            "live": not loop.stalled,
            "loop": {
                "stalled": loop.stalled,
                "reason": loop.reason,
                "last_lag_ms": round(loop.last_lag * 1000, 3),
                "worst_recent_lag_ms": round(loop.worst_recent_lag * 1000, 3),
                "heartbeat_age_ms": round(loop.beat_age * 1000, 3),
            },
            "faces": {
                face: {"state": state.value, "address": self.addresses.get(face)}
                for face, state in self.faces.items()
            },
            "gates": {face: attrs.asdict(gate.statistics()) for face, gate in self.gates.items()},
            "stores": {
                name: {"state": store.state.value, "poisoned_reason": store.poisoned_reason}
                for name, store in self.stores.items()
            },
        }


def _single() -> dict[str, object]:
    return {"role": "single", "name": None, "epoch": 0, "primary": None, "in_sync": False,
            "behind_records": 0, "primary_faces": {}}  # fmt: skip
