"""One client's bad input never fails another client's request: payloads nested 100,000
deep (200 KB, under every cap) and lone surrogates, sent beside honest publishers, are
answered `invalid` naming the field and cost nobody else anything."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.client import Invalid
from cmdbus_trio.client.trio import IngestClient, TierClient

from ..helpers import frame_client, metric_sum, metrics_text, server_log, serving

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    tmp_path = tmp_path_factory.mktemp("hostile")
    with serving(tmp_path) as (_, ports):
        yield tmp_path, ports


@pytest.mark.once
async def test_deep_payloads_beside_honest_publishers(
    writer: tuple[Path, dict[str, str]],
) -> None:
    tmp_path, ports = writer
    honest: list[int] = []
    refused: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            stop = trio.Event()

            async def publisher(n: int) -> None:
                async with await IngestClient.connect(ports["cmd_ingest"]) as ingest:
                    while not stop.is_set():
                        record = {"execution_id": n, "payload": json.dumps({"n": n})}
                        honest.append((await ingest.publish(record)).sort_key)

            async def hostile() -> None:
                async with await IngestClient.connect(ports["cmd_ingest"]) as ingest:
                    for payload in (DEEP, '{"a": ' * 200 + "1" + "}" * 200) * 10:
                        try:
                            await ingest.publish({"execution_id": 1, "payload": payload})
                        except Invalid as exc:
                            refused.append(str(exc))
                        await trio.sleep(0.05)
                stop.set()

            for n in range(8):
                nursery.start_soon(publisher, n)
            nursery.start_soon(hostile)
    assert len(refused) == 20 and all("record.payload" in r for r in refused), refused[:2]
    assert "nested deeper than 128 levels" in refused[0]
    assert len(honest) > 100 and len(set(honest)) == len(honest)
    lines = server_log(tmp_path).splitlines()
    assert not [line for line in lines if '"level": "error"' in line]


async def test_tier_appends_of_deep_payloads_are_invalid(
    writer: tuple[Path, dict[str, str]],
) -> None:
    _, ports = writer
    with trio.fail_after(20):
        async with await TierClient.connect(ports["tier"]) as tier:
            with pytest.raises(Invalid, match="payload: nested deeper than 128 levels"):
                await tier.append("deep-1", DEEP)
            with pytest.raises(Invalid, match=r"payloads\[1\]"):
                await tier.append_batch("deep-1", ['{"event_id": 1}', DEEP])
            appended = await tier.append("deep-1", '{"event_id": 2}')  # the face goes on
            assert appended.log_record_count >= 1


@pytest.mark.parametrize(
    ("face", "frame"),
    [
        ("cmd_ingest", "[" * 100_000 + "]" * 100_000),
        ("tier", '{"id": 1, "op": "scan", "x": ' + DEEP + "}"),
    ],
)
async def test_a_frame_nested_too_deep_gets_the_documented_answer(
    writer: tuple[Path, dict[str, str]], face: str, frame: str
) -> None:
    """An unparseable v2 frame: an error with `"id": null`, then the connection closes
    (it used to close without a word, after an internal error)."""
    _, ports = writer
    with trio.fail_after(10):
        async with frame_client(ports[face]) as client:
            await client.send(frame.encode())
            reply: dict[str, Any] = await client.receive_json()
            assert reply["id"] is None and reply["ok"] is False
            assert reply["error"]["code"] == "invalid"
            assert await client.receive() is None


async def test_lone_surrogates_are_invalid_or_stored_as_json_escapes(
    writer: tuple[Path, dict[str, str]],
) -> None:
    """A lone surrogate (JSON may carry one as an escape) in a msg_id, a pool or a
    transaction_id cannot be stored as text: `invalid`, naming the field. Inside a
    payload's string it is kept, as the same escape. The writer answers every request."""
    _, ports = writer
    with trio.fail_after(10):
        async with frame_client(ports["cmd_ingest"]) as client:
            record = '{"execution_id": 1, "payload": "{}"}'
            await client.send(
                (
                    '{"id": 1, "op": "publish", "msg_id": "\\ud800", "record": ' + record + "}"
                ).encode()
            )
            reply = await client.receive_json()
            assert reply["error"]["code"] == "invalid" and "msg_id" in reply["error"]["message"]
            pool = '{\\"execution_pool\\": \\"\\\\udc00\\"}'
            await client.send(
                ('{"id": 2, "op": "publish", "record": {"execution_id": 1, "payload": "'
                 + pool + '"}}').encode()
            )  # fmt: skip
            reply = await client.receive_json()
            assert reply["error"]["code"] == "invalid" and "execution_pool" in str(reply)
            await client.send(
                b'{"id": 3, "op": "publish", "record": {"execution_id": 1, "payload": "{}",'
                b' "transaction_id": "\\ud800"}}'
            )
            reply = await client.receive_json()
            assert reply["error"]["code"] == "invalid" and "transaction_id" in str(reply)
            payload = '{\\"s\\": \\"\\\\ud800\\"}'
            await client.send(
                ('{"id": 4, "op": "publish", "record": {"execution_id": 1, "payload": "'
                 + payload + '"}}').encode()
            )  # fmt: skip
            reply = await client.receive_json()
            assert reply["ok"], reply
        text = await trio.to_thread.run_sync(metrics_text, ports)
        assert metric_sum(text, 'cmdbus_request_duration_seconds_count{face="cmd_ingest"') > 0


HUGE = 10**400  # JSON has no integer limit; every field that takes one has
I64_MAX = (1 << 63) - 1
OUT_OF_RANGE: list[tuple[str, str, dict[str, Any], str]] = [
    ("cmd_ingest", "publish", {"record": {"execution_id": 1, "payload": "{}"},
                               "deadline_ms": HUGE}, "deadline_ms"),
    ("cmd_ingest", "publish", {"record": {"execution_id": 1, "payload": "{}"},
                               "deadline_ms": 1.5}, "deadline_ms"),
    ("cmd_claim", "next", {"filter": "commands.>", "timeout_ms": HUGE}, "timeout_ms"),
    ("cmd_claim", "next", {"filter": "commands.>", "timeout_ms": 1e300}, "timeout_ms"),
    ("cmd_claim", "next", {"filter": "commands.\ud800"}, "filter"),
    ("cmd_claim", "nack", {"sort_key": 1, "delay_ms": HUGE}, "delay_ms"),
    ("cmd_claim", "ack", {"sort_key": 1 << 64}, "sort_key"),
    ("cmd_claim", "ack", {"sort_key": 1.0}, "sort_key"),
    ("cmd_claim", "extend", {"sort_key": I64_MAX + 1}, "sort_key"),
    ("cmd_claim", "dead", {"after": 1 << 64}, "after"),
    ("cmd_claim", "dead", {"filter": "commands.\udc00"}, "filter"),
    ("cmd_claim", "lag", {"filter": "\ud800"}, "filter"),
    ("cmd_claim", "requeue", {"sort_keys": [1 << 64]}, "sort_keys"),
    ("evt_claim", "next", {"filter": "events.>", "group": "\ud800"}, "group"),
    ("evt_subscribe", "subscribe", {"from": 1 << 64}, "from"),
    ("evt_subscribe", "subscribe", {"filter": "events.\ud800"}, "filter"),
    ("tier", "read_execution", {"execution_id": "x", "after": 1 << 64}, "after"),
    ("tier", "scan", {"after": HUGE}, "after"),
    ("tier", "append", {"execution_id": "x", "payload": "{}", "expected_version": 1 << 64},
     "expected_version"),
    ("tier", "append", {"execution_id": "x", "payload": '"\ud800"'}, "payload"),
    ("tier", "append", {"execution_id": "x", "payload": "{}", "transaction_id": "\udfff"},
     "transaction_id"),
]  # fmt: skip


STILL_SERVING: dict[str, tuple[str, dict[str, Any]]] = {
    "cmd_ingest": ("publish", {"record": {"execution_id": 1, "payload": "{}"}}),
    "cmd_claim": ("lag", {}),
    "tier": ("health", {}),
}


@pytest.fixture(scope="module")
def guarded_writer(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, dict[str, str]]]:
    tmp_path = tmp_path_factory.mktemp("guarded")
    with serving(tmp_path, CMDBUS_AUTH_TOKEN="sesame") as (_, ports):
        yield tmp_path, ports


async def test_numbers_past_any_range_and_lone_surrogates_are_invalid_without_an_error_line(
    guarded_writer: tuple[Path, dict[str, str]],
) -> None:
    """Integers past 2^63-1 (or 10^400), floats where integers belong and lone surrogates
    where text is kept or compared: each answers `invalid` naming its field, the
    connection goes on, and the log has no ERROR line (they used to answer `internal`
    with a traceback; a token of "\\ud800" did so before authentication)."""
    tmp_path, ports = guarded_writer
    with trio.fail_after(30):
        for face, op, fields, field in OUT_OF_RANGE:
            async with frame_client(ports[face], v2=False) as client:
                await client.send(
                    json.dumps({"hello": {"protocol": 2, "token": "sesame"}}).encode()
                )
                assert (await client.receive_json())["ok"]
                reply = await client.request(op, **fields)
                assert reply["ok"] is False, (op, fields, reply)
                assert reply["error"]["code"] == "invalid", (op, fields, reply)
                assert reply["error"]["message"].startswith(field), (op, fields, reply)
                if face in STILL_SERVING:  # the connection goes on
                    good_op, good_fields = STILL_SERVING[face]
                    assert (await client.request(good_op, **good_fields))["ok"]
        async with frame_client(ports["tier"], v2=False) as client:
            await client.send(json.dumps({"hello": {"protocol": 2, "token": "\ud800"}}).encode())
            refused = await client.receive_json()
            assert refused["error"]["message"].startswith("hello.token")
            assert await client.receive() is None
    errors = [line for line in server_log(tmp_path).splitlines() if '"level": "error"' in line]
    assert not errors, errors[:3]


def _send_all_then_read(address: str, frame: bytes) -> tuple[bytes, bool]:
    """As a careless client does: send a whole request before reading anything; then
    read to the end. The bytes read and whether the writer closed cleanly (no reset)."""
    host, port = address.rsplit(":", 1)
    hello = json.dumps({"hello": {"protocol": 2}}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(len(hello).to_bytes(4, "big") + hello)
        sock.sendall(frame)  # reset by the peer here, before the fix
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return received, False
            if not chunk:
                return received, True
            received += chunk


def _frames(data: bytes) -> list[dict[str, Any]]:
    frames = []
    while data:
        length = int.from_bytes(data[:4], "big")
        frames.append(json.loads(data[4 : 4 + length]))
        data = data[4 + length :]
    return frames


@pytest.mark.parametrize("count", [1500, 6000])  # 1.5 MB, and more than the socket buffers
async def test_a_request_over_the_cap_is_answered_too_large_before_the_close(
    writer: tuple[Path, dict[str, str]], count: int
) -> None:
    """A 1.5 MB publish_batch against the default 1 MiB cap, sent whole before reading:
    the client gets `too_large`, then a clean close. The writer closed with the request's
    rest unread, which made the kernel answer the client's next bytes with a reset, and
    the answer was lost; it now shuts its side, discards what still comes (bounded), and
    then closes. The face serves the next client."""
    _, ports = writer
    records = [{"execution_id": n, "payload": json.dumps({"x": "y" * 1000})} for n in range(count)]
    body = json.dumps({"id": 1, "op": "publish_batch", "records": records}).encode()
    assert len(body) > 1_500_000
    frame = len(body).to_bytes(4, "big") + body
    with trio.fail_after(30):
        received, clean = await trio.to_thread.run_sync(
            _send_all_then_read, ports["cmd_ingest"], frame
        )
        replies = _frames(received)
        assert [r.get("ok") for r in replies] == [True, False] and clean, (replies, clean)
        assert replies[1]["id"] is None and replies[1]["error"]["code"] == "too_large"
        async with await IngestClient.connect(ports["cmd_ingest"]) as ingest:
            await ingest.publish({"execution_id": 1, "payload": "{}"})


@pytest.mark.once
def test_a_drain_does_not_linger_over_an_idle_subscriber(tmp_path: Path) -> None:
    """On SIGTERM an idle v2 subscriber is told `unavailable` and its connection closed
    at once, within a shutdown budget of a second: the lingering close is for a client
    that may still be sending, not for an answer the writer chose to give. It used to
    linger 2 s over each such subscriber (`shutdown_budget_exhausted`, with nothing in
    flight)."""
    import signal

    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_SHUTDOWN_TIMEOUT_MS": "1000"}
    with serving(tmp_path, **settings) as (writer, ports):

        async def subscribe_then_drain() -> dict[str, Any]:
            async with frame_client(ports["evt_subscribe"]) as subscriber:
                await subscriber.send(b'{"id": 1, "op": "subscribe", "from": 0}')
                await trio.sleep(0.3)  # caught up, idle
                writer.send_signal(signal.SIGTERM)
                with trio.fail_after(10):
                    told: dict[str, Any] = await subscriber.receive_json()
                    # Held open, as a client busy elsewhere would: the writer closes it.
                    await trio.to_thread.run_sync(writer.wait)
                return told

        told = trio.run(subscribe_then_drain)
        assert writer.wait(timeout=30) == 0
    assert told["error"]["code"] == "unavailable", told
    log = server_log(tmp_path)
    assert "shutdown_budget_exhausted" not in log, log[-2000:]


@pytest.mark.parametrize("last", ["too_large", "invalid"])
@pytest.mark.once
def test_a_last_answer_comes_after_the_replies_to_the_requests_ahead_of_it(
    tmp_path: Path, last: str
) -> None:
    """A publish still committing, then a frame over the cap (or one that is not JSON)
    in the same write: the publish is answered first, then the last answer, then the
    connection closes. The last answer used to go out first."""
    from cmdbus_trio.protocol import encode_frame

    from ..helpers import get

    publish = {"id": 1, "op": "publish", "record": {"execution_id": 1, "payload": "{}"}}
    bad = b"x" * (1 << 20 + 1) if last == "too_large" else b"{not json"
    burst = encode_frame(json.dumps(publish).encode()) + encode_frame(bad)
    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_DEBUG_HOOKS": "true"}
    with serving(tmp_path, **settings) as (_, ports):

        async def send_both() -> list[dict[str, Any]]:
            path = "/debug/slow-commits?store=commands&seconds=0.3"
            assert (await get(ports["control"], path, "POST")).status == 202
            async with frame_client(ports["cmd_ingest"]) as client:
                with trio.fail_after(10):
                    await client.stream.send_all(burst)
                    answers = [await client.receive_json() for _ in range(2)]
                    assert await client.receive() is None
            return answers

        first, then = trio.run(send_both)
    assert first["id"] == 1 and first["ok"], first
    assert then["ok"] is False and then["error"]["code"] == last, then


@pytest.mark.once
def test_a_drain_answers_every_request_it_was_sent_and_closes_without_a_reset(
    tmp_path: Path,
) -> None:
    """200 publishes pipelined in one write while commits are slow, then SIGTERM: every
    one is answered (published, or `unavailable` for those the drain will not take),
    then the connection ends with end of stream, not a reset. The drain used to stop
    reading at once: requests waiting in the socket went unanswered, and closing over
    them reset the connection, losing answers already sent."""
    import signal

    from cmdbus_trio.protocol import encode_frame

    from ..helpers import get

    frames = b"".join(
        encode_frame(
            json.dumps(
                {"id": n, "op": "publish", "record": {"execution_id": n, "payload": "{}"}}
            ).encode()
        )
        for n in range(1, 201)
    )
    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_DEBUG_HOOKS": "true"}
    with serving(tmp_path, **settings) as (writer, ports):

        async def pipeline_then_drain() -> tuple[dict[int, str], str]:
            path = "/debug/slow-commits?store=commands&seconds=0.3"
            assert (await get(ports["control"], path, "POST")).status == 202
            async with frame_client(ports["cmd_ingest"]) as client:
                await client.stream.send_all(frames)
                await trio.sleep(0.1)
                writer.send_signal(signal.SIGTERM)
                answers: dict[int, str] = {}
                with trio.fail_after(20):
                    while True:
                        try:
                            data = await client.stream.receive_some(1 << 16)
                        except trio.BrokenResourceError as exc:
                            return answers, f"reset: {exc.__cause__!r}"
                        if not data:
                            return answers, "end of stream"
                        client.decoder.receive_data(data)
                        while isinstance(frame := client.decoder.next_frame(), bytes):
                            reply = json.loads(frame)
                            error = reply.get("error", {})
                            # A drain's `unavailable` says when to ask again.
                            retry = error.get("retry_after_ms") if error else None
                            answers[reply["id"]] = error.get("code", "ok") + f"/{retry}" * bool(
                                error
                            )

        answers, ending = trio.run(pipeline_then_drain)
        assert writer.wait(timeout=30) == 0
    assert ending == "end of stream"
    assert sorted(answers) == list(range(1, 201)), f"{200 - len(answers)} unanswered"
    assert set(answers.values()) <= {"ok", "unavailable/1000"}, set(answers.values())
