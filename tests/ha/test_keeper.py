"""The lease keeper (cmdbus_trio/ha/keeper.py): the elector run against a store, on a
clock. Most tests run on trio's MockClock with a store in memory (its calls made on the
loop: no thread, so the clock jumps only when every task waits); one runs two members on
a real ``file:`` store, in threads, on the real clock."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.ha import Elector, LeaseConflict, LeaseError, LeaseRecord, Versioned
from cmdbus_trio.ha._file_lease import FileLeaseStore
from cmdbus_trio.ha.keeper import LeaseKeeper


class MemoryStore:
    def __init__(self) -> None:
        self.current: Versioned | None = None
        self.writes = 0
        self.down = False  # every call fails, as a store that cannot be reached

    def describe(self) -> str:
        return "memory:"

    def read(self) -> Versioned | None:
        if self.down:
            raise LeaseError("the store is down")
        return self.current

    def write(self, record: LeaseRecord, version: str | None) -> str:
        if self.down:
            raise LeaseError("the store is down")
        if version != (None if self.current is None else self.current.version):
            raise LeaseConflict("moved")
        self.writes += 1
        self.current = Versioned(record, str(self.writes))
        return self.current.version


async def on_the_loop(fn: Callable[[], Any]) -> Any:
    await trio.lowlevel.checkpoint()
    return fn()


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def keeper(name: str, store: Any, duration: float = 3.0) -> LeaseKeeper:
    return LeaseKeeper(Elector(name, duration), store, on_the_loop)


def killable(nursery: trio.Nursery, member: LeaseKeeper) -> trio.CancelScope:
    """Run ``member``'s keeper in ``nursery``; cancelling the scope is its death (it
    renews no more and writes nothing)."""
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await member.run()

    nursery.start_soon(run)
    return scope


async def until(check: Callable[[], bool], step: float = 0.01) -> float:
    while not check():
        await trio.sleep(step)
    return trio.current_time()


async def test_a_killed_primary_is_replaced_by_its_standby_in_sync_never_two_at_once(
    mock_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a, b = keeper("a", store), keeper("b", store)
    primaries: list[tuple[float, bool, bool]] = []
    async with trio.open_nursery() as nursery:
        a_scope = killable(nursery, a)
        await until(a.is_primary)
        assert await a.record_sync("b")
        await nursery.start(b.run)

        async def watch() -> None:
            while True:
                primaries.append((trio.current_time(), a.is_primary(), b.is_primary()))
                await trio.sleep(0.01)

        nursery.start_soon(watch)
        await trio.sleep(5)
        assert a.is_primary() and not b.is_primary()  # a renews: b waits
        killed = trio.current_time()
        a_scope.cancel()  # a dies: it renews no more
        took = await until(b.is_primary)
        # b takes over within the duration (3 s) and one turn (1 s) of a's last renewal.
        assert took - killed <= 3.0 + 1.0 + 0.05
        assert store.current is not None and store.current.record.epoch == 2
        nursery.cancel_scope.cancel()
    assert not any(a_primary and b_primary for _, a_primary, b_primary in primaries)


async def test_a_primary_that_cannot_renew_stops_at_its_own_deadline(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The store goes away for longer (10 s) than the lease lasts (3 s): the primary's
    followers are woken at its deadline, the duration less the margin after the start
    of its last renewal."""
    store = MemoryStore()
    a = keeper("a", store)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        assert a.is_primary()
        await trio.sleep(2.5)
        last_renewal = 2.0  # its turns: 0, 1, 2
        store.down = True
        await a.wait_changed()
        while a.is_primary():
            await a.wait_changed()
        assert trio.current_time() == pytest.approx(last_renewal + 3.0 - 0.6)
        assert a.last_error == "the store is down"
        await trio.sleep(10)
        assert not a.is_primary()
        store.down = False
        await until(a.is_primary)  # its own, nobody took it: it takes it again
        assert store.current is not None and store.current.record.epoch == 2
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("write_s", "logged"), [(0.4, True), (0.2, False)])
async def test_a_renewal_slower_than_half_the_margin_is_logged(
    mock_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    write_s: float,
    logged: bool,
) -> None:
    """A 3 s lease keeps a margin of 0.6 s: a write of 0.4 s is the warning an operator
    gets before a slow store deposes the primary; one of 0.2 s is not."""

    async def slow(fn: Callable[[], Any]) -> Any:
        await trio.sleep(write_s)
        return fn()

    a = LeaseKeeper(Elector("a", 3.0), MemoryStore(), slow)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await trio.sleep(2.5)
        nursery.cancel_scope.cancel()
    assert ("lease_write_slow" in caplog.text) is logged


async def test_sync_is_recorded_only_by_a_holder(mock_clock: trio.testing.MockClock) -> None:
    store = MemoryStore()
    a, b = keeper("a", store), keeper("b", store)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(b.run)
        assert not await b.record_sync("b")
        assert await a.record_sync("b")
        assert store.current is not None and store.current.record.in_sync == "b"
        assert await a.record_sync(None)
        assert store.current.record.in_sync is None
        store.down = True
        assert not await a.record_sync("b")  # not written: the caller may not count on it
        nursery.cancel_scope.cancel()


async def test_a_hand_over_is_taken_within_a_turn_not_a_lease(
    mock_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a, b = keeper("a", store), keeper("b", store)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        assert await a.record_sync("b")
        await nursery.start(b.run)
        await trio.sleep(2)
        released = trio.current_time()
        assert await a.hand_over()
        assert not a.is_primary()
        took = await until(b.is_primary)
        assert took - released <= 1.0 + 0.05  # b's next turn
        nursery.cancel_scope.cancel()


async def test_two_members_on_a_file_lease_in_threads(tmp_path: Path) -> None:
    """Real clock, real threads: a 1 s lease, a takes it, dies; b (in sync) takes it
    within the lease and a turn; the file store's epochs say so."""
    limiter = trio.CapacityLimiter(2)
    offload = functools.partial(run_in_thread, limiter=limiter)

    async def in_thread(fn: Callable[[], Any]) -> Any:
        return await offload(fn)

    store = FileLeaseStore(tmp_path / "lease")
    a = LeaseKeeper(Elector("a", 1.0), store, in_thread)
    b = LeaseKeeper(Elector("b", 1.0), FileLeaseStore(tmp_path / "lease"), in_thread)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            a_scope = killable(nursery, a)
            await until(a.is_primary)
            assert await a.record_sync("b")
            await nursery.start(b.run)
            await trio.sleep(1.5)
            assert not b.is_primary()
            killed = trio.current_time()
            a_scope.cancel()
            took = await until(b.is_primary)
            assert took - killed < 1.0 + 0.34 + 1.0  # the lease, a turn, and slack
            current = await trio.to_thread.run_sync(store.read)
            assert current is not None
            assert (current.record.holder, current.record.epoch) == ("b", 2)
            nursery.cancel_scope.cancel()


async def test_a_hand_over_a_turn_wrote_first_is_still_a_hand_over(
    mock_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a = keeper("a", store)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        a.elector.release()  # asked; the turn at 1.0 writes it before hand_over runs
        await trio.sleep(1.5)
        assert store.current is not None and store.current.record.holder is None
        assert await a.hand_over()
        nursery.cancel_scope.cancel()


async def test_a_primary_whose_clock_jumps_forward_stops_at_once_and_takes_its_lease_again(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Its own deadline passes with the jump (30 s, ten leases): it is not primary from
    that instant (the safe way), and takes its lease again at a new epoch."""
    store = MemoryStore()
    a = keeper("a", store)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        assert a.is_primary()
        mock_clock.jump(30)
        assert not a.is_primary()
        await until(a.is_primary)
        assert store.current is not None and store.current.record.epoch == 2
        nursery.cancel_scope.cancel()
