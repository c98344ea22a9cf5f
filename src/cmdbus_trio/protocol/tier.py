"""The tier face's requests and replies, both dialects (docs/protocol.md, "Tier face").

Decoding checks every field and names the bad one; it never touches a store. Reply
encoding works on pre-encoded record fragments so that a page can be cut by bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from ._errors import ErrorCode
from ._fields import (
    FieldError,
    UnsupportedOp,
    execution_id,
    is_int,
    payload_json,
    payload_text,
    transaction_id,
    whole_number,
)
from ._json import dumps, dumps_str, loads

TIERS: Final = ("eventlog", "projection", "catalog")
DEFAULT_TIER: Final = "eventlog"
MAX_RECORDS_PER_REPLY: Final = 1000
DEFAULT_SCAN_LIMIT: Final = 100
MAX_BATCH: Final = 10_000
V1_HEALTH_REPLY: Final = b"ok tier-service v1"


@attrs.frozen
class TierRecord:
    """A stored record as a read returns it (the store's columns, in this order)."""

    global_sequence: int
    execution_id: str
    transaction_id: str
    byte_len: int
    payload: str


@attrs.frozen
class Health:
    op = "health"


@attrs.frozen
class Append:
    tier: str
    execution_id: str
    payload: str
    transaction_id: str = ""
    expected_version: int | None = None
    op = "append"


@attrs.frozen
class AppendBatch:
    tier: str
    execution_id: str
    payloads: tuple[str, ...]
    transaction_id: str = ""
    op = "append_batch"


@attrs.frozen
class ReadExecution:
    tier: str
    execution_id: str
    after: int = 0
    limit: int = MAX_RECORDS_PER_REPLY
    op = "read_execution"


@attrs.frozen
class Scan:
    tier: str
    after: int = 0
    limit: int = DEFAULT_SCAN_LIMIT
    op = "scan"


@attrs.frozen
class DeleteExecution:
    tier: str
    execution_id: str
    op = "delete_execution"


TierRequest = Health | Append | AppendBatch | ReadExecution | Scan | DeleteExecution
WRITE_OPS: Final = frozenset({"append", "append_batch", "delete_execution"})
V2_ONLY_OPS: Final = frozenset({"delete_execution"})
"""Clean-up tooling's ops: not in NoETL's v1 dialect."""

_FIELDS: Final[dict[str, frozenset[str]]] = {
    "health": frozenset({"tier"}),
    "append": frozenset({"tier", "execution_id", "payload", "transaction_id", "expected_version"}),
    "append_batch": frozenset({"tier", "execution_id", "payloads", "transaction_id"}),
    "read_execution": frozenset({"tier", "execution_id", "after", "limit"}),
    "scan": frozenset({"tier", "after", "limit"}),
    "delete_execution": frozenset({"tier", "execution_id"}),
}


def decode_v1(frame: bytes) -> TierRequest:
    """A v1 request: the bare text ``health``, or a JSON object with ``op``.

    Error handling: :class:`FieldError` (answer ``invalid …`` / ``unsupported …``), or a
    fatal :class:`RemoteProtocolError` when the frame is not JSON.
    """
    if frame.strip() == b"health":
        return Health()
    value = loads(frame)
    if not isinstance(value, dict):
        raise FieldError("request", "expected a JSON object or the text health")
    op = value.get("op")
    if not isinstance(op, str):
        raise FieldError("op", "expected a string")
    if op in V2_ONLY_OPS:
        raise UnsupportedOp(op, sorted(set(_FIELDS) - V2_ONLY_OPS))
    # v1 is what NoETL clients send: members we do not know are ignored, not refused.
    return decode_op(op, {k: v for k, v in value.items() if k != "op"}, strict=False)


def decode_op(op: str, fields: Mapping[str, Any], *, strict: bool = True) -> TierRequest:
    """The request for ``op`` from its fields (v2: the envelope's other members)."""
    known = _FIELDS.get(op)
    if known is None:
        raise UnsupportedOp(op, _FIELDS)
    if strict and (unknown := sorted(set(fields) - known)):
        raise FieldError(unknown[0], "unknown field")
    tier = _tier(fields)
    if op == "health":
        return Health()
    if op == "scan":
        return Scan(tier, _after(fields), _limit(fields, DEFAULT_SCAN_LIMIT))
    execution = str(execution_id(fields.get("execution_id")))
    if op == "read_execution":
        return ReadExecution(tier, execution, _after(fields), _limit(fields, MAX_RECORDS_PER_REPLY))
    if op == "delete_execution":
        return DeleteExecution(tier, execution)
    transaction = transaction_id(fields.get("transaction_id"))
    if op == "append":
        expected = fields.get("expected_version")
        if expected is not None:
            expected = whole_number(expected, "expected_version")
        return Append(tier, execution, payload_text(fields.get("payload")), transaction, expected)
    payloads = fields.get("payloads")
    if not isinstance(payloads, list) or not 1 <= len(payloads) <= MAX_BATCH:
        raise FieldError("payloads", f"expected a list of 1 to {MAX_BATCH} payloads")
    checked = tuple(payload_text(item, f"payloads[{i}]") for i, item in enumerate(payloads))
    return AppendBatch(tier, execution, checked, transaction)


def _tier(fields: Mapping[str, Any]) -> str:
    tier = fields.get("tier", DEFAULT_TIER)
    if tier is None:
        return DEFAULT_TIER
    if tier not in TIERS:
        raise FieldError("tier", f"unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
    return str(tier)


def _after(fields: Mapping[str, Any]) -> int:
    after = fields.get("after", 0)
    if after is None:
        return 0
    return whole_number(after, "after")


def _limit(fields: Mapping[str, Any], default: int) -> int:
    limit = fields.get("limit", default)
    if limit is None:
        return default
    if not is_int(limit):
        raise FieldError("limit", "expected an integer")
    return max(1, min(MAX_RECORDS_PER_REPLY, int(limit)))  # clamped, as docs/protocol.md says


def payload_event_id(payload: str, field: str = "payload") -> str | None:
    """Check that a payload is JSON text and return its ``event_id`` as canonical JSON
    text (``None`` when it has none). Runs in the request's worker thread: it parses
    the whole payload."""
    value = payload_json(payload, field)
    if isinstance(value, dict) and value.get("event_id") is not None:
        return dumps(value["event_id"]).decode()
    return None


# --- replies -------------------------------------------------------------------------


def append_body(global_sequence: int, log_record_count: int, deduplicated: bool) -> dict[str, Any]:
    return {
        "appended": True,
        "global_sequence": global_sequence,
        "log_record_count": log_record_count,
        "deduplicated": deduplicated,
    }


def append_batch_body(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "action": "ehdb.tier.append_batch",
        "outcome": "ok",
        "appended": sum(1 for body in bodies if not body["deduplicated"]),
        "requested": len(bodies),
        "results": [{"ok": True, "body": body} for body in bodies],
    }


def record_fragment(
    global_sequence: int, execution_id: str, transaction_id: str, byte_len: int, payload: str
) -> bytes:
    """One record of a read reply, encoded: replies are assembled from these fragments.

    Built from C-encoded string literals rather than by encoding a dict: this runs once per
    record returned, in a worker thread holding the GIL, so its cost is the probes' latency
    under load. The bytes are those of ``dumps({...})`` (a property test checks it)."""
    return (
        f'{{"global_sequence":{int(global_sequence)},"execution_id":{dumps_str(execution_id)},'
        f'"transaction_id":{dumps_str(transaction_id)},"byte_len":{int(byte_len)},'
        f'"payload":{dumps_str(payload)}}}'
    ).encode()


def v1_error(code: ErrorCode, message: str, retry_after_ms: int | None = None) -> bytes:
    """The v1 text error: ``invalid <why>``, ``unsupported <op>``, ``unavailable <why>``,
    ``busy <reason> retry_after_ms=<n>``, else ``error <why>``."""
    if code is ErrorCode.BUSY:
        return f"busy {message} retry_after_ms={retry_after_ms or 0}".encode()
    word = (
        code.value
        if code in (ErrorCode.INVALID, ErrorCode.UNSUPPORTED, ErrorCode.UNAVAILABLE)
        else "error"
    )
    return f"{word} {message}".encode("utf-8", "backslashreplace")  # a hint may quote input


def too_large_message(size: int, cap: int) -> str:
    return f"reply of {size} bytes exceeds the {cap}-byte cap; page the query"
