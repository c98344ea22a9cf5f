"""The event subscribe face's requests, both dialects (docs/protocol.md, "Event subscribe")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from ._fields import FieldError, UnsupportedOp, is_int, whole_number
from ._json import loads
from .subjects import parse_filter

OPS: Final = ("subscribe",)
_FIELDS: Final = frozenset({"from", "filter"})


@attrs.frozen
class Subscribe:
    after: int
    """The request's ``from``: records after this sort key."""
    filter: tuple[str, ...] | None
    op = "subscribe"


@attrs.frozen
class V1Subscribe:
    shard: int
    cursor: int


def decode_op(op: str, fields: Mapping[str, Any]) -> Subscribe:
    """The v2 request ``subscribe {from?, filter?}``.

    Error handling: :class:`UnsupportedOp` for any other op, :class:`FieldError` naming
    the first bad field.
    """
    if op != "subscribe":
        raise UnsupportedOp(op, OPS)
    if unknown := sorted(set(fields) - _FIELDS):
        raise FieldError(unknown[0], "unknown field")
    after = whole_number(fields.get("from", 0), "from")
    tokens = None if fields.get("filter") is None else parse_filter(fields["filter"])
    return Subscribe(after, tokens)


def decode_v1(frame: bytes) -> V1Subscribe:
    """A v1 request ``{"shard": n, "cursor": c}``.

    Error handling: :class:`FieldError`, or the JSON decoder's error for a frame that is
    not JSON; v1 answers either by closing the connection.
    """
    value = loads(frame)
    if not isinstance(value, dict):
        raise FieldError("request", 'expected {"shard": n, "cursor": c}')
    shard, cursor = value.get("shard"), value.get("cursor")
    if not is_int(shard):
        raise FieldError("shard", "expected an integer")
    return V1Subscribe(shard, whole_number(cursor, "cursor"))
