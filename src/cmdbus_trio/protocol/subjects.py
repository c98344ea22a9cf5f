"""Subjects, shards and filters (docs/protocol.md, "Records"; shards: docs/scale-out.md).

Commands go to ``commands.<pool>.shard.<n>``; events to ``events.<event_type>``. Filters
follow NATS: tokens split on ``.``, ``*`` matches one token, ``>`` one or more trailing
tokens and must be last.
"""

from __future__ import annotations

import re
import struct
from typing import Any, Final

import xxhash

from ._errors import ErrorCode, RemoteProtocolError
from ._fields import SURROGATE

SHARED_POOL: Final = "shared"
UNKNOWN_EVENT: Final = "unknown"
_I64_TEXT = re.compile(r"[+-]?[0-9]+")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_BAD_POOL = re.compile("[.*>\\s\ud800-\udfff]")  # a lone surrogate cannot be stored as text
_BAD_EVENT_TYPE = re.compile("[*>\\s\ud800-\udfff]")


class SubjectError(RemoteProtocolError):
    def __init__(self, hint: str) -> None:
        super().__init__(hint, code=ErrorCode.INVALID, fatal=False)


def as_i64(execution_id: str | int) -> int | None:
    """The id as a signed 64-bit integer when it is one, or is text that parses as one:
    an optional ``+``/``-`` then ASCII digits (leading zeros allowed) fitting in i64."""
    if isinstance(execution_id, int) and not isinstance(execution_id, bool):
        value = execution_id
    elif isinstance(execution_id, str) and _I64_TEXT.fullmatch(execution_id):
        value = int(execution_id, 10)
    else:
        return None
    return value if _I64_MIN <= value <= _I64_MAX else None


def shard_of(execution_id: str | int, shard_count: int) -> int:
    """XxHash64 (seed 0) of the id modulo the shard count: over the id's 8 little-endian
    bytes when it is an i64 (see :func:`as_i64`), else over its UTF-8 bytes."""
    if shard_count <= 1:
        return 0
    number = as_i64(execution_id)
    data = struct.pack("<q", number) if number is not None else str(execution_id).encode()
    return int(xxhash.xxh64_intdigest(data, seed=0) % shard_count)


def pool_of(payload: Any) -> str:
    """The command pool: the payload's ``execution_pool`` when a non-empty string."""
    pool = payload.get("execution_pool") if isinstance(payload, dict) else None
    if pool is None or pool == "":
        return SHARED_POOL
    if not isinstance(pool, str) or _BAD_POOL.search(pool):
        raise SubjectError(
            "payload.execution_pool: expected a string without '.', '*', '>', whitespace or "
            "a lone surrogate"
        )
    return pool


def command_subject(pool: str, shard: int) -> str:
    return f"commands.{pool}.shard.{shard}"


def event_subject(payload: Any) -> str:
    """``events.<event_type>`` with ``.`` replaced by ``_``; ``events.unknown`` when absent
    or empty."""
    event_type = payload.get("event_type") if isinstance(payload, dict) else None
    if event_type is None or event_type == "":
        return f"events.{UNKNOWN_EVENT}"
    if not isinstance(event_type, str) or _BAD_EVENT_TYPE.search(event_type):
        raise SubjectError(
            "payload.event_type: expected a string without '*', '>', whitespace or a lone surrogate"
        )
    return "events." + event_type.replace(".", "_")


def parse_filter(text: Any, field: str = "filter") -> tuple[str, ...]:
    """A filter's tokens. Raises :class:`SubjectError` for an empty filter, an empty
    token, or a ``>`` that is not the last token."""
    if not isinstance(text, str) or not text:
        raise SubjectError(f"{field}: expected a non-empty subject filter")
    if SURROGATE.search(text):  # matches nothing, and SQLite cannot take it as text
        raise SubjectError(f"{field}: a lone surrogate (\\ud800-\\udfff) is not Unicode text")
    tokens = tuple(text.split("."))
    if any(token == "" for token in tokens):
        raise SubjectError(f"{field}: {text!r} has an empty token")
    if ">" in tokens[:-1]:
        raise SubjectError(f"{field}: '>' must be the last token")
    return tokens


def matches(filter_tokens: tuple[str, ...], subject: str) -> bool:
    tokens = subject.split(".")
    for index, wanted in enumerate(filter_tokens):
        if wanted == ">":
            return len(tokens) > index
        if index >= len(tokens) or (wanted != "*" and wanted != tokens[index]):
            return False
    return len(tokens) == len(filter_tokens)
