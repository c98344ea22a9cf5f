"""What a client call can raise: one exception class per v2 error code, plus transport
failures. Nothing here imports trio."""

from __future__ import annotations

from typing import Any, ClassVar

from cmdbus_trio.protocol import ErrorCode


class ClientError(Exception):
    """Base of everything the cmdbus-trio clients raise."""

    shard: int | None = None
    """Set by the routers and sharded claim clients: the shard whose writer failed."""


class ConnectionLost(ClientError):
    """The connection ended (closed by the server, reset, or broken by a protocol
    violation) before the reply came. Whether the request was carried out is unknown."""


class ClientClosed(ConnectionLost):
    """The client was closed (by the application): its calls end, and none reconnects."""


class CannotConnect(ConnectionLost):
    """No connection could be made (refused, unreachable, timed out): nothing was sent,
    so any call may be tried again, say while a writer is starting."""


class ServerError(ClientError):
    """The server answered ``{"ok": false, "error": …}``. ``code`` is the v2 error code."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(
        self, message: str, *, retry_after_ms: int | None = None, primary: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.primary = primary
        """From a member of a pair that is not primary: the face's address on the
        primary, where it knows (the clients go there)."""

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class Invalid(ServerError):
    """A malformed or missing field; the message names it."""

    code = ErrorCode.INVALID


class Unsupported(ServerError):
    code = ErrorCode.UNSUPPORTED


class TooLarge(ServerError):
    code = ErrorCode.TOO_LARGE


class Busy(ServerError):
    """Shed by admission control; retry after ``retry_after_ms``. Nothing was done."""

    code = ErrorCode.BUSY


class DeadlineExceeded(ServerError):
    """The call's time budget ran out: the server said ``deadline``, or no reply came in
    time (then whether a write was carried out is unknown)."""

    code = ErrorCode.DEADLINE


class Unavailable(ServerError):
    """The face or its store cannot serve now (draining, or a poisoned store)."""

    code = ErrorCode.UNAVAILABLE


class Conflict(ServerError):
    """``expected_version`` did not match; nothing was stored."""

    code = ErrorCode.CONFLICT


class InternalError(ServerError):
    code = ErrorCode.INTERNAL


ERRORS: dict[ErrorCode, type[ServerError]] = {
    cls.code: cls
    for cls in (Invalid, Unsupported, TooLarge, Busy, DeadlineExceeded, Unavailable, Conflict)
}
ERRORS[ErrorCode.INTERNAL] = InternalError


def error_from_reply(error: Any) -> ServerError:
    """The exception for a reply's ``error`` object; an unknown code maps to
    :class:`InternalError` with the code kept in the message."""
    if not isinstance(error, dict):
        return InternalError(f"malformed error object: {error!r}")
    message = str(error.get("message", ""))
    retry_after = error.get("retry_after_ms")
    retry_after_ms = retry_after if isinstance(retry_after, int) else None
    primary = error.get("primary") if isinstance(error.get("primary"), str) else None
    try:
        cls = ERRORS[ErrorCode(str(error.get("code")))]
    except ValueError:
        return InternalError(f"{error.get('code')}: {message}", retry_after_ms=retry_after_ms)
    return cls(message, retry_after_ms=retry_after_ms, primary=primary)
