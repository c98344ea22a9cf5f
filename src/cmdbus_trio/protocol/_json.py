from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate
from typing import Any, Final

from ._errors import RemoteProtocolError


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_decoder = json.JSONDecoder(parse_constant=_refuse_constant)


MAX_DEPTH: Final = 128
"""Deepest nesting of arrays and objects accepted in a payload (``loads(max_depth=...)``),
checked before parsing. A payload is stored, and parsed in the commit and tier threads:
one nested 100,000 deep (200 KB, under every cap) used to end in a RecursionError there,
which failed every other record of the group commit it had joined."""


class TooDeep(RemoteProtocolError):
    """A text nested deeper than the ``max_depth`` it was read with."""


def loads(body: bytes, *, max_depth: int | None = None) -> Any:
    """Strict JSON from a frame body or a payload: UTF-8 only, no NaN/Infinity, and at
    most ``max_depth`` levels deep when given. Raises a fatal :class:`RemoteProtocolError`
    (an unparseable frame closes the connection); its hint says why.

    A frame without ``max_depth`` is bounded by the parser's own recursion limit (near
    1,000 levels): what is deeper is answered like any unparseable frame, never a crash.
    (Checking frames as payloads are checked would cost a third of the parse of a large
    batch, for a frame that is never stored.)"""
    if max_depth is not None and _too_deep(body, max_depth):
        raise TooDeep(f"nested deeper than {max_depth} levels", fatal=True)
    try:
        text = body.decode("utf-8")
        value, end = _decoder.raw_decode(text, _skip_ws(text, 0))
        if _skip_ws(text, end) != len(text):
            raise ValueError("extra data after the JSON value")
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RemoteProtocolError(f"frame is not UTF-8 JSON: {exc}", fatal=True) from None
    return value


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, linear
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as signed bytes: +1, +1, -1, -1
_NOT_BRACKET = bytes(set(range(256)) - set(b"[]{}"))


def _too_deep(body: bytes, limit: int) -> bool:
    """Whether ``body`` nests arrays and objects deeper than ``limit``, found in C and
    without recursion: the depth is the highest running sum of its brackets outside
    strings. Most texts have fewer brackets than the limit and skip it all; the strings
    are taken out (the slow part) only for the others. (Counting brackets inside strings
    too is wrong both ways: ``["]]]…", [[[…]]]]`` hid 600 levels behind the string's.)"""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    return _depth(_STRING.sub(b"", body)) > limit


def _depth(body: bytes) -> int:
    return max(accumulate(array("b", body.translate(_STEP, _NOT_BRACKET))), default=0)


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
    # A lone surrogate in a string (JSON can carry one as "\ud800") is written back as
    # that escape: valid JSON and UTF-8, where a plain encode raised and failed the whole
    # reply or the group commit the record was in.
    return _encoder.encode(value).encode("utf-8", "backslashreplace")


def dumps_str(text: str) -> str:
    """A JSON string literal for ``text`` (the C encoder's fast path), as :func:`dumps`
    would write it inside a larger value."""
    return _encoder.encode(text)
