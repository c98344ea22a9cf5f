"""Dead letters at any size (issue 16 item 2): `dead` pages like `read_execution`, filtered
in the query, bounded by the reply cap; `requeue` and `purge` by sort keys or filter,
durable before the reply, also across a SIGKILL; both faces, both clients and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.client import blocking
from cmdbus_trio.client import trio as trio_client

from ..helpers import FrameClient, environment, frame_client, serving

SETTINGS = {"CMDBUS_TIER_BIND": "", "CMDBUS_MAX_DELIVER": "1", "CMDBUS_EVT_GROUPS": "audit"}


def command(n: int, pool: str) -> dict[str, Any]:
    return {"execution_id": n, "payload": json.dumps({"n": n, "execution_pool": pool})}


async def park(ports: dict[str, str], pools: list[str], face: str = "cmd_claim") -> list[int]:
    """Publish one record per entry of ``pools`` and nack each once (max_deliver 1: dead)."""
    ingest = "cmd_ingest" if face == "cmd_claim" else "evt_ingest"
    records = [command(n, pool) for n, pool in enumerate(pools)]
    if face == "evt_claim":
        records = [
            {"execution_id": n, "payload": json.dumps({"event_type": pool})}
            for n, pool in enumerate(pools)
        ]
    keys: list[int] = []
    async with frame_client(ports[ingest]) as client:
        for start in range(0, len(records), 500):
            reply = await client.request("publish_batch", records=records[start : start + 500])
            keys += reply["sort_keys"]
    group = {"group": "audit"} if face == "evt_claim" else {}
    async with frame_client(ports[face]) as client:
        for _ in keys:
            reply = await client.request("next", filter=">", timeout_ms=2000, **group)
            sort_key = reply["delivery"]["sort_key"]
            assert (await client.request("nack", sort_key=sort_key, **group))["nacked"]
        await settled_dead(client, len(keys), group)
    return keys


async def settled_dead(client: FrameClient, count: int, group: dict[str, str]) -> None:
    """Dead letters are group-committed just after the nack: wait until all are listed."""
    with trio.fail_after(10):
        while len(await all_dead(client, **group)) < count:
            await trio.sleep(0.05)


async def all_dead(client: FrameClient, **fields: Any) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    after = None
    while True:
        page = await client.request(
            "dead", limit=1000, **fields, **({"after": after} if after else {})
        )
        assert page["ok"], page
        records += page["records"]
        if page["next_after"] is None:
            return records
        after = page["next_after"]


@pytest.mark.once
async def test_dead_pages_past_a_thousand_filtered_in_the_query(tmp_path: Path) -> None:
    with serving(tmp_path, **SETTINGS) as (_, ports):
        keys = await park(ports, ["busy"] * 1200 + ["rare"] * 3)
        async with frame_client(ports["cmd_claim"]) as client:
            rare = await client.request("dead", filter="commands.rare.>")
            assert [r["sort_key"] for r in rare["records"]] == keys[1200:]
            assert rare["next_after"] is None
            first = await client.request("dead", limit=10)
            assert [r["sort_key"] for r in first["records"]] == keys[:10]
            assert first["next_after"] == keys[9]
            second = await client.request("dead", limit=10, after=first["next_after"])
            assert [r["sort_key"] for r in second["records"]] == keys[10:20]
            everything = await all_dead(client)
            assert [r["sort_key"] for r in everything] == keys
            one = everything[0]
            assert one["subject"] == "commands.busy.shard.0"
            assert (one["deliveries"], one["redelivered"]) == (1, False)
            assert one["record"] == {
                "execution_id": 0,
                "payload": '{"n": 0, "execution_pool": "busy"}',
            }
            # A page of 1,000 (63 queries) takes far longer than a 1 ms budget: the read
            # stops between pages and the reply says so.
            late = await client.request("dead", limit=1000, deadline_ms=1)
            assert late["error"]["code"] == "deadline", late
            for bad in ({"after": -1}, {"limit": "x"}, {"filter": "a..b"}):
                reply = await client.request("dead", **bad)
                assert reply["error"]["code"] == "invalid", bad
                assert next(iter(bad)) in reply["error"]["message"]


async def test_a_page_stops_at_the_reply_cap(tmp_path: Path) -> None:
    with serving(tmp_path, CMDBUS_MAX_REPLY_BYTES="1500", **SETTINGS) as (_, ports):
        keys = await park(ports, ["p"] * 12)
        async with frame_client(ports["cmd_claim"]) as client:
            page = await client.request("dead", limit=100)
            returned = [r["sort_key"] for r in page["records"]]
            assert 1 <= len(returned) < 12 and page["next_after"] == returned[-1]
            assert [r["sort_key"] for r in await all_dead(client)] == keys


@pytest.mark.once
async def test_requeue_and_purge_survive_a_sigkill(tmp_path: Path) -> None:
    with serving(tmp_path, **SETTINGS) as (writer, ports):
        keys = await park(ports, ["a"] * 4 + ["b"] * 4)
        await trio.sleep(1.5)  # the low-water mark is persisted past the dead letters
        async with frame_client(ports["cmd_claim"]) as client:
            requeued = await client.request("requeue", sort_keys=[keys[0], keys[1], 999_999])
            assert requeued["requeued"] == 2
            assert (await client.request("requeue", sort_keys=[keys[0]]))["requeued"] == 0
            assert (await client.request("purge", filter="commands.b.>"))["purged"] == 4
            for bad in (
                {},
                {"sort_keys": [1], "filter": ">"},
                {"sort_keys": [0]},
                {"sort_keys": 5},
            ):
                reply = await client.request("purge", **bad)
                assert reply["error"]["code"] == "invalid", bad
            assert [r["sort_key"] for r in await all_dead(client)] == keys[2:4]
        writer.kill()
        writer.wait()
    with serving(tmp_path, **SETTINGS) as (_, ports):
        async with frame_client(ports["cmd_claim"]) as client:
            got = []
            for _ in range(2):
                delivery = (await client.request("next", filter=">", timeout_ms=2000))["delivery"]
                got.append((delivery["sort_key"], delivery["deliveries"], delivery["redelivered"]))
                assert (await client.request("ack", sort_key=delivery["sort_key"]))["acked"]
            assert got == [(keys[0], 1, False), (keys[1], 1, False)]  # a fresh count
            assert (await client.request("next", filter=">", timeout_ms=200))["delivery"] is None
            assert [r["sort_key"] for r in await all_dead(client)] == keys[2:4]
            assert (await client.request("lag"))["total"] == 0


async def test_event_groups_and_both_clients(tmp_path: Path) -> None:
    with serving(tmp_path, **SETTINGS) as (_, ports):
        keys = await park(ports, ["x", "y", "y"], face="evt_claim")
        async with await trio_client.ClaimClient.connect(ports["evt_claim"]) as claim:
            page = await claim.dead(group="audit", limit=2)
            assert [d.sort_key for d in page.records] == keys[:2]
            assert page.next_after == keys[1]
            assert await claim.requeue(filter="events.y", group="audit") == 2
            delivery = await claim.next(">", group="audit", wait=2)
            assert delivery is not None and delivery.sort_key == keys[1]
            assert await claim.ack(delivery.sort_key, group="audit")
            delivery = await claim.next(">", group="audit", wait=2)
            assert delivery is not None and delivery.sort_key == keys[2]
            assert await claim.ack(delivery.sort_key, group="audit")

        def blocking_side() -> None:
            with blocking.ClaimClient.connect(ports["evt_claim"]) as claim:
                assert claim.purge([keys[0]], group="audit") == 1
                assert claim.dead(group="audit").records == ()

        await trio.to_thread.run_sync(blocking_side)


@pytest.mark.once
def test_the_cli_lists_requeues_and_purges(tmp_path: Path) -> None:
    with serving(tmp_path, **SETTINGS) as (_, ports):
        keys = trio.run(park, ports, ["c"] * 3)

        def client(*args: str) -> list[Any]:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "cmdbus_trio",
                    "client",
                    "dead",
                    "--addr",
                    ports["cmd_claim"],
                    *args,
                ],
                env=environment(tmp_path),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return [json.loads(line) for line in done.stdout.splitlines()]

        assert [r["sort_key"] for r in client()] == keys
        assert client("--requeue", "--sort-key", str(keys[0])) == [{"requeued": 1}]
        assert client("--purge", "--filter", "commands.c.>") == [{"purged": 2}]
        assert client() == []
        # Acting on every dead letter takes --all: it used to be one flag away.
        trio.run(park, ports, ["d"])
        refused = subprocess.run(
            [sys.executable, "-m", "cmdbus_trio", "client", "dead", "--addr", ports["cmd_claim"],
             "--purge"],
            env=environment(tmp_path), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode == 2  # a usage error
        assert "--purge: name --filter F or --sort-key K, or --all" in refused.stderr
        assert len(client()) == 1
        assert client("--requeue", "--all") == [{"requeued": 1}]
