"""The event claim face end to end: named consumer groups, `cmdbus-trio serve` as a
subprocess."""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from ..helpers import FrameClient, frame_client, get, publish_over_wire, serving

EVENTS_ONLY = {"CMDBUS_TIER_BIND": "", "CMDBUS_EVT_GROUPS": "alpha,beta"}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, str]]:
    with serving(tmp_path, **EVENTS_ONLY) as (_, ports):
        yield ports


def event(n: int, event_type: str = "step.done") -> dict[str, Any]:
    return {"execution_id": n, "payload": json.dumps({"event_type": event_type, "n": n})}


async def publish(ports: dict[str, str], count: int, start: int = 0) -> list[int]:
    records = [event(start + i) for i in range(count)]
    return await publish_over_wire(ports["evt_ingest"], records, batch=max(count, 1))


async def drain_group(client: FrameClient, group: str, **extra: Any) -> list[int]:
    acked = []
    while True:
        reply = await client.request(
            "next", filter="events.>", group=group, timeout_ms=200, **extra
        )
        extra = {}  # `from` only matters the first time
        delivery = reply["delivery"]
        if delivery is None:
            return acked
        assert (await client.request("ack", sort_key=delivery["sort_key"], group=group))["acked"]
        acked.append(delivery["sort_key"])


async def test_every_group_gets_every_record(server: dict[str, str]) -> None:
    keys = await publish(server, 30)
    async with frame_client(server["evt_claim"]) as client:
        assert await drain_group(client, "alpha") == keys
        assert await drain_group(client, "beta") == keys
        lag = await client.request("lag", group="alpha")
        assert lag["total"] == 0
        assert (await client.request("lag", group="beta"))["subjects"] == {}


async def test_members_of_a_group_compete(server: dict[str, str]) -> None:
    keys = set(await publish(server, 100))
    acked: Counter[int] = Counter()

    async def member() -> None:
        async with frame_client(server["evt_claim"]) as client:
            for key in await drain_group(client, "alpha"):
                acked[key] += 1

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(member)
    assert set(acked) == keys and set(acked.values()) == {1}


async def test_members_of_a_group_compete_in_batches(server: dict[str, str]) -> None:
    """Issue 41: `next` with `max` and `ack` with `sort_keys` on an event group; every
    record reaches the group once, and a member that leaves with its batch unacked
    gives it back whole."""
    keys = await publish(server, 300)
    async with frame_client(server["evt_claim"]) as leaver:
        first = await leaver.request(
            "next", filter="events.>", group="batched", max=40, **{"from": "beginning"}
        )
        assert [d["sort_key"] for d in first["deliveries"]] == keys[:40]
    acked: Counter[int] = Counter()

    async def member() -> None:
        async with frame_client(server["evt_claim"]) as client:
            while True:
                reply = await client.request(
                    "next", filter="events.>", group="batched", max=64, timeout_ms=300
                )
                batch = [d["sort_key"] for d in reply["deliveries"]]
                if not batch:
                    return
                ack = await client.request("ack", sort_keys=batch, group="batched")
                assert ack["acked"] == [True] * len(batch)
                acked.update(batch)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(member)
    assert set(acked) == set(keys) and set(acked.values()) == {1}
    async with frame_client(server["evt_claim"]) as client:
        assert (await client.request("lag", group="batched"))["total"] == 0


async def test_groups_are_created_from_the_beginning_or_the_tail(server: dict[str, str]) -> None:
    before = await publish(server, 3)
    async with frame_client(server["evt_claim"]) as client:
        unknown = await client.request("next", filter="events.>", group="gamma")
        assert unknown["error"]["code"] == "invalid"
        assert unknown["error"]["message"].startswith("group: unknown group 'gamma'")
        bad_from = await client.request(
            "next", filter="events.>", group="gamma", **{"from": "middle"}
        )
        assert bad_from["error"]["message"].startswith("from: expected beginning or tail")
        bad_name = await client.request("next", filter="events.>", group="a b", **{"from": "tail"})
        assert bad_name["error"]["message"].startswith("group: expected 1-128")
        missing = await client.request("lag")
        assert missing["error"]["message"].startswith("group: expected the name")
        assert await drain_group(client, "gamma", **{"from": "beginning"}) == before
        empty = await client.request(
            "next", filter="events.>", group="delta", timeout_ms=0, **{"from": "tail"}
        )
        assert empty["delivery"] is None
        after = await publish(server, 2, start=100)
        assert await drain_group(client, "delta") == after


async def test_v1_requests_carry_the_group(server: dict[str, str]) -> None:
    (key,) = await publish(server, 1)
    async with frame_client(server["evt_claim"], v2=False) as client:
        await client.send(b'{"Next": {"member": 1, "filter": "events.>", "group": "beta"}}')
        delivery = await client.receive_json()
        assert delivery == {"sort_key": key, "redelivered": False, "record": event(0)}
        assert await client.v1({"Ack": {"sort_key": key, "group": "beta"}}) == b"1"
    async with frame_client(server["evt_claim"], v2=False) as no_group:
        await no_group.send(b'{"Next": {"member": 1, "filter": "events.>"}}')
        assert await no_group.receive() is None  # a v1 request without its group closes


@pytest.mark.once
async def test_group_lag_metric(server: dict[str, str]) -> None:
    await publish(server, 4)
    async with frame_client(server["evt_claim"]) as client:
        delivery = (await client.request("next", filter="events.>", group="alpha"))["delivery"]
        await client.request("ack", sort_key=delivery["sort_key"], group="alpha")
        await trio.sleep(1.5)  # the sampler runs every second
        text = (await get(server["control"], "/metrics")).body.decode()
    assert 'ehdb_events_group_lag{group="alpha"} 3.0' in text
    assert 'ehdb_events_group_lag{group="beta"} 4.0' in text


@pytest.mark.once
async def test_a_restart_keeps_groups_and_their_acks(tmp_path: Path) -> None:
    with serving(tmp_path, **EVENTS_ONLY) as (process, ports):
        keys = await publish(ports, 4)
        async with frame_client(ports["evt_claim"]) as client:
            for group in ("alpha", "made-here"):
                first = await client.request(
                    "next", filter="events.>", group=group, **{"from": "beginning"}
                )
                await client.request("ack", sort_key=first["delivery"]["sort_key"], group=group)
        process.send_signal(signal.SIGKILL)
        process.wait()
    with serving(tmp_path, **EVENTS_ONLY) as (_, ports):
        async with frame_client(ports["evt_claim"]) as client:
            assert await drain_group(client, "made-here") == keys[1:]  # no `from`: it exists
            assert await drain_group(client, "alpha") == keys[1:]
            assert await drain_group(client, "beta") == keys


@pytest.mark.once
async def test_a_configured_group_is_the_operators_to_delete(tmp_path: Path) -> None:
    """A client deleting a CMDBUS_EVT_GROUPS group closed its v1 consumers, and the next
    restart re-created it from the beginning: every retained event went to the
    materializers again. It is refused; out of the setting, it may go."""
    with serving(tmp_path, **EVENTS_ONLY) as (_, ports):
        keys = await publish(ports, 3)
        async with frame_client(ports["evt_claim"]) as client:
            first = await client.request("next", filter="events.>", group="alpha")
            await client.request("ack", sort_key=first["delivery"]["sort_key"], group="alpha")
            refused = await client.request("delete_group", group="alpha")
            assert refused["error"]["code"] == "invalid"
            assert refused["error"]["message"].startswith("group: 'alpha' is configured")
            assert "CMDBUS_EVT_GROUPS" in refused["error"]["message"]
            assert await drain_group(client, "alpha") == keys[1:]  # nothing was forgotten
    with serving(tmp_path, **{**EVENTS_ONLY, "CMDBUS_EVT_GROUPS": "beta"}) as (_, ports):
        async with frame_client(ports["evt_claim"]) as client:
            assert (await client.request("delete_group", group="alpha"))["deleted"]


@pytest.mark.once
async def test_delete_group_forgets_the_group_and_all_it_recorded(tmp_path: Path) -> None:
    settings = {**EVENTS_ONLY, "CMDBUS_EVT_MAX_GROUPS": "3"}
    with serving(tmp_path, **settings) as (_, ports):
        keys = await publish(ports, 5)
        async with frame_client(ports["evt_claim"]) as client:
            assert await drain_group(client, "gamma", **{"from": "beginning"}) == keys
            refused = await client.request(
                "next", filter="events.>", group="delta", **{"from": "tail"}
            )
            assert refused["error"]["code"] == "invalid"
            assert "CMDBUS_EVT_MAX_GROUPS" in refused["error"]["message"]

            async with frame_client(ports["evt_claim"]) as waiter:
                async with trio.open_nursery() as nursery:
                    answers: list[dict[str, Any]] = []

                    async def wait() -> None:
                        answers.append(
                            await waiter.request(
                                "next", filter="events.none", group="gamma", timeout_ms=30_000
                            )
                        )

                    nursery.start_soon(wait)
                    await trio.sleep(0.3)  # parked in next
                    assert (await client.request("delete_group", group="gamma"))["deleted"]
                assert answers[0]["ok"] is False and "deleted" in answers[0]["error"]["message"]

            assert not (await client.request("delete_group", group="gamma"))["deleted"]
            unknown = await client.request("lag", group="gamma")
            assert unknown["error"]["code"] == "invalid"
            # Room for one more group now; gamma anew has none of its old acks.
            assert await drain_group(client, "gamma", **{"from": "beginning"}) == keys
            assert (await client.request("delete_group", group="gamma"))["deleted"]
        metrics = (await get(ports["control"], "/metrics")).body.decode()
        assert 'ehdb_events_group_lag{group="gamma"}' not in metrics
        assert "cmdbus_groups_deleted_total 2.0" in metrics
        assert "cmdbus_groups_refused_total 1.0" in metrics

    with serving(tmp_path, **settings) as (_, ports):  # restarted: still gone
        async with frame_client(ports["evt_claim"]) as client:
            unknown = await client.request("lag", group="gamma")
            assert unknown["error"]["code"] == "invalid"
            assert (await client.request("lag", group="alpha"))["total"] == 5


async def test_the_command_face_has_no_delete_group(server: dict[str, str]) -> None:
    async with frame_client(server["cmd_claim"]) as client:
        reply = await client.request("delete_group", group="commands")
        assert reply["error"]["code"] == "unsupported"
    async with frame_client(server["evt_claim"]) as client:
        assert not (await client.request("delete_group", group="nope"))["deleted"]
        reply = await client.request("delete_group", group=7)
        assert reply["error"]["code"] == "invalid" and "group" in reply["error"]["message"]
