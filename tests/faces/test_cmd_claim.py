"""The command claim face end to end: `cmdbus-trio serve` as a subprocess."""

from __future__ import annotations

import json
import signal
from collections import Counter
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
    publish_over_wire,
    server_log,
    serving,
)

BUS_ONLY = {"CMDBUS_TIER_BIND": ""}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, str]]:
    with serving(tmp_path, CMDBUS_ACK_WAIT_MS="400", CMDBUS_MAX_DELIVER="3", **BUS_ONLY) as (
        _,
        ports,
    ):
        yield ports


def record(execution_id: Any, pool: str | None = None) -> dict[str, Any]:
    payload = {"n": execution_id} if pool is None else {"n": execution_id, "execution_pool": pool}
    return {"execution_id": execution_id, "payload": json.dumps(payload)}


async def publish(ports: dict[str, str], records: list[dict[str, Any]]) -> list[int]:
    return await publish_over_wire(ports["cmd_ingest"], records)


async def next_delivery(
    client: FrameClient, filter: str = "commands.>", timeout_ms: int = 0
) -> Any:
    reply = await client.request("next", filter=filter, timeout_ms=timeout_ms)
    return reply["delivery"]


async def test_batches_over_the_wire(server: dict[str, str]) -> None:
    """Issue 41, v2: `next` with `max` answers `deliveries` as soon as one record is
    there; `ack`, `nack` and `extend` with `sort_keys` answer a list in order."""
    async with frame_client(server["cmd_claim"]) as client:
        empty = await client.request("next", filter="commands.>", max=10, timeout_ms=100)
        assert empty == {"id": empty["id"], "ok": True, "deliveries": []}
        async with trio.open_nursery() as nursery:
            replies: list[Any] = []

            async def parked() -> None:
                replies.append(await client.request("next", filter="commands.>", max=10))

            nursery.start_soon(parked)
            await trio.sleep(0.2)  # parked: nothing there yet
            keys = await publish(server, [record(n) for n in range(3)])
        (reply,) = replies
        taken = [d["sort_key"] for d in reply["deliveries"]]
        assert 1 <= len(taken) <= 3 and taken == keys[: len(taken)]
        rest = await client.request("next", filter="commands.>", max=10, timeout_ms=0)
        taken += [d["sort_key"] for d in rest["deliveries"]]
        assert taken == keys
        extended = await client.request("extend", sort_keys=[keys[0], 999_999])
        assert (extended["extended"], extended["lease_ms"]) == ([True, False], 400)
        nacked = await client.request("nack", sort_keys=[keys[1]])
        assert nacked["nacked"] == [True]
        acked = await client.request("ack", sort_keys=[keys[0], keys[1], keys[2]])
        assert acked["acked"] == [True, False, True]  # the nacked one is no longer held
        again = await client.request("next", filter="commands.>", max=10, timeout_ms=1000)
        assert [(d["sort_key"], d["redelivered"]) for d in again["deliveries"]] == [(keys[1], True)]
        bad = await client.request("next", filter="commands.>", max=1001)
        assert bad["error"]["code"] == "invalid" and bad["error"]["message"].startswith("max:")
        both = await client.request("ack", sort_key=keys[1], sort_keys=[keys[1]])
        assert both["error"]["message"].startswith("sort_keys:")


async def test_deliver_ack_and_shapes(server: dict[str, str]) -> None:
    keys = await publish(server, [record(1), record(2, pool="system")])
    async with frame_client(server["cmd_claim"]) as client:
        first = await next_delivery(client)
        lease = first.pop("lease")
        assert isinstance(lease, int) and 0 <= lease < 1 << 53
        assert first == {
            "sort_key": keys[0],
            "subject": "commands.shared.shard.0",
            "redelivered": False,
            "deliveries": 1,
            "record": {"execution_id": 1, "payload": json.dumps({"n": 1})},
        }
        system = await next_delivery(client, "commands.system.>")
        assert system["sort_key"] == keys[1]
        assert await next_delivery(client) is None  # everything is leased
        lag = await client.request("lag")
        assert (lag["subjects"], lag["total"]) == (
            {"commands.shared.shard.0": 1, "commands.system.shard.0": 1},
            2,
        )
        assert (await client.request("ack", sort_key=keys[0]))["acked"] is True
        assert (await client.request("ack", sort_key=keys[0]))["acked"] is False  # already
        assert (await client.request("ack", sort_key=999_999))["acked"] is False  # unknown
        assert (await client.request("lag", filter="commands.shared.>"))["total"] == 0
        bad = await client.request("next", filter="commands..x")
        assert bad["error"]["code"] == "invalid" and bad["error"]["message"].startswith("filter:")
        grouped = await client.request("lag", group="g")
        assert grouped["error"]["message"].startswith("group:")


async def test_competing_consumers_ack_every_record_exactly_once(server: dict[str, str]) -> None:
    keys = set(await publish(server, [record(i) for i in range(300)]))
    acked: Counter[int] = Counter()
    held: set[int] = set()

    async def consumer() -> None:
        async with frame_client(server["cmd_claim"]) as client:
            while (delivery := await next_delivery(client, timeout_ms=200)) is not None:
                key = delivery["sort_key"]
                # Held from delivery until the ack's answer: no one else may hold it
                # then, unless its lease ran out first (then this ack is refused).
                assert key not in held or delivery["redelivered"], "held twice at once"
                held.add(key)
                if (await client.request("ack", sort_key=key))["acked"]:
                    acked[key] += 1
                held.discard(key)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(consumer)
    assert set(acked) == keys
    assert set(acked.values()) == {1}


async def test_unacked_records_redeliver_after_the_lease(server: dict[str, str]) -> None:
    (key,) = await publish(server, [record(1)])
    async with frame_client(server["cmd_claim"]) as client:
        assert (await next_delivery(client))["sort_key"] == key
        again = await next_delivery(client, timeout_ms=2000)  # lease: 400 ms
        assert (again["sort_key"], again["redelivered"], again["deliveries"]) == (key, True, 2)
        extended = await client.request("extend", sort_key=key)
        assert extended == {"id": extended["id"], "ok": True, "extended": True, "lease_ms": 400}
        assert (await client.request("nack", sort_key=key))["nacked"] is True
        third = await next_delivery(client)
        assert (third["sort_key"], third["deliveries"]) == (key, 3)


async def test_a_closed_connection_releases_its_leases_at_once(
    server: dict[str, str], tmp_path: Path
) -> None:
    """And says so: counted by the connection's outcome, and logged."""
    (key,) = await publish(server, [record(1)])
    async with frame_client(server["cmd_claim"]) as leaving:
        assert (await next_delivery(leaving))["sort_key"] == key
    async with frame_client(server["cmd_claim"]) as staying:
        again = await next_delivery(staying, timeout_ms=300)  # well before the lease ends
        assert again is not None and again["redelivered"] is True
        assert (await staying.request("ack", sort_key=key))["acked"] is True
    text = (await get(server["control"], "/metrics")).body.decode()
    released = 'cmdbus_leases_released_total{face="cmd_claim",outcome="closed"}'
    assert metric_sum(text, released) == 1
    (line,) = [x for x in server_log(tmp_path).splitlines() if "leases_released" in x]
    assert json.loads(line)["outcome"] == "closed" and json.loads(line)["leases"] == 1


async def test_max_deliver_parks_dead_letters(server: dict[str, str]) -> None:
    (key,) = await publish(server, [record(42)])
    async with frame_client(server["cmd_claim"]) as client:
        for _ in range(3):
            assert (await next_delivery(client, timeout_ms=2000))["sort_key"] == key
            assert (await client.request("nack", sort_key=key))["nacked"]
        assert await next_delivery(client, timeout_ms=600) is None
        assert (await client.request("lag"))["total"] == 0
        dead = await client.request("dead")
        for _ in range(20):  # the dead letter is group-committed just after the nack
            if dead["records"]:
                break
            await trio.sleep(0.05)
            dead = await client.request("dead")
        assert [(r["sort_key"], r["deliveries"]) for r in dead["records"]] == [(key, 3)]
        assert dead["records"][0]["record"]["execution_id"] == 42
    text = (await get(server["control"], "/metrics")).body.decode()
    assert 'cmdbus_dead_total{subject="commands.shared.shard.0"} 1.0' in text
    assert 'cmdbus_redeliveries_total{subject="commands.shared.shard.0"} 2.0' in text


async def test_a_waiting_next_wakes_on_a_new_publish(server: dict[str, str]) -> None:
    async with frame_client(server["cmd_claim"]) as client:
        await client.send(b'{"id": 1, "op": "next", "filter": "commands.>"}')
        await trio.sleep(0.2)
        (key,) = await publish(server, [record(7)])
        with trio.fail_after(5):
            reply = await client.receive_json()
    assert reply["delivery"]["sort_key"] == key


async def test_v1_next_ack_nack(server: dict[str, str]) -> None:
    keys = await publish(server, [record(1), record(2)])
    async with frame_client(server["cmd_claim"], v2=False) as client:
        await client.send(b'{"Next": {"member": 1, "filter": "commands.>"}}')
        first = await client.receive_json()
        assert first == {"sort_key": keys[0], "redelivered": False, "record": record(1)}
        assert await client.v1({"Ack": {"sort_key": keys[0]}}) == b"1"
        await client.send(b'{"Next": {"member": 1, "filter": "commands.>"}}')
        second = await client.receive_json()
        assert await client.v1({"Nack": {"sort_key": second["sort_key"]}}) == b"1"
    async with frame_client(server["cmd_claim"], v2=False) as bad:
        await bad.send(b'{"Fetch": {}}')
        assert await bad.receive() is None


@pytest.mark.once
async def test_lag_metric_is_undelivered_plus_unacked(server: dict[str, str]) -> None:
    keys = await publish(server, [record(i) for i in range(5)])
    async with frame_client(server["cmd_claim"]) as client:
        for _ in range(3):
            await next_delivery(client)
        await client.request("ack", sort_key=keys[0])
        await trio.sleep(1.5)  # the sampler runs every second
        text = (await get(server["control"], "/metrics")).body.decode()
    assert 'ehdb_feed_subject_lag{subject="commands.shared.shard.0"} 4.0' in text
    assert "ehdb_feed_total_lag 4.0" in text


@pytest.mark.once
async def test_acks_survive_a_restart_and_unacked_records_return(tmp_path: Path) -> None:
    with serving(tmp_path, **BUS_ONLY) as (process, ports):
        keys = await publish(ports, [record(i) for i in range(5)])
        async with frame_client(ports["cmd_claim"]) as client:
            for _ in range(3):
                delivery = await next_delivery(client)
                assert (await client.request("ack", sort_key=delivery["sort_key"]))["acked"]
            await next_delivery(client)  # leased, never acked
        process.send_signal(signal.SIGKILL)
        process.wait()
    with serving(tmp_path, **BUS_ONLY) as (_, ports):
        async with frame_client(ports["cmd_claim"]) as client:
            returned = []
            while (delivery := await next_delivery(client, timeout_ms=300)) is not None:
                returned.append(delivery["sort_key"])
    assert returned == keys[3:]


@pytest.mark.once
async def test_a_drain_wakes_waiting_consumers_instead_of_waiting_for_them(tmp_path: Path) -> None:
    with serving(tmp_path, CMDBUS_SHUTDOWN_TIMEOUT_MS="15000", **BUS_ONLY) as (process, ports):
        async with (
            frame_client(ports["cmd_claim"]) as v2,
            frame_client(ports["cmd_claim"], v2=False) as v1,
        ):
            await v2.send(b'{"id": 1, "op": "next", "filter": "commands.>"}')  # no timeout
            await v1.send(b'{"Next": {"member": 1, "filter": "commands.>"}}')
            await trio.sleep(0.3)
            start = trio.current_time()
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                reply = await v2.receive_json()
                assert await v1.receive() is None  # v1 has no error to say it with: closed
            assert reply["error"]["code"] == "unavailable"
            assert reply["error"]["retry_after_ms"] == 1000  # the clients reconnect for it
            await trio.to_thread.run_sync(process.wait, 10)
        assert process.returncode == 0
        assert trio.current_time() - start < 5  # not the 15 s shutdown budget


@pytest.mark.once
async def test_settled_positions_prune_acks_and_restarts_stay_right(tmp_path: Path) -> None:
    import sqlite3

    with serving(tmp_path, **BUS_ONLY) as (process, ports):
        keys = await publish(ports, [record(i) for i in range(20)])
        async with frame_client(ports["cmd_claim"]) as client:
            for _ in range(15):
                delivery = await next_delivery(client)
                assert (await client.request("ack", sort_key=delivery["sort_key"]))["acked"]
        await trio.sleep(2.5)  # the sampler persists the low-water mark every second
        process.send_signal(signal.SIGKILL)
        process.wait()
    db = sqlite3.connect(tmp_path / "data" / "commands.sqlite3")
    assert db.execute("SELECT settled_below FROM positions").fetchall() == [(keys[15],)]
    assert db.execute("SELECT COUNT(*) FROM acks").fetchone() == (0,)
    db.close()
    with serving(tmp_path, **BUS_ONLY) as (_, ports):
        async with frame_client(ports["cmd_claim"]) as client:
            returned = []
            while (delivery := await next_delivery(client, timeout_ms=300)) is not None:
                returned.append(delivery["sort_key"])
    assert returned == keys[15:]
