"""Open files: the writer's descriptors, shared out so that a flood of connections to any
face never takes the probes, the stores or the other faces down.

Many container runtimes start a process with a soft limit of 1,024 open files, below the
per-face cap of ``CMDBUS_MAX_CONNECTIONS`` (1,024): one client opening 1,200 idle
connections then ran the writer out of descriptors; ``/healthz`` stopped answering (a
kubelet restarts the pod), the other faces stopped accepting, and every accept failed
with EMFILE. So, at start: the soft limit is raised to the hard one (as Go's runtime
does), a reserve is counted out for everything but the data faces' connections, and the
per-face caps are made to fit in the rest. Each user of the reserve is bounded on its own:
the stores open every descriptor they will use at start (a pool of fixed size,
``storage/_sqlite.py``), the control face and each lag port hold at most a fixed number
of connections (:mod:`cmdbus_trio.control.face`).
"""

from __future__ import annotations

import logging
import resource
from typing import Final

import attrs

from ..logs import event
from . import (
    DATA_FACE_NAMES,
    LAG_PORT_NAMES,
    SETTINGS_BY_NAME,
    Config,
    ConfigError,
    cpu_quota,
)

log = logging.getLogger(__name__)

STORE_FACES = {
    "tier": {"tier"},
    "commands": {"cmd_ingest", "cmd_claim"},
    "events": {"evt_ingest", "evt_claim", "evt_subscribe"},
}
"""Which faces use each store: a store is open while an enabled face needs it. Its file
is ``<data dir>/<name>.sqlite3``."""

CONTROL_CONNECTIONS: Final = 64
"""Connections the control face holds at once (probes and scrapers need a few); past it,
a new connection closes the one quiet the longest."""
LAG_PORT_CONNECTIONS: Final = 16
"""Connections each NoETL lag port holds at once, as :data:`CONTROL_CONNECTIONS`."""
SPARE: Final = 64
"""Descriptors for the rest: the listeners, the log, the data directory, the runtime's own
(epoll, wake-up pipes)."""
MIN_PER_FACE: Final = 16
"""Below this many connections a face is of no use: the writer refuses to start."""


def store_pool_size(config: Config, store: str) -> int:
    """SQLite connections of ``store``'s pool: as many as calls may run on it at once.

    The tier: its Gate's reads (``tier_max_inflight``), the appends' committer, retention
    and the writer's own calls (open, sizes). A bus: its claim face's and subscribe face's
    threads (a CPU quota each), its committer, body reader, retention and the writer's
    own. A call past these waits for a connection (``cmdbus_store_connection_waits_total``)."""
    if store == "tier":
        return config.tier_max_inflight + 3
    return 2 * cpu_quota() + 4


def open_stores(config: Config) -> list[str]:
    """The stores an enabled data face needs (each ``<data dir>/<name>.sqlite3``)."""
    enabled = {face for face in DATA_FACE_NAMES if config.bind(face) is not None}
    return [store for store, users in STORE_FACES.items() if users & enabled]


def reserved(config: Config) -> int:
    """Descriptors kept out of the data faces' reach: each store's pool (a database and
    a WAL file per connection, one shared-memory file), the control face's and the lag
    ports' connections and listeners, and :data:`SPARE`."""
    stores = sum(2 * store_pool_size(config, store) + 1 for store in open_stores(config))
    http = sum(
        cap + 1
        for cap, bind in (
            (CONTROL_CONNECTIONS, config.control_bind),
            *((LAG_PORT_CONNECTIONS, config.bind(port)) for port in LAG_PORT_NAMES),
        )
        if bind is not None
    )
    return stores + http + SPARE


def raise_soft_limit() -> tuple[int, int]:
    """Raise the soft limit of open files to the hard one; returns (before, now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):
        return soft, soft  # not allowed here: share out what there is
    return soft, wanted


def fit(config: Config, *, limit: int | None = None) -> Config:
    """``config`` with ``max_connections`` lowered, if need be, so that every enabled data
    face at its cap, plus the :func:`reserved` descriptors, fits in the open-files limit
    (the current soft limit after :func:`raise_soft_limit`, unless ``limit`` is given).
    Logs one line for what it changed.

    Error handling: raises :class:`ConfigError` when not even :data:`MIN_PER_FACE`
    connections a face fit."""
    if limit is None:
        before, limit = raise_soft_limit()
        if limit != before:
            event(log, logging.INFO, "open_files_limit_raised", soft_before=before, soft=limit)
    faces = sum(1 for face in DATA_FACE_NAMES if config.bind(face) is not None)
    if not faces or limit == resource.RLIM_INFINITY:
        return config
    kept = reserved(config)
    per_face = (limit - kept) // faces
    if per_face >= config.max_connections:
        return config
    if per_face < MIN_PER_FACE:
        raise ConfigError(
            SETTINGS_BY_NAME["max_connections"],
            str(config.max_connections),
            f"the open-files limit is {limit}, which leaves {max(0, per_face)} connections "
            f"for each of {faces} data faces after {kept} kept for the stores, the control "
            f"face and the lag ports; at least {MIN_PER_FACE} are needed: raise the limit "
            f"(ulimit -n) or turn faces off",
        )
    event(
        log,
        logging.WARNING,
        "connection_caps_lowered",
        open_files_limit=limit,
        data_faces=faces,
        reserved=kept,
        max_connections_wanted=config.max_connections,
        max_connections=per_face,
    )
    return attrs.evolve(config, max_connections=per_face)
