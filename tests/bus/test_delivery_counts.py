"""Delivery counts survive a restart, so CMDBUS_MAX_DELIVER holds across one: a poison
command that kills its worker goes to the dead letters after max_deliver deliveries, also
when the writer is SIGKILLed in between."""

from __future__ import annotations

import json
import signal
from pathlib import Path

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
