"""What a data face gives the connection runner, and what it may raise or return.

A face supplies a :class:`FaceHandler` (how to answer a v1 frame and a v2 request);
``faces._connection`` runs the connections. A v2 request is answered by the awaitable the
handler returns, run in a task, or, when it returns a :class:`Deferred`, by the callback
that settles it (a group committer, the Gate), with no task of its own. Which of the two
is the op's, never the moment's: an op has one way to complete.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import attrs

from cmdbus_trio.admission import DeadlineExceeded, GateClosed, Shed
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.protocol import ErrorCode, LocalProtocolError, RemoteProtocolError, Request
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage.tier import VersionConflict

T = TypeVar("T")
P = TypeVar("P")


DRAIN_RETRY_AFTER_MS = 1000
"""The ``retry_after_ms`` of a draining writer's ``unavailable``: about when the next
writer (or this one, restarted) serves."""


class FaceError(Exception):
    """An error answer: v2 ``{"ok": false, "error": …}``, v1 as the face words it."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        retry_after_ms: int | None = None,
        primary: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.primary = primary
        """A member that is not primary: the face's ``HOST:PORT`` on the primary."""


class CloseConnection(Exception):
    """Close the connection, after ``final`` if given (v1's documented response to bad
    input; a v2 subscriber cut off as a slow consumer)."""

    def __init__(self, outcome: str = "protocol_error", final: bytes | None = None) -> None:
        super().__init__(outcome)
        self.outcome = outcome
        self.final = final


Sender = Callable[[bytes], Awaitable[bool]]
"""Sends bytes on the connection, in order; False once the peer is gone."""


def as_face_error(exc: Exception) -> FaceError | None:
    """The answer for an exception from admission, the stores or the codecs."""
    if isinstance(exc, FaceError):
        return exc
    if isinstance(exc, Shed):
        if exc.reason.value == "deadline":
            return FaceError(ErrorCode.DEADLINE, "the request's budget ran out before it started")
        return FaceError(ErrorCode.BUSY, exc.reason.value, exc.retry_after_ms)
    if isinstance(exc, DeadlineExceeded):
        return FaceError(ErrorCode.DEADLINE, "the request's budget ran out; read work stopped")
    if isinstance(exc, GateClosed):  # draining, or the consumer group was deleted
        # A drain's answer says when to ask again: the clients take it as the writer
        # being away for a moment (a poisoned store's, or a deleted group's, does not).
        retry_after = DRAIN_RETRY_AFTER_MS if exc.draining else None
        return FaceError(ErrorCode.UNAVAILABLE, str(exc) or "the writer is draining", retry_after)
    if isinstance(exc, StoreUnavailable):
        return FaceError(ErrorCode.UNAVAILABLE, str(exc), exc.retry_after_ms)
    if isinstance(exc, VersionConflict):
        return FaceError(ErrorCode.CONFLICT, str(exc))
    if isinstance(exc, RemoteProtocolError | LocalProtocolError) and not exc.fatal:
        return FaceError(exc.code, exc.hint)  # a bad field, or a reply over the cap
    return None


@attrs.frozen
class V1Reply:
    op: str
    data: bytes
    """Sent as it is (a face frames it, or not, as its v1 dialect says)."""
    outcome: str = "ok"


class FaceHandler(Protocol):
    gated_ops: frozenset[str]
    """The v2 ops that take a Gate slot (the others never wait for one)."""
    large_reply_ops: frozenset[str]
    """The v2 ops whose reply may be as large as the reply cap (pages): a connection
    runs only as many at once as its unsent-bytes cap holds (at least one)."""

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        """Answer one v1 frame. Raise :class:`CloseConnection` to close instead."""
        ...

    def v2(self, request: Request, arrival: float) -> Awaitable[bytes] | Deferred[bytes]:
        """Start one v2 request; the awaitable (run in a task of its own) or the
        :class:`Deferred` gives its reply body (``{"id": …, "ok": true, …}``). Called in
        the order the requests arrived, so whatever this does before returning keeps that
        order (an ``async def`` does nothing before it is awaited). Raise, here or from
        the awaitable, or settle with, an exception that :func:`as_face_error` maps, for
        an error answer."""
        ...

    def holding(self) -> bool:
        """The connection holds work that has timers of its own (claim leases): it is
        not idle while it does, even when it asks nothing."""
        ...

    def closed(self, outcome: str) -> None:
        """The connection ended (``outcome``: why, as counted in
        ``cmdbus_connections_total``): let go of what it held."""
        ...
