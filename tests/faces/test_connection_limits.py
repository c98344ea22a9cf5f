"""Limits a client cannot push past: at most 32 requests in flight per connection (the 33rd
waits in its socket until one of them is answered), and op names it makes up never become
metric labels."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import trio

from ..helpers import frame_client, metric_sum, metrics_text, serving


@pytest.mark.once
async def test_at_most_32_requests_in_flight_per_connection(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, ports), trio.fail_after(30):
        async with frame_client(ports["cmd_claim"]) as client:
            for n in range(1, 33):  # 32 waiting `next`s fill the connection's slots
                body = {"id": n, "op": "next", "filter": "commands.>", "timeout_ms": 60_000}
                await client.send(json.dumps(body).encode())
            await client.send(json.dumps({"id": 33, "op": "lag"}).encode())
            with trio.move_on_after(0.5) as waited:
                await client.receive_json()
            assert waited.cancelled_caught, "the 33rd request was served past the limit"
            async with frame_client(ports["cmd_ingest"]) as ingest:
                record = {"execution_id": 1, "payload": "{}"}
                await ingest.request("publish", record=record)
            # One `next` gets the record; its slot frees; the `lag` is read and answered.
            replies = {(await client.receive_json())["id"] for _ in range(2)}
            assert 33 in replies and len(replies) == 2


async def test_made_up_ops_are_counted_under_one_label(tmp_path: Path) -> None:
    # Each distinct op name as a label value would be a new time series: a client could
    # grow the writer's memory and every scrape without bound.
    with serving(tmp_path) as (_, ports), trio.fail_after(30):
        for face in ("cmd_ingest", "cmd_claim", "evt_subscribe", "tier"):
            async with frame_client(ports[face]) as client:
                for n in range(20):
                    reply = await client.request(f"made-up-{n}")
                    assert reply["error"]["code"] == "unsupported"
        text = await trio.to_thread.run_sync(metrics_text, ports)
    assert "made-up" not in text
    for face in ("cmd_ingest", "cmd_claim", "evt_subscribe", "tier"):
        counted = metric_sum(
            text,
            f'cmdbus_request_duration_seconds_count{{face="{face}",op="unknown",'
            'outcome="unsupported"}',
        )
        assert counted == 20, face


@pytest.mark.once
async def test_the_first_frame_has_a_deadline_from_the_accept(tmp_path: Path) -> None:
    """A connection that never finishes its first frame (silent, or trickling a byte now
    and then, which restarts the read timeout each time) held one of the face's
    CMDBUS_MAX_CONNECTIONS for the 300 s idle timeout without authenticating. It is
    closed at CMDBUS_HELLO_TIMEOUT_MS; a connection that said hello idles on, as does a
    v1 one that sent its first request."""
    timers = {"CMDBUS_HELLO_TIMEOUT_MS": "300", "CMDBUS_IDLE_TIMEOUT_MS": "60000",
              "CMDBUS_READ_TIMEOUT_MS": "60000"}  # fmt: skip
    with serving(tmp_path, **timers) as (_, ports), trio.fail_after(30):
        host, port = ports["tier"].rsplit(":", 1)
        silent = await trio.open_tcp_stream(host, int(port))
        trickling = await trio.open_tcp_stream(host, int(port))
        async with (
            frame_client(ports["tier"]) as greeted,
            frame_client(ports["tier"], v2=False) as v1,
            silent,
            trickling,
        ):
            assert b"ok" in (await v1.v1({"op": "health"}) or b"")
            started = trio.current_time()
            with contextlib.suppress(trio.BrokenResourceError):  # closed on the way
                for byte in b"\x00\x00\x00\x40{":  # a frame begun, a byte every 0.1 s
                    await trickling.send_all(bytes([byte]))
                    await trio.sleep(0.1)
            await trio.sleep(0.5)  # past the deadline for all four
            assert await silent.receive_some(10) == b""
            with trio.move_on_after(5), contextlib.suppress(trio.BrokenResourceError):
                while await trickling.receive_some(10):
                    pass  # (nothing is answered: the hello never came)
            assert trio.current_time() - started < 5, "the trickling one was not closed"
            assert (await greeted.request("health"))["ok"]
            assert b"ok" in (await v1.v1({"op": "health"}) or b"")
        text = await trio.to_thread.run_sync(metrics_text, ports)
    assert metric_sum(text, 'cmdbus_connections_total{face="tier",outcome="hello_timeout"}') == 2
