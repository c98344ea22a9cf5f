"""The event ingest face end to end: `cmdbus-trio serve` as a subprocess."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from ..helpers import frame_client, serving

WRITER_SETTINGS = {"CMDBUS_TIER_BIND": ""}  # the `server` fixture's (conftest.py)


def event(event_type: Any = None, execution_id: Any = 1) -> dict[str, Any]:
    payload = {} if event_type is None else {"event_type": event_type}
    return {"execution_id": execution_id, "payload": json.dumps(payload)}


async def test_event_subjects_and_a_log_of_its_own(tmp_path: Path) -> None:
    with serving(tmp_path, CMDBUS_TIER_BIND="") as (_, ports):  # fresh: sort keys from 1
        async with frame_client(ports["evt_ingest"]) as events:
            started = await events.request("publish", record=event("step.started"))
            assert (started["subject"], started["sort_key"]) == ("events.step_started", 1)
            unknown = await events.request("publish", record=event())
            assert unknown["subject"] == "events.unknown"
            empty = await events.request("publish", record=event(""))
            assert empty["subject"] == "events.unknown"
            batch = await events.request("publish_batch", records=[event("a.b.c"), event("x")])
            assert batch["sort_keys"] == [4, 5]
        async with frame_client(ports["cmd_ingest"]) as commands:
            # The command bus numbers its own records: the event bus took none of its keys.
            assert (await commands.request("publish", record=event()))["sort_key"] == 1


async def test_hello_names_the_event_face(server: dict[str, str]) -> None:
    async with frame_client(server["evt_ingest"], v2=False) as client:
        assert (await client.hello())["face"] == "evt_ingest"


async def test_v1_reply_is_8_raw_bytes(server: dict[str, str]) -> None:
    async with frame_client(server["evt_ingest"], v2=False) as client:
        await client.send(json.dumps(event("done")).encode())
        reply = b""
        while len(reply) < 8 and (chunk := await client.stream.receive_some(8 - len(reply))):
            reply += chunk
    assert len(reply) == 8 and struct.unpack(">Q", reply)[0] >= 1


async def test_a_bad_event_type_is_invalid(server: dict[str, str]) -> None:
    async with frame_client(server["evt_ingest"]) as client:
        reply = await client.request("publish", record=event("a b"))
        assert reply["error"]["code"] == "invalid"
        assert reply["error"]["message"].startswith("record: payload.event_type: ")


def test_each_bus_has_its_own_file(tmp_path: Path) -> None:
    with serving(tmp_path, CMDBUS_TIER_BIND="") as (process, _):
        process.terminate()
        process.wait(timeout=30)
    assert {p.name for p in (tmp_path / "data").glob("*.sqlite3")} == {
        "commands.sqlite3",
        "events.sqlite3",
    }
