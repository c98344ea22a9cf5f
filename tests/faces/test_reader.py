"""A data connection's reader (faces/_reader.py) over real sockets: bytes read at once
when they are there, the socket waited for only when they are not, and a peer that
resets its connection ends that connection alone."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from types import SimpleNamespace

import attrs
import trio
import trio.testing

from cmdbus_trio.admission import ByteBudget
from cmdbus_trio.config import Config
from cmdbus_trio.faces._reader import RECEIVE_CHUNK, Reader, linger
from cmdbus_trio.protocol import encode_frame

from ..helpers import frame_client, get, metric_sum, running_writer

RECORD = {"execution_id": 1, "payload": "{}"}


async def test_frames_sent_in_one_write_are_all_answered_in_order(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(cmd_ingest_bind="127.0.0.1:0")
    frames = [
        encode_frame(json.dumps({"id": n, "op": "publish", "record": RECORD}).encode())
        for n in range(1, 21)
    ]
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):  # noqa: SIM117 (needs its address)
            async with frame_client(addresses["cmd_ingest"]) as client:
                await client.stream.send_all(b"".join(frames))  # one read takes them all
                replies = [await client.receive_json() for _ in frames]
    assert [reply["id"] for reply in replies] == list(range(1, 21))
    assert all(reply["ok"] for reply in replies)


async def test_a_reset_by_the_peer_ends_its_connection_and_its_lease_redelivers_at_once(
    make_config: Callable[..., Config],
) -> None:
    """The worker's connection is reset (RST, not FIN) while it holds a lease: the
    reader's read fails, the connection ends, the record goes to the next worker long
    before its ack wait, and the face serves on."""
    config = make_config(
        cmd_ingest_bind="127.0.0.1:0", cmd_claim_bind="127.0.0.1:0", ack_wait_ms=600_000
    )
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):
            before = (await get(addresses["control"], "/metrics")).body.decode()
            async with frame_client(addresses["cmd_ingest"]) as ingest:
                await ingest.request("publish", record=RECORD)
            async with frame_client(addresses["cmd_claim"]) as first:
                held = await first.request("next", filter="commands.>", timeout_ms=5000)
                assert held["delivery"]["redelivered"] is False
                raw = first.stream.socket
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # Half a frame first: the reset comes while the reader waits mid-frame.
                await first.stream.send_all(encode_frame(b'{"id": 9, "op": "lag"}')[:6])
            async with frame_client(addresses["cmd_claim"]) as second:
                again = await second.request("next", filter="commands.>", timeout_ms=5000)
                scrape = (await get(addresses["control"], "/metrics")).body.decode()
            assert again["delivery"]["sort_key"] == held["delivery"]["sort_key"]
            assert again["delivery"]["redelivered"] is True
    # (The metrics are the process's: other tests' writers counted into them too.)
    released = 'cmdbus_leases_released_total{face="cmd_claim"'
    assert metric_sum(scrape, released) - metric_sum(before, released) == 1
    # A reset is a peer gone, not a bug met by the connection.
    failed = 'cmdbus_connections_total{face="cmd_claim",outcome="internal_error"}'
    assert metric_sum(scrape, failed) == metric_sum(before, failed)


@attrs.define
class Lingering:
    """:func:`linger` on our end of a stream pair, run in a task; its result once done."""

    discarded: int | None = None
    done: trio.Event = attrs.Factory(trio.Event)

    async def run(self, stream: trio.abc.Stream, seconds: float, max_bytes: int) -> None:
        self.discarded = await linger(stream, seconds, max_bytes)
        self.done.set()


async def test_linger_shuts_the_sending_side_and_discards_until_the_peer_closes() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    lingering = Lingering()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lingering.run, ours, 5.0, 1 << 20)
            await theirs.send_all(b"x" * 1000)
            assert await theirs.receive_some(10) == b""  # our side was shut: EOF
            await theirs.send_all(b"y" * 500)
            await theirs.send_eof()
    assert lingering.discarded == 1500


async def test_linger_ends_after_its_timeout_with_a_peer_that_trickles_forever(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    lingering = Lingering()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lingering.run, ours, 2.0, 1 << 20)
        started = trio.current_time()
        with trio.move_on_after(60):  # far past the timeout: the peer never stops
            while not lingering.done.is_set():
                await theirs.send_all(b"z")
                await trio.sleep(0.5)
        assert 2.0 <= trio.current_time() - started < 3.0
    assert lingering.discarded in (4, 5)


async def test_linger_ends_after_its_bytes_with_a_peer_that_floods() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    lingering = Lingering()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lingering.run, ours, 60.0, 100_000)
            while not lingering.done.is_set():
                await theirs.send_all(b"w" * 10_000)
    assert lingering.discarded is not None
    assert 100_000 <= lingering.discarded <= 100_000 + RECEIVE_CHUNK  # the read that passed it


class StepCounter(trio.abc.Instrument):
    """Counts the steps of tasks whose name ends with ``suffix``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.suffix):
            self.steps += 1


async def test_a_request_with_nothing_ahead_of_it_is_taken_by_the_reader(
    make_config: Callable[..., Config],
) -> None:
    """A lone request (nothing handed to the connection's dispatcher before it, nothing
    making it wait) is taken in the reader's own task: no hand-over, so the dispatcher
    (the connection's main task) takes no step for it. 20 requests one after another
    cost it fewer steps than one each."""
    config = make_config(cmd_ingest_bind="127.0.0.1:0")
    counter = StepCounter("_run_handler")  # the connection's task: its dispatcher
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):  # noqa: SIM117 (needs its address)
            async with frame_client(addresses["cmd_ingest"]) as client:
                await client.request("publish", record=RECORD)  # the hello's hand-over done
                trio.lowlevel.add_instrument(counter)
                try:
                    replies = [await client.request("publish", record=RECORD) for _ in range(20)]
                finally:
                    trio.lowlevel.remove_instrument(counter)
    assert all(reply["ok"] for reply in replies)
    assert counter.steps < 5, counter.steps


async def test_a_hello_and_requests_in_one_write_are_answered_hello_first(
    make_config: Callable[..., Config],
) -> None:
    """The hello is the dispatcher's; the requests read with it wait behind it (none is
    taken by the reader ahead of the hello's answer), and a bad one among them gets its
    error in its place."""
    config = make_config(cmd_ingest_bind="127.0.0.1:0")
    hello = encode_frame(b'{"hello": {"protocol": 2, "client": "tests"}}')
    frames = [
        encode_frame(json.dumps({"id": 1, "op": "publish", "record": RECORD}).encode()),
        encode_frame(b'{"id": 2, "op": "publish", "record": 7}'),
        encode_frame(json.dumps({"id": 3, "op": "publish", "record": RECORD}).encode()),
    ]
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):  # noqa: SIM117 (needs its address)
            async with frame_client(addresses["cmd_ingest"], v2=False) as client:
                await client.stream.send_all(hello + b"".join(frames))
                answers = [await client.receive_json() for _ in range(4)]
                # Then lone requests, taken by the reader, on the same connection.
                again = await client.request("publish", record=RECORD)
    assert "hello" in answers[0] or answers[0].get("ok"), answers[0]
    assert "id" not in answers[0]
    by_id = {answer["id"]: answer for answer in answers[1:]}
    assert by_id[1]["ok"] and by_id[3]["ok"]
    assert by_id[2]["ok"] is False and by_id[2]["error"]["code"] == "invalid"
    assert again["ok"]


def budget_reader(budget: ByteBudget, *, over_cap: bool = False) -> Reader:
    """A reader with only a budget and an outbox's flag: for its loans alone."""

    async def wait_drained() -> None:
        if over_cap:
            await trio.sleep_forever()

    outbox = SimpleNamespace(over_cap=over_cap, wait_drained=wait_drained)
    return Reader(
        SimpleNamespace(pending_bytes=budget),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        outbox,  # type: ignore[arg-type]
        holding=lambda: False,
        end=lambda _outcome: None,
        take_now=lambda frame, _arrival, _lent: frame,
    )


async def test_a_connection_holding_bytes_waits_for_its_own_before_it_queues() -> None:
    """No connection holds part of the face's budget while it waits for more of it: with
    no room, a reader that holds bytes waits for its own to come back (its earlier
    frames are answered without the budget), and only then queues. A connection holding
    nothing queues at once and goes first."""
    budget = ByteBudget("test_reader_hold_and_wait", 4)
    holder, other, newcomer = (budget_reader(budget) for _ in range(3))
    held = await holder.lend(1)
    others = await other.lend(3)
    got: dict[str, int] = {}

    async def ask(name: str, reader: Reader, size: int) -> None:
        got[name] = await reader.lend(size)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "holder", holder, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert not budget._waiting  # it waits for its own, not in the face's queue
        nursery.start_soon(ask, "newcomer", newcomer, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert len(budget._waiting) == 1
        other.give_back(others)
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"newcomer": 2}  # the room went to the one holding nothing
        holder.give_back(held)
    assert got == {"newcomer": 2, "holder": 2}
    assert budget.lent == 4
    for name, reader in (("holder", holder), ("newcomer", newcomer)):
        reader.give_back(got[name])
    assert budget.lent == 0


async def test_a_client_that_does_not_read_is_lent_nothing_more() -> None:
    """While a connection's unsent replies are over their cap, its reader lends no
    bytes to its next frame (they would be held until the client reads)."""
    budget = ByteBudget("test_reader_unread", 10)
    reader = budget_reader(budget, over_cap=True)
    assert reader.lend_nowait(1) is None
    with trio.move_on_after(1):
        await reader.lend(1)
        raise AssertionError("lent to a client that does not read its replies")
    assert budget.lent == 0


async def test_loans_of_frames_not_taken_go_back_when_the_connection_ends() -> None:
    budget = ByteBudget("test_reader_untaken", 3 * RECEIVE_CHUNK)
    reader = budget_reader(budget)
    for size in (10, 2 * RECEIVE_CHUNK):
        reader._untaken.append(await reader.lend(size))
    assert reader.take_loan() == 10
    reader.return_untaken()
    assert budget.lent == 10  # the loan taken is the request's, given back with its reply
