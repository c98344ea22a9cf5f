"""W3C trace context as a record carries it (docs/protocol.md, "Trace context").

A v2 publish may give each record a ``traceparent`` and a ``tracestate``. They are checked
here, stored beside the record (never inside its JSON text, which v1 delivers as it is),
and handed back with every v2 delivery of it. The writer does not interpret them beyond
the format: they belong to the publisher's trace.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import attrs

from ._fields import FieldError
from ._json import dumps_str

FIELDS: Final = frozenset({"traceparent", "tracestate"})
TRACEPARENT_CHARS: Final = 55
"""A version-00 ``traceparent``'s length, the only version accepted."""
MAX_TRACESTATE_BYTES: Final = 512
_TRACEPARENT: Final = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-fA-F]{2}")
_TRACESTATE: Final = re.compile(r"[\x20-\x7e]*")
"""W3C list members are printable ASCII; the list's finer grammar is the tracer's."""


@attrs.frozen
class TraceContext:
    """A record's ``traceparent`` and, when it has one, its ``tracestate``."""

    traceparent: str
    tracestate: str | None = None

    def json_members(self) -> bytes:
        """``,"traceparent":…[,"tracestate":…]``: the members a delivery's JSON object
        carries after its other fields (a traceparent is checked hex and dashes, so it
        needs no escaping)."""
        members = f',"traceparent":"{self.traceparent}"'
        if self.tracestate is not None:
            members += f',"tracestate":{dumps_str(self.tracestate)}'
        return members.encode()

    def as_fields(self) -> dict[str, str]:
        """The members as a dict, for a reply built from one."""
        if self.tracestate is None:
            return {"traceparent": self.traceparent}
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}


def decode(fields: Mapping[str, Any], where: str = "") -> TraceContext | None:
    """The trace context among ``fields`` (a ``publish`` request, or one item of a
    ``publish_batch``), or None when it has none. ``where`` prefixes the field names in
    errors (``records[3].``).

    Error handling: :class:`FieldError` naming ``traceparent`` or ``tracestate``: a
    traceparent that is not version 00 (``00-<32 hex>-<16 hex>-<2 hex>``, lowercase ids)
    or has an all-zero trace or span id; a tracestate that is not printable ASCII, is
    over :data:`MAX_TRACESTATE_BYTES`, or comes without a traceparent (W3C: it means
    nothing alone). An empty tracestate is no tracestate, also without a traceparent.
    """
    parent = fields.get("traceparent")
    state = fields.get("tracestate")
    if parent is None:
        if state is not None and state != "":  # an empty one is none, with or without
            raise FieldError(f"{where}tracestate", "given without a traceparent")
        return None
    return TraceContext(traceparent(parent, where), tracestate(state, where) or None)


def traceparent(value: Any, where: str = "") -> str:
    field = f"{where}traceparent"
    if not isinstance(value, str):
        raise FieldError(field, "expected a W3C traceparent string")
    if len(value) > TRACEPARENT_CHARS:
        raise FieldError(field, f"over {TRACEPARENT_CHARS} characters")
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        raise FieldError(
            field, "expected 00-<32 lowercase hex>-<16 lowercase hex>-<2 hex> (W3C, version 00)"
        )
    if match[1] == "0" * 32:
        raise FieldError(field, "the trace id is all zeros")
    if match[2] == "0" * 16:
        raise FieldError(field, "the span id (parent id) is all zeros")
    return value


def tracestate(value: Any, where: str = "") -> str | None:
    field = f"{where}tracestate"
    if value is None:
        return None
    if not isinstance(value, str):
        raise FieldError(field, "expected a W3C tracestate string")
    if len(value) > MAX_TRACESTATE_BYTES:  # ASCII, checked next: a character is a byte
        raise FieldError(field, f"over {MAX_TRACESTATE_BYTES} bytes")
    if not _TRACESTATE.fullmatch(value):
        raise FieldError(field, "expected printable ASCII (W3C list members)")
    return value
