"""Coverage-guided fuzzing of the wire protocol with atheris (libFuzzer):

    nox -s fuzz                                  # 60 s
    nox -s fuzz -- -max_total_time=3600          # any libFuzzer flags

Every decoder a face runs on untrusted bytes, and the client's reply decoder, must
return or raise the protocol's own errors: anything else is a crash, saved by libFuzzer
as crash-<hash> for a regression test.
"""

from __future__ import annotations

import contextlib
import json
import sys

import atheris
import attrs

with atheris.instrument_imports():
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
        parse_request,
        subscribe,
        tier,
    )
    from cmdbus_trio.protocol.server import Closed, Dialect, FrameReceived, ServerConnection
    from cmdbus_trio.protocol.subjects import parse_filter

OPS = ["append", "append_batch", "read_execution", "scan", "health", "publish", "publish_batch",
       *claim.GROUP_OPS, "subscribe"]  # fmt: skip


def usable(decoded: object) -> None:
    """A decoded request a handler can use: every integer fits i64 (SQLite, a float of
    seconds), every text encodes (a lone surrogate cannot be stored). A claim face's
    ``group`` and ``from`` are checked later, by the group registry."""
    fields = attrs.asdict(decoded, recurse=False) if attrs.has(type(decoded)) else {}
    for name, value in fields.items():
        for item in value if isinstance(value, tuple) else (value,):
            if name in ("group", "start"):
                continue
            if isinstance(item, int) and not isinstance(item, bool):
                assert -(1 << 63) <= item < 1 << 63, (name, decoded)
            elif isinstance(item, str):
                item.encode()


def frames(data: bytes, cap: int) -> None:
    decoder = FrameDecoder(cap)
    for start in range(0, len(data), 7):
        decoder.receive_data(data[start : start + 7])
        while (frame := decoder.next_frame()) is not NEED_DATA:
            if frame is CLOSED:
                return
    decoder.receive_data(b"")
    while decoder.next_frame() not in (NEED_DATA, CLOSED):
        pass


def server_connection(data: bytes, token: str | None) -> None:
    """A server connection fed ``data`` in pieces, each v2 request read as a face would.
    Nothing the peer sends may raise: every answer is an event or a frame."""
    server = ServerConnection(
        face="fuzz",
        server="fuzz",
        max_request_bytes=256,
        max_reply_bytes=128,
        auth_token=token,
        v1_trusted=len(data) % 3 == 0,
    )
    for start in range(0, len(data) + 11, 11):
        server.receive_data(data[start : start + 11])  # b"" once past the end: EOF
        while (event := server.next_event()) is not NEED_DATA:
            if isinstance(event, Closed):
                return
            if isinstance(event, FrameReceived) and server.dialect is Dialect.V2:
                server.read_request(event.data)


def client_replies(data: bytes) -> None:
    client = ClientProtocol()
    if data:
        client.receive_data(data)
    client.receive_data(b"")
    while client.next_event() not in (NEED_DATA, CLOSED):
        pass


def test_one_input(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    target = provider.ConsumeIntInRange(0, 8)
    depth = provider.ConsumeIntInRange(0, 100_000) if target == 7 else 0
    body = provider.ConsumeBytes(provider.remaining_bytes())
    try:
        if target == 0:
            frames(body, cap=64)
        elif target == 1:
            parse_request(body)
            detect_dialect(body)
        elif target == 2:
            for decode_v1 in (tier.decode_v1, bus.decode_v1_record, claim.decode_v1,
                              subscribe.decode_v1):  # fmt: skip
                with contextlib.suppress(RemoteProtocolError):
                    decode_v1(body)
        elif target in (3, 4):
            try:
                fields = json.loads(body)
            except (ValueError, RecursionError):
                return
            if isinstance(fields, dict):
                op = OPS[len(body) % len(OPS)]
                if target == 3:
                    usable(tier.decode_op(op, fields, strict=len(body) % 2 == 0))
                    usable(claim.decode_op(op, fields, named_groups=len(body) % 2 == 0))
                else:
                    usable(bus.decode_op(op, fields))
                    usable(subscribe.decode_op(op, fields))
                    parse_filter(fields.get("filter"))
        elif target == 5:
            client_replies(body)
        elif target == 8:
            server_connection(body, token="t" if len(body) % 2 else None)
        elif target == 7:  # deep nesting, around whatever else was given
            text = "[" * depth + body.decode("utf-8", "surrogateescape") + "]" * depth
            parse_request(text.encode("utf-8", "surrogateescape"))
            for decode_v1 in (claim.decode_v1, subscribe.decode_v1):
                with contextlib.suppress(RemoteProtocolError):
                    decode_v1(text.encode("utf-8", "surrogateescape"))
            for kind in (bus.BusKind.COMMANDS, bus.BusKind.EVENTS):
                with contextlib.suppress(RemoteProtocolError):
                    bus.SubjectRule(kind).subject(bus.PublishRecord(1, text))
            tier.payload_event_id(text)
        else:
            try:
                value = json.loads(body)
            except (ValueError, RecursionError):
                value = body
            bus.decode_record(value)
    except (RemoteProtocolError, ClientError):
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
