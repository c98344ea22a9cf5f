"""The event claim face (:9104): named consumer groups of the event bus. Every record goes
to every group; the members of one group compete for it, with leases exactly as on the
command claim face (``faces/_claim.py``). Every request names its ``group``; a v2 ``next``
may create one with ``from``: ``beginning`` or ``tail``."""

from __future__ import annotations

from typing import Any

import trio

from cmdbus_trio.bus import Bus
from cmdbus_trio.bus.claims import Claims
from cmdbus_trio.protocol import FieldError

from . import FaceContext
from ._claim import ClaimHandler
from ._listen import serve as serve_connections


async def serve(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    bus = ctx.store("events", Bus)
    groups = bus.groups
    if groups is None:
        raise TypeError("the event claim face needs the event bus's consumer groups")

    async def resolve(group: Any, start: Any) -> Claims:
        if not isinstance(group, str):
            raise FieldError("group", "expected the name of a consumer group")
        return await groups.get(group, start)

    await serve_connections(
        ctx,
        lambda _send: ClaimHandler(ctx, bus, resolve, groups.delete),
        task_status=task_status,
    )
