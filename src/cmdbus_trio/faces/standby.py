"""Every data face on a member that is not primary (a standby, or one still finding out):
it listens, so clients connect and learn where to go, and answers every v2 request after
the hello ``unavailable``, with ``retry_after_ms`` and, where known, ``primary``: that
face's ``HOST:PORT`` on the primary. v1 gets v1's answer to an unavailable writer: the
tier's ``unavailable <why>`` text, the other faces' close.

A request already sent to a member that was primary a moment ago may have been stored:
clients repeat it with the same msg_id (docs/protocol.md says so).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.protocol import ErrorCode, Request, encode_frame
from cmdbus_trio.protocol import tier as tier_codec

from . import FaceContext
from ._handler import CloseConnection, FaceError, V1Reply
from ._listen import serve as serve_connections

RETRY_AFTER_MS = 500
"""When to ask again: about when a standby takes over, or a primary is found."""


class StandbyHandler:
    gated_ops: frozenset[str] = frozenset()
    large_reply_ops: frozenset[str] = frozenset()

    def __init__(self, face: str, primary: Callable[[], str | None]) -> None:
        self.face = face
        self.primary = primary

    def _error(self) -> FaceError:
        where = self.primary()
        message = "this member is not primary" + (
            f": the primary serves this face at {where}" if where else ": no primary yet"
        )
        return FaceError(ErrorCode.UNAVAILABLE, message, RETRY_AFTER_MS, where)

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        if self.face != "tier":
            raise CloseConnection("unavailable")  # v1 has no error frame
        error = self._error()
        text = tier_codec.v1_error(error.code, error.message)
        return V1Reply("unknown", encode_frame(text), error.code.value)

    def v2(self, request: Request, arrival: float) -> Deferred[bytes]:
        raise self._error()

    def holding(self) -> bool:
        return False

    def closed(self, outcome: str) -> None:
        pass  # stateless


async def serve(
    ctx: FaceContext,
    primary: Callable[[], str | None],
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``ctx``'s face as a member that is not primary, until ``ctx.draining``.
    ``primary``: the face's address on the primary, when known."""
    handler = StandbyHandler(ctx.name, primary)
    await serve_connections(ctx, lambda _send: handler, task_status=task_status)
