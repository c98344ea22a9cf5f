"""Split roles (issue 18, deploy/k8s/overlays/split): the buses and the tier service in two
processes, each with the other's faces off, the clients pointed at each. A stalled tier
process costs the buses nothing: they answer their probes and publishes meanwhile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from cmdbus_trio.client.trio import ClaimClient, IngestClient, TierClient

from .helpers import get, serving

BUS_FACES = ("CMD_INGEST", "CMD_CLAIM", "EVT_INGEST", "EVT_CLAIM", "EVT_SUBSCRIBE")


@pytest.mark.once
async def test_the_buses_and_the_tier_run_side_by_side_and_a_tier_stall_spares_the_buses(
    tmp_path: Path,
) -> None:
    buses_env = {"CMDBUS_TIER_BIND": ""}
    tier_env = {f"CMDBUS_{face}_BIND": "" for face in BUS_FACES} | {"CMDBUS_DEBUG_HOOKS": "true"}
    (tmp_path / "buses").mkdir()
    (tmp_path / "tier").mkdir()
    with (
        trio.fail_after(60),
        serving(tmp_path / "buses", **buses_env) as (_, buses),
        serving(tmp_path / "tier", **tier_env) as (_, tier),
    ):
        assert "tier" not in buses and set(tier) == {"control", "tier"}
        record = {"execution_id": 7, "payload": json.dumps({"execution_pool": "shared"})}
        async with (
            await IngestClient.connect(buses["cmd_ingest"]) as ingest,
            await ClaimClient.connect(buses["cmd_claim"]) as claim,
            await TierClient.connect(tier["tier"]) as history,
        ):
            await ingest.publish(record)
            delivery = await claim.next("commands.>", wait=5)
            assert delivery is not None
            await history.append(7, json.dumps({"event_id": "7-done"}))
            assert await claim.ack(delivery.sort_key)
            page = await history.read_execution(7)
            assert [json.loads(r.payload)["event_id"] for r in page.records] == ["7-done"]
            # Stall the tier process's loop (its hook answers once the stall is over);
            # the buses' process answers all the while.
            stalled = trio.Event()
            async with trio.open_nursery() as nursery:

                async def stall_the_tier() -> None:
                    await get(tier["control"], "/debug/block-loop?seconds=5", "POST")
                    stalled.set()

                nursery.start_soon(stall_the_tier)
                await trio.sleep(0.5)
                assert (await get(buses["control"], "/healthz")).status == 200
                assert (await ingest.publish(record)).sort_key == delivery.sort_key + 1
                assert not stalled.is_set()  # the tier process was stalled meanwhile
        stores = {
            name: sorted(p.name for p in (tmp_path / name / "data").glob("*.sqlite3"))
            for name in ("buses", "tier")
        }
        assert stores == {
            "buses": ["commands.sqlite3", "events.sqlite3"],
            "tier": ["tier.sqlite3"],
        }
