"""The event subscribe face end to end: `cmdbus-trio serve` as a subprocess."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from ..helpers import FrameClient, frame_client, get, publish_over_wire, serving

EVENTS = {"CMDBUS_TIER_BIND": ""}


def event(n: int, event_type: str = "tick", pad: int = 0) -> dict[str, Any]:
    return {
        "execution_id": n,
        "payload": json.dumps({"event_type": event_type, "n": n, "p": "x" * pad}),
    }


async def publish(
    address: str, count: int, *, start: int = 0, batch: int = 100, **kind: Any
) -> None:
    records = [event(i, **kind) for i in range(start, start + count)]
    await publish_over_wire(address, records, batch=batch)


async def collect(client: FrameClient, want: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    while len(records) < want:
        frame = await client.receive_json()
        assert frame["ok"], frame
        records += frame["records"]
    return records


@pytest.mark.once
async def test_history_then_live_without_gap_or_duplicate(tmp_path: Path) -> None:
    with serving(tmp_path, **EVENTS) as (_, ports):
        await publish(ports["evt_ingest"], 3000)
        with trio.fail_after(60):
            async with (
                frame_client(ports["evt_subscribe"]) as subscriber,
                trio.open_nursery() as nursery,
            ):
                await subscriber.send(b'{"id": 7, "op": "subscribe", "from": 0}')
                # Publish while the subscriber is catching up, across the boundary.
                nursery.start_soon(lambda: publish(ports["evt_ingest"], 1500, start=3000, batch=10))
                records = await collect(subscriber, 4500)
        keys = [record["sort_key"] for record in records]
        assert keys == list(range(1, 4501))
        assert records[0] == {"sort_key": 1, "subject": "events.tick", "record": event(0)}
        text = (await get(ports["control"], "/metrics")).body.decode()
        assert "cmdbus_subscribers " in text


async def test_from_is_exclusive_and_filters_apply(tmp_path: Path) -> None:
    with serving(tmp_path, **EVENTS) as (_, ports):
        await publish(ports["evt_ingest"], 10, event_type="a.b")
        await publish(ports["evt_ingest"], 10, start=10, event_type="other")
        async with frame_client(ports["evt_subscribe"]) as subscriber:
            await subscriber.send(
                b'{"id": 1, "op": "subscribe", "from": 5, "filter": "events.a_b"}'
            )
            records = await collect(subscriber, 5)
            assert [r["sort_key"] for r in records] == [6, 7, 8, 9, 10]
            await publish(ports["evt_ingest"], 2, start=20, event_type="a.b")
            live = await collect(subscriber, 2)
            assert [r["sort_key"] for r in live] == [21, 22]
        async with frame_client(ports["evt_subscribe"]) as bad:
            reply = await bad.request("subscribe", **{"from": -1})
            assert reply["error"]["message"].startswith("from:")


async def test_v1_pushes_json_arrays_and_refuses_another_shard(tmp_path: Path) -> None:
    with serving(tmp_path, **EVENTS) as (_, ports):
        await publish(ports["evt_ingest"], 3)
        async with frame_client(ports["evt_subscribe"], v2=False) as subscriber:
            await subscriber.send(b'{"shard": 0, "cursor": 1}')
            frame = await subscriber.receive_json()
            assert isinstance(frame, list)
            assert [r["sort_key"] for r in frame] == [2, 3]
        async with frame_client(ports["evt_subscribe"], v2=False) as wrong:
            await wrong.send(b'{"shard": 3, "cursor": 0}')
            assert await wrong.receive() is None


@pytest.mark.once
async def test_a_slow_subscriber_is_cut_off_while_a_fast_one_keeps_up(tmp_path: Path) -> None:
    settings = {"CMDBUS_SUBSCRIBER_BUFFER": "400", "CMDBUS_READ_TIMEOUT_MS": "60000", **EVENTS}
    with serving(tmp_path, **settings) as (_, ports), trio.fail_after(90):
        total = 1200  # 16 KB each: ~19 MB, more than the slow one's socket buffers hold
        async with (
            frame_client(ports["evt_subscribe"]) as fast,
            frame_client(ports["evt_subscribe"]) as slow,
        ):
            await fast.send(b'{"id": 1, "op": "subscribe", "from": 0}')
            await slow.send(b'{"id": 2, "op": "subscribe", "from": 0}')
            await trio.sleep(0.3)  # both are live
            async with trio.open_nursery() as nursery:
                got: list[int] = []

                async def read_fast() -> None:
                    got.extend(r["sort_key"] for r in await collect(fast, total))

                nursery.start_soon(read_fast)
                await publish(ports["evt_ingest"], total, batch=40, pad=16_000)
            assert got == list(range(1, total + 1))
            # Now the slow one reads: what was sent, then `busy`, then the end.
            received, error = 0, None
            while (frame := await slow.receive()) is not None:
                message = json.loads(frame)
                if message["ok"]:
                    received += len(message["records"])
                else:
                    error = message["error"]
            assert error is not None and error["code"] == "busy"
            assert error["message"].startswith("slow consumer")
            assert received < total
        text = (await get(ports["control"], "/metrics")).body.decode()
        assert "cmdbus_subscribers_dropped_total 1.0" in text


@pytest.mark.once
async def test_two_subscriptions_on_one_connection_do_not_defeat_the_buffer(
    tmp_path: Path,
) -> None:
    """Issue 16 item 11: the push of each subscription waits while the connection's unsent
    replies are over CMDBUS_CONNECTION_UNSENT_BYTES, so a client that does not read is cut
    off as a slow consumer (its subscriber buffers fill) instead of having every record
    queued for it in the writer's memory."""
    settings = {
        "CMDBUS_SUBSCRIBER_BUFFER": "400",
        "CMDBUS_CONNECTION_UNSENT_BYTES": str(1 << 20),
        "CMDBUS_READ_TIMEOUT_MS": "60000",
        **EVENTS,
    }
    with serving(tmp_path, **settings) as (_, ports), trio.fail_after(90):
        total = 1200  # 16 KB each: ~19 MB, far more than the cap and the buffers
        async with frame_client(ports["evt_subscribe"]) as slow:
            await slow.send(b'{"id": 1, "op": "subscribe", "from": 0}')
            await slow.send(b'{"id": 2, "op": "subscribe", "from": 0, "filter": "events.>"}')
            await trio.sleep(0.3)  # both are live
            await publish(ports["evt_ingest"], total, batch=40, pad=16_000)
            received, errors = 0, []
            while (frame := await slow.receive()) is not None:
                message = json.loads(frame)
                if message["ok"]:
                    received += len(message["records"])
                else:
                    errors.append((message["id"], message["error"]["code"]))
            # One subscription cut as a slow consumer ends the connection, the other too.
            assert errors and {code for _, code in errors} == {"busy"}, errors
            assert received < 2 * total
        text = (await get(ports["control"], "/metrics")).body.decode()
        assert "cmdbus_subscribers_dropped_total 0.0" not in text
        waits = 'cmdbus_unsent_waits_total{face="evt_subscribe"} '
        assert waits in text and f"{waits}0.0" not in text  # the pushes waited
