from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from cmdbus_trio.bus.claims import Claims, Delivery
from cmdbus_trio.protocol.subjects import parse_filter

ALL = parse_filter(">")
SHARED = "commands.shared.shard.0"
SYSTEM = "commands.system.shard.0"


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
async def claims(autojump_clock: trio.testing.MockClock) -> AsyncIterator[Claims]:
    dead: list[tuple[int, str, int]] = []
    coordinator = Claims(
        "commands", ack_wait=30.0, max_deliver=3, on_dead=lambda *a: dead.append(a)
    )
    coordinator.dead = dead  # type: ignore[attr-defined]
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run_timers)
        yield coordinator
        nursery.cancel_scope.cancel()


async def test_fresh_records_go_out_oldest_first_one_owner_at_a_time(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SYSTEM), (3, SHARED)])
    a, b = object(), object()
    assert claims.take(ALL, a) == Delivery(1, SHARED, False, 1)
    assert claims.take(ALL, b) == Delivery(2, SYSTEM, False, 1)
    assert claims.take(ALL, a) == Delivery(3, SHARED, False, 1)
    assert claims.take(ALL, b) is None
    assert claims.leased == 3


async def test_filters_pick_subjects(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SYSTEM)])
    assert claims.take(parse_filter("commands.system.>"), object()) == Delivery(2, SYSTEM, False, 1)
    assert claims.take(parse_filter("commands.system.>"), object()) is None
    assert claims.take(parse_filter("commands.*.shard.0"), object()) == Delivery(
        1, SHARED, False, 1
    )


async def test_expired_leases_are_redelivered_first(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SHARED), (3, SHARED)])
    owner = object()
    claims.take(ALL, owner)  # 1
    claims.take(ALL, owner)  # 2
    await trio.sleep(29.9)
    assert claims.take(ALL, owner) == Delivery(3, SHARED, False, 1)
    await trio.sleep(0.2)  # 1 and 2 expire (30 s); 3 not yet
    assert claims.take(ALL, owner) == Delivery(1, SHARED, True, 2)
    assert claims.take(ALL, owner) == Delivery(2, SHARED, True, 2)
    assert claims.take(ALL, owner) is None


async def test_ack_only_by_the_owner_and_then_never_again(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner, other = object(), object()
    claims.take(ALL, owner)
    assert not claims.begin_ack(1, other)
    assert not claims.begin_ack(99, owner)
    assert claims.begin_ack(1, owner)
    await trio.sleep(60)  # the lease would have expired: an ack in progress is not redelivered
    assert claims.take(ALL, owner) is None
    claims.finish_ack(1)
    assert claims.lag() == {SHARED: 0}
    assert not claims.begin_ack(1, owner)  # already acked


async def test_a_failed_ack_redelivers(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner = object()
    claims.take(ALL, owner)
    claims.begin_ack(1, owner)
    claims.abort_ack(1)
    assert claims.take(ALL, owner) == Delivery(1, SHARED, True, 2)


async def test_nack_with_and_without_delay(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SHARED)])
    owner = object()
    claims.take(ALL, owner)
    claims.take(ALL, owner)
    assert claims.nack(1, owner)
    assert claims.take(ALL, owner) == Delivery(1, SHARED, True, 2)
    assert claims.nack(2, owner, delay=5.0)
    assert claims.take(ALL, owner) is None
    await trio.sleep(5.1)
    assert claims.take(ALL, owner) == Delivery(2, SHARED, True, 2)
    assert not claims.nack(2, object())


async def test_a_nack_delay_shorter_than_every_lease_is_kept(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    # The timers task sleeps until the soonest lease expiry (30 s) and is woken only for
    # something sooner: this nack's 5 s.
    claims.add_many([(1, SHARED), (2, SHARED)])
    owner = object()
    claims.take(ALL, owner)
    claims.take(ALL, owner)
    await trio.sleep(1)  # the timers task has gone to sleep until the leases expire
    assert claims.nack(2, owner, delay=5.0)
    await trio.sleep(5.1)
    assert claims.take(ALL, owner) == Delivery(2, SHARED, True, 2)
    assert trio.current_time() < 30


async def test_extend_renews_the_lease(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner = object()
    claims.take(ALL, owner)
    await trio.sleep(20)
    assert claims.extend(1, owner)
    await trio.sleep(20)  # 40 s after delivery, 20 s after the extension
    assert claims.take(ALL, owner) is None
    await trio.sleep(11)
    assert claims.take(ALL, owner) == Delivery(1, SHARED, True, 2)
    assert not claims.extend(1, object())


async def test_a_closed_connection_releases_its_leases_at_once(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SHARED), (3, SHARED)])
    gone, staying = object(), object()
    claims.take(ALL, gone)
    claims.take(ALL, gone)
    claims.take(ALL, staying)
    assert claims.release(gone) == 2
    assert claims.take(ALL, staying) == Delivery(1, SHARED, True, 2)
    assert claims.take(ALL, staying) == Delivery(2, SHARED, True, 2)


async def test_leases_are_kept_per_owner(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    """A connection's leases are found without walking everyone's: release, and whether
    a connection holds any (it is then not idle)."""
    claims.add_many([(n, SHARED) for n in range(1, 7)])
    a, b = object(), object()
    for owner in (a, b, a, b, a, b):
        claims.take(ALL, owner)
    assert claims.holds(a) and claims.holds(b)
    assert claims.begin_ack(1, a)
    claims.finish_ack(1)
    assert claims.nack(3, a) and claims.give_back(5, a)
    assert not claims.holds(a)  # every way a lease ends takes it off its owner
    assert claims.release(b) == 3 and not claims.holds(b)
    await trio.sleep(claims.ack_wait + 1)
    assert claims.leased == 0


async def test_an_expired_lease_leaves_its_owner(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED)])
    owner = object()
    claims.take(ALL, owner)
    await trio.sleep(claims.ack_wait + 1)
    assert not claims.holds(owner)
    assert claims.release(owner) == 0


async def test_max_deliver_parks_dead_letters(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner = object()
    for delivery in (1, 2, 3):
        assert claims.take(ALL, owner) == Delivery(1, SHARED, delivery > 1, delivery)
        await trio.sleep(31)
    assert claims.take(ALL, owner) is None
    assert claims.dead == [(1, SHARED, 3)]  # type: ignore[attr-defined]
    assert claims.lag() == {SHARED: 0}  # dead letters are not backlog


async def test_lag_counts_undelivered_and_unacked(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SHARED), (3, SYSTEM)])
    owner = object()
    claims.take(parse_filter(SHARED), owner)
    assert claims.lag() == {SHARED: 2, SYSTEM: 1}
    assert claims.lag(parse_filter("commands.system.>")) == {SYSTEM: 1}
    claims.begin_ack(1, owner)
    claims.finish_ack(1)
    assert claims.lag() == {SHARED: 1, SYSTEM: 1}


async def test_a_waiting_next_wakes_on_a_new_matching_record(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    got: list[Delivery] = []

    async def consumer() -> None:
        got.append(await claims.next(parse_filter("commands.system.>"), object()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        claims.add(1, SHARED)  # does not match: still waiting
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        claims.add(2, SYSTEM)
    assert got == [Delivery(2, SYSTEM, False, 1)]


async def test_next_with_a_timeout_leases_nothing(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.move_on_after(5):
        await claims.next(ALL, object())
    claims.add(1, SHARED)
    assert claims.leased == 0
    assert claims.take(ALL, object()) == Delivery(1, SHARED, False, 1)


async def test_close_wakes_waiting_consumers(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    from cmdbus_trio.admission import GateClosed

    outcomes: list[str] = []

    async def consumer() -> None:
        try:
            await claims.next(ALL, object())
        except GateClosed:
            outcomes.append("closed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        claims.close()
    assert outcomes == ["closed", "closed"]
    claims.add(1, SHARED)
    with pytest.raises(GateClosed):
        await claims.next(ALL, object())


async def test_low_water_is_the_lowest_unsettled_sort_key(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    assert claims.low_water() == 1  # nothing seen yet
    claims.add_many([(1, SHARED), (2, SYSTEM), (3, SHARED)])
    owner = object()
    claims.take(ALL, owner)  # 1 leased
    assert claims.low_water() == 1
    claims.begin_ack(1, owner)
    assert claims.low_water() == 1  # an ack not yet durable still holds it
    claims.finish_ack(1)
    assert claims.low_water() == 2
    claims.take(ALL, owner)  # 2
    claims.nack(2, owner, delay=5.0)
    assert claims.low_water() == 2  # a delayed nack holds it
    claims.take(ALL, owner)  # 3
    claims.begin_ack(3, owner)
    claims.finish_ack(3)
    assert claims.low_water() == 2
    await trio.sleep(6)
    delivery = claims.take(ALL, owner)
    assert delivery is not None and delivery.sort_key == 2
    claims.begin_ack(2, owner)
    claims.finish_ack(2)
    assert claims.low_water() == 4  # all settled: one past the last seen
