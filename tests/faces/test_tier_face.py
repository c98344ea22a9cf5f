"""The tier face end to end: `cmdbus-trio serve` as a subprocess, real sockets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from ..helpers import frame_client, metric_sum, metrics_text, serving

SMALL_REPLY_CAP = 4096


WRITER_SETTINGS = {"CMDBUS_TIER_MAX_INFLIGHT": "2", "CMDBUS_TIER_MAX_WAITERS": "16"}  # `server`'s


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Small caps, to exercise paging by bytes and the too-large answers."""
    with serving(
        tmp_path_factory.mktemp("tier-small"),
        CMDBUS_MAX_REPLY_BYTES=str(SMALL_REPLY_CAP),
        CMDBUS_MAX_REQUEST_BYTES="8192",
        CMDBUS_IDLE_TIMEOUT_MS="300",
        CMDBUS_READ_TIMEOUT_MS="300",
    ) as (_, ports):
        yield ports


counter = iter(range(1, 1 << 30))


def new_execution() -> str:
    return f"exec-{next(counter)}"


# --- v1 (NoETL-compatible) ------------------------------------------------------------


async def test_v1_health(server: dict[str, str]) -> None:
    with trio.fail_after(10):
        async with frame_client(server["tier"], v2=False) as client:
            assert await client.v1(b"health") == b"ok tier-service v1"
            assert await client.v1(b"health") == b"ok tier-service v1"


async def test_v1_append_read_scan_shapes(server: dict[str, str]) -> None:
    execution = new_execution()
    with trio.fail_after(10):
        async with frame_client(server["tier"], v2=False) as client:
            first = json.loads(
                await client.v1(
                    {"op": "append", "execution_id": execution, "payload": '{"event_id": "a"}'}
                )
                or b""
            )
            assert set(first) == {"appended", "global_sequence", "log_record_count", "deduplicated"}
            assert first["appended"] is True and first["deduplicated"] is False
            again = json.loads(
                await client.v1(
                    {"op": "append", "execution_id": execution, "payload": '{"event_id": "a"}'}
                )
                or b""
            )
            assert again["deduplicated"] is True
            assert again["global_sequence"] == first["global_sequence"]
            batch = json.loads(
                await client.v1(
                    {
                        "op": "append_batch",
                        "execution_id": execution,
                        "payloads": ['{"n": 1}', '{"event_id": "a"}', '{"n": 2}'],
                        "transaction_id": "tx-9",
                    }
                )
                or b""
            )
            assert batch["action"] == "ehdb.tier.append_batch"
            assert (batch["outcome"], batch["appended"], batch["requested"]) == ("ok", 2, 3)
            assert [r["ok"] for r in batch["results"]] == [True, True, True]
            assert [r["body"]["deduplicated"] for r in batch["results"]] == [False, True, False]
            read = json.loads(
                await client.v1({"op": "read_execution", "execution_id": execution}) or b""
            )
            assert read["action"] == "eventlog-read-execution"
            assert (
                read["execution_id"],
                read["exists"],
                read["record_count"],
                read["returned"],
            ) == (
                execution,
                True,
                3,
                3,
            )
            assert read["records"][0] == {
                "global_sequence": first["global_sequence"],
                "execution_id": execution,
                "transaction_id": "",
                "byte_len": len('{"event_id": "a"}'),
                "payload": '{"event_id": "a"}',
            }
            assert [r["transaction_id"] for r in read["records"]] == ["", "tx-9", "tx-9"]
            missing = json.loads(
                await client.v1({"op": "read_execution", "execution_id": "nope"}) or b""
            )
            assert (missing["exists"], missing["record_count"], missing["records"]) == (
                False,
                0,
                [],
            )
            scan = json.loads(
                await client.v1({"op": "scan", "after": first["global_sequence"] - 1, "limit": 2})
                or b""
            )
            assert [r["global_sequence"] for r in scan["records"]] == [
                first["global_sequence"],
                first["global_sequence"] + 1,
            ]
            assert scan["next_after"] == first["global_sequence"] + 1


async def test_v1_tiers_are_separate(server: dict[str, str]) -> None:
    execution = new_execution()
    async with frame_client(server["tier"], v2=False) as client:
        for tier in ("projection", "catalog"):
            reply = await client.v1(
                {"op": "append", "tier": tier, "execution_id": execution, "payload": "{}"}
            )
            assert json.loads(reply or b"")["appended"] is True
        read = json.loads(
            await client.v1({"op": "read_execution", "tier": "catalog", "execution_id": execution})
            or b""
        )
        assert read["action"] == "catalog-read-execution"
        assert read["record_count"] == 1
        assert (
            json.loads(await client.v1({"op": "read_execution", "execution_id": execution}) or b"")[
                "exists"
            ]
            is False
        )


@pytest.mark.parametrize(
    ("request_body", "reply"),
    [
        ({"op": "frobnicate"}, b"unsupported frobnicate"),
        (
            {"op": "append", "tier": "attic", "execution_id": "e", "payload": "{}"},
            b"invalid tier: unknown tier 'attic'; tiers: eventlog, projection, catalog",
        ),
        (
            {"op": "append", "execution_id": "a/../b", "payload": "{}"},
            b"invalid execution_id: expected an integer or 1-128 characters of "
            b"A-Z a-z 0-9 _ . : + -",
        ),
        (
            {"op": "append", "execution_id": "e", "payload": {"not": "text"}},
            b"invalid payload: expected JSON text (a string)",
        ),
        (
            {"op": "append", "execution_id": "e", "payload": "{nope"},
            b"invalid payload: not valid JSON text",
        ),
        (
            {"op": "append_batch", "execution_id": "e", "payloads": ["{}", "{bad"]},
            b"invalid payloads[1]: not valid JSON text",
        ),
        (
            {"op": "append_batch", "execution_id": "e", "payloads": []},
            b"invalid payloads: expected a list of 1 to 10000 payloads",
        ),
        (
            {"op": "scan", "after": -1},
            b"invalid after: expected an integer in 0..9223372036854775807",
        ),
        ([1, 2], b"invalid request: expected a JSON object or the text health"),
    ],
)
async def test_v1_errors_are_text_and_keep_the_connection(
    server: dict[str, str], request_body: Any, reply: bytes
) -> None:
    async with frame_client(server["tier"], v2=False) as client:
        assert await client.v1(json.dumps(request_body).encode()) == reply
        assert await client.v1(b"health") == b"ok tier-service v1"


async def test_v1_invalid_batch_stores_nothing(server: dict[str, str]) -> None:
    execution = new_execution()
    async with frame_client(server["tier"], v2=False) as client:
        await client.v1({"op": "append_batch", "execution_id": execution, "payloads": ["{}", "x"]})
        read = json.loads(
            await client.v1({"op": "read_execution", "execution_id": execution}) or b""
        )
        assert read["exists"] is False


async def test_v1_reply_over_the_cap_is_refused_with_its_size(small_server: dict[str, str]) -> None:
    execution = new_execution()
    async with frame_client(small_server["tier"], v2=False) as client:
        for _ in range(5):
            await client.v1(
                {"op": "append", "execution_id": execution, "payload": json.dumps("x" * 1000)}
            )
        reply = await client.v1({"op": "read_execution", "execution_id": execution})
        assert reply is not None
        text = reply.decode()
        assert text.startswith("error reply of ")
        assert text.endswith(f" bytes exceeds the {SMALL_REPLY_CAP}-byte cap; page the query")
        assert int(text.split()[3]) > SMALL_REPLY_CAP


async def test_v1_request_over_the_cap_closes(small_server: dict[str, str]) -> None:
    async with frame_client(small_server["tier"], v2=False) as client:
        await client.stream.send_all((4096).to_bytes(4, "big"))
        assert await client.receive() is None


# --- v2 -----------------------------------------------------------------------------------


async def test_v2_hello(server: dict[str, str]) -> None:
    async with frame_client(server["tier"], v2=False) as client:
        hello = await client.hello()
    assert hello["ok"] is True and hello["protocol"] == 2 and hello["face"] == "tier"
    assert hello["server"].startswith("cmdbus-trio ")
    assert hello["limits"] == {"max_request_bytes": 1 << 20, "max_reply_bytes": 16 << 20}


async def test_v2_unsupported_hello_version_closes(server: dict[str, str]) -> None:
    async with frame_client(server["tier"], v2=False) as client:
        await client.send(b'{"hello": {"protocol": 9}}')
        reply = await client.receive_json()
        assert reply["id"] is None and reply["ok"] is False
        assert reply["error"]["code"] == "unsupported"
        assert "supported: 2" in reply["error"]["message"]
        assert await client.receive() is None


async def test_an_append_repeated_at_its_version_is_the_same_append(
    server: dict[str, str],
) -> None:
    """A client repeats an append whose reply it lost: the same event at the same
    expected version is answered as the first one was (deduplicated, its sequence),
    not `conflict`. A different event at that version, and the same event at another
    version, still conflict; a payload without an event id cannot be told apart."""
    execution = new_execution()
    first_event = json.dumps({"event_id": "step-1", "event_type": "step.done"})
    async with frame_client(server["tier"]) as client:

        async def append(payload: str, version: int) -> dict[str, Any]:
            return await client.request(
                "append", execution_id=execution, payload=payload, expected_version=version
            )

        first = await append(first_event, 0)
        assert first["ok"] and first["deduplicated"] is False
        again = await append(first_event, 0)
        assert again["ok"], again
        assert again["deduplicated"] is True
        assert again["global_sequence"] == first["global_sequence"]
        other = await append(json.dumps({"event_id": "step-2"}), 0)
        assert other["error"]["code"] == "conflict", other
        assert (await append(json.dumps({"event_id": "step-2"}), 1))["ok"]
        elsewhere = await append(first_event, 1)  # stored, but not at version 1
        assert elsewhere["error"]["code"] == "conflict", elsewhere
        assert (await append("{}", 2))["ok"]
        assert (await append("{}", 2))["error"]["code"] == "conflict"
        read = await client.request("read_execution", execution_id=execution)
        assert read["record_count"] == 3


async def test_v2_ops_and_shapes(server: dict[str, str]) -> None:
    execution = new_execution()
    async with frame_client(server["tier"]) as client:
        assert await client.request("health") == {
            "id": 1,
            "ok": True,
            "status": "ok",
            "service": "tier-service",
        }
        appended = await client.request(
            "append", execution_id=execution, payload='{"k": 1}', expected_version=0
        )
        assert appended["ok"] is True
        assert set(appended) == {
            "id",
            "ok",
            "appended",
            "global_sequence",
            "log_record_count",
            "deduplicated",
        }
        conflict = await client.request(
            "append", execution_id=execution, payload="{}", expected_version=0
        )
        assert conflict["ok"] is False and conflict["error"]["code"] == "conflict"
        assert "expected_version 0 but the execution has 1 records" in conflict["error"]["message"]
        batch = await client.request("append_batch", execution_id=execution, payloads=["1", "2"])
        assert (batch["appended"], batch["requested"]) == (2, 2)
        read = await client.request("read_execution", execution_id=execution, limit=2)
        assert (read["record_count"], read["returned"]) == (3, 2)
        assert read["next_after"] == read["records"][-1]["global_sequence"]
        rest = await client.request(
            "read_execution", execution_id=execution, after=read["next_after"]
        )
        assert rest["returned"] == 1 and rest["next_after"] is None
        scan = await client.request("scan", after=appended["global_sequence"] - 1, limit=1)
        assert set(scan) == {"id", "ok", "records", "next_after"}
        assert scan["next_after"] == appended["global_sequence"]


async def test_v2_integer_execution_ids(server: dict[str, str]) -> None:
    async with frame_client(server["tier"]) as client:
        reply = await client.request("append", execution_id=9223372036854775807, payload="{}")
        assert reply["ok"] is True
        read = await client.request("read_execution", execution_id="9223372036854775807")
        assert read["record_count"] == 1
        too_big = await client.request("append", execution_id=9223372036854775808, payload="{}")
        assert too_big["error"]["code"] == "invalid"
        assert too_big["error"]["message"].startswith("execution_id:")


@pytest.mark.parametrize(
    ("op", "fields", "code", "message_start"),
    [
        ("frobnicate", {}, "unsupported", "op: unknown op 'frobnicate'"),
        (
            "append",
            {"execution_id": "e", "payload": "{}", "colour": 1},
            "invalid",
            "colour: unknown field",
        ),
        ("append", {"payload": "{}"}, "invalid", "execution_id:"),
        ("scan", {"tier": "attic"}, "invalid", "tier: unknown tier 'attic'"),
        (
            "read_execution",
            {"execution_id": "e", "limit": "ten"},
            "invalid",
            "limit: expected an integer",
        ),
        (
            "append",
            {"execution_id": "e", "payload": "{}", "expected_version": -1},
            "invalid",
            "expected_version:",
        ),
    ],
)
async def test_v2_errors_name_the_field_and_keep_the_connection(
    server: dict[str, str], op: str, fields: dict[str, Any], code: str, message_start: str
) -> None:
    async with frame_client(server["tier"]) as client:
        reply = await client.request(op, **fields)
        assert reply["ok"] is False
        assert reply["error"]["code"] == code
        assert reply["error"]["message"].startswith(message_start)
        assert (await client.request("health"))["ok"] is True


async def test_v2_malformed_envelope_keeps_the_connection_unparseable_closes(
    server: dict[str, str],
) -> None:
    async with frame_client(server["tier"]) as client:
        await client.send(b'{"op": "health"}')
        reply = await client.receive_json()
        assert reply == {
            "id": None,
            "ok": False,
            "error": {"code": "invalid", "message": reply["error"]["message"]},
        }
        assert reply["error"]["message"].startswith("id:")
        assert (await client.request("health"))["ok"] is True
        await client.send(b"{not json")
        reply = await client.receive_json()
        assert reply["id"] is None and reply["error"]["code"] == "invalid"
        assert await client.receive() is None


async def test_v2_pipelining_replies_carry_their_ids(server: dict[str, str]) -> None:
    execution = new_execution()
    async with frame_client(server["tier"]) as client:
        # 16 in flight fit this server's Gate: 2 slots + 16 waiters.
        for request_id in range(100, 116):
            body = {"id": request_id, "op": "append", "execution_id": execution, "payload": "{}"}
            await client.send(json.dumps(body).encode())
        replies = [await client.receive_json() for _ in range(16)]
    assert sorted(reply["id"] for reply in replies) == list(range(100, 116))
    assert all(reply["ok"] for reply in replies), replies
    assert len({reply["global_sequence"] for reply in replies}) == 16


async def test_v2_paging_by_bytes_visits_every_record_once(small_server: dict[str, str]) -> None:
    execution = new_execution()
    async with frame_client(small_server["tier"]) as client:
        expected = []
        for i in range(60):
            reply = await client.request(
                "append",
                execution_id=execution,
                payload=json.dumps({"i": i, "pad": "p" * (i * 7 % 300)}),
            )
            expected.append(reply["global_sequence"])
        seen: list[int] = []
        after = 0
        pages = 0
        while True:
            page = await client.request("read_execution", execution_id=execution, after=after)
            pages += 1
            seen += [record["global_sequence"] for record in page["records"]]
            if page["next_after"] is None:
                break
            after = page["next_after"]
        assert seen == expected
        assert pages > 2  # the byte cap, not the record limit, cut the pages
        # scan pages the same way
        scanned: list[int] = []
        after = expected[0] - 1
        while after is not None:
            page = await client.request("scan", after=after, limit=1000)
            scanned += [
                r["global_sequence"] for r in page["records"] if r["execution_id"] == execution
            ]
            after = page["next_after"]
        assert scanned == expected


async def test_v2_a_record_alone_over_the_reply_cap_is_too_large(
    small_server: dict[str, str],
) -> None:
    execution = new_execution()
    async with frame_client(small_server["tier"]) as client:
        payload = json.dumps("r" * 5000)  # fits the request cap (8 KiB), not the reply cap
        assert (await client.request("append", execution_id=execution, payload=payload))["ok"]
        reply = await client.request("read_execution", execution_id=execution)
        assert reply["error"]["code"] == "too_large"
        assert f"over the {SMALL_REPLY_CAP}-byte cap" in reply["error"]["message"]


async def test_v2_request_over_the_cap_gets_too_large_then_close(
    small_server: dict[str, str],
) -> None:
    async with frame_client(small_server["tier"]) as client:
        await client.stream.send_all((1 << 30).to_bytes(4, "big"))
        reply = await client.receive_json()
        assert reply["id"] is None
        assert reply["error"]["code"] == "too_large"
        assert "exceeds the 8192-byte request cap" in reply["error"]["message"]
        assert await client.receive() is None


async def test_idle_and_stalled_connections_are_closed(small_server: dict[str, str]) -> None:
    with trio.fail_after(10):
        async with frame_client(small_server["tier"]) as idle:
            assert await idle.receive() is None  # idle 300 ms: closed
        async with frame_client(small_server["tier"]) as stalled:
            await stalled.stream.send_all(b"\x00\x00\x00\x10{partial")
            assert await stalled.receive() is None
    text = metrics_text(small_server)
    assert 'cmdbus_connections_total{face="tier",outcome="idle_timeout"}' in text


async def test_metrics_record_tier_requests(server: dict[str, str]) -> None:
    async with frame_client(server["tier"]) as client:
        await client.request("append", execution_id=new_execution(), payload="{}")
        await client.request("nope")
    text = metrics_text(server)
    assert 'cmdbus_request_duration_seconds_count{face="tier",op="append",outcome="ok"}' in text
    # An op the client made up is counted, under "unknown" (not as a label of its own).
    assert (
        'cmdbus_request_duration_seconds_count{face="tier",op="unknown",outcome="unsupported"}'
        in text
    )
    assert 'cmdbus_queue_wait_seconds_count{face="tier",op="append"}' in text
    assert 'cmdbus_service_seconds_count{face="tier",op="append"}' in text
    assert 'cmdbus_store_state{state="ok",store="tier"} 1.0' in text
    assert 'cmdbus_store_state{state="poisoned",store="tier"} 0.0' in text
    assert 'cmdbus_capacity{face="tier"}' in text
    assert 'cmdbus_connections_total{face="tier",outcome="accepted"}' in text
    # Every entry point's series exists (a dashboard's sum() reads 0), and reads 0.
    assert 'cmdbus_loop_blocking_calls_total{entry="TierStore.append"} 0.0' in text
    assert metric_sum(text, "cmdbus_loop_blocking_calls_total{") == 0


async def test_v1_frame_that_is_not_json_gets_text_and_keeps_the_connection(
    server: dict[str, str],
) -> None:
    async with frame_client(server["tier"], v2=False) as client:
        reply = await client.v1(b"{nope")
        assert reply is not None and reply.startswith(b"invalid frame is not UTF-8 JSON: ")
        assert await client.v1(b"health") == b"ok tier-service v1"


async def test_v2_hello_and_an_oversized_frame_in_one_write_get_too_large(
    small_server: dict[str, str],
) -> None:
    """The too_large answer depends on the dialect the hello chose, even when both arrive
    in the same packet (repeated: the reader and the dispatcher race otherwise)."""
    for _ in range(20):
        async with frame_client(small_server["tier"], v2=False) as client:
            hello = b'{"hello": {"protocol": 2}}'
            await client.stream.send_all(
                len(hello).to_bytes(4, "big") + hello + (1 << 20).to_bytes(4, "big")
            )
            assert (await client.receive_json())["ok"] is True
            error = await client.receive_json()
            assert (error["id"], error["error"]["code"]) == (None, "too_large")
            assert await client.receive() is None


async def test_a_client_that_never_reads_its_replies_is_cut_off(
    small_server: dict[str, str],
) -> None:
    execution = new_execution()
    async with frame_client(small_server["tier"]) as writer:
        for _ in range(3):
            await writer.request("append", execution_id=execution, payload=json.dumps("p" * 1000))
    before = write_errors(small_server)
    with trio.fail_after(30):
        async with frame_client(small_server["tier"]) as hog:
            request = json.dumps({"id": 1, "op": "read_execution", "execution_id": execution})
            frame = len(request).to_bytes(4, "big") + request.encode()
            try:
                for _ in range(200):  # ~3 KB replies each; never read: the socket fills
                    await hog.stream.send_all(frame * 50)
            except trio.BrokenResourceError:
                pass  # the server already gave up on us
            while write_errors(small_server) == before:
                await trio.sleep(0.1)
            async with frame_client(small_server["tier"]) as other:  # everyone else is fine
                assert (await other.request("health"))["ok"]


def write_errors(ports: dict[str, str]) -> float:
    name = 'cmdbus_connections_total{face="tier",outcome="write_error"} '
    lines = [line for line in metrics_text(ports).splitlines() if line.startswith(name)]
    return float(lines[0].split()[-1]) if lines else 0.0


async def test_v2_delete_execution_is_durable_counted_and_v2_only(server: dict[str, str]) -> None:
    execution = new_execution()
    async with frame_client(server["tier"]) as client:
        await client.request("append_batch", execution_id=execution, payloads=["1", "2", "3"])
        await client.request("append", execution_id=execution, tier="catalog", payload="{}")
        before = metric_sum(
            metrics_text(server), 'cmdbus_retention_deleted_total{kind="records",store="tier"}'
        )
        deleted = await client.request("delete_execution", execution_id=execution)
        assert (deleted["ok"], deleted["deleted"]) == (True, 3)
        read = await client.request("read_execution", execution_id=execution)
        assert (read["exists"], read["record_count"], read["records"]) == (False, 0, [])
        catalog = await client.request("read_execution", execution_id=execution, tier="catalog")
        assert catalog["record_count"] == 1  # another tier: untouched
        again = await client.request("delete_execution", execution_id=execution)
        assert again["deleted"] == 0
        bad = await client.request("delete_execution", execution_id="../etc", tier="eventlog")
        assert bad["ok"] is False and bad["error"]["code"] == "invalid"
        unknown = await client.request("delete_execution", execution_id=execution, limit=1)
        assert unknown["error"]["message"].startswith("limit")
    after = metric_sum(
        metrics_text(server), 'cmdbus_retention_deleted_total{kind="records",store="tier"}'
    )
    assert after == before + 3
    async with frame_client(server["tier"], v2=False) as v1:
        body = json.dumps({"op": "delete_execution", "execution_id": execution}).encode()
        assert (await v1.v1(body)).startswith(b"unsupported")
        assert await v1.v1(b"health") == b"ok tier-service v1"


def test_a_connection_reads_ahead_only_what_the_fullest_gate_can_take() -> None:
    """Frames are batched before they are parsed, so the read-ahead bound is the least
    room of the face's Gates: with the write lane full, a flood of appends stays unread
    in its socket instead of running out its budgets in a batch (benchmarks/soak.py saw
    up to 0.8 x its peak in `deadline` answers a second when the bound was the read
    Gate's room alone)."""
    from cmdbus_trio.admission import Gate
    from cmdbus_trio.config import Bind, load
    from cmdbus_trio.faces import FaceContext
    from cmdbus_trio.faces.gates import lanes_for

    config = load({}, environ={"CMDBUS_TIER_MAX_INFLIGHT": "2", "CMDBUS_TIER_MAX_WAITERS": "6"})
    reads = Gate("tier", max_inflight=2, max_waiters=6, shed_after=1.0, default_budget=1.0)
    lanes = lanes_for("tier", config)
    ctx = FaceContext("tier", Bind("127.0.0.1", 0), config, reads, trio.Event(), lanes=lanes)
    writes = lanes["append"]
    assert ctx.room == min(reads.room, writes.room) > 0
    for _ in range(writes.room):
        writes.take_in()
    assert reads.room == 8 and ctx.room == 0
