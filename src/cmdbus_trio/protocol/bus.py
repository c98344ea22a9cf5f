"""The ingest faces' requests: records, ``publish`` and ``publish_batch`` (docs/protocol.md,
"Command ingest (:9100)" and "Event ingest (:9103)")."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Any, Final

import attrs

from ._envelope import encode_ok
from ._fields import (
    FieldError,
    UnsupportedOp,
    execution_id,
    payload_json,
    payload_text,
    storable_text,
    transaction_id,
)
from ._json import dumps, loads
from .subjects import SubjectError, command_subject, event_subject, pool_of, shard_of
from .trace import FIELDS as TRACE_FIELDS
from .trace import TraceContext
from .trace import decode as decode_trace

MAX_BATCH: Final = 10_000
MAX_MSG_ID: Final = 256
GROUP_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""An event consumer group's name (the wire's ``group``, ``CMDBUS_EVT_GROUPS``)."""
GROUP_NAME_RULE: Final = "1-128 letters, digits, '_' or '-'"
_RECORD_FIELDS: Final = frozenset({"execution_id", "payload", "transaction_id", "global_sequence"})
_PUBLISH_FIELDS: Final = frozenset({"record", "msg_id"}) | TRACE_FIELDS
_WRAPPED_ITEM_FIELDS: Final = _PUBLISH_FIELDS
"""A ``publish_batch`` item with a ``msg_id`` or trace context: ``{"record": {...},
"msg_id": ..., "traceparent": ..., "tracestate": ...}``, shaped as ``publish`` is (a
record itself has no ``record``)."""


class BusKind(enum.Enum):
    COMMANDS = "commands"
    EVENTS = "events"


@attrs.frozen
class Published:
    """A published record's place, as a publish is answered: ``duplicate`` when its
    ``msg_id`` was seen within the dedup window (the first record's sort key);
    ``evicted`` when that first record was then evicted by the event log's byte cap
    (``CMDBUS_EVT_MAX_BYTES``), maybe before every group consumed it."""

    sort_key: int
    subject: str
    duplicate: bool
    evicted: bool = False


@attrs.frozen
class PublishRecord:
    execution_id: str | int
    payload: str
    transaction_id: str | None = None
    trace: TraceContext | None = None
    """Stored beside the record, not in its JSON text (v1 deliveries stay as they were)."""

    def stored(self) -> str:
        """The record as JSON text, as it is stored and later delivered."""
        value: dict[str, Any] = {"execution_id": self.execution_id, "payload": self.payload}
        if self.transaction_id is not None:
            value["transaction_id"] = self.transaction_id
        return dumps(value).decode()


@attrs.frozen
class Publish:
    record: PublishRecord
    msg_id: str | None = None
    op = "publish"


@attrs.frozen
class PublishBatch:
    records: tuple[PublishRecord, ...]
    msg_ids: tuple[str | None, ...] = ()
    """Each record's ``msg_id`` (None: none), in order; () when no record has one."""
    op = "publish_batch"


def decode_record(
    value: Any, field: str = "record", trace: TraceContext | None = None
) -> PublishRecord:
    """A record's fields, checked (the payload is only checked to be text here; it is
    parsed in the commit thread). ``global_sequence`` is ignored; unknown members are
    ``invalid``."""
    if not isinstance(value, dict):
        raise FieldError(field, "expected a JSON object")
    if unknown := sorted(set(value) - _RECORD_FIELDS):
        raise FieldError(f"{field}.{unknown[0]}", "unknown field")
    tx = value.get("transaction_id")
    return PublishRecord(
        execution_id(value.get("execution_id"), f"{field}.execution_id"),
        payload_text(value.get("payload"), f"{field}.payload"),
        None if tx is None else transaction_id(tx, f"{field}.transaction_id"),
        trace,
    )


def decode_batch_item(value: Any, field: str) -> tuple[PublishRecord, str | None]:
    """One of ``publish_batch``'s ``records``: a record, or a record wrapped with its
    ``msg_id`` or trace context (see :data:`_WRAPPED_ITEM_FIELDS`); and its msg_id."""
    if not (isinstance(value, dict) and "record" in value):
        return decode_record(value, field), None
    if unknown := sorted(set(value) - _WRAPPED_ITEM_FIELDS):
        raise FieldError(f"{field}.{unknown[0]}", "unknown field")
    trace = decode_trace(value, f"{field}.")
    record = decode_record(value["record"], f"{field}.record", trace)
    return record, _msg_id(value.get("msg_id"), f"{field}.msg_id")


def _msg_id(value: Any, field: str = "msg_id") -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_MSG_ID:
        raise FieldError(field, f"expected a string of 1 to {MAX_MSG_ID} characters")
    storable_text(value, field)
    return value


def publish_reply(
    request_id: int, op: Publish | PublishBatch, published: Sequence[Published]
) -> bytes:
    """The v2 reply to ``op``, its records placed as ``published`` (in order)."""
    if isinstance(op, Publish):
        first = published[0]
        body = {"sort_key": first.sort_key, "subject": first.subject, "duplicate": first.duplicate}
        if first.evicted:  # only then: the common reply stays as it was
            body["evicted"] = True
        return encode_ok(request_id, body)
    return encode_ok(request_id, {"sort_keys": [p.sort_key for p in published]})


def decode_v1_record(frame: bytes) -> PublishRecord:
    """A v1 ingest frame: one record. Any error means the documented close."""
    return decode_record(loads(frame))


def decode_op(op: str, fields: dict[str, Any]) -> Publish | PublishBatch:
    if op == "publish":
        if unknown := sorted(set(fields) - _PUBLISH_FIELDS):
            raise FieldError(unknown[0], "unknown field")
        trace = decode_trace(fields)
        msg_id = _msg_id(fields.get("msg_id"))
        return Publish(decode_record(fields.get("record"), trace=trace), msg_id)
    if op == "publish_batch":
        if unknown := sorted(set(fields) - {"records"}):
            raise FieldError(unknown[0], "unknown field")
        records = fields.get("records")
        if not isinstance(records, list) or not 1 <= len(records) <= MAX_BATCH:
            raise FieldError("records", f"expected a list of 1 to {MAX_BATCH} records")
        items = [decode_batch_item(r, f"records[{i}]") for i, r in enumerate(records)]
        msg_ids = tuple(msg_id for _, msg_id in items)
        return PublishBatch(tuple(record for record, _ in items), msg_ids if any(msg_ids) else ())
    raise UnsupportedOp(op, ("publish", "publish_batch"))


@attrs.frozen
class SubjectRule:
    """How a bus names and shards its records."""

    kind: BusKind
    shard: int = 0
    shard_count: int = 1

    def subject(self, record: PublishRecord, field: str = "record") -> str:
        """The record's subject; checks its payload and its shard. Runs in the commit
        thread: it parses the whole payload."""
        payload = payload_json(record.payload, f"{field}.payload")
        shard = shard_of(record.execution_id, self.shard_count)
        if shard != self.shard:
            raise FieldError(
                f"{field}.execution_id",
                f"belongs to shard {shard}; this writer owns shard {self.shard} "
                f"of {self.shard_count}",
            )
        try:
            if self.kind is BusKind.COMMANDS:
                return command_subject(pool_of(payload), shard)
            return event_subject(payload)
        except SubjectError as exc:
            raise FieldError(field, exc.hint) from None
