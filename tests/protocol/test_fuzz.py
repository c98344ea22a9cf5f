"""Fuzzing: hypothesis state machines and properties of the frame codec, the request
decoders of every face and the client's reply decoder; then random frames against a
running writer, which must answer each with an error or the documented close, never
with an internal error, and keep serving other clients. (`nox -s fuzz` runs the same
decoders under atheris for longer: fuzz/fuzz_protocol.py.)"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cmdbus_trio.client import ClientError
from cmdbus_trio.client._core import ClientProtocol
from cmdbus_trio.protocol import (
    CLOSED,
    NEED_DATA,
    FrameDecoder,
    RemoteProtocolError,
    bus,
    claim,
    detect_dialect,
    encode_frame,
    parse_request,
    subscribe,
    tier,
)
from cmdbus_trio.protocol._fields import FieldError, payload_json
from cmdbus_trio.protocol._json import MAX_DEPTH
from cmdbus_trio.protocol.subjects import parse_filter

from ..helpers import metric_sum, metrics_text, serving

CAP = 512

# Edges a careless or hostile client reaches: integers past 2^63 (JSON has no limit; they
# once answered `internal`), floats where integers belong, lone surrogates.
edge_integers = st.sampled_from([1 << 63, (1 << 63) - 1, 1 << 64, -(1 << 63) - 1, 10**400])
edge_text = st.text(alphabet=st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=4)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | edge_integers
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | edge_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["execution_id", "payload", "payloads", "tier", "after", "limit", "transaction_id",
     "expected_version", "record", "records", "msg_id", "filter", "group", "from",
     "sort_key", "timeout_ms", "delay_ms", "member", "id", "op", "other", "sort_keys",
     "Next", "Ack", "Nack", "shard", "cursor", "max", "traceparent", "tracestate"]
)  # fmt: skip
fields = st.dictionaries(field_names, json_values, max_size=5)


class FrameStream(RuleBasedStateMachine):
    """Frames in, cut anywhere; oversize headers and truncation; the decoder returns
    exactly the frames sent, or one final RemoteProtocolError."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = FrameDecoder(CAP)
        self.pending = b""
        self.sent: list[bytes] = []
        self.got: list[bytes] = []
        self.error: RemoteProtocolError | None = None
        self.ended = False

    # Rules check their own state instead of using preconditions: with a precondition,
    # hypothesis 6.100 (the lowest version we support) redraws a rule until one is
    # enabled, which after `close` took two minutes per run.
    @rule(body=st.binary(max_size=CAP))
    def frame(self, body: bytes) -> None:
        if self.ended or self.error is not None:
            return
        self.pending += encode_frame(body)
        self.sent.append(body)

    @rule(size=st.integers(CAP + 1, (1 << 32) - 1))
    def oversize_header(self, size: int) -> None:
        if self.ended or self.error is not None:
            return
        self.pending += struct.pack(">I", size)
        self.sent.append(b"<too large>")

    @rule(cut=st.integers(1, 64))
    def deliver(self, cut: int) -> None:
        if self.ended or self.pending == b"":
            return
        chunk, self.pending = self.pending[:cut], self.pending[cut:]
        self.decoder.receive_data(chunk)
        self._pull()

    @rule()
    def close(self) -> None:
        if self.ended:
            return
        if self.pending:
            self.decoder.receive_data(self.pending)
            self.pending = b""
        self._pull()
        self.decoder.receive_data(b"")
        self.ended = True
        self._pull()

    @rule()
    def look_again(self) -> None:
        self._pull()  # asking again changes nothing

    def _pull(self) -> None:
        while self.error is None:
            try:
                frame = self.decoder.next_frame()
            except RemoteProtocolError as exc:
                self.error = exc
                return
            if frame is NEED_DATA or frame is CLOSED:
                return
            assert isinstance(frame, bytes)
            self.got.append(frame)

    @invariant()
    def frames_in_order(self) -> None:
        assert self.sent[: len(self.got)] == self.got
        if self.error is not None:  # the first frame it could not return is the reason
            assert self.error.fatal
            with pytest.raises(RemoteProtocolError):
                self.decoder.next_frame()  # and it stays broken
        assert self.decoder.buffered <= CAP + 4 + 64


TestFrameStream = FrameStream.TestCase
TestFrameStream.settings = settings(max_examples=150, stateful_step_count=30)


@given(st.binary(max_size=300))
def test_envelope_and_dialect_decoders_raise_only_protocol_errors(body: bytes) -> None:
    for decode in (
        parse_request,
        detect_dialect,
        tier.decode_v1,
        bus.decode_v1_record,
        claim.decode_v1,
        subscribe.decode_v1,
    ):
        with contextlib.suppress(RemoteProtocolError):
            decode(body)


def assert_storable(decoded: Any) -> None:
    """What a decoder lets through, a handler can use: integers fit SQLite's i64 (and a
    float of seconds), text holds no lone surrogate. (A claim face's ``group`` and
    ``from`` are Any here: the group registry checks them, tests/bus/test_group_creation.py.)"""
    if attrs.has(type(decoded)):
        fields = attrs.asdict(decoded, recurse=False)
        values = tuple(v for k, v in fields.items() if k not in ("group", "start"))
    else:
        values = decoded
    for value in values if isinstance(values, tuple) else (values,):
        if isinstance(value, tuple):
            assert_storable(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            assert -(1 << 63) <= value < 1 << 63, decoded
        elif isinstance(value, str):
            value.encode()


@given(st.sampled_from(["append", "append_batch", "read_execution", "scan", "health", "x"]), fields)
def test_tier_decoder_raises_only_protocol_errors(op: str, request: dict[str, Any]) -> None:
    for strict in (True, False):
        with contextlib.suppress(RemoteProtocolError):
            assert_storable(tier.decode_op(op, request, strict=strict))


@given(st.sampled_from(["publish", "publish_batch", "x"]), fields, json_values)
def test_bus_decoders_raise_only_protocol_errors(
    op: str, request: dict[str, Any], value: Any
) -> None:
    for decode in (lambda: bus.decode_op(op, request), lambda: bus.decode_record(value)):
        with contextlib.suppress(RemoteProtocolError):
            decode()
    with contextlib.suppress(RemoteProtocolError):
        parse_filter(value)


@given(st.sampled_from([*claim.GROUP_OPS, "subscribe", "x"]), fields, st.booleans())
@example("nack", {"sort_key": 1, "delay_ms": 1 << 64}, False)
@example("ack", {"sort_keys": [1, 1 << 63]}, False)
@example("next", {"filter": ">", "max": 1 << 64}, False)
@example("subscribe", {"from": 10**400}, False)
def test_claim_and_subscribe_decoders_raise_only_protocol_errors(
    op: str, request: dict[str, Any], named_groups: bool
) -> None:
    with contextlib.suppress(RemoteProtocolError):
        assert_storable(claim.decode_op(op, request, named_groups=named_groups))
    with contextlib.suppress(RemoteProtocolError):
        assert_storable(subscribe.decode_op(op, request))
    body = json.dumps(request).encode()
    for decode_v1 in (claim.decode_v1, subscribe.decode_v1):
        with contextlib.suppress(RemoteProtocolError):
            decode_v1(body)


@given(st.lists(st.binary(max_size=200), max_size=5), st.booleans())
def test_the_client_decoder_raises_only_client_errors(
    frames: list[bytes], hello_first: bool
) -> None:
    client = ClientProtocol()
    stream = b"".join(encode_frame(frame) for frame in frames)
    if hello_first:
        hello = {"ok": True, "protocol": 2, "server": "s", "face": "tier",
                 "limits": {"max_request_bytes": 10, "max_reply_bytes": 10}}  # fmt: skip
        stream = encode_frame(json.dumps(hello).encode()) + stream
    if stream:
        client.receive_data(stream)
    client.receive_data(b"")
    try:
        while client.next_event() not in (NEED_DATA, CLOSED):
            pass
    except ClientError:
        pass


# --- against a running writer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    env = {"CMDBUS_MAX_REQUEST_BYTES": "4096", "CMDBUS_READ_TIMEOUT_MS": "300",
           "CMDBUS_IDLE_TIMEOUT_MS": "300"}  # fmt: skip
    with serving(tmp_path_factory.mktemp("fuzz"), **env) as (_, ports):
        yield ports


def exchange(address: str, data: bytes) -> bytes:
    """Send ``data``, then read until the server closes or goes quiet for a moment."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.settimeout(0.5)
        try:
            sock.sendall(data)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError, BrokenPipeError):
            pass
    return received


hello = encode_frame(b'{"hello": {"protocol": 2, "client": "fuzz"}}')
requests = st.builds(
    lambda op, request, id_: json.dumps({"id": id_, "op": op, **request}).encode(),
    st.sampled_from(["append", "read_execution", "scan", "publish", "publish_batch", "next",
                     "ack", "nack", "extend", "lag", "dead", "subscribe", "health", "x"]),
    fields,
    st.one_of(st.integers(-5, 5), st.none(), st.text(max_size=3)),
)  # fmt: skip
frames = st.one_of(
    requests.map(encode_frame), st.binary(max_size=64).map(encode_frame), st.binary(max_size=64)
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    face=st.sampled_from(
        ["tier", "cmd_ingest", "cmd_claim", "evt_ingest", "evt_claim", "evt_subscribe"]
    ),
    v2=st.booleans(),
    payload=st.lists(frames, min_size=1, max_size=4),
)
def test_random_frames_over_a_socket_never_hurt_the_writer(
    writer: dict[str, str], face: str, v2: bool, payload: list[bytes]
) -> None:
    exchange(writer[face], (hello if v2 else b"") + b"".join(payload))


def test_after_the_fuzzing_nothing_failed_and_everyone_is_served(writer: dict[str, str]) -> None:
    """Runs after the socket fuzz (file order): no request or connection hit a bug."""
    text = metrics_text(writer)
    assert metric_sum(text, 'cmdbus_connections_total{face="tier",outcome="accepted"}') > 0
    assert metric_sum(text, "cmdbus_face_crashes_total") == 0
    assert metric_sum(text, "cmdbus_connections_total{") > 0
    for face in ("tier", "cmd_ingest", "cmd_claim", "evt_ingest", "evt_claim", "evt_subscribe"):
        prefix = f'cmdbus_connections_total{{face="{face}",outcome="internal_error"}}'
        assert metric_sum(text, prefix) == 0, face
    assert 'outcome="internal"' not in text
    from cmdbus_trio.client.blocking import TierClient

    with TierClient.connect(writer["tier"]) as tier_client:
        assert tier_client.health()["status"] == "ok"


# Deep nesting and lone surrogates: inputs a careless or hostile client sends under every
# size cap, which once made one client's record fail every record of its group commit.
nested_texts = st.integers(0, 3000).flatmap(
    lambda n: st.sampled_from(
        ["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n, "[" * n, '["' + "]" * n + '",' + "[" * n]
    )
)
surrogate_texts = st.text(
    alphabet=st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=8
)
payload_texts = nested_texts | surrogate_texts | st.builds(json.dumps, json_values)


@given(payload_texts, payload_texts)
def test_payload_and_text_checks_raise_only_protocol_errors(payload: str, text: str) -> None:
    for kind in (bus.BusKind.COMMANDS, bus.BusKind.EVENTS):
        with contextlib.suppress(RemoteProtocolError):
            bus.SubjectRule(kind).subject(bus.PublishRecord(1, payload))
    with contextlib.suppress(RemoteProtocolError):
        tier.payload_event_id(payload)
    with contextlib.suppress(RemoteProtocolError):
        bus.decode_op("publish", {"record": {"execution_id": 1, "payload": "{}"}, "msg_id": text})
    with contextlib.suppress(RemoteProtocolError):
        bus.decode_record({"execution_id": 1, "payload": "{}", "transaction_id": text})
    stored = bus.PublishRecord(1, payload, text or None).stored()  # never raises
    # as JSON would carry it (a lone surrogate as its escape; a pair as its character)
    assert json.loads(stored)["payload"] == json.loads(json.dumps(payload))
    with contextlib.suppress(RemoteProtocolError):
        parse_request(("[" * len(payload)).encode() + payload.encode("utf-8", "replace"))
    for decode_v1 in (claim.decode_v1, subscribe.decode_v1, tier.decode_v1):
        with contextlib.suppress(RemoteProtocolError):
            decode_v1(payload.encode("utf-8", "replace"))


@given(
    st.text(alphabet='[]{}"\\ab', max_size=400).map(json.dumps)
    | st.builds(
        lambda bracket, n: json.dumps(bracket * n), st.sampled_from("[]{}"), st.integers(0, 700)
    ),
    st.integers(0, 700),
    st.sampled_from(["[]", '{"k":}']),
)
@example(json.dumps("]" * 600), 600, "[]")
def test_payload_depth_is_counted_outside_strings(string: str, depth: int, pair: str) -> None:
    """Brackets inside strings count for nothing, either way: ``["]]]…", [[[…]]]]`` once
    passed 600 levels deep (the string's ``]`` hid them), and ``"[[[…"`` must never look
    deep."""
    opening, closing = (pair[0], pair[-1]) if pair == "[]" else ('{"k":', "}")
    nested = opening * depth + ("1" if pair != "[]" else "") + closing * depth
    text = f"[{string},{nested}]" if depth else f"[{string}]"
    real_depth = depth + 1
    if real_depth > MAX_DEPTH:
        with pytest.raises(FieldError, match="nested deeper than"):
            payload_json(text)
    else:
        assert payload_json(text) is not None
