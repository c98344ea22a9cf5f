"""The command claim face (:9101): competing consumers of the command bus, one consumer
group (the handler is shared with the event claim face: ``faces/_claim.py``)."""

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
    bus = ctx.store("commands", Bus)
    claims = bus.claims
    if claims is None:
        raise TypeError("the command claim face needs the command bus's claim coordinator")

    async def resolve(group: Any, start: Any) -> Claims:
        if group is not None:
            raise FieldError("group", "the command bus has no consumer groups")
        if start is not None:
            raise FieldError("from", "the command bus has no consumer groups")
        return claims

    await serve_connections(
        ctx, lambda _send: ClaimHandler(ctx, bus, resolve), task_status=task_status
    )
