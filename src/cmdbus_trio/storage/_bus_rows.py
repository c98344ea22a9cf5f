"""What a bus log's reads return, and how its rows become those records: with their trace
context only where the log holds any (:meth:`BusLog._columns
<cmdbus_trio.storage.buslog.BusLog._columns>`)."""

from __future__ import annotations

from typing import Any

import attrs

from cmdbus_trio.protocol.trace import TraceContext


@attrs.frozen
class StoredRecord:
    sort_key: int
    subject: str
    record: str
    trace: TraceContext | None = None
    """The trace context it was published with (None: none)."""


@attrs.frozen
class DeadRecord:
    sort_key: int
    subject: str
    record: str
    deliveries: int
    trace: TraceContext | None = None


HIGHEST = (1 << 63) - 1
"""The highest sort key SQLite can hold."""

PLAIN = "sort_key, subject, record"
TRACED = f"{PLAIN}, traceparent, tracestate"
"""The columns a record is read from, without and with its trace context."""


def trace_of(traceparent: str | None, tracestate: str | None) -> TraceContext | None:
    return None if traceparent is None else TraceContext(traceparent, tracestate)


def stored_records(rows: list[Any], columns: str) -> list[StoredRecord]:
    """Rows of ``columns`` (:data:`PLAIN` or :data:`TRACED`) as records."""
    if columns is PLAIN:
        return [StoredRecord(*row) for row in rows]
    return [StoredRecord(row[0], row[1], row[2], trace_of(row[3], row[4])) for row in rows]
