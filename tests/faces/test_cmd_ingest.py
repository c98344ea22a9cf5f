"""The command ingest face end to end: `cmdbus-trio serve` as a subprocess."""

from __future__ import annotations

import json
import signal
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.config import Config
from cmdbus_trio.faces import _connection as connection_module
from cmdbus_trio.protocol.subjects import shard_of

from ..helpers import frame_client, running_writer, serving

ONLY_INGEST = {"CMDBUS_TIER_BIND": ""}


WRITER_SETTINGS = ONLY_INGEST  # the `server` fixture's (conftest.py)


def record(execution_id: Any = 1, pool: str | None = None, **extra: Any) -> dict[str, Any]:
    payload = {"step": "x"} if pool is None else {"execution_pool": pool}
    return {"execution_id": execution_id, "payload": json.dumps(payload), **extra}


async def v1_publish(client: Any, body: dict[str, Any] | bytes) -> bytes:
    """Send one v1 record; return the reply's raw bytes (8 unless the server closed)."""
    await client.send(body if isinstance(body, bytes) else json.dumps(body).encode())
    reply = b""
    while len(reply) < 8 and (chunk := await client.stream.receive_some(8 - len(reply))):
        reply += chunk
    return reply


async def test_v1_reply_is_8_raw_big_endian_bytes(server: dict[str, str]) -> None:
    with trio.fail_after(10):
        async with frame_client(server["cmd_ingest"], v2=False) as client:
            first = await v1_publish(client, record(1))
            second = await v1_publish(client, record("exec-2", transaction_id="t"))
    assert len(first) == len(second) == 8
    (a,), (b,) = struct.unpack(">Q", first), struct.unpack(">Q", second)
    assert b > a >= 1


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        json.dumps({"execution_id": 1}).encode(),
        json.dumps(record(1, colour="red")).encode(),
        json.dumps({"execution_id": "a/b", "payload": "{}"}).encode(),
        json.dumps({"execution_id": 1, "payload": "{bad"}).encode(),
        json.dumps(record(1, pool="a.b")).encode(),
    ],
)
async def test_v1_bad_record_closes_and_others_keep_serving(
    server: dict[str, str], body: bytes
) -> None:
    with trio.fail_after(10):
        async with frame_client(server["cmd_ingest"], v2=False) as bad:
            await bad.send(body)
            assert await bad.receive() is None  # closed, no reply
        async with frame_client(server["cmd_ingest"], v2=False) as good:
            assert len(await v1_publish(good, record(1))) == 8


async def test_v2_publish_shapes_subjects_and_dedup(server: dict[str, str]) -> None:
    async with frame_client(server["cmd_ingest"]) as client:
        shared = await client.request("publish", record=record(7))
        assert set(shared) == {"id", "ok", "sort_key", "subject", "duplicate"}
        assert (shared["subject"], shared["duplicate"]) == ("commands.shared.shard.0", False)
        system = await client.request("publish", record=record(7, pool="system"))
        assert system["subject"] == "commands.system.shard.0"
        empty_pool = await client.request("publish", record=record(7, pool=""))
        assert empty_pool["subject"] == "commands.shared.shard.0"
        first = await client.request("publish", record=record(8), msg_id="once")
        again = await client.request("publish", record=record(8), msg_id="once")
        assert (again["sort_key"], again["duplicate"]) == (first["sort_key"], True)
        ignored = await client.request("publish", record=record(9, global_sequence=123))
        assert ignored["ok"]


async def test_v2_publish_batch_and_whole_refusal(server: dict[str, str]) -> None:
    async with frame_client(server["cmd_ingest"]) as client:
        batch = await client.request("publish_batch", records=[record(i) for i in range(5)])
        keys = batch["sort_keys"]
        assert keys == list(range(keys[0], keys[0] + 5))
        bad_field = await client.request("publish_batch", records=[record(1), {"execution_id": 2}])
        assert bad_field["error"]["code"] == "invalid"
        assert bad_field["error"]["message"].startswith("records[1].payload: ")
        bad_payload = await client.request(
            "publish_batch", records=[record(1), {"execution_id": 2, "payload": "{bad"}]
        )
        assert bad_payload["error"]["message"] == "records[1].payload: not valid JSON text"
        after = await client.request("publish", record=record(1))
        assert after["sort_key"] == keys[-1] + 1  # the refused batches appended nothing


async def test_v2_publish_batch_records_with_their_own_msg_ids(server: dict[str, str]) -> None:
    """A batch whose records carry msg_ids, sent twice (a lost reply): the second is
    answered with the first's sort keys and stores nothing; records without one mix in;
    a record's bad msg_id is refused naming it."""
    items = [{"record": record(1), "msg_id": "batch-a"}, record(2)]
    items.append({"record": record(3), "msg_id": "batch-c"})
    async with frame_client(server["cmd_ingest"]) as client:
        first = (await client.request("publish_batch", records=items))["sort_keys"]
        again = (await client.request("publish_batch", records=items[::2]))["sort_keys"]
        assert again == [first[0], first[2]]
        bad = await client.request("publish_batch", records=[{"record": record(4), "msg_id": ""}])
        assert bad["error"]["message"].startswith("records[0].msg_id: expected a string")
        after = await client.request("publish", record=record(5))
        assert after["sort_key"] == first[-1] + 1  # the repeat stored nothing


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"record": record(1, colour="red")}, "record.colour: unknown field"),
        ({"record": record(1), "extra": 1}, "extra: unknown field"),
        ({"record": record(1), "msg_id": ""}, "msg_id: expected a string of 1 to 256"),
        ({"record": record(1, pool="a b")}, "record: payload.execution_pool: expected a string"),
        ({"record": {"execution_id": True, "payload": "{}"}}, "record.execution_id: expected"),
        ({}, "record: expected a JSON object"),
    ],
)
async def test_v2_errors_name_the_field(
    server: dict[str, str], fields: dict[str, Any], message: str
) -> None:
    async with frame_client(server["cmd_ingest"]) as client:
        reply = await client.request("publish", **fields)
        assert reply["error"]["code"] == "invalid"
        assert reply["error"]["message"].startswith(message)
        assert (await client.request("publish", record=record(1)))["ok"]
        unknown = await client.request("subscribe")
        assert unknown["error"]["code"] == "unsupported"


async def test_v2_pipelined_publishes_keep_their_order(server: dict[str, str]) -> None:
    async with frame_client(server["cmd_ingest"]) as client:
        for request_id in range(1, 101):
            body = {"id": request_id, "op": "publish", "record": record(request_id)}
            await client.send(json.dumps(body).encode())
        replies = [await client.receive_json() for _ in range(100)]
    keys_by_id = sorted((reply["id"], reply["sort_key"]) for reply in replies)
    keys = [key for _, key in keys_by_id]
    assert keys == sorted(keys) and len(set(keys)) == 100


async def test_group_commit_batches_concurrent_publishes(server: dict[str, str]) -> None:
    async def publisher(n: int) -> None:
        async with frame_client(server["cmd_ingest"]) as client:
            for i in range(20):
                assert (await client.request("publish", record=record(n * 1000 + i)))["ok"]

    async with trio.open_nursery() as nursery:
        for n in range(16):
            nursery.start_soon(publisher, n)
    from ..helpers import get

    text = (await get(server["control"], "/metrics")).body.decode()
    count = _sample(text, 'cmdbus_commit_batch_records_count{store="commands"}')
    total = _sample(text, 'cmdbus_commit_batch_records_sum{store="commands"}')
    assert total >= 320
    assert count < total  # fewer transactions (fsyncs) than records


def _sample(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


async def test_a_full_queue_sheds_busy(tmp_path: Path) -> None:
    with serving(tmp_path, CMDBUS_INGEST_MAX_PENDING="1", **ONLY_INGEST) as (_, ports):
        async with frame_client(ports["cmd_ingest"]) as client:
            for request_id in range(1, 201):
                body = {"id": request_id, "op": "publish", "record": record(request_id)}
                await client.send(json.dumps(body).encode())
            replies = [await client.receive_json() for _ in range(200)]
    busy = [r["error"] for r in replies if not r["ok"]]
    assert busy and all(e["code"] == "busy" and e["message"] == "waiters_full" for e in busy)
    assert all(e["retry_after_ms"] == 1000 for e in busy)
    assert any(r["ok"] for r in replies)


async def test_writers_refuse_records_of_other_shards(tmp_path: Path) -> None:
    mine = next(i for i in range(100) if shard_of(i, 4) == 1)
    other = next(i for i in range(100) if shard_of(i, 4) == 2)
    with serving(tmp_path, CMDBUS_SHARD="1", CMDBUS_SHARD_COUNT="4", **ONLY_INGEST) as (_, ports):
        async with frame_client(ports["cmd_ingest"]) as client:
            accepted = await client.request("publish", record=record(mine))
            assert accepted["subject"] == "commands.shared.shard.1"
            refused = await client.request("publish", record=record(other))
            assert refused["error"]["code"] == "invalid"
            assert refused["error"]["message"] == (
                "record.execution_id: belongs to shard 2; this writer owns shard 1 of 4"
            )
        async with frame_client(ports["cmd_ingest"], v2=False) as v1:
            await v1.send(json.dumps(record(other)).encode())
            assert await v1.receive() is None


async def test_sigkill_after_acknowledged_publishes_loses_nothing(tmp_path: Path) -> None:
    acked: dict[int, int] = {}  # sort key -> execution id
    killed = trio.Event()

    async def publisher(n: int, address: str) -> None:
        try:
            async with frame_client(address, v2=False) as client:
                for i in range(10_000):
                    reply = await v1_publish(client, record(n * 100_000 + i))
                    if len(reply) < 8:
                        raise trio.BrokenResourceError
                    acked[struct.unpack(">Q", reply)[0]] = n * 100_000 + i
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            assert killed.is_set()

    with serving(tmp_path, **ONLY_INGEST) as (process, ports), trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(publisher, n, ports["cmd_ingest"])
            while len(acked) < 300:
                await trio.sleep(0.01)
            killed.set()
            process.send_signal(signal.SIGKILL)
        process.wait()
    with serving(tmp_path, **ONLY_INGEST) as (_, ports):  # recovers the log on open
        async with frame_client(ports["cmd_ingest"]) as client:
            after = await client.request("publish", record=record(1))
    rows = dict(
        sqlite3.connect(tmp_path / "data" / "commands.sqlite3").execute(
            "SELECT sort_key, json_extract(record, '$.execution_id') FROM records"
        )
    )
    missing = {key: eid for key, eid in acked.items() if rows.get(key) != eid}
    assert not missing, f"acknowledged but lost or changed: {list(missing.items())[:5]}"
    assert after["sort_key"] > max(acked)  # no sort key reused


async def test_a_dispatcher_step_out_of_time_yields_and_loses_nothing(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No time for a second frame in a step of the dispatcher: it yields before each, and
    every pipelined publish is still answered once, in the writer's order."""
    monkeypatch.setattr(connection_module, "MAX_STEP", 0.0)
    config = make_config(cmd_ingest_bind="127.0.0.1:0")
    with trio.fail_after(20):
        async with (
            running_writer(config) as (_, ports),
            frame_client(ports["cmd_ingest"]) as client,
        ):
            for request_id in range(1, 101):
                body = {"id": request_id, "op": "publish", "record": record(request_id)}
                await client.send(json.dumps(body).encode())
            replies = [await client.receive_json() for _ in range(100)]
    assert sorted(reply["id"] for reply in replies) == list(range(1, 101))
    keys = [key for _, key in sorted((reply["id"], reply["sort_key"]) for reply in replies)]
    assert keys == sorted(keys) and len(set(keys)) == 100
