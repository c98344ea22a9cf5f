"""Issue 38, black-box: no client, face or access pattern takes the writer from the
others. Each test runs a real writer and speaks to it over real sockets, as a careless or
hostile client would (docs/reliability.md, "Isolation")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from .helpers import FrameClient, frame_client, serving
from .test_memory_bounds import rss_mib


async def pipelined(
    client: FrameClient, requests: list[dict[str, object]]
) -> list[dict[str, object]]:
    """Send every request without waiting, then read every reply (in any order)."""
    replies: list[dict[str, object]] = []

    async def send_all() -> None:
        for n, request in enumerate(requests, 1):
            await client.send(json.dumps({"id": n, **request}).encode())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all)
        while len(replies) < len(requests):
            replies.append(await client.receive_json())
    return replies


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_timed_out_nexts_leave_nothing_behind(tmp_path: Path) -> None:
    """100,000 ``next`` calls that time out, on one filter and on 2,000 others: the writer's
    memory stays flat (each used to leave its waiter parked for good, ~0.4 KiB apiece,
    and a filter holding only those never counted as idle)."""
    with serving(tmp_path) as (writer, ports):
        client = await FrameClient.connect(ports["cmd_claim"])
        await client.hello()
        with trio.fail_after(120):
            await trio.sleep(0.3)
            before = rss_mib(writer)
            for round_ in range(10):
                requests: list[dict[str, object]] = [
                    {"op": "next", "filter": f"commands.pool{n % 2000}.>", "timeout_ms": 0}
                    if n % 2
                    else {"op": "next", "filter": "commands.shared.>", "timeout_ms": 0}
                    for n in range(round_ * 10_000, (round_ + 1) * 10_000)
                ]
                replies = await pipelined(client, requests)
                assert all(
                    reply == {"id": reply["id"], "ok": True, "delivery": None} for reply in replies
                )
            await trio.sleep(0.3)
            grown = rss_mib(writer) - before
        await client.aclose()
    assert grown < 5, f"RSS grew {grown:.1f} MiB"


async def test_subscribe_frames_keep_to_the_reply_cap(tmp_path: Path) -> None:
    """Every frame a subscriber gets, catching up and live, is within
    ``CMDBUS_MAX_REPLY_BYTES``; a record larger than the cap goes alone. (A catch-up frame
    used to carry 500 records whatever their size: 500 events of 150 KiB made a 75 MiB
    frame, which the bundled client refuses, so it reconnected to the same frame for
    ever.)"""
    from .test_evt_subscribe import publish

    cap = 64 << 10
    settings = {"CMDBUS_MAX_REPLY_BYTES": str(cap), "CMDBUS_TIER_BIND": ""}
    with serving(tmp_path, **settings) as (_, ports), trio.fail_after(60):
        await publish(ports["evt_ingest"], 300, pad=2000)  # ~600 KB of history
        async with frame_client(ports["evt_subscribe"]) as subscriber:
            await subscriber.send(b'{"id": 1, "op": "subscribe", "from": 0}')
            keys: list[int] = []
            sizes: list[tuple[int, int]] = []  # (frame bytes, records)

            async def read(want: int) -> None:
                while len(keys) < want:
                    frame = await subscriber.receive()
                    assert frame is not None
                    records = json.loads(frame)["records"]
                    sizes.append((len(frame), len(records)))
                    keys.extend(record["sort_key"] for record in records)

            await read(300)
            await publish(ports["evt_ingest"], 300, start=300, batch=300, pad=2000)
            await publish(ports["evt_ingest"], 1, start=600, pad=100_000)  # over the cap
            await read(601)
    assert keys == list(range(1, 602))
    assert all(size <= cap for size, records in sizes if records > 1), sizes
    assert [records for size, records in sizes if size > cap] == [1]
