from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """The v2 error codes (docs/protocol.md, "Error codes")."""

    INVALID = "invalid"
    UNSUPPORTED = "unsupported"
    TOO_LARGE = "too_large"
    BUSY = "busy"
    DEADLINE = "deadline"
    UNAVAILABLE = "unavailable"
    CONFLICT = "conflict"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A violation of the wire protocol.

    ``code`` is the v2 error code to answer with, ``hint`` a sentence for the peer's
    operator, and ``fatal`` says whether the connection must close after the answer
    (docs/protocol.md: after ``too_large`` or an unparseable frame).
    """

    def __init__(self, hint: str, *, code: ErrorCode = ErrorCode.INVALID, fatal: bool) -> None:
        super().__init__(hint)
        self.hint = hint
        self.code = code
        self.fatal = fatal


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow (e.g. a reply over the
    reply cap). The connection itself is still sound unless ``fatal`` says otherwise."""
