from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdbus_trio.protocol import ErrorCode, LocalProtocolError
from cmdbus_trio.protocol import pages as paging
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
    built = paging.with_records(head, fragments, tail)
    assert json.loads(built) == {**head, "records": [json.loads(f) for f in fragments], **tail}
    assert paging.reply_size(head, sum(map(len, fragments)), count, tail) == len(built)


def _reference_page(
    head: dict[str, object], items: list[tuple[int, bytes]], limit: int, max_reply: int
) -> bytes | None:
    """What a paged reply holds, one record at a time: as many records as fit by count
    and by bytes (None: the first alone is over the cap)."""
    taken: list[tuple[int, bytes]] = []
    for item in items:
        built = paging.with_records(
            head | {"returned": limit}, [f for _, f in [*taken, item]], {"next_after": 1 << 63}
        )
        if len(taken) == limit or len(built) > max_reply:
            break
        taken.append(item)
    if not taken and items:
        return None
    more = len(taken) < len(items)
    tail = {"next_after": taken[-1][0] if more else None}
    return paging.with_records(head | {"returned": len(taken)}, [f for _, f in taken], tail)


@given(
    sizes=st.lists(st.lists(st.integers(0, 40), max_size=6), max_size=5),
    limit=st.integers(1, 12),
    room=st.integers(0, 200),
)
def test_a_page_of_fragments_takes_what_a_record_at_a_time_would(
    sizes: list[list[int]], limit: int, room: int
) -> None:
    """Pages are cut by bisecting their ends, not record by record: the same records,
    limits and caps as the plain loop, at every boundary (empty pages included)."""
    keys = iter(range(1, 1000))
    pages = [
        paging.Fragments.of((next(keys), json.dumps("x" * n).encode()) for n in page)
        for page in sizes
    ]
    items = [pair for page in pages for pair in page]
    head = {"id": 1, "ok": True}
    max_reply = len(paging.with_records(head | {"returned": limit}, [], {"next_after": 1 << 63}))
    max_reply += room
    expected = _reference_page(head, items, limit, max_reply)
    if expected is None:
        with pytest.raises(LocalProtocolError, match=f"record {items[0][0]} alone"):
            paging.page(head, pages, limit=limit, max_reply=max_reply, name="record", returned=True)
        return
    built = paging.page(head, pages, limit=limit, max_reply=max_reply, name="record", returned=True)
    assert built == expected


def test_fragments_refuse_parts_that_disagree() -> None:
    assert list(paging.Fragments.joined([7, 9], [2, 3], b"ab,cde")) == [(7, b"ab"), (9, b"cde")]
    with pytest.raises(ValueError, match="disagree"):
        paging.Fragments.joined([7], [2, 3], b"ab,cde")
    with pytest.raises(ValueError, match="disagree"):
        paging.Fragments.joined([7, 9], [2, 3], b"ab,cdef")
