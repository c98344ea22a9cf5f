"""The event ingest face (:9103): the command ingest face's dialects and group commit, on
the event bus (its own database file, Gate and committer, so a busy event bus never slows
the command bus). Subjects are ``events.<event_type>`` (docs/protocol.md)."""

from __future__ import annotations

import trio

from cmdbus_trio.bus import Bus

from . import FaceContext
from ._listen import serve as serve_connections
from .cmd_ingest import IngestHandler


async def serve(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    handler = IngestHandler(ctx, ctx.store("events", Bus))
    await serve_connections(ctx, lambda _send: handler, task_status=task_status)
