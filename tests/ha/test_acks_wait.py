"""Acknowledgements wait for the standby (loop/batcher.py's durability, ha/sync.py,
the replication stream): a publish through a real group committer is answered only
once the standby confirmed it, and then it is in the standby's journal; a standby that
stops confirming holds an answer for the sync timeout, no longer, and the lease is told
first."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from cmdbus_trio.bus.committer import GroupCommitter
from cmdbus_trio.ha.elector import SyncMode
from cmdbus_trio.ha.follower import Follower
from cmdbus_trio.ha.source import Source
from cmdbus_trio.ha.sync import SYNC_TIMEOUT, Synchronizer
from cmdbus_trio.protocol.bus import BusKind, SubjectRule
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage._tier_appends import Appending, NewRecord
from cmdbus_trio.storage.buslog import BusLog
from cmdbus_trio.storage.tier import TierStore
from cmdbus_trio.tier.committer import AppendTicket, TierCommitter

from ..helpers import commit_lines, publish_ticket
from .test_stream import offload


@attrs.define
class Keeper:
    lease: list[str | None] = attrs.Factory(list)
    writable: bool = True

    epoch: int = 1

    def is_primary(self) -> bool:
        return True

    async def record_sync(self, standby: str | None) -> bool:
        self.lease.append(standby)
        return self.writable


@attrs.define
class Setup:
    committer: GroupCommitter
    source: Source
    sync: Synchronizer
    keeper: Keeper
    follower: Follower
    standby: Path
    nursery: trio.Nursery
    writer: trio.CancelScope  # the committer's and the synchronizer's: the writer stopping
    follow_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)

    def follow(self) -> None:
        ours, theirs = trio.testing.memory_stream_pair()
        self.follow_scope = trio.CancelScope()

        async def follow() -> None:
            with self.follow_scope:
                async with trio.open_nursery() as both:
                    both.start_soon(self.source.serve, ours)
                    await self.follower.follow(theirs, lambda: 1)

        self.nursery.start_soon(follow)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    log = await offload(partial(BusLog.open, tmp_path / "a" / "commands.sqlite3", name="commands"))
    source = Source({"commands": log}, epoch=1, primary="a", offload=offload)
    await offload(partial(log.attach_tap, source.committed, pytest.fail))
    keeper = Keeper()
    sync = Synchronizer(SyncMode.ON, source, keeper)
    source.listeners.append(sync.poke)
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    committer.wait_for(sync)
    standby = tmp_path / "b"
    standby.mkdir()
    follower = Follower("b", standby, ["commands"], offload=offload)
    await follower.open()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            writer = trio.CancelScope()

            async def run_writer(task_status: trio.TaskStatus[None]) -> None:
                with writer:
                    async with trio.open_nursery() as tasks:
                        await tasks.start(committer.run)
                        await tasks.start(sync.run)
                        task_status.started()

            await nursery.start(run_writer)
            yield Setup(committer, source, sync, keeper, follower, standby, nursery, writer)
            nursery.cancel_scope.cancel()
    await follower.close()
    await offload(log.close)


async def publish(setup: Setup, n: int) -> int:
    ticket = publish_ticket(json.dumps({"n": n}), n)
    setup.committer.enqueue(ticket)
    return (await ticket.wait())[0].sort_key


def keys_on(path: Path) -> list[int]:
    connection = sqlite3.connect(path)
    try:
        return [row[0] for row in connection.execute("SELECT sort_key FROM records ORDER BY 1")]
    finally:
        connection.close()


async def test_an_answer_comes_once_the_standby_has_the_record(setup: Setup) -> None:
    await publish(setup, 0)  # alone: no standby yet
    setup.follow()
    while not setup.sync.in_sync:
        await trio.sleep(0.01)
    assert setup.keeper.lease == ["b"]
    keys = [await publish(setup, n) for n in range(1, 20)]
    # Every answered record is in the standby's journal: fold it and look.
    setup.follow_scope.cancel()
    await setup.follower.close()
    assert set(keys) <= set(await offload(partial(keys_on, setup.standby / "commands.sqlite3")))


async def test_a_standby_that_stops_holds_an_answer_for_the_timeout_and_the_lease_hears_first(
    setup: Setup,
) -> None:
    """The standby stops (its task is cancelled: nothing more is read or confirmed) for
    longer (the whole test) than the sync timeout (1 s)."""
    setup.follow()
    while not setup.sync.in_sync:
        await trio.sleep(0.01)
    setup.follow_scope.cancel()  # and the connection with it... so the source sees it end
    await trio.sleep(0.1)
    assert setup.keeper.lease == ["b", None]  # dropped at once: its connection ended
    start = trio.current_time()
    await publish(setup, 1)  # alone now
    assert trio.current_time() - start < SYNC_TIMEOUT / 2


class OneWayCut(trio.abc.HalfCloseableStream):
    """The standby's side of the link; once ``cut``, what it sends never arrives (its
    confirmations are lost, the link stays open: a one-way cut)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.cut = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.cut:
            await trio.sleep_forever()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.inner.aclose()


async def in_sync_then_cut(setup: Setup) -> None:
    """The standby follows through a link the test then cuts one way (its side's sends)."""
    ours, theirs = trio.testing.memory_stream_pair()
    cut = OneWayCut(theirs)
    setup.nursery.start_soon(setup.source.serve, ours)
    setup.nursery.start_soon(setup.follower.follow, cut, lambda: 1)
    while not setup.sync.in_sync:
        await trio.sleep(0.01)
    cut.cut = True


async def test_a_silent_standby_holds_an_answer_for_the_timeout_no_longer(setup: Setup) -> None:
    """Its confirmations are lost (a one-way cut) for longer (the rest of the test) than
    the sync timeout (1 s): the answer waits that long, and the lease hears first."""
    await in_sync_then_cut(setup)
    start = trio.current_time()
    await publish(setup, 1)
    waited = trio.current_time() - start
    assert SYNC_TIMEOUT <= waited < SYNC_TIMEOUT + 1.0
    assert setup.keeper.lease == ["b", None]


async def test_a_primary_that_cannot_tell_the_lease_answers_unavailable(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    await in_sync_then_cut(setup)
    setup.keeper.writable = False  # deposed: another member wrote the lease
    for n in (1, 2):
        with pytest.raises(StoreUnavailable, match="cannot record in the lease"):
            await publish(setup, n)
    # A refusal, not a store that failed: a warning, and not one a batch.
    why = "cannot record in the lease that no standby is in sync"
    assert commit_lines(caplog) == [
        ("WARNING", "commit_refused", {"store": "commands", "why": why, "traceback": False})
    ]


@attrs.define
class HeldDurability:
    """A durability that holds every batch until the test lets it go."""

    held: list[Any] = attrs.Factory(list)

    def sequence(self) -> int:
        return 0

    def when_durable(self, sequence: int, done: Any) -> None:
        self.held.append(done)

    def release(self) -> None:
        for done in self.held:
            done(None)
        self.held.clear()


async def test_a_tier_append_is_read_only_once_it_could_be_acknowledged(tmp_path: Path) -> None:
    store = await offload(partial(TierStore.open, tmp_path / "tier.sqlite3"))
    old = NewRecord('{"n": 0}')
    await offload(partial(store.append_batch, "eventlog", "e1", [old]))
    await offload(store.hold_back)  # (a primary with a standby)
    committer = TierCommitter(store)
    durability = HeldDurability()
    committer.wait_for(durability)

    def read() -> list[str]:
        return [r.payload for page in store.iter_execution("eventlog", "e1") for r in page]

    request = Appending("eventlog", "e1", [NewRecord('{"n": 1}')])
    settled = trio.Event()
    ticket = AppendTicket(lambda: request, lambda results: b"ok")
    ticket.on_settled = lambda _: settled.set()
    async with trio.open_nursery() as nursery:
        await nursery.start(committer.run)
        committer.enqueue(ticket)
        while not durability.held:  # committed, waiting for the standby
            await trio.sleep(0.01)
        assert await offload(read) == ['{"n": 0}']
        scans = await offload(lambda: [r for page in store.iter_scan("eventlog") for r in page])
        assert len(scans) == 1
        assert not settled.is_set()
        durability.release()
        await settled.wait()
        assert await offload(read) == ['{"n": 0}', '{"n": 1}']
        nursery.cancel_scope.cancel()
    await offload(store.close)


async def test_a_commit_still_in_the_committer_as_a_drain_settles_is_confirmed_not_failed(
    setup: Setup,
) -> None:
    """A stopping primary's last commits (its drain's lease releases) may still be in a
    committer's thread when its faces have drained: ``settled`` waits for them to reach
    the synchronizer and be confirmed, so the writer stopping right after (the committer
    and the synchronizer cancelled) fails none of them. Seen in a pair's system run as a
    ``commit_failed`` error, "the writer stops", on a SIGTERM."""
    setup.follow()
    while not setup.sync.in_sync:
        await trio.sleep(0.01)
    ticket = publish_ticket(json.dumps({"n": 1}), 1)
    setup.committer.enqueue(ticket)  # no checkpoint since: still queued
    await setup.sync.settled([setup.committer])
    setup.writer.cancel()  # the writer stops, and its standby with it: nothing is
    setup.follow_scope.cancel()  # confirmed from now on
    with trio.fail_after(5):
        (published,) = await ticket.wait()
    await setup.follower.close()
    standby = await offload(partial(keys_on, setup.standby / "commands.sqlite3"))
    assert published.sort_key in standby


async def test_wait_quiet_returns_once_every_ticket_is_handed_to_the_durability(
    tmp_path: Path,
) -> None:
    log = await offload(partial(BusLog.open, tmp_path / "commands.sqlite3", name="commands"))
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    durability = HeldDurability()
    committer.wait_for(durability)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await committer.wait_quiet()  # nothing enqueued: at once
            await nursery.start(committer.run)
            for n in range(3):
                committer.enqueue(publish_ticket(json.dumps({"n": n}), n))
            await committer.wait_quiet()
            assert durability.held  # every batch committed and asked about
            held = len(durability.held)
            await trio.sleep(0.05)
            assert len(durability.held) == held  # none was still on its way
            durability.release()
            nursery.cancel_scope.cancel()
    await offload(log.close)
