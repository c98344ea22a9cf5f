"""Issue 38, black-box: no client, face or access pattern takes the writer from the
others. Each test runs a real writer and speaks to it over real sockets, as a careless or
hostile client would (docs/reliability.md, "Isolation")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from .faces.test_memory_bounds import rss_mib
from .helpers import FrameClient, frame_client, metric_sum, metrics_text, serving


async def pipelined(
    client: FrameClient, requests: list[dict[str, object]]
) -> list[dict[str, object]]:
    """Send every request without waiting, then read every reply (in any order)."""
    replies: list[dict[str, object]] = []

    async def send_all() -> None:
        for n, request in enumerate(requests, 1):
            await client.send(json.dumps({"id": n, **request}).encode())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all)
        while len(replies) < len(requests):
            replies.append(await client.receive_json())
    return replies


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_timed_out_nexts_leave_nothing_behind(tmp_path: Path) -> None:
    """100,000 ``next`` calls that time out, on one filter and on 2,000 others: the writer's
    memory stays flat (each used to leave its waiter parked for good, ~0.4 KiB apiece,
    and a filter holding only those never counted as idle)."""
    with serving(tmp_path) as (writer, ports):
        client = await FrameClient.connect(ports["cmd_claim"])
        await client.hello()
        with trio.fail_after(120):
            await trio.sleep(0.3)
            before = rss_mib(writer)
            for round_ in range(10):
                requests: list[dict[str, object]] = [
                    {"op": "next", "filter": f"commands.pool{n % 2000}.>", "timeout_ms": 0}
                    if n % 2
                    else {"op": "next", "filter": "commands.shared.>", "timeout_ms": 0}
                    for n in range(round_ * 10_000, (round_ + 1) * 10_000)
                ]
                replies = await pipelined(client, requests)
                assert all(
                    reply == {"id": reply["id"], "ok": True, "delivery": None} for reply in replies
                )
            await trio.sleep(0.3)
            grown = rss_mib(writer) - before
        await client.aclose()
    assert grown < 5, f"RSS grew {grown:.1f} MiB"


async def test_subscribe_frames_keep_to_the_reply_cap(tmp_path: Path) -> None:
    """Every frame a subscriber gets, catching up and live, is within
    ``CMDBUS_MAX_REPLY_BYTES``; a record larger than the cap goes alone. (A catch-up frame
    used to carry 500 records whatever their size: 500 events of 150 KiB made a 75 MiB
    frame, which the bundled client refuses, so it reconnected to the same frame for
    ever.)"""
    from .faces.test_evt_subscribe import publish

    cap = 64 << 10
    settings = {"CMDBUS_MAX_REPLY_BYTES": str(cap), "CMDBUS_TIER_BIND": ""}
    with serving(tmp_path, **settings) as (_, ports), trio.fail_after(60):
        await publish(ports["evt_ingest"], 300, pad=2000)  # ~600 KB of history
        async with frame_client(ports["evt_subscribe"]) as subscriber:
            await subscriber.send(b'{"id": 1, "op": "subscribe", "from": 0}')
            keys: list[int] = []
            sizes: list[tuple[int, int]] = []  # (frame bytes, records)

            async def read(want: int) -> None:
                while len(keys) < want:
                    frame = await subscriber.receive()
                    assert frame is not None
                    records = json.loads(frame)["records"]
                    sizes.append((len(frame), len(records)))
                    keys.extend(record["sort_key"] for record in records)

            await read(300)
            await publish(ports["evt_ingest"], 300, start=300, batch=300, pad=2000)
            await publish(ports["evt_ingest"], 1, start=600, pad=100_000)  # over the cap
            await read(601)
    assert keys == list(range(1, 602))
    assert all(size <= cap for size, records in sizes if records > 1), sizes
    assert [records for size, records in sizes if size > cap] == [1]


async def test_a_publisher_retrying_an_evicted_record_is_told(tmp_path: Path) -> None:
    """A msg_id retry of an event the byte cap evicted (before any group consumed it)
    answers ``evicted: true`` beside ``duplicate: true``; it used to look like success."""
    settings = {
        "CMDBUS_TIER_BIND": "",
        "CMDBUS_EVT_MAX_BYTES": str(1 << 20),
        "CMDBUS_RETENTION_INTERVAL_MS": "50",
    }
    pad = "x" * 10_000

    def record(n: int) -> dict[str, object]:
        return {"execution_id": n, "payload": json.dumps({"event_type": "e", "pad": pad})}

    with trio.fail_after(60), serving(tmp_path, **settings) as (_, ports):
        async with frame_client(ports["evt_ingest"]) as ingest:
            first = await ingest.request("publish", record=record(0), msg_id="m-1")
            assert first["duplicate"] is False and "evicted" not in first
            for batch in range(30):  # about 3 MiB: the oldest go
                records = [record(n) for n in range(batch * 10, batch * 10 + 10)]
                assert (await ingest.request("publish_batch", records=records))["ok"]
            retry = None
            while retry is None or "evicted" not in retry:
                await trio.sleep(0.1)
                retry = await ingest.request("publish", record=record(0), msg_id="m-1")
            assert retry["duplicate"] is True and retry["evicted"] is True
            assert retry["sort_key"] == first["sort_key"]


async def test_an_event_groups_lag_waits_for_a_gate_slot(tmp_path: Path) -> None:
    """``lag`` on an event group walks the group's backlog: it is admitted by the face's
    Gate like any other work (counted under its op), where it used to run beside it."""
    from .faces.test_evt_subscribe import publish

    with trio.fail_after(30), serving(tmp_path, CMDBUS_TIER_BIND="") as (_, ports):
        await publish(ports["evt_ingest"], 50)
        async with frame_client(ports["evt_claim"]) as client:
            reply = await client.request("lag", group="noetl_materializer")
            assert reply["total"] == 50
        text = await trio.to_thread.run_sync(metrics_text, ports)
    admitted = 'cmdbus_queue_wait_seconds_count{face="evt_claim",op="lag"}'
    assert metric_sum(text, admitted) == 1


@pytest.mark.once
async def test_groups_that_never_consume_owe_nothing(tmp_path: Path) -> None:
    """30 groups created ``from: tail`` never consume while 3,000 events come: past
    ``CMDBUS_STUCK_AFTER_MS`` each used to owe a row per event it had not consumed
    (90,000 rows, written in the group commit every publish and ack waits for, and all
    loaded at a restart). A lagging group now keeps its position and owes nothing; a
    restart still gives it every event."""
    from .faces.test_evt_subscribe import publish

    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_STUCK_AFTER_MS": "200", "CMDBUS_EVT_GROUPS": ""}
    with trio.fail_after(90):
        with serving(tmp_path, **settings) as (_, ports):
            async with frame_client(ports["evt_claim"]) as client:
                for n in range(30):
                    created = await client.request(
                        "next", group=f"idle_{n}", filter=">", timeout_ms=0, **{"from": "tail"}
                    )
                    assert created["delivery"] is None
            await publish(ports["evt_ingest"], 3000, batch=500)
            await trio.sleep(3.0)  # the groups' sampler, every second, past stuck_after
            owed = _rows(tmp_path, "SELECT count(*) FROM owed")
        assert owed == 0
        with serving(tmp_path, **settings) as (_, ports):
            async with frame_client(ports["evt_claim"]) as client:
                lag = await client.request("lag", group="idle_7")
                assert lag["total"] == 3000


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_a_restart_costs_the_same_with_100_lagging_groups_as_with_one(
    tmp_path: Path,
) -> None:
    """100 groups ``from: tail`` that never consume while 15,000 events come, against
    one such group: restarted, the writer holds the same memory (a lagging group costs
    its position, not a row or an entry per record behind it; each used to owe a row
    per record, all loaded at a restart), and each group still has all 15,000."""
    from .faces.test_evt_subscribe import publish

    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_STUCK_AFTER_MS": "200", "CMDBUS_EVT_GROUPS": ""}
    resident = {}
    with trio.fail_after(150):
        for groups in (100, 1):
            root = tmp_path / str(groups)
            root.mkdir()
            with serving(root, **settings) as (_, ports):
                async with frame_client(ports["evt_claim"]) as client:
                    for n in range(groups):
                        created = await client.request(
                            "next",
                            group=f"behind_{n}",
                            filter=">",
                            timeout_ms=0,
                            **{"from": "tail"},
                        )
                        assert created["delivery"] is None
                for _ in range(2):  # the groups' sampler (every second) sees them stuck
                    await publish(ports["evt_ingest"], 7_500, batch=500)
                    await trio.sleep(2.0)
            with serving(root, **settings) as (process, ports):
                async with frame_client(ports["evt_claim"]) as client:
                    lag = await client.request("lag", group=f"behind_{groups - 1}")
                    assert lag["total"] == 15_000
                await trio.sleep(1.0)  # settled after start
                resident[groups] = rss_mib(process)
    assert resident[100] - resident[1] < 8, resident


BEHIND = 500_000


def events_behind(data_dir: Path, records: int, group: str) -> None:
    """An event log of ``records`` events written straight to the store (publishing
    them would take minutes), and ``group`` at its start: every one of them behind."""
    from cmdbus_trio.protocol.bus import BusKind, PublishRecord, SubjectRule
    from cmdbus_trio.storage.buslog import BusEntry, BusLog

    rule = SubjectRule(BusKind.EVENTS)
    log = BusLog.open(data_dir / "events.sqlite3", name="events", synchronous="normal")
    try:
        for first in range(0, records, 50_000):
            batch = [
                PublishRecord(n, '{"event_type": "old"}') for n in range(first, first + 50_000)
            ]
            log.publish([BusEntry(rule.subject(r), r.stored()) for r in batch])
        log.create_group(group, 0)
    finally:
        log.close()


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_new_filters_on_a_group_far_behind_leave_the_probes_answering(
    tmp_path: Path,
) -> None:
    """120 ``next``s, each naming a new filter on a group 500,000 events behind (none
    matches: each filter's look goes through the whole backlog), with ``/livez`` asked
    every 20 ms meanwhile. Each look used to run on the loop at once (0.1-0.2 s a
    filter: /livez p99 4.2 s); it now goes through 4,096 records a step, within the
    data plane's share of a turn.

    The bounds are a loop held by a look, not a machine's speed: with the whole backlog
    in one step (a mutation of ``SCAN_STEP``) probes took 2.5-3.4 s and the loop's
    heartbeat woke up to 2.5 s late; as built, probes took 5 ms (p99) on a quiet 2-CPU
    machine and 0.28 s on a slow, busy one, where a 60 ms bound failed."""
    await trio.to_thread.run_sync(events_behind, tmp_path / "data", BEHIND, "behind")
    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_EVT_GROUPS": ""}
    with serving(tmp_path, **settings) as (_, ports):
        host, port = ports["control"].rsplit(":", 1)
        probes: list[float] = []
        done = trio.Event()

        async def probe() -> None:
            while not done.is_set():
                started = trio.current_time()
                async with await trio.open_tcp_stream(host, int(port)) as stream:
                    await stream.send_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
                    assert (await stream.receive_some(4096)).startswith(b"HTTP/1.1 200")
                probes.append(trio.current_time() - started)
                await trio.sleep(0.02)

        with trio.fail_after(120):
            async with frame_client(ports["evt_claim"]) as client, trio.open_nursery() as nursery:
                nursery.start_soon(probe)
                fields = {"group": "behind", "timeout_ms": 0}
                replies = await pipelined(
                    client,
                    [{"op": "next", "filter": f"events.new_{n}", **fields} for n in range(120)],
                )
                done.set()
        assert all(reply["ok"] and reply["delivery"] is None for reply in replies)
        text = metrics_text(ports)
        assert metric_sum(text, 'ehdb_events_group_lag{group="behind"') == BEHIND
    heartbeats = metric_sum(text, 'cmdbus_loop_lag_seconds_bucket{le="+Inf"}')
    assert metric_sum(text, 'cmdbus_loop_lag_seconds_bucket{le="0.5"}') == heartbeats
    probes.sort()
    assert len(probes) >= 10
    assert probes[int(len(probes) * 0.99)] <= 1.0, probes[-5:]


def _rows(tmp_path: Path, sql: str) -> int:
    import sqlite3

    with sqlite3.connect(tmp_path / "data" / "events.sqlite3") as connection:
        return int(connection.execute(sql).fetchone()[0])


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_a_scrape_flood_gets_its_share_of_the_loop_and_no_more(tmp_path: Path) -> None:
    """32 keep-alive clients loop ``GET /metrics`` (and the lag port's) as fast as they
    are answered, beside a publisher: the control face's time on the loop stays within
    its share (after the burst), the flood waits for it, a probe is answered, and the
    publisher is served. The control face used to take all but 3% of the loop."""
    from cmdbus_trio.loop import turns

    from .helpers import http_connection

    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_CMD_LAG_BIND": "127.0.0.1:0"}
    seconds = 3.0
    with trio.fail_after(60), serving(tmp_path, **settings) as (_, ports):
        before = await trio.to_thread.run_sync(metrics_text, ports)
        scrapes = [0]
        published = [0]

        async def scraper(address: str, path: str) -> None:
            async with http_connection(address) as connection:
                while True:
                    assert (await connection.request("GET", path)).status == 200
                    scrapes[0] += 1

        async def publisher() -> None:
            async with frame_client(ports["cmd_ingest"]) as client:
                while True:
                    record = {"execution_id": 1, "payload": "{}"}
                    assert (await client.request("publish", record=record))["ok"]
                    published[0] += 1

        async with trio.open_nursery() as nursery:
            for n in range(32):
                if n % 4:
                    nursery.start_soon(scraper, ports["control"], "/metrics")
                else:
                    nursery.start_soon(scraper, ports["cmd_lag"], "/")
            nursery.start_soon(publisher)
            await trio.sleep(seconds)
            async with http_connection(ports["control"]) as prober:
                probe = await prober.request("GET", "/readyz")
            nursery.cancel_scope.cancel()
        await trio.sleep(1.2)  # a heartbeat syncs the loop's counters
        after = await trio.to_thread.run_sync(metrics_text, ports)
    assert probe.status == 200
    assert scrapes[0] > 32 and published[0] > 0

    def spent(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    control = spent("cmdbus_loop_control_seconds_total")
    assert 0 < control <= turns.CONTROL_SHARE * (seconds + 1.5) + turns.CONTROL_BURST + 0.05
    assert spent("cmdbus_control_paced_seconds_total") > 0


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_frames_being_read_count_against_the_face_budget(tmp_path: Path) -> None:
    """200 clients each send two frames of ~1 MiB while the disk is slow: a face takes in
    ``CMDBUS_FACE_PENDING_BYTES`` (8 MiB) of requests, and a connection reads a frame
    larger than one read only once that frame's bytes are lent to it. Each connection
    used to read up to two whole frames first, outside the budget (RSS +270-330 MiB)."""
    from .faces.test_memory_bounds import watch_peak
    from .helpers import get

    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_DEBUG_HOOKS": "true"}
    record = {"execution_id": 1, "payload": json.dumps({"pad": "x" * 1_000_000})}
    with trio.fail_after(120), serving(tmp_path, **settings) as (writer, ports):
        slow = await get(ports["control"], "/debug/slow-commits?store=commands&seconds=0.5", "POST")
        assert slow.status == 202
        await trio.sleep(0.5)
        idle = rss_mib(writer)
        clients = [await FrameClient.connect(ports["cmd_ingest"]) for _ in range(200)]
        for client in clients:
            await client.hello()

        async def send_two(client: FrameClient) -> None:
            for n in (1, 2):  # a client held back waits in its socket
                body = json.dumps({"id": n, "op": "publish_batch", "records": [record]})
                await client.send(body.encode())

        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(send_two, client)
            peak = await watch_peak(writer, 4.0)
            nursery.cancel_scope.cancel()  # the clients held back are still sending
        for client in clients:
            await client.aclose()
    # What the face's 8 MiB of requests weigh parsed and committed, and a read's worth
    # per connection (measured 85-105 MiB); two frames per connection would be 400.
    grown = peak - idle
    assert grown < 160, f"RSS grew {grown:.0f} MiB"


@pytest.mark.once
async def test_a_client_gone_mid_frame_gives_its_loan_back(tmp_path: Path) -> None:
    """A large frame's bytes are lent before it is read whole; a client that leaves
    half-way leaves nothing lent (``cmdbus_pending_bytes`` back to 0), and a client
    after it is served."""
    from cmdbus_trio.protocol import encode_frame

    record = {"execution_id": 1, "payload": json.dumps({"pad": "x" * 500_000})}
    frame = encode_frame(json.dumps({"id": 1, "op": "publish", "record": record}).encode())
    with trio.fail_after(30), serving(tmp_path, CMDBUS_TIER_BIND="") as (_, ports):
        leaving = await FrameClient.connect(ports["cmd_ingest"])
        await leaving.hello()
        await leaving.stream.send_all(frame[: len(frame) // 2])
        await trio.sleep(0.3)
        text = await trio.to_thread.run_sync(metrics_text, ports)
        assert metric_sum(text, 'cmdbus_pending_bytes{face="cmd_ingest"}') >= 500_000
        await leaving.aclose()
        await trio.sleep(0.3)
        text = await trio.to_thread.run_sync(metrics_text, ports)
        assert metric_sum(text, 'cmdbus_pending_bytes{face="cmd_ingest"}') == 0
        async with frame_client(ports["cmd_ingest"]) as client:
            assert (await client.request("publish", record=record))["ok"]


AT_THE_CAP = (1 << 20) - 16
"""A frame body this size is within the 1 MiB request cap, and with any other frame
beside it over a budget of 1 MiB."""


def _publish_frame(request_id: int, size: int) -> bytes:
    """A v2 publish frame whose body is ``size`` bytes (at least ~90)."""
    from cmdbus_trio.protocol import encode_frame

    def body(pad: int) -> bytes:
        record = {"execution_id": 1, "payload": json.dumps({"pad": "x" * pad})}
        return json.dumps({"id": request_id, "op": "publish", "record": record}).encode()

    padded = body(size - len(body(0)))
    assert len(padded) == size
    return encode_frame(padded)


async def _pending_bytes(ports: dict[str, str]) -> float:
    text = await trio.to_thread.run_sync(metrics_text, ports)
    return metric_sum(text, 'cmdbus_pending_bytes{face="cmd_ingest"}')


@pytest.mark.once
async def test_a_small_frame_then_one_at_the_cap_in_one_write_are_both_answered(
    tmp_path: Path,
) -> None:
    """A hello, a small publish and one near the 1 MiB cap in one write, with the face's
    budget at the cap. The large frame's bytes used to be lent before the dispatcher had
    lent the small one's, which then waited for them for good: neither was answered, and
    every other client's publish on the face hung behind it."""
    from cmdbus_trio.protocol import encode_frame

    hello = encode_frame(b'{"hello": {"protocol": 2, "client": "tests"}}')
    burst = hello + _publish_frame(1, 100) + _publish_frame(2, AT_THE_CAP)
    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_FACE_PENDING_BYTES": "1048576"}
    with trio.fail_after(30), serving(tmp_path, **settings) as (_, ports):
        async with frame_client(ports["cmd_ingest"], v2=False) as client:
            await client.stream.send_all(burst)
            assert (await client.receive_json())["protocol"] == 2  # the hello's answer
            replies = {(reply := await client.receive_json())["id"]: reply for _ in range(2)}
            assert replies[1]["ok"] and replies[2]["ok"], replies
        async with frame_client(ports["cmd_ingest"]) as other:
            record = {"execution_id": 2, "payload": "{}"}
            assert (await other.request("publish", record=record))["ok"]
        assert await _pending_bytes(ports) == 0


@pytest.mark.once
async def test_v1_a_small_record_then_one_larger_than_the_budget_are_both_answered(
    tmp_path: Path,
) -> None:
    """Over v1: a small record and a 500 KB one in one write, the budget at 200,000
    bytes (the large frame is taken in alone, with the whole budget)."""
    from cmdbus_trio.protocol import encode_frame

    small = encode_frame(json.dumps({"execution_id": 1, "payload": "{}"}).encode())
    large_record = {"execution_id": 1, "payload": json.dumps({"pad": "x" * 500_000})}
    large = encode_frame(json.dumps(large_record).encode())
    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_FACE_PENDING_BYTES": "200000"}
    with trio.fail_after(30), serving(tmp_path, **settings) as (_, ports):
        async with frame_client(ports["cmd_ingest"], v2=False) as client:
            await client.stream.send_all(small + large)
            keys = [await client.stream.receive_some(8) for _ in range(2)]
            assert all(len(key) == 8 for key in keys), keys
        async with frame_client(ports["cmd_ingest"], v2=False) as other:
            await other.send(json.dumps({"execution_id": 2, "payload": "{}"}).encode())
            assert len(await other.stream.receive_some(8)) == 8  # v1: the raw sort key
        assert await _pending_bytes(ports) == 0


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_a_crowd_of_small_then_large_writers_leaves_a_steady_publisher_its_rate(
    tmp_path: Path,
) -> None:
    """Twelve clients each send a small publish and one near the cap in one write, again
    and again, against a 2 MiB budget, beside a publisher of one small record every
    20 ms. The publisher's 100 publishes are all answered while the crowd goes on (the
    crowd used to wedge the face within its first writes), and so are the crowd's."""
    settings = {"CMDBUS_TIER_BIND": "", "CMDBUS_FACE_PENDING_BYTES": str(2 << 20)}
    crowd_answered = 0
    with trio.fail_after(90), serving(tmp_path, **settings) as (_, ports):

        async def writer_in_the_crowd() -> None:
            nonlocal crowd_answered
            async with frame_client(ports["cmd_ingest"]) as client:
                for n in range(0, 1000, 2):
                    small, large = _publish_frame(n + 1, 100), _publish_frame(n + 2, AT_THE_CAP)
                    await client.stream.send_all(small + large)
                    for _ in range(2):
                        assert (await client.receive_json())["ok"]
                        crowd_answered += 1

        async with trio.open_nursery() as crowd:
            for _ in range(12):
                crowd.start_soon(writer_in_the_crowd)
            async with frame_client(ports["cmd_ingest"]) as steady:
                for n in range(100):
                    record = {"execution_id": 7, "payload": f"{n}"}
                    reply = await steady.request("publish", record=record)
                    assert reply["ok"], reply
                    await trio.sleep(0.02)
            crowd.cancel_scope.cancel()
        assert crowd_answered > 0
