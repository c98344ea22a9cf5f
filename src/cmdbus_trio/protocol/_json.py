from __future__ import annotations

import json
import re
from typing import Any

from ._errors import RemoteProtocolError


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_decoder = json.JSONDecoder(parse_constant=_refuse_constant)


def loads(body: bytes) -> Any:
    """Strict JSON from a frame body: UTF-8 only, no NaN/Infinity. Raises a fatal
    :class:`RemoteProtocolError` (an unparseable frame closes the connection)."""
    try:
        text = body.decode("utf-8")
        value, end = _decoder.raw_decode(text, _skip_ws(text, 0))
        if _skip_ws(text, end) != len(text):
            raise ValueError("extra data after the JSON value")
    except (UnicodeDecodeError, ValueError) as exc:
        raise RemoteProtocolError(f"frame is not UTF-8 JSON: {exc}", fatal=True) from None
    return value


_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's own


def _skip_ws(text: str, index: int) -> int:
    # In the regex engine (C): a frame of a megabyte of spaces, sent before any auth,
    # took a Python loop ~25x longer than parsing a megabyte of JSON.
    match = _WHITESPACE.match(text, index)
    assert match is not None  # the pattern matches the empty string
    return match.end()


# One encoder for every reply: json.dumps with non-default options builds a new encoder
# on each call, which costs more than encoding a small reply.
_encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps(value: Any) -> bytes:
    return _encoder.encode(value).encode("utf-8")


def dumps_str(text: str) -> str:
    """A JSON string literal for ``text`` (the C encoder's fast path), as :func:`dumps`
    would write it inside a larger value."""
    return _encoder.encode(text)
