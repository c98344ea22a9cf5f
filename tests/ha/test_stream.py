"""The replication stream (ha/source.py, ha/follower.py) between two data dirs in one
process, over a memory stream: a standby that starts with nothing gets base copies, then
the transactions; what it confirmed is on its disk and, folded, is the primary's
database; it resumes where it stopped, or is copied again when it fell behind the
backlog or its history went another way; a deposed primary's frames end the stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.ha._wire import WireError
from cmdbus_trio.ha.follower import Deposed, Follower, Refused
from cmdbus_trio.ha.source import Source
from cmdbus_trio.storage._tier_appends import NewRecord
from cmdbus_trio.storage.buslog import BusEntry, BusLog
from cmdbus_trio.storage.tier import TierStore

from ..storage.test_replica_pages import dump

STORES = ("commands", "tier")


async def offload(fn: Callable[[], Any]) -> Any:
    return await run_in_thread(fn, limiter=LIMITER)


LIMITER = trio.CapacityLimiter(4)


@attrs.define
class Primary:
    commands: BusLog
    tier: TierStore
    source: Source
    path: Path

    async def publish(self, count: int, start: int = 0) -> None:
        entries = [
            BusEntry("commands.a", json.dumps({"n": n})) for n in range(start, start + count)
        ]
        await offload(partial(self.commands.publish, entries))
        record = NewRecord(json.dumps({"n": start}))
        await offload(partial(self.tier.append_batch, "eventlog", f"e{start}", [record]))


@pytest.fixture
async def primary(tmp_path: Path) -> AsyncIterator[Primary]:
    path = tmp_path / "a"
    commands = await offload(partial(BusLog.open, path / "commands.sqlite3", name="commands"))
    tier = await offload(partial(TierStore.open, path / "tier.sqlite3"))
    source = Source({"commands": commands, "tier": tier}, epoch=1, primary="a", offload=offload)
    for store in (commands, tier):
        await offload(partial(store.attach_tap, source.committed, pytest.fail))
    yield Primary(commands, tier, source, path)
    for store in (commands, tier):
        await offload(store.close)


async def follow_until_caught_up(
    primary: Primary, follower: Follower, epoch_seen: Callable[[], int] = lambda: 1
) -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(primary.source.serve, ours)
            nursery.start_soon(follower.follow, theirs, epoch_seen)
            while (
                primary.source.confirmed < primary.source.sequence or primary.source.sequence == 0
            ):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()


async def the_same(primary: Primary, standby: Path, follower: Follower) -> None:
    await follower.close()
    for name in STORES:
        assert await offload(partial(dump, standby / f"{name}.sqlite3")) == await offload(
            partial(dump, primary.path / f"{name}.sqlite3")
        ), name


async def test_a_standby_from_nothing_is_copied_then_follows(
    primary: Primary, tmp_path: Path
) -> None:
    await primary.publish(20)
    standby = tmp_path / "b"
    standby.mkdir()
    follower = Follower("b", standby, STORES, offload=offload)
    await follower.open()
    assert follower.positions() == {}

    async def more() -> None:
        for n in range(20, 200, 20):
            await primary.publish(20, n)
            await trio.sleep(0.01)

    ours, theirs = trio.testing.memory_stream_pair()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(primary.source.serve, ours)
            nursery.start_soon(follower.follow, theirs, lambda: 1)
            await more()
            while primary.source.confirmed < primary.source.sequence:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert follower.base_copies == 2 and follower.behind == 0
    await the_same(primary, standby, follower)


async def test_a_standby_resumes_where_it_stopped(primary: Primary, tmp_path: Path) -> None:
    standby = tmp_path / "b"
    standby.mkdir()
    follower = Follower("b", standby, STORES, offload=offload)
    await follower.open()
    await primary.publish(5)
    await follow_until_caught_up(primary, follower)
    await follower.close()  # the standby restarts
    await primary.publish(5, 5)  # meanwhile
    again = Follower("b", standby, STORES, offload=offload)
    await again.open()
    assert set(again.positions()) == set(STORES)
    await follow_until_caught_up(primary, again)
    assert again.base_copies == 0  # from the backlog
    await the_same(primary, standby, again)


async def test_a_standby_behind_the_backlog_is_copied_again(
    primary: Primary, tmp_path: Path
) -> None:
    primary.source._backlog_bytes = 64 << 10  # a few transactions
    standby = tmp_path / "b"
    standby.mkdir()
    follower = Follower("b", standby, STORES, offload=offload)
    await follower.open()
    await primary.publish(5)
    await follow_until_caught_up(primary, follower)
    await follower.close()
    for n in range(5, 400, 5):
        await primary.publish(5, n)
    assert primary.source.floor > 0
    again = Follower("b", standby, STORES, offload=offload)
    await again.open()
    await follow_until_caught_up(primary, again)
    assert again.base_copies == 2
    await the_same(primary, standby, again)


async def test_a_deposed_primarys_stream_ends_and_a_wrong_token_is_refused(
    primary: Primary, tmp_path: Path
) -> None:
    standby = tmp_path / "b"
    standby.mkdir()
    follower = Follower("b", standby, STORES, offload=offload)
    await follower.open()
    await primary.publish(5)
    await follow_until_caught_up(primary, follower)
    seen = [1]

    async def deposed() -> None:
        await trio.sleep(0.1)
        seen[0] = 2  # the lease moved on: a newer primary took it
        await primary.publish(1, 100)

    ours, theirs = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(primary.source.serve, ours)
            nursery.start_soon(deposed)
            with pytest.raises(Deposed):
                await follower.follow(theirs, lambda: seen[0])
            nursery.cancel_scope.cancel()
    confirmed = primary.source.confirmed
    assert confirmed < primary.source.sequence  # nothing of epoch 1 confirmed after
    ours, theirs = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(primary.source.serve, ours)
            with pytest.raises(Refused, match="deposed"):  # it says so to that primary
                await follower.follow(theirs, lambda: seen[0])
            nursery.cancel_scope.cancel()
    primary.source._token = "secret"
    ours, theirs = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(primary.source.serve, ours)
            with pytest.raises(Refused, match="wrong token"):
                await follower.follow(theirs, lambda: 1)
            nursery.cancel_scope.cancel()
    await follower.close()


async def test_a_connection_that_says_nothing_displaces_nobody_and_is_closed(
    primary: Primary, tmp_path: Path
) -> None:
    """A second connection to the replication face that never says Hello (a port scan, a
    careless client) is closed after the hello timeout (0.3 s here; it waits 1 s), and
    the standby it would have replaced goes on confirming."""
    standby = tmp_path / "b"
    standby.mkdir()
    follower = Follower("b", standby, STORES, offload=offload)
    await follower.open()
    await primary.publish(5)
    ours, theirs = trio.testing.memory_stream_pair()
    silent_ours, _silent_theirs = trio.testing.memory_stream_pair()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(primary.source.serve, ours)
            nursery.start_soon(follower.follow, theirs, lambda: 1)
            while primary.source.confirmed < primary.source.sequence:
                await trio.sleep(0.01)
            with pytest.raises(WireError, match=r"no Hello within 0\.3 s"), trio.move_on_after(1):
                await primary.source.serve(silent_ours, hello_timeout=0.3)  # (ends it first)
            assert primary.source.standby == "b"
            await primary.publish(5, 5)
            while primary.source.confirmed < primary.source.sequence:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    await follower.close()
