from __future__ import annotations

import pytest

from cmdbus_trio.protocol import ErrorCode
from cmdbus_trio.protocol import tier as codec


def test_defaults() -> None:
    assert codec.decode_op("read_execution", {"execution_id": "e"}) == codec.ReadExecution(
        "eventlog", "e", 0, 1000
    )
    assert codec.decode_op("scan", {}) == codec.Scan("eventlog", 0, 100)
    assert codec.decode_op("append", {"execution_id": 5, "payload": "{}"}) == codec.Append(
        "eventlog", "5", "{}", "", None
    )
    assert codec.decode_op("health", {}) == codec.Health()


@pytest.mark.parametrize(("limit", "clamped"), [(0, 1), (-5, 1), (1, 1), (999, 999), (5000, 1000)])
def test_limit_is_clamped_to_1_1000(limit: int, clamped: int) -> None:
    assert codec.decode_op("scan", {"limit": limit}).limit == clamped  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "execution_id", [0, -1, (1 << 63) - 1, -(1 << 63), "abc", "a.b:c-d_e+f", "x" * 128, "007"]
)
def test_execution_ids_accepted(execution_id: int | str) -> None:
    decoded = codec.decode_op("read_execution", {"execution_id": execution_id})
    assert decoded.execution_id == str(execution_id)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "execution_id",
    [1 << 63, -(1 << 63) - 1, "", "x" * 129, "a/b", "..\\x", "a b", "é", True, None, 1.5, ["e"]],
)
def test_execution_ids_refused(execution_id: object) -> None:
    with pytest.raises(codec.FieldError, match=r"^execution_id: "):
        codec.decode_op("read_execution", {"execution_id": execution_id})


def test_v2_refuses_unknown_members_v1_ignores_them() -> None:
    fields = {"execution_id": "e", "payload": "{}", "action": "x"}
    with pytest.raises(codec.FieldError, match=r"^action: unknown field"):
        codec.decode_op("append", fields)
    assert codec.decode_v1(b'{"op": "append", "execution_id": "e", "payload": "{}", "action": 1}')


def test_unknown_op_is_unsupported_and_carries_the_op() -> None:
    with pytest.raises(codec.UnsupportedOp) as info:
        codec.decode_op("frob", {})
    assert info.value.op == "frob"
    assert info.value.code is ErrorCode.UNSUPPORTED


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"execution_id": "e", "payload": "{}", "transaction_id": 5}, "transaction_id"),
        ({"execution_id": "e", "payload": "{}", "transaction_id": "t" * 257}, "transaction_id"),
        ({"execution_id": "e", "payload": "{}", "expected_version": True}, "expected_version"),
        ({"execution_id": "e", "payload": None}, "payload"),
    ],
)
def test_append_fields_are_checked(fields: dict[str, object], field: str) -> None:
    with pytest.raises(codec.FieldError, match=f"^{field}: "):
        codec.decode_op("append", fields)


def test_batch_names_the_bad_payload() -> None:
    with pytest.raises(codec.FieldError, match=r"^payloads\[2\]: expected JSON text"):
        codec.decode_op("append_batch", {"execution_id": "e", "payloads": ["1", "2", 3]})
    with pytest.raises(codec.FieldError, match=r"^payloads: expected a list of 1 to 10000"):
        codec.decode_op("append_batch", {"execution_id": "e", "payloads": ["1"] * 10_001})


@pytest.mark.parametrize(
    ("payload", "event_id"),
    [
        ('{"event_id": "a"}', '"a"'),
        ('{"event_id": 7}', "7"),
        ('{"event_id": {"b": 1, "a": 2}}', '{"b":1,"a":2}'),
        ('{"event_id": null}', None),
        ('{"other": 1}', None),
        ("[1]", None),
        ('"text"', None),
    ],
)
def test_event_id_is_canonical_json_text(payload: str, event_id: str | None) -> None:
    assert codec.payload_event_id(payload) == event_id


@pytest.mark.parametrize("payload", ["{", "NaN", '{"a": Infinity}', "", "1 2"])
def test_payload_must_be_json(payload: str) -> None:
    with pytest.raises(codec.FieldError, match=r"^payload: not valid JSON text"):
        codec.payload_event_id(payload)


def test_v1_error_texts() -> None:
    assert codec.v1_error(ErrorCode.INVALID, "tier: x") == b"invalid tier: x"
    assert codec.v1_error(ErrorCode.UNSUPPORTED, "frob") == b"unsupported frob"
    assert codec.v1_error(ErrorCode.UNAVAILABLE, "draining") == b"unavailable draining"
    assert (
        codec.v1_error(ErrorCode.BUSY, "queue_timeout", 250)
        == b"busy queue_timeout retry_after_ms=250"
    )
    assert codec.v1_error(ErrorCode.DEADLINE, "late") == b"error late"
    assert codec.v1_error(ErrorCode.TOO_LARGE, codec.too_large_message(20, 10)) == (
        b"error reply of 20 bytes exceeds the 10-byte cap; page the query"
    )


@pytest.mark.parametrize("count", [0, 1, 3])
@pytest.mark.parametrize("tail", [{}, {"next_after": None}, {"next_after": 12}])
@pytest.mark.parametrize("head", [{}, {"id": 1, "ok": True, "returned": 3}])
def test_reply_size_matches_with_records(
    head: dict[str, object], tail: dict[str, object], count: int
) -> None:
    fragments = [b'{"a":1}', b'{"bb":22}', b'{"c":"x"}'][:count]
    built = codec.with_records(head, fragments, tail)
    import json

    assert json.loads(built) == {**head, "records": [json.loads(f) for f in fragments], **tail}
    assert codec.reply_size(head, sum(map(len, fragments)), count, tail) == len(built)
