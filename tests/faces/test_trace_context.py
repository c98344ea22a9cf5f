"""Trace context over the wire (issue 49, items 1 and 2): a v2 publish's ``traceparent``
and ``tracestate`` come back with every v2 delivery of its record (command ``next``,
single and batched; event-group ``next``; subscribe frames, from the store and live; dead
letters), across a restart; v1 frames are unchanged; a malformed value stores nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from ..helpers import frame_client, serving

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
STATE = 'vendor=opaque,other="x\\y"'
BUSES = {"CMDBUS_TIER_BIND": "", "CMDBUS_MAX_DELIVER": "2", "CMDBUS_ACK_WAIT_MS": "60000"}


def record(n: int, event_type: str = "step") -> dict[str, Any]:
    return {"execution_id": n, "payload": json.dumps({"event_type": event_type, "n": n})}


def context_of(delivery: dict[str, Any]) -> tuple[str | None, str | None]:
    return delivery.get("traceparent"), delivery.get("tracestate")


async def publish_three(address: str) -> None:
    """Records 1-3: one published alone with both fields, then a batch of one with a
    traceparent only and one with none."""
    async with frame_client(address) as client:
        one = await client.request(
            "publish", record=record(1), traceparent=PARENT, tracestate=STATE
        )
        assert one["ok"] and one["sort_key"] == 1, one
        batch = await client.request(
            "publish_batch", records=[{"record": record(2), "traceparent": OTHER}, record(3)]
        )
        assert batch["ok"] and batch["sort_keys"] == [2, 3], batch


EXPECTED = [(PARENT, STATE), (OTHER, None), (None, None)]


async def test_every_delivery_carries_the_context_it_was_published_with(tmp_path: Path) -> None:
    with trio.fail_after(60), serving(tmp_path, **BUSES) as (_, ports):
        await publish_three(ports["cmd_ingest"])
        await publish_three(ports["evt_ingest"])
        async with frame_client(ports["cmd_claim"]) as claim:
            single = await claim.request("next", filter="commands.>", timeout_ms=1000)
            assert context_of(single["delivery"]) == EXPECTED[0]
            assert single["delivery"]["record"] == record(1)  # the record itself untouched
            batch = await claim.request("next", filter="commands.>", max=5, timeout_ms=1000)
            assert [context_of(d) for d in batch["deliveries"]] == EXPECTED[1:]
            assert not {"traceparent", "tracestate"} & set(batch["deliveries"][1])
            # Twice nacked (CMDBUS_MAX_DELIVER=2): record 1 is a dead letter, context kept.
            await claim.request("nack", sort_key=1)
            again = await claim.request("next", filter="commands.>", timeout_ms=1000)
            assert again["delivery"]["redelivered"] and context_of(again["delivery"]) == EXPECTED[0]
            await claim.request("nack", sort_key=1)
            with trio.move_on_after(0.3):  # parked as dead, not delivered a third time
                await claim.request("next", filter="commands.>")
        async with frame_client(ports["cmd_claim"]) as claim:
            dead = await claim.request("dead")
            assert [(d["sort_key"], context_of(d)) for d in dead["records"]] == [(1, EXPECTED[0])]
        async with frame_client(ports["evt_claim"]) as group:
            taken = await group.request(
                "next", filter="events.>", group="noetl_materializer", max=5, timeout_ms=1000
            )
            assert [context_of(d) for d in taken["deliveries"]] == EXPECTED
        async with frame_client(ports["evt_subscribe"]) as subscriber:
            await subscriber.send(b'{"id": 1, "op": "subscribe", "from": 0}')
            stored = (await subscriber.receive_json())["records"]  # caught up from the store
            assert [context_of(r) for r in stored] == EXPECTED
            async with frame_client(ports["evt_ingest"]) as ingest:
                await ingest.request("publish", record=record(4), traceparent=OTHER)
            (live,) = (await subscriber.receive_json())["records"]  # pushed live
            assert (live["sort_key"], context_of(live)) == (4, (OTHER, None))
        async with frame_client(ports["evt_subscribe"], v2=False) as old:
            frame = await old.v1({"shard": 0, "cursor": 0})
            assert frame is not None
            assert [set(r) for r in json.loads(frame)] == [{"sort_key", "subject", "record"}] * 4


async def test_v1_deliveries_are_unchanged(tmp_path: Path) -> None:
    with trio.fail_after(60), serving(tmp_path, **BUSES) as (_, ports):
        await publish_three(ports["cmd_ingest"])
        async with frame_client(ports["cmd_claim"], v2=False) as old:
            frame = await old.v1({"Next": {"member": 1, "filter": "commands.>"}})
            assert frame is not None
            assert json.loads(frame) == {"sort_key": 1, "redelivered": False, "record": record(1)}


async def test_the_context_survives_a_restart(tmp_path: Path) -> None:
    with trio.fail_after(60):
        with serving(tmp_path, **BUSES) as (writer, ports):
            await publish_three(ports["cmd_ingest"])
            writer.terminate()
            assert writer.wait(timeout=30) == 0
        with serving(tmp_path, **BUSES) as (_, ports):
            async with frame_client(ports["cmd_claim"]) as claim:
                batch = await claim.request("next", filter="commands.>", max=5, timeout_ms=1000)
            assert [context_of(d) for d in batch["deliveries"]] == EXPECTED


async def test_a_malformed_context_is_invalid_and_stores_nothing(tmp_path: Path) -> None:
    with trio.fail_after(60), serving(tmp_path, **BUSES) as (_, ports):
        async with frame_client(ports["cmd_ingest"]) as ingest:
            bad = await ingest.request(
                "publish", record=record(1), traceparent=PARENT.replace("4bf", "4BF")
            )
            assert bad["error"]["code"] == "invalid"
            assert bad["error"]["message"].startswith("traceparent: ")
            long_state = await ingest.request(
                "publish", record=record(1), traceparent=PARENT, tracestate="k=" + "v" * 511
            )
            assert long_state["error"]["message"].startswith("tracestate: over 512 bytes")
            batch = await ingest.request(
                "publish_batch",
                records=[record(1), {"record": record(2), "traceparent": "00-" + "0" * 52}],
            )
            assert batch["error"]["message"].startswith("records[1].traceparent: ")
            good = await ingest.request("publish", record=record(3), traceparent=PARENT)
            assert good["sort_key"] == 1  # nothing was stored before it
            lone_state = await ingest.request("publish", record=record(4), tracestate="a=1")
            assert lone_state["error"]["message"] == "tracestate: given without a traceparent"
            empty_state = await ingest.request("publish", record=record(5), tracestate="")
            assert empty_state["ok"], empty_state  # an empty one is none
        async with frame_client(ports["cmd_claim"]) as claim:
            lag = await claim.request("lag")
            assert lag["total"] == 2


async def test_a_subscriber_catching_up_beside_traced_publishes_gets_every_context(
    tmp_path: Path,
) -> None:
    """Subscribers that catch up from a new store while traced events are published get
    each record's context, from the store and live alike. A scan of the store used to
    choose its columns before its SELECT, from a traced range widened only after the
    commit: a record committed in between came without its context, and its live copy
    was then skipped as already sent."""
    batches, size = 200, 10
    with trio.fail_after(120), serving(tmp_path, **BUSES) as (_, ports):

        async def publish() -> None:
            async with frame_client(ports["evt_ingest"]) as ingest:
                for batch in range(batches):
                    records = [
                        {"record": record(batch * size + n), "traceparent": PARENT}
                        for n in range(size)
                    ]
                    assert (await ingest.request("publish_batch", records=records))["ok"]

        async def subscribe(seen: list[dict[str, Any]]) -> None:
            async with frame_client(ports["evt_subscribe"]) as subscriber:
                await subscriber.send(b'{"id": 1, "op": "subscribe", "from": 0}')
                while len(seen) < batches * size:
                    seen += (await subscriber.receive_json())["records"]

        subscribers: list[list[dict[str, Any]]] = [[] for _ in range(6)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            for n, seen in enumerate(subscribers):
                await trio.sleep(0.02 * (n // 2))  # joining at points of the history
                nursery.start_soon(subscribe, seen)
    for seen in subscribers:
        assert [r["sort_key"] for r in seen] == list(range(1, batches * size + 1))
        untraced = [r["sort_key"] for r in seen if r.get("traceparent") != PARENT]
        assert not untraced, f"{len(untraced)} records without their context: {untraced[:10]}"
