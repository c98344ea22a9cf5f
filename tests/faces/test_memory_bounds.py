"""Memory per client bounded (issue 16 item 11): a client that pipelines big reads and does
not read its replies, and a flood of 1 MiB batches, leave the writer's RSS within 150 MiB of
idle. Before the bounds, replies queued without limit once their request had freed its slot
(~95 MiB a second for 4 such readers) and every pipelined frame was parsed at once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import trio
import trio.testing

from cmdbus_trio.admission import ByteBudget
from cmdbus_trio.protocol import RemoteProtocolError

from ..helpers import FrameClient, frame_client, serving

BOUND_MIB = 150
TIER_ONLY = {
    f"CMDBUS_{face}_BIND": ""
    for face in ("CMD_INGEST", "CMD_CLAIM", "EVT_INGEST", "EVT_CLAIM", "EVT_SUBSCRIBE")
}


def rss_mib(process: subprocess.Popen[str]) -> float:
    with open(f"/proc/{process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def watch_peak(process: subprocess.Popen[str], seconds: float) -> float:
    peak = 0.0
    end = trio.current_time() + seconds
    while trio.current_time() < end:
        peak = max(peak, rss_mib(process))
        await trio.sleep(0.05)
    return peak


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_readers_that_do_not_read_their_replies(tmp_path: Path) -> None:
    with serving(tmp_path, **TIER_ONLY) as (writer, ports):
        pad = "x" * 1000
        async with frame_client(ports["tier"]) as client:
            for _ in range(20):  # 20,000 records of ~1 KB: pages of ~1.1 MB
                payloads = [json.dumps({"n": n, "pad": pad}) for n in range(1000)]
                reply = await client.request("append_batch", execution_id="big", payloads=payloads)
                assert reply["ok"], reply
        await trio.sleep(0.5)
        idle = rss_mib(writer)
        readers: list[FrameClient] = []
        with trio.fail_after(60):
            for _ in range(4):
                reader = await FrameClient.connect(ports["tier"])
                await reader.hello()
                for n in range(60):  # 66 MB of replies each, never read meanwhile
                    request = {"id": n + 1, "op": "read_execution", "execution_id": "big"}
                    await reader.send(json.dumps({**request, "limit": 1000}).encode())
                readers.append(reader)
            peak = await watch_peak(writer, 3.0)
            assert peak - idle <= BOUND_MIB, f"RSS grew {peak - idle:.0f} MiB over idle {idle:.0f}"
            # Nothing was lost: each reader gets all 60 replies once it reads.
            for reader in readers:
                for n in range(60):
                    reply = await reader.receive_json()
                    assert reply["id"] == n + 1 and reply["ok"] and reply["returned"] == 1000
                await reader.aclose()


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
async def test_a_flood_of_one_mib_batches(tmp_path: Path) -> None:
    with serving(tmp_path, CMDBUS_TIER_BIND="") as (writer, ports):
        await trio.sleep(0.5)
        idle = rss_mib(writer)
        # The most records a batch may hold, each small: parsed, a frame weighs the most.
        records = [
            {"execution_id": n, "payload": '{"k": "' + "z" * 50 + '"}'} for n in range(10_000)
        ]
        frame = json.dumps({"op": "publish_batch", "records": records})
        assert 900_000 < len(frame) < 1 << 20

        async def flood(replies: list[int]) -> None:
            # A fast client: it sends its 12 frames (12 MB, the face takes in 8 MiB at
            # most) back to back and reads the replies as they come, concurrently.
            async with frame_client(ports["cmd_ingest"]) as client:

                async def send_all() -> None:
                    for i in range(12):
                        body = frame.replace('"op"', f'"id": {i + 1}, "op"', 1)
                        await client.send(body.encode())

                async with trio.open_nursery() as sending:
                    sending.start_soon(send_all)
                    for _ in range(12):
                        reply = await client.receive_json()
                        assert reply["ok"], reply
                        replies.append(len(reply["sort_keys"]))

        replies: list[int] = []
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(flood, replies)
                peak = await watch_peak(writer, 2.0)
        assert replies == [10_000] * 48  # everything was committed and answered
        assert peak - idle <= BOUND_MIB, f"RSS grew {peak - idle:.0f} MiB over idle {idle:.0f}"


async def test_byte_budget_lends_in_order_and_never_more_than_it_has() -> None:
    budget = ByteBudget("test", 100)
    assert budget.acquire_nowait(60) == 60
    order: list[str] = []

    async def ask(name: str, size: int) -> None:
        lent = await budget.acquire(size)
        order.append(name)
        budget.release(lent)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "big", 50)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(ask, "small", 10)  # would fit, but "big" asked first
        await trio.testing.wait_all_tasks_blocked()
        assert order == [] and budget.lent == 60
        with pytest.raises(trio.WouldBlock):
            budget.acquire_nowait(1)  # not while others wait
        budget.release(60)
    assert sorted(order) == ["big", "small"] and budget.lent == 0
    assert budget.acquire_nowait(1000) == 100  # bigger than the budget: all of it, alone
    budget.release(100)


async def test_a_cancelled_ask_takes_nothing_and_lets_the_next_through() -> None:
    budget = ByteBudget("test", 100)
    budget.acquire_nowait(90)
    got: list[tuple[str, int]] = []
    first = trio.CancelScope()

    async def ask_first() -> None:
        with first:
            got.append(("first", await budget.acquire(50)))

    async def ask_second() -> None:
        got.append(("second", await budget.acquire(10)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask_first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(ask_second)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # it fits, but waits behind the first asker
        first.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert got == [("second", 10)]
    assert budget.lent == 100


@pytest.mark.once
async def test_a_reader_cut_off_mid_reply_never_gets_a_corrupt_frame(tmp_path: Path) -> None:
    """A write that stalls past the read timeout may have sent part of a frame: the
    connection must end there. It used to go on writing the next replies after the
    partial one, so a slow client read garbage instead of an end of stream."""
    settings = {**TIER_ONLY, "CMDBUS_READ_TIMEOUT_MS": "500"}
    with serving(tmp_path, **settings) as (_, ports):
        pad = "x" * 1000
        async with frame_client(ports["tier"]) as client:
            for _ in range(5):
                payloads = [json.dumps({"n": n, "pad": pad}) for n in range(1000)]
                reply = await client.request("append_batch", execution_id="big", payloads=payloads)
                assert reply["ok"], reply
        with trio.fail_after(60):
            reader = await FrameClient.connect(ports["tier"])
            await reader.hello()
            for n in range(40):
                request = {"id": n + 1, "op": "read_execution", "execution_id": "big"}
                await reader.send(json.dumps(request).encode())
            await trio.sleep(3)  # the writer's writes stall far past its read timeout
            ids = []
            try:
                while (frame := await reader.receive()) is not None:
                    ids.append(json.loads(frame)["id"])  # every whole frame is a reply
            except (trio.BrokenResourceError, RemoteProtocolError):
                pass  # reset, or the stream ended inside the frame cut short
            assert ids == list(range(1, len(ids) + 1)) and len(ids) < 40


@pytest.mark.slow  # a load measured in a subprocess: see noxfile.SYSTEM_ONCE
def test_a_blocking_call_many_bigger_than_the_unsent_cap_does_not_wait_on_itself(
    tmp_path: Path,
) -> None:
    """The blocking client cannot read while it sends. Sent whole, 30 batches whose
    replies pass the writer's unsent cap made the writer stop reading while the client was
    still sending: both waited until the read timeout closed the connection. It now sends
    a window at a time and reads its replies in between."""
    from cmdbus_trio.client import _calls as calls
    from cmdbus_trio.client import blocking

    settings = {
        **TIER_ONLY,
        "CMDBUS_CONNECTION_UNSENT_BYTES": str(1 << 20),
        "CMDBUS_READ_TIMEOUT_MS": "3000",
    }
    with serving(tmp_path, **settings) as (_, ports):
        with blocking.TierClient.connect(ports["tier"]) as tier:
            payload = json.dumps({"p": "x" * 60})
            batch = [calls.append_batch(f"many-{n}", [payload] * 10_000) for n in range(30)]
            results = tier.call_many(batch, timeout=120)  # ~27 MB sent, ~20 MB of replies
        assert [result.appended for result in results] == [10_000] * 30
