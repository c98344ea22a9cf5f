"""The v2 request/reply envelope and the hello handshake that selects the dialect."""

from __future__ import annotations

import re
from typing import Any, Final

import attrs

from ._errors import ErrorCode, RemoteProtocolError
from ._fields import I64_MAX, is_int
from ._json import dumps, loads

PROTOCOL_VERSION: Final = 2
SUPPORTED_VERSIONS: Final = (2,)
MAX_REQUEST_ID: Final = I64_MAX


@attrs.frozen
class Hello:
    protocol: int
    client: str
    fields: dict[str, Any] = attrs.field(factory=dict)
    """Other members of the hello object (e.g. an auth token), for the face to check."""


@attrs.frozen
class Request:
    id: int
    op: str
    deadline_ms: int | None
    fields: dict[str, Any]
    """Every member but ``id``, ``op`` and ``deadline_ms``; the op's decoder checks them."""

    @property
    def budget(self) -> float | None:
        """Seconds the request may take (its ``deadline_ms``), or None: the face's
        default applies."""
        return None if self.deadline_ms is None else self.deadline_ms / 1000


_LEADING_WHITESPACE = re.compile(rb"[ \t\n\r]*")  # JSON's own, in C (no copy of the frame)


def detect_dialect(first_frame: bytes) -> Hello | None:
    """The dialect of a connection from its first frame: a :class:`Hello` for v2, ``None``
    for v1 (the frame is then the first v1 request, to be decoded by the face).

    Error handling: a hello that is malformed or asks for an unsupported version raises a
    fatal :class:`RemoteProtocolError`; answer it with :func:`encode_error` (``id`` null)
    and close.
    """
    start = _LEADING_WHITESPACE.match(first_frame)
    if start is None or not first_frame.startswith(b"{", start.end()):
        return None
    try:
        value = loads(first_frame)
    except RemoteProtocolError:
        return None  # not JSON: the v1 decoder of the face decides what it is
    if not (isinstance(value, dict) and len(value) == 1 and "hello" in value):
        return None
    hello = value["hello"]
    if not isinstance(hello, dict):
        raise RemoteProtocolError("hello: expected an object", fatal=True)
    version = hello.get("protocol")
    if not is_int(version):
        raise RemoteProtocolError("hello.protocol: expected an integer", fatal=True)
    if version not in SUPPORTED_VERSIONS:
        raise RemoteProtocolError(
            f"hello.protocol: version {version} is not supported; supported: "
            + ", ".join(map(str, SUPPORTED_VERSIONS)),
            code=ErrorCode.UNSUPPORTED,
            fatal=True,
        )
    client = hello.get("client", "")
    if not isinstance(client, str):
        raise RemoteProtocolError("hello.client: expected a string", fatal=True)
    extra = {key: item for key, item in hello.items() if key not in ("protocol", "client")}
    return Hello(version, client, extra)


def encode_hello_reply(
    *, server: str, face: str, max_request_bytes: int, max_reply_bytes: int
) -> bytes:
    return dumps(
        {
            "ok": True,
            "protocol": PROTOCOL_VERSION,
            "server": server,
            "face": face,
            "limits": {"max_request_bytes": max_request_bytes, "max_reply_bytes": max_reply_bytes},
        }
    )


class RequestError(RemoteProtocolError):
    """A v2 request that cannot be served; ``request_id`` is its id when it could be read."""

    def __init__(
        self, hint: str, *, request_id: int | None, code: ErrorCode = ErrorCode.INVALID
    ) -> None:
        super().__init__(hint, code=code, fatal=False)
        self.request_id = request_id


def parse_request(body: bytes) -> Request:
    """Decode a v2 request envelope.

    Error handling: an unparseable body raises a fatal :class:`RemoteProtocolError`
    (answer with ``id`` null, then close); a parseable but malformed envelope raises
    :class:`RequestError` naming the field (the connection stays usable).
    """
    value = loads(body)
    if not isinstance(value, dict):
        raise RequestError("request: expected a JSON object", request_id=None)
    request_id = value.get("id")
    if not is_int(request_id) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise RequestError(f"id: expected an integer in 0..{MAX_REQUEST_ID}", request_id=None)
    op = value.get("op")
    if not isinstance(op, str) or not op:
        raise RequestError("op: expected a non-empty string", request_id=request_id)
    deadline_ms = value.get("deadline_ms")
    if deadline_ms is not None and not (is_int(deadline_ms) and 0 <= deadline_ms <= I64_MAX):
        hint = f"deadline_ms: expected an integer in 0..{I64_MAX}"
        raise RequestError(hint, request_id=request_id)
    fields = {key: item for key, item in value.items() if key not in ("id", "op", "deadline_ms")}
    return Request(request_id, op, deadline_ms, fields)


def encode_ok(request_id: int, result: dict[str, Any]) -> bytes:
    return dumps({"id": request_id, "ok": True, **result})


def encode_error(
    request_id: int | None,
    code: ErrorCode,
    message: str,
    *,
    retry_after_ms: int | None = None,
    primary: str | None = None,
) -> bytes:
    error: dict[str, Any] = {"code": code.value, "message": message}
    if retry_after_ms is not None:
        error["retry_after_ms"] = retry_after_ms
    if primary is not None:
        error["primary"] = primary
    return dumps({"id": request_id, "ok": False, "error": error})
