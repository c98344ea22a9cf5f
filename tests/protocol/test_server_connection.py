"""The sans-io server connection (protocol.server): bytes in, events and frames out."""

from __future__ import annotations

import itertools
import json
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmdbus_trio.protocol import NEED_DATA, ErrorCode, Request, encode_frame, encode_ok
from cmdbus_trio.protocol.server import (
    UNKNOWN_OP,
    Answer,
    Closed,
    Dialect,
    FrameReceived,
    Opened,
    ServerConnection,
)

HELLO = encode_frame(b'{"hello": {"protocol": 2, "client": "t"}}')


def connection(**overrides: Any) -> ServerConnection:
    settings: dict[str, Any] = {
        "face": "tier",
        "server": "cmdbus-trio test",
        "max_request_bytes": 64,
        "max_reply_bytes": 48,
    }
    return ServerConnection(**(settings | overrides))


def body_of(frame: bytes) -> Any:
    (length,) = struct.unpack_from(">I", frame)
    assert len(frame) == 4 + length
    return json.loads(frame[4:])


def opened(**overrides: Any) -> ServerConnection:
    server = connection(**overrides)
    server.receive_data(HELLO)
    assert isinstance(server.next_event(), Opened)
    return server


def test_a_hello_opens_v2_and_its_reply_states_the_limits() -> None:
    server = connection()
    assert server.dialect is Dialect.UNDECIDED
    server.receive_data(HELLO[:5])
    assert server.next_event() is NEED_DATA
    assert server.in_partial_frame
    server.receive_data(HELLO[5:])
    event = server.next_event()
    assert isinstance(event, Opened)
    assert event.hello.client == "t"
    assert server.dialect is Dialect.V2
    assert not server.in_partial_frame
    assert body_of(event.reply) == {
        "ok": True,
        "protocol": 2,
        "server": "cmdbus-trio test",
        "face": "tier",
        "limits": {"max_request_bytes": 64, "max_reply_bytes": 48},
    }
    assert server.next_event() is NEED_DATA


def test_a_first_frame_that_is_not_a_hello_is_v1_and_goes_to_the_face() -> None:
    server = connection()
    server.receive_data(encode_frame(b"health") + encode_frame(b"x"))
    assert server.next_event() == FrameReceived(b"health")
    assert server.dialect is Dialect.V1
    assert server.next_event() == FrameReceived(b"x")
    assert server.next_event() is NEED_DATA


def test_a_bad_hello_is_answered_with_a_null_id_and_closes() -> None:
    server = connection()
    server.receive_data(encode_frame(b'{"hello": {"protocol": 3}}'))
    event = server.next_event()
    assert isinstance(event, Closed)
    assert event.outcome == "protocol_error" and not event.by_peer
    assert event.final is not None
    reply = body_of(event.final)
    assert reply["id"] is None and reply["error"]["code"] == "unsupported"
    assert server.next_event() == event == server.closed  # closed stays closed


@pytest.mark.parametrize(
    ("token", "accepted"), [("s3cret", True), ("s3cre", False), (7, False), (None, False)]
)
def test_with_an_auth_token_a_hello_must_carry_it(token: object, accepted: bool) -> None:
    server = connection(auth_token="s3cret")
    hello: dict[str, Any] = {"protocol": 2}
    if token is not None:
        hello["token"] = token
    server.receive_data(encode_frame(json.dumps({"hello": hello}).encode()))
    event = server.next_event()
    if accepted:
        assert isinstance(event, Opened)
        return
    assert isinstance(event, Closed) and event.outcome == "unauthorized"
    assert event.final is not None
    assert body_of(event.final)["error"] == {
        "code": "invalid",
        "message": "hello.token: missing or not accepted",
    }


@pytest.mark.parametrize("trusted", [True, False])
def test_with_an_auth_token_v1_is_taken_only_from_a_trusted_peer(trusted: bool) -> None:
    server = connection(auth_token="s3cret", v1_trusted=trusted)
    server.receive_data(encode_frame(b"health"))
    event = server.next_event()
    if trusted:
        assert event == FrameReceived(b"health")
    else:
        assert event == Closed("unauthorized")  # v1 has no error frame: just closed


def test_without_an_auth_token_any_peer_may_speak_either_dialect() -> None:
    assert opened(v1_trusted=False).dialect is Dialect.V2
    server = connection(v1_trusted=False)
    server.receive_data(encode_frame(b"health"))
    assert server.next_event() == FrameReceived(b"health")


def over_cap_header() -> bytes:
    return struct.pack(">I", 65)


def test_a_frame_over_the_request_cap_closes_v2_with_a_null_id_too_large() -> None:
    server = opened()
    server.receive_data(over_cap_header())  # refused at the header, before any body
    event = server.next_event()
    assert isinstance(event, Closed) and event.outcome == "too_large"
    assert event.final is not None
    reply = body_of(event.final)
    assert reply["id"] is None and reply["error"]["code"] == "too_large"


@pytest.mark.parametrize("first", [b"", encode_frame(b"health")])
def test_a_frame_over_the_cap_closes_v1_or_an_undecided_stream_without_a_word(
    first: bytes,
) -> None:
    server = connection()
    server.receive_data(first + over_cap_header())
    if first:
        assert isinstance(server.next_event(), FrameReceived)
    assert server.next_event() == Closed("too_large")


def test_the_end_of_the_stream_on_a_frame_boundary_is_the_peers_close() -> None:
    server = opened()
    server.receive_data(b"")
    assert server.next_event() == Closed("closed", by_peer=True)


def test_the_end_of_the_stream_inside_a_frame_is_a_protocol_error() -> None:
    server = opened()
    server.receive_data(encode_frame(b"{}")[:3])
    server.receive_data(b"")
    assert server.next_event() == Closed("protocol_error")


def test_a_request_is_read_only_when_asked() -> None:
    server = opened()
    frame = b'{"id": 3, "op": "health", "deadline_ms": 250, "x": [1]}'
    server.receive_data(encode_frame(frame))
    event = server.next_event()
    assert event == FrameReceived(frame)  # not parsed: the budget is taken first
    request = server.read_request(frame)
    assert request == Request(3, "health", 250, {"x": [1]})
    assert isinstance(request, Request) and request.budget == 0.25


@pytest.mark.parametrize(
    ("frame", "request_id", "field"),
    [
        (b"[1]", None, "request"),
        (b'{"op": "health"}', None, "id"),
        (b'{"id": -1, "op": "health"}', None, "id"),
        (b'{"id": 4}', 4, "op"),
        (b'{"id": 4, "op": "health", "deadline_ms": -1}', 4, "deadline_ms"),
    ],
)
def test_a_malformed_envelope_gets_an_error_naming_the_field_and_the_connection_goes_on(
    frame: bytes, request_id: int | None, field: str
) -> None:
    server = opened()
    answer = server.read_request(frame)
    assert isinstance(answer, Answer)
    assert (answer.op, answer.outcome) == (UNKNOWN_OP, "invalid")
    reply = body_of(answer.frame)
    assert reply["id"] == request_id
    assert reply["error"]["message"].startswith(f"{field}:")
    assert server.closed is None


@pytest.mark.parametrize("frame", [b"not json", b'{"id": 1', b"[" * 100_000])
def test_an_unparseable_frame_is_answered_with_a_null_id_and_closes(frame: bytes) -> None:
    server = opened()
    closed = server.read_request(frame)
    assert isinstance(closed, Closed) and closed.outcome == "protocol_error"
    assert closed.final is not None
    assert body_of(closed.final)["id"] is None
    server.receive_data(encode_frame(b'{"id": 2, "op": "health"}'))
    assert server.next_event() == closed  # nothing more is taken


def test_a_reply_over_the_reply_cap_is_answered_too_large_instead() -> None:
    server = opened()
    request = Request(9, "read_execution", None, {})
    fits = encode_ok(9, {"x": "y" * 10})
    answer = server.reply(request, fits)
    assert answer == Answer(encode_frame(fits), "read_execution", "ok")
    over = encode_ok(9, {"x": "y" * 40})
    answer = server.reply(request, over)
    assert (answer.op, answer.outcome) == ("read_execution", "too_large")
    reply = body_of(answer.frame)
    assert reply["id"] == 9 and reply["error"]["code"] == "too_large"
    assert server.closed is None


def test_an_error_answer_carries_its_retry_hint() -> None:
    answer = opened().error(5, "append", ErrorCode.BUSY, "waiters_full", 40)
    assert answer.outcome == "busy"
    assert body_of(answer.frame) == {
        "id": 5,
        "ok": False,
        "error": {"code": "busy", "message": "waiters_full", "retry_after_ms": 40},
    }


@settings(max_examples=300)
@given(
    st.lists(st.binary(max_size=40), max_size=6),
    st.lists(st.integers(1, 30), min_size=1, max_size=8),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, "s3cret"]),
)
def test_any_bytes_cut_anywhere_give_events_never_an_exception(
    bodies: list[bytes], cuts: list[int], hello_first: bool, eof: bool, token: str | None
) -> None:
    frames = [HELLO] if hello_first else []
    frames += [encode_frame(body) for body in bodies]
    if bodies and bodies[-1][:1] == b"!":
        frames.append(over_cap_header())
    stream = b"".join(frames)
    server = connection(auth_token=token, v1_trusted=bool(cuts[0] % 2))
    events: list[object] = []

    def drain() -> bool:
        """Take the events there are; True once closed."""
        while (event := server.next_event()) is not NEED_DATA:
            events.append(event)
            if isinstance(event, FrameReceived) and server.dialect is Dialect.V2:
                outcome = server.read_request(event.data)
                assert isinstance(outcome, Request | Answer | Closed)
            if isinstance(event, Closed):
                return True
        return False

    position, sizes = 0, itertools.cycle(cuts)
    while not drain() and position < len(stream):
        size = next(sizes)
        server.receive_data(stream[position : position + size])
        position += size
    if eof and server.closed is None:
        server.receive_data(b"")
        assert drain()  # the rest, then the end
    # Opened can only come first; nothing follows Closed but Closed.
    assert all(not isinstance(event, Opened) for event in events[1:])
    closed = [index for index, event in enumerate(events) if isinstance(event, Closed)]
    assert closed in ([], [len(events) - 1])
