"""A worker waits for work longer than every timer, the way a NoETL worker waits between
executions: its `next` is answered when a record comes, on both claim faces and in both
dialects, never charged to a request budget and never cut by the idle timeout.

The writer runs with its budget, idle timeout and shed wait far below the wait."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from ..helpers import (
    FrameClient,
    frame_client,
    get,
    metric_sum,
    metrics_text,
    server_log,
    serving,
)

TIMERS = {
    "CMDBUS_DEFAULT_BUDGET_MS": "300",
    "CMDBUS_IDLE_TIMEOUT_MS": "400",
    "CMDBUS_READ_TIMEOUT_MS": "400",
    "CMDBUS_ACK_WAIT_MS": "60000",
    "CMDBUS_MAX_DELIVER": "1",  # one wrongly counted delivery would park the record as dead
    "CMDBUS_TIER_BIND": "",
}
IDLE = 1.2
"""How long every worker waits before its record is published: longer than each timer."""


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    tmp_path = tmp_path_factory.mktemp("long_poll")
    with serving(tmp_path, **TIMERS) as (_, ports):
        yield tmp_path, ports


FACES = {
    "cmd": ("cmd_ingest", "cmd_claim", "commands.{pool}.>", None),
    "evt": ("evt_ingest", "evt_claim", "events.{pool}", "noetl_materializer"),
}


def record(pool: str) -> dict[str, Any]:
    payload = {"execution_pool": pool, "event_type": pool}
    return {"execution_id": 7, "payload": json.dumps(payload)}


async def publish_later(ports: dict[str, str], ingest: str, pool: str, delay: float) -> int:
    await trio.sleep(delay)
    async with frame_client(ports[ingest]) as client:
        reply = await client.request("publish", record=record(pool))
    sort_key: int = reply["sort_key"]
    return sort_key


async def v2_worker(client: FrameClient, filter: str, group: str | None, **wait: Any) -> Any:
    fields: dict[str, Any] = {"filter": filter, **wait}
    if group is not None:
        fields["group"] = group
    reply = await client.request("next", **fields)
    assert reply["ok"], reply
    delivery = reply["delivery"]
    assert delivery is not None, "the wait for a record ended without one"
    ack = await client.request(
        "ack", sort_key=delivery["sort_key"], **({"group": group} if group else {})
    )
    assert ack == {"id": client.next_id, "ok": True, "acked": True}  # still connected
    return delivery


async def v1_worker(client: FrameClient, filter: str, group: str | None) -> Any:
    body: dict[str, Any] = {"member": 1, "filter": filter}
    ack: dict[str, Any] = {}
    if group is not None:
        body["group"] = ack["group"] = group
    reply = await client.v1({"Next": body})
    assert reply is not None, "the writer closed a waiting v1 worker"
    delivery = json.loads(reply)
    assert await client.v1({"Ack": {"sort_key": delivery["sort_key"], **ack}}) == b"1"
    return delivery


@pytest.mark.parametrize("face", sorted(FACES))
@pytest.mark.parametrize("dialect", ["v1", "v2-timeout", "v2-unbounded", "v2-deadline"])
async def test_a_worker_waiting_longer_than_every_timer_gets_its_record(
    writer: tuple[Path, dict[str, str]], face: str, dialect: str
) -> None:
    tmp_path, ports = writer
    ingest, claim, filter_pattern, group = FACES[face]
    pool = f"idle_{dialect.replace('-', '_')}"
    filter = filter_pattern.format(pool=pool)
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            keys: list[int] = []

            async def publish() -> None:
                keys.append(await publish_later(ports, ingest, pool, IDLE))

            nursery.start_soon(publish)
            async with frame_client(ports[claim], v2=dialect != "v1") as client:
                if dialect == "v1":
                    delivery = await v1_worker(client, filter, group)
                elif dialect == "v2-timeout":
                    delivery = await v2_worker(client, filter, group, timeout_ms=10_000)
                elif dialect == "v2-unbounded":
                    delivery = await v2_worker(client, filter, group)
                else:  # a budget of its own, shorter than the wait: the wait is not charged
                    delivery = await v2_worker(
                        client, filter, group, timeout_ms=10_000, deadline_ms=200
                    )
    assert delivery["sort_key"] == keys[0]
    assert delivery["redelivered"] is False
    if dialect != "v1":
        assert delivery["deliveries"] == 1
    errors = [line for line in server_log(tmp_path).splitlines() if '"level": "error"' in line]
    assert not errors, errors
    text = await trio.to_thread.run_sync(metrics_text, ports)
    assert metric_sum(text, "cmdbus_dead_total{") == 0
    assert metric_sum(text, "cmdbus_shed_total{") == 0
    assert metric_sum(text, 'cmdbus_connections_total{face="' + claim + '",outcome="idle') == 0
    # Published while the worker waited: its body was still kept, not read back.
    store = "commands" if face == "cmd" else "events"
    assert metric_sum(text, f'cmdbus_body_reads_total{{source="memory",store="{store}"}}') > 0


async def test_an_idle_connection_with_nothing_asked_is_still_closed(
    writer: tuple[Path, dict[str, str]],
) -> None:
    """The idle timeout still closes a connection that waits for nothing."""
    _, ports = writer
    with trio.fail_after(5):
        async with frame_client(ports["cmd_claim"]) as client:
            await trio.sleep(0.6)  # longer than CMDBUS_IDLE_TIMEOUT_MS
            assert await client.receive() is None


async def test_a_worker_mid_command_is_not_idle(writer: tuple[Path, dict[str, str]]) -> None:
    """A worker holds a lease and says nothing for longer than the idle timeout (its
    command runs): the connection stays, and its ack lands. The lease has its own timer."""
    _, ports = writer
    with trio.fail_after(10):
        await publish_later(ports, "cmd_ingest", "mid_command", 0)
        async with frame_client(ports["cmd_claim"]) as client:
            reply = await client.request("next", filter="commands.mid_command.>", timeout_ms=0)
            sort_key = reply["delivery"]["sort_key"]
            await trio.sleep(IDLE)  # the command runs
            assert (await client.request("ack", sort_key=sort_key))["acked"] is True
            await trio.sleep(IDLE)  # holding nothing now: idle, so closed
            assert await client.receive() is None


async def test_the_idle_timer_restarts_from_the_last_answer(
    writer: tuple[Path, dict[str, str]],
) -> None:
    """A `next` waits longer than the idle timeout and is answered empty: the quiet time
    counts from that answer, not from the request. A request sent 300 ms later (under the
    400 ms timeout, 1.5 s after the last read) is answered; 600 ms of quiet closes."""
    _, ports = writer
    with trio.fail_after(10):
        async with frame_client(ports["cmd_claim"]) as client:
            reply = await client.request("next", filter="commands.restart.>", timeout_ms=1200)
            assert reply["delivery"] is None
            await trio.sleep(0.3)
            reply = await client.request("next", filter="commands.restart.>", timeout_ms=0)
            assert reply["delivery"] is None
            await trio.sleep(0.6)
            assert await client.receive() is None


@pytest.mark.parametrize("dialect", ["v1", "v2"])
async def test_a_quiet_subscriber_is_not_idle(
    writer: tuple[Path, dict[str, str]], dialect: str
) -> None:
    _, ports = writer
    pool = f"quiet_{dialect}"
    with trio.fail_after(10):
        cursor = await publish_later(ports, "evt_ingest", pool, 0)
        async with frame_client(ports["evt_subscribe"], v2=dialect == "v2") as client:
            if dialect == "v1":
                await client.send(json.dumps({"shard": 0, "cursor": cursor}).encode())
            else:
                await client.send(
                    json.dumps(
                        {"id": 1, "op": "subscribe", "from": cursor, "filter": f"events.{pool}"}
                    ).encode()
                )
            sort_key = await publish_later(ports, "evt_ingest", pool, IDLE)
            frame = await client.receive()
    assert frame is not None, "the writer closed a quiet subscriber"
    records = json.loads(frame) if dialect == "v1" else json.loads(frame)["records"]
    assert [r["sort_key"] for r in records] == [sort_key]


async def test_parked_consumers_hold_no_intake_place(writer: tuple[Path, dict[str, str]]) -> None:
    """More parked `next`s than the claim Gate has slots and queue places (64 + 512): a
    worker with one of them in flight still has its other requests taken in at once,
    instead of being held back for shed_after (1 s) as if the face were flooded."""
    _, ports = writer
    parked = 0
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            clients = [await FrameClient.connect(ports["cmd_claim"]) for _ in range(20)]
            for client in clients:
                await client.hello()
                for n in range(31):  # one fewer than a connection may have in flight
                    body = {"id": n + 1, "op": "next", "filter": "commands.nobody.>"}
                    await client.send(json.dumps(body).encode())
                    parked += 1
            assert parked > 64 + 512
            worker = clients[0]
            await trio.sleep(0.5)  # every frame read and parked
            gates = (await get(ports["control"], "/healthz")).json()["gates"]
            assert gates["cmd_claim"]["intake"] == 0  # the parked ones take no place
            await worker.send(json.dumps({"id": 99, "op": "dead", "limit": 1}).encode())
            reply = await worker.receive_json()
            assert reply == {"id": 99, "ok": True, "records": [], "next_after": None}
            for client in clients:
                await client.aclose()
            nursery.cancel_scope.cancel()


async def test_requests_held_back_longer_than_every_timer_are_all_answered(
    writer: tuple[Path, dict[str, str]],
) -> None:
    """Eighty `next`s at once, more than a connection takes in (32): the rest wait
    unread while the first ones wait for records, longer than every timer. The reader's
    timer expires while it hands the held-back requests over; none is lost, each gets
    its record once records come, and the connection stays."""
    _, ports = writer
    pool, count = "held_back", 80
    with trio.fail_after(20):
        async with frame_client(ports["cmd_claim"]) as client:
            for id in range(1, count + 1):
                body = {"id": id, "op": "next", "filter": f"commands.{pool}.>"}
                await client.send(json.dumps(body | {"timeout_ms": 15_000}).encode())
            await trio.sleep(IDLE)
            async with frame_client(ports["cmd_ingest"]) as ingest:
                for _ in range(count):
                    assert (await ingest.request("publish", record=record(pool)))["ok"]
            replies = [await client.receive_json() for _ in range(count)]
            assert sorted(reply["id"] for reply in replies) == list(range(1, count + 1))
            assert all(reply["delivery"] is not None for reply in replies), replies
            for reply in replies:
                sort_key = reply["delivery"]["sort_key"]
                assert (await client.request("ack", sort_key=sort_key))["acked"] is True


async def test_a_frame_trickling_in_slower_than_the_read_timeout_in_all_is_read(
    writer: tuple[Path, dict[str, str]],
) -> None:
    """A frame arrives a few bytes at a time over three read timeouts, each piece within
    one: the connection is not stalled, and the request is answered."""
    _, ports = writer
    with trio.fail_after(10):
        async with frame_client(ports["cmd_claim"]) as client:
            request = {"id": 1, "op": "next", "filter": "commands.trickle.>", "timeout_ms": 0}
            body = json.dumps(request)
            frame = len(body).to_bytes(4, "big") + body.encode()
            pieces = [frame[i : i + 8] for i in range(0, len(frame), 8)]
            pause = 1.2 / len(pieces)  # 1.2 s in all against a 400 ms read timeout
            assert pause < 0.2
            for piece in pieces:
                await client.stream.send_all(piece)
                await trio.sleep(pause)
            reply = await client.receive_json()
            assert reply["id"] == 1 and reply["delivery"] is None, reply


async def test_a_lease_in_a_deleted_group_holds_its_connection_no_longer(
    writer: tuple[Path, dict[str, str]],
) -> None:
    """Issue 38: a group deleted while a worker holds one of its leases ends the lease
    (its timers no longer run): the worker's connection then holds nothing, so it idles
    out like any other, and its ack answers false. It used to be held open for ever."""
    _, ports = writer
    with trio.fail_after(10):
        await publish_later(ports, "evt_ingest", "doomed", 0)
        async with frame_client(ports["evt_claim"]) as worker:
            reply = await worker.request(
                "next",
                filter="events.doomed",
                group="doomed_group",
                timeout_ms=0,
                **{"from": "beginning"},
            )
            sort_key = reply["delivery"]["sort_key"]
            async with frame_client(ports["evt_claim"]) as operator:
                deleted = await operator.request("delete_group", group="doomed_group")
                assert deleted["deleted"] is True
            assert (await worker.request("ack", sort_key=sort_key, group="doomed_group"))[
                "ok"
            ] is False  # an unknown group now
            await trio.sleep(IDLE)
            assert await worker.receive() is None
