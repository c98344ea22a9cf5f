"""A data connection's reader (faces/_reader.py) over real sockets: bytes read at once
when they are there, the socket waited for only when they are not, and a peer that
resets its connection ends that connection alone."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable

import trio

from cmdbus_trio.config import Config
from cmdbus_trio.protocol import encode_frame

from ..helpers import frame_client, get, metric_sum, running_writer

RECORD = {"execution_id": 1, "payload": "{}"}


async def test_frames_sent_in_one_write_are_all_answered_in_order(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(cmd_ingest_bind="127.0.0.1:0")
    frames = [
        encode_frame(json.dumps({"id": n, "op": "publish", "record": RECORD}).encode())
        for n in range(1, 21)
    ]
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):  # noqa: SIM117 (needs its address)
            async with frame_client(addresses["cmd_ingest"]) as client:
                await client.stream.send_all(b"".join(frames))  # one read takes them all
                replies = [await client.receive_json() for _ in frames]
    assert [reply["id"] for reply in replies] == list(range(1, 21))
    assert all(reply["ok"] for reply in replies)


async def test_a_reset_by_the_peer_ends_its_connection_and_its_lease_redelivers_at_once(
    make_config: Callable[..., Config],
) -> None:
    """The worker's connection is reset (RST, not FIN) while it holds a lease: the
    reader's read fails, the connection ends, the record goes to the next worker long
    before its ack wait, and the face serves on."""
    config = make_config(
        cmd_ingest_bind="127.0.0.1:0", cmd_claim_bind="127.0.0.1:0", ack_wait_ms=600_000
    )
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):
            before = (await get(addresses["control"], "/metrics")).body.decode()
            async with frame_client(addresses["cmd_ingest"]) as ingest:
                await ingest.request("publish", record=RECORD)
            async with frame_client(addresses["cmd_claim"]) as first:
                held = await first.request("next", filter="commands.>", timeout_ms=5000)
                assert held["delivery"]["redelivered"] is False
                raw = first.stream.socket
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # Half a frame first: the reset comes while the reader waits mid-frame.
                await first.stream.send_all(encode_frame(b'{"id": 9, "op": "lag"}')[:6])
            async with frame_client(addresses["cmd_claim"]) as second:
                again = await second.request("next", filter="commands.>", timeout_ms=5000)
                scrape = (await get(addresses["control"], "/metrics")).body.decode()
            assert again["delivery"]["sort_key"] == held["delivery"]["sort_key"]
            assert again["delivery"]["redelivered"] is True
    # (The metrics are the process's: other tests' writers counted into them too.)
    released = 'cmdbus_leases_released_total{face="cmd_claim"'
    assert metric_sum(scrape, released) - metric_sum(before, released) == 1
    # A reset is a peer gone, not a bug met by the connection.
    failed = 'cmdbus_connections_total{face="cmd_claim",outcome="internal_error"}'
    assert metric_sum(scrape, failed) == metric_sum(before, failed)
