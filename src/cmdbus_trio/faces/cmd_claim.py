"""The command claim face (:9101): competing consumers of the command bus, in its one
consumer group, which requests never name (the handler is shared with the event claim
face: ``faces/_claim.py``)."""

from __future__ import annotations

import trio

from . import FaceContext
from ._claim import serve as serve_claims


async def serve(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    await serve_claims(ctx, "commands", task_status=task_status)
