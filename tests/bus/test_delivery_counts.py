"""Delivery counts survive a restart, so CMDBUS_MAX_DELIVER holds across one: a poison
command that kills its worker goes to the dead letters after max_deliver deliveries, also
when the writer is SIGKILLed in between."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from ..helpers import frame_client, metric_sum, metrics_text, serving

TIMERS = {"CMDBUS_MAX_DELIVER": "3", "CMDBUS_ACK_WAIT_MS": "300", "CMDBUS_TIER_BIND": ""}


async def claim(ports: dict[str, str], filter: str = "commands.>") -> dict[str, object]:
    async with frame_client(ports["cmd_claim"]) as client:  # gone after: leases released
        reply = await client.request("next", filter=filter, timeout_ms=5000)
    delivery: dict[str, object] = reply["delivery"]
    return delivery


def ended_claim_connections(ports: dict[str, str]) -> float:
    text = metrics_text(ports)
    every = metric_sum(text, 'cmdbus_connections_total{face="cmd_claim",')
    return every - metric_sum(text, 'cmdbus_connections_total{face="cmd_claim",outcome="accepted"}')


@pytest.mark.once
def test_max_deliver_holds_across_a_sigkill(tmp_path: Path) -> None:
    record = {"execution_id": 1, "payload": json.dumps({"step": "poison"})}
    with serving(tmp_path, **TIMERS) as (writer, ports):

        async def before() -> list[dict[str, object]]:
            async with frame_client(ports["cmd_ingest"]) as client:
                await client.request("publish", record=record)
            first = await claim(ports)  # the worker dies: its connection closes
            second = await claim(ports)
            # The count goes to the committer once the writer has seen the second worker
            # go, which races the client's next publish: wait for the writer to count
            # both connections as ended first.
            with trio.fail_after(5):
                while await trio.to_thread.run_sync(ended_claim_connections, ports) < 2:
                    await trio.sleep(0.02)
            async with frame_client(ports["cmd_ingest"]) as client:
                # The count went to the committer before this publish: once the publish
                # is durable, so is the count (one committer, in order).
                barrier = json.dumps({"execution_pool": "barrier"})
                await client.request("publish", record={"execution_id": 2, "payload": barrier})
            return [first, second]

        first, second = trio.run(before)
        assert (first["deliveries"], second["deliveries"]) == (1, 2)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    with serving(tmp_path, **TIMERS) as (_, ports):

        async def after() -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
            third = await claim(ports, "commands.shared.>")  # the third and last delivery
            async with frame_client(ports["cmd_claim"]) as client:
                with trio.fail_after(5):
                    while not (await client.request("dead"))["records"]:
                        await trio.sleep(0.05)
                dead = (await client.request("dead"))["records"][0]
                nothing = await client.request("next", filter="commands.shared.>", timeout_ms=500)
            return third, dead, nothing

        third, dead, nothing = trio.run(after)
        assert (third["deliveries"], third["redelivered"]) == (3, True)
        assert dead["deliveries"] == 3 and nothing["delivery"] is None
        assert metric_sum(metrics_text(ports), "cmdbus_dead_total{") == 1


EVENT_GROUP = "noetl_materializer"  # a configured group, as a deployment has it
BUSES = [  # (ingest face, claim face, the claim's group field)
    ("cmd_ingest", "cmd_claim", {}),
    ("evt_ingest", "evt_claim", {"group": EVENT_GROUP}),
]


async def claim_and_nack_later(
    ports: dict[str, str], claim_face: str, group: dict[str, str]
) -> Any:
    """Claim the record and nack it with a delay that outlasts the writer."""
    async with frame_client(ports[claim_face]) as client:
        reply = await client.request("next", filter=">", timeout_ms=5000, **group)
        delivery = reply["delivery"]
        nacked = await client.request(
            "nack", sort_key=delivery["sort_key"], delay_ms=600_000, **group
        )
        assert nacked["ok"], nacked
    return delivery


@pytest.mark.parametrize(("ingest", "claim_face", "group"), BUSES, ids=["commands", "events"])
@pytest.mark.once
def test_a_delayed_nack_counts_across_a_clean_restart(
    tmp_path: Path, ingest: str, claim_face: str, group: dict[str, str]
) -> None:
    """A record nacked with a delay, then the writer stopped by SIGTERM before the delay
    ends, each time: its deliveries still count, and after max_deliver it is dead. The
    count used to be written when the delay ended, so after each restart the record came
    back as a first delivery and never died."""
    settings = {"CMDBUS_MAX_DELIVER": "2", "CMDBUS_TIER_BIND": ""}
    seen = []
    for run in range(3):
        with serving(tmp_path, **settings) as (writer, ports):

            async def step(run: int = run, ports: dict[str, str] = ports) -> Any:
                if run == 0:
                    async with frame_client(ports[ingest]) as client:
                        record = {"execution_id": 1, "payload": "{}"}
                        assert (await client.request("publish", record=record))["ok"]
                if run < 2:
                    return await claim_and_nack_later(ports, claim_face, group)
                async with frame_client(ports[claim_face]) as client:
                    nothing = await client.request("next", filter=">", timeout_ms=300, **group)
                    assert nothing["delivery"] is None, nothing
                    return (await client.request("dead", **group))["records"]

            seen.append(trio.run(step))
            writer.send_signal(signal.SIGTERM)
            assert writer.wait(timeout=30) == 0
    first, second, dead = seen
    assert (first["deliveries"], first["redelivered"]) == (1, False)
    assert (second["deliveries"], second["redelivered"]) == (2, True)
    assert [record["sort_key"] for record in dead] == [first["sort_key"]]
    assert dead[0]["deliveries"] == 2


@pytest.mark.once
def test_an_event_restart_loads_the_backlog_not_the_history(tmp_path: Path) -> None:
    """20,000 events published and settled by both configured groups (each created from
    the beginning), then 300 more left unconsumed: after a restart the groups hold only
    the 300 back from the store (``cmdbus_groups_tail_loaded_records_total``), and owe
    exactly those. A
    restart used to read the key and subject of every retained event, whatever the
    groups' positions: its memory and time grew with the history."""
    settings = {"CMDBUS_EVT_GROUPS": "first,second", "CMDBUS_TIER_BIND": ""}
    loaded = "cmdbus_groups_tail_loaded_records_total "

    async def publish(ports: dict[str, str], count: int) -> None:
        async with frame_client(ports["evt_ingest"]) as client:
            for start in range(0, count, 5000):
                records = [
                    {"execution_id": n, "payload": "{}"} for n in range(start, start + 5000)
                ][: count - start]
                assert (await client.request("publish_batch", records=records))["ok"]

    async def settle_all(ports: dict[str, str]) -> None:
        for group in ("first", "second"):
            async with frame_client(ports["evt_claim"]) as client:
                while True:
                    reply = await client.request(
                        "next", group=group, filter=">", max=256, timeout_ms=0
                    )
                    if not reply["deliveries"]:
                        break
                    keys = [delivery["sort_key"] for delivery in reply["deliveries"]]
                    assert all((await client.request("ack", group=group, sort_keys=keys))["acked"])

    with serving(tmp_path, **settings) as (writer, ports):
        trio.run(publish, ports, 20_000)
        trio.run(settle_all, ports)
        trio.run(publish, ports, 300)
        time.sleep(2.5)  # the groups' settled positions are made durable each second
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=30) == 0
    with serving(tmp_path, **settings) as (_, ports):
        read = metric_sum(metrics_text(ports), loaded)
        assert read <= 300, f"the groups read {read:.0f} records back at the restart"

        async def backlog(group: str) -> int:
            async with frame_client(ports["evt_claim"]) as client:
                lag = await client.request("lag", group=group)
                return int(lag["total"])

        assert [trio.run(backlog, group) for group in ("first", "second")] == [300, 300]
