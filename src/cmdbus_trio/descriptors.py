"""Open files: the writer's descriptors, shared out so that a flood of connections never
takes the probes or the stores down.

Many container runtimes start a process with a soft limit of 1,024 open files, below the
per-face cap of ``CMDBUS_MAX_CONNECTIONS`` (1,024): one client opening 1,200 idle
connections then ran the writer out of descriptors; ``/healthz`` stopped answering (a
kubelet restarts the pod), the other faces stopped accepting, and every accept failed
with EMFILE. So, at start: the soft limit is raised to the hard one (as Go's runtime
does), a reserve is kept for the control face, the stores and the listeners, and the
per-face caps are made to fit in the rest.
"""

from __future__ import annotations

import logging
import resource
from typing import Final

import attrs

from .config import DATA_FACE_NAMES, SETTINGS_BY_NAME, Config, ConfigError
from .logs import event

log = logging.getLogger(__name__)

RESERVED: Final = 256
"""Descriptors kept out of the data faces' reach: the control face's connections (probes,
scrapes), the stores (three files per SQLite connection in WAL mode, one connection per
thread at work), the listeners, the log."""
MIN_PER_FACE: Final = 16
"""Below this many connections a face is of no use: the writer refuses to start."""


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
    face at its cap, plus :data:`RESERVED`, fits in the open-files limit (the current
    soft limit after :func:`raise_soft_limit`, unless ``limit`` is given). Logs one line
    for what it changed.

    Error handling: raises :class:`ConfigError` when not even :data:`MIN_PER_FACE`
    connections a face fit."""
    if limit is None:
        before, limit = raise_soft_limit()
        if limit != before:
            event(log, logging.INFO, "open_files_limit_raised", soft_before=before, soft=limit)
    faces = sum(1 for face in DATA_FACE_NAMES if config.bind(face) is not None)
    if not faces or limit == resource.RLIM_INFINITY:
        return config
    per_face = (limit - RESERVED) // faces
    if per_face >= config.max_connections:
        return config
    if per_face < MIN_PER_FACE:
        raise ConfigError(
            SETTINGS_BY_NAME["max_connections"],
            str(config.max_connections),
            f"the open-files limit is {limit}, which leaves {max(0, per_face)} connections "
            f"for each of {faces} data faces after {RESERVED} kept for the control face and "
            f"the stores; at least {MIN_PER_FACE} are needed: raise the limit (ulimit -n) or "
            f"turn faces off",
        )
    event(
        log,
        logging.WARNING,
        "connection_caps_lowered",
        open_files_limit=limit,
        data_faces=faces,
        reserved=RESERVED,
        max_connections_wanted=config.max_connections,
        max_connections=per_face,
    )
    return attrs.evolve(config, max_connections=per_face)
