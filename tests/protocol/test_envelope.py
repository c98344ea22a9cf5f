from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdbus_trio.protocol import (
    ErrorCode,
    Hello,
    RemoteProtocolError,
    RequestError,
    detect_dialect,
    encode_error,
    encode_hello_reply,
    encode_ok,
    loads,
    parse_request,
)


def test_hello_selects_v2() -> None:
    hello = detect_dialect(b'{"hello": {"protocol": 2, "client": "me"}}')
    assert hello == Hello(2, "me", {})


def test_hello_keeps_extra_members_for_the_face() -> None:
    hello = detect_dialect(b'{"hello": {"protocol": 2, "token": "s3cret"}}')
    assert hello is not None
    assert hello.client == ""
    assert hello.fields == {"token": "s3cret"}


@pytest.mark.parametrize(
    "first",
    [
        b"health",
        b'{"execution_id": 1, "payload": "{}"}',
        b'{"op": "append", "hello": 1}',
        b'{"Next": {"member": 1, "filter": "commands.>"}}',
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
    ],
)
def test_anything_else_is_v1(first: bytes) -> None:
    assert detect_dialect(first) is None


def test_unsupported_version_names_the_supported_ones() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        detect_dialect(b'{"hello": {"protocol": 3}}')
    assert info.value.code is ErrorCode.UNSUPPORTED
    assert info.value.fatal
    assert "supported: 2" in info.value.hint


@pytest.mark.parametrize(
    ("first", "field"),
    [
        (b'{"hello": 2}', "hello"),
        (b'{"hello": {"protocol": "2"}}', "hello.protocol"),
        (b'{"hello": {"protocol": true}}', "hello.protocol"),
        (b'{"hello": {}}', "hello.protocol"),
        (b'{"hello": {"protocol": 2, "client": 7}}', "hello.client"),
    ],
)
def test_malformed_hello_names_the_field(first: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        detect_dialect(first)
    assert info.value.code is ErrorCode.INVALID
    assert info.value.hint.startswith(field + ":")


def test_hello_reply_shape() -> None:
    reply = json.loads(
        encode_hello_reply(
            server="cmdbus-trio 0.1.0", face="tier", max_request_bytes=10, max_reply_bytes=20
        )
    )
    assert reply == {
        "ok": True,
        "protocol": 2,
        "server": "cmdbus-trio 0.1.0",
        "face": "tier",
        "limits": {"max_request_bytes": 10, "max_reply_bytes": 20},
    }


def test_request_parses() -> None:
    request = parse_request(b'{"id": 7, "op": "append", "deadline_ms": 250, "tier": "catalog"}')
    assert (request.id, request.op, request.deadline_ms) == (7, "append", 250)
    assert request.fields == {"tier": "catalog"}
    assert parse_request(b'{"id": 0, "op": "health"}').deadline_ms is None


@pytest.mark.parametrize(
    ("body", "field", "request_id"),
    [
        (b"[]", "request", None),
        (b'{"op": "x"}', "id", None),
        (b'{"id": "1", "op": "x"}', "id", None),
        (b'{"id": true, "op": "x"}', "id", None),
        (b'{"id": -1, "op": "x"}', "id", None),
        (b'{"id": 9223372036854775808, "op": "x"}', "id", None),
        (b'{"id": 3}', "op", 3),
        (b'{"id": 3, "op": ""}', "op", 3),
        (b'{"id": 3, "op": 5}', "op", 3),
        (b'{"id": 4, "op": "x", "deadline_ms": -5}', "deadline_ms", 4),
        (b'{"id": 4, "op": "x", "deadline_ms": 1.5}', "deadline_ms", 4),
    ],
)
def test_malformed_envelope_names_the_field_and_keeps_the_connection(
    body: bytes, field: str, request_id: int | None
) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(body)
    assert info.value.hint.startswith(field + ":")
    assert info.value.request_id == request_id
    assert info.value.code is ErrorCode.INVALID
    assert not info.value.fatal


@pytest.mark.parametrize(
    "body", [b"{", b'{"id": 1, "op": "x"} trailing', b"\xc3\x28", b'{"id": NaN}', b""]
)
def test_unparseable_frame_is_fatal(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_request(body)
    assert info.value.fatal
    assert not isinstance(info.value, RequestError)


def test_replies() -> None:
    assert json.loads(encode_ok(5, {"appended": True})) == {"id": 5, "ok": True, "appended": True}
    assert json.loads(encode_error(None, ErrorCode.TOO_LARGE, "big")) == {
        "id": None,
        "ok": False,
        "error": {"code": "too_large", "message": "big"},
    }
    busy = json.loads(encode_error(1, ErrorCode.BUSY, "queue_timeout", retry_after_ms=1000))
    assert busy["error"] == {"code": "busy", "message": "queue_timeout", "retry_after_ms": 1000}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=10,
)


@given(json_values)
def test_loads_round_trips_json(value: object) -> None:
    assert loads(json.dumps(value).encode()) == value


@given(st.binary(max_size=200))
def test_any_bytes_parse_or_give_a_protocol_error(body: bytes) -> None:
    # Anything else (TypeError, KeyError, ...) escaping would crash a face.
    with contextlib.suppress(RemoteProtocolError):
        parse_request(body)


@given(
    st.integers(1, 1 << 62),
    st.text(),
    st.text(),
    st.integers(0, 1 << 30),
    st.text(),
)
def test_record_fragment_is_the_json_of_the_record(
    sequence: int, execution_id: str, transaction_id: str, byte_len: int, payload: str
) -> None:
    from cmdbus_trio.protocol import dumps
    from cmdbus_trio.protocol.tier import record_fragment

    expected = dumps(
        {
            "global_sequence": sequence,
            "execution_id": execution_id,
            "transaction_id": transaction_id,
            "byte_len": byte_len,
            "payload": payload,
        }
    )
    assert record_fragment(sequence, execution_id, transaction_id, byte_len, payload) == expected


def test_json_whitespace_around_a_value_is_skipped_and_only_json_whitespace() -> None:
    """A megabyte of spaces around a value (under every cap, before any auth) is skipped
    in the regex engine, not a Python loop; other white space is not JSON."""
    padding = b" \t\r\n" * (1 << 18)
    assert loads(padding + b'{"a": 1}' + padding) == {"a": 1}
    assert detect_dialect(padding + b'{"hello": {"protocol": 2}}') is not None
    with pytest.raises(RemoteProtocolError):
        loads(b"\x0b{}")
    assert detect_dialect(b"\x0c{}") is None  # not JSON white space: a v1 frame
