"""The event claim face (:9104): named consumer groups of the event bus. Every record goes
to every group; the members of one group compete for it, with leases exactly as on the
command claim face (``faces/_claim.py``). Every request names its ``group``; a v2 ``next``
may create one with ``from``: ``beginning`` or ``tail``."""

from __future__ import annotations

import trio

from . import FaceContext
from ._claim import serve as serve_claims


async def serve(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    await serve_claims(ctx, "events", task_status=task_status)
