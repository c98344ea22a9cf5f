from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from cmdbus_trio.bus.claims import Claims, Delivery
from cmdbus_trio.metrics import REGISTRY
from cmdbus_trio.protocol.subjects import parse_filter

ALL = parse_filter(">")
SHARED = "commands.shared.shard.0"
SYSTEM = "commands.system.shard.0"


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
    assert claims.next_nowait(ALL, a) == Delivery(1, SHARED, False, 1)
    assert claims.next_nowait(ALL, b) == Delivery(2, SYSTEM, False, 1)
    assert claims.next_nowait(ALL, a) == Delivery(3, SHARED, False, 1)
    assert claims.next_nowait(ALL, b) is None
    assert claims.leased == 3


async def test_filters_pick_subjects(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SYSTEM)])
    assert claims.next_nowait(parse_filter("commands.system.>"), object()) == Delivery(
        2, SYSTEM, False, 1
    )
    assert claims.next_nowait(parse_filter("commands.system.>"), object()) is None
    assert claims.next_nowait(parse_filter("commands.*.shard.0"), object()) == Delivery(
        1, SHARED, False, 1
    )


async def test_expired_leases_are_redelivered_first(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SHARED), (3, SHARED)])
    owner = object()
    claims.next_nowait(ALL, owner)  # 1
    claims.next_nowait(ALL, owner)  # 2
    await trio.sleep(29.9)
    assert claims.next_nowait(ALL, owner) == Delivery(3, SHARED, False, 1)
    await trio.sleep(0.2)  # 1 and 2 expire (30 s); 3 not yet
    assert claims.next_nowait(ALL, owner) == Delivery(1, SHARED, True, 2)
    assert claims.next_nowait(ALL, owner) == Delivery(2, SHARED, True, 2)
    assert claims.next_nowait(ALL, owner) is None


async def test_ack_only_by_the_owner_and_then_never_again(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner, other = object(), object()
    claims.next_nowait(ALL, owner)
    assert not claims.begin_ack(1, other)
    assert not claims.begin_ack(99, owner)
    assert claims.begin_ack(1, owner)
    await trio.sleep(60)  # the lease would have expired: an ack in progress is not redelivered
    assert claims.next_nowait(ALL, owner) is None
    claims.finish_ack(1)
    assert claims.lag() == {}  # only subjects with a backlog are listed
    assert not claims.begin_ack(1, owner)  # already acked


async def test_a_failed_ack_redelivers(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner = object()
    claims.next_nowait(ALL, owner)
    claims.begin_ack(1, owner)
    claims.abort_ack(1)
    assert claims.next_nowait(ALL, owner) == Delivery(1, SHARED, True, 2)


async def test_nack_with_and_without_delay(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SHARED)])
    owner = object()
    claims.next_nowait(ALL, owner)
    claims.next_nowait(ALL, owner)
    assert claims.nack(1, owner)
    assert claims.next_nowait(ALL, owner) == Delivery(1, SHARED, True, 2)
    assert claims.nack(2, owner, delay=5.0)
    assert claims.next_nowait(ALL, owner) is None
    await trio.sleep(5.1)
    assert claims.next_nowait(ALL, owner) == Delivery(2, SHARED, True, 2)
    assert not claims.nack(2, object())


async def test_a_nack_delay_shorter_than_every_lease_is_kept(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    # The timers task sleeps until the soonest lease expiry (30 s) and is woken only for
    # something sooner: this nack's 5 s.
    claims.add_many([(1, SHARED), (2, SHARED)])
    owner = object()
    claims.next_nowait(ALL, owner)
    claims.next_nowait(ALL, owner)
    await trio.sleep(1)  # the timers task has gone to sleep until the leases expire
    assert claims.nack(2, owner, delay=5.0)
    await trio.sleep(5.1)
    assert claims.next_nowait(ALL, owner) == Delivery(2, SHARED, True, 2)
    assert trio.current_time() < 30


async def test_extend_renews_the_lease(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner = object()
    claims.next_nowait(ALL, owner)
    await trio.sleep(20)
    assert claims.extend(1, owner)
    await trio.sleep(20)  # 40 s after delivery, 20 s after the extension
    assert claims.next_nowait(ALL, owner) is None
    await trio.sleep(11)
    assert claims.next_nowait(ALL, owner) == Delivery(1, SHARED, True, 2)
    assert not claims.extend(1, object())


async def test_a_closed_connection_releases_its_leases_at_once(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SHARED), (3, SHARED)])
    gone, staying = object(), object()
    claims.next_nowait(ALL, gone)
    claims.next_nowait(ALL, gone)
    claims.next_nowait(ALL, staying)
    assert claims.release(gone) == 2
    assert claims.next_nowait(ALL, staying) == Delivery(1, SHARED, True, 2)
    assert claims.next_nowait(ALL, staying) == Delivery(2, SHARED, True, 2)


async def test_leases_are_kept_per_owner(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    """A connection's leases are found without walking everyone's: release, and whether
    a connection holds any (it is then not idle)."""
    claims.add_many([(n, SHARED) for n in range(1, 7)])
    a, b = object(), object()
    for owner in (a, b, a, b, a, b):
        claims.next_nowait(ALL, owner)
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
    claims.next_nowait(ALL, owner)
    await trio.sleep(claims.ack_wait + 1)
    assert not claims.holds(owner)
    assert claims.release(owner) == 0


async def test_max_deliver_parks_dead_letters(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner = object()
    for delivery in (1, 2, 3):
        assert claims.next_nowait(ALL, owner) == Delivery(1, SHARED, delivery > 1, delivery)
        await trio.sleep(31)
    assert claims.next_nowait(ALL, owner) is None
    assert claims.dead == [(1, SHARED, 3)]  # type: ignore[attr-defined]
    assert claims.lag() == {}  # dead letters are not backlog


async def test_a_delayed_nack_is_counted_when_it_is_made(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The count goes to the store when the delivery ends (so it survives a restart
    during the delay), once; the last allowed delivery nacked with a delay is dead at
    once, without waiting for its delay."""
    counted: list[tuple[int, int]] = []
    dead: list[tuple[int, str, int]] = []
    claims = Claims(
        "commands",
        ack_wait=30.0,
        max_deliver=2,
        on_dead=lambda *a: dead.append(a),
        on_count=lambda *a: counted.append(a),
    )
    claims.add(1, SHARED)
    owner = object()
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.run_timers)
        claims.next_nowait(ALL, owner)
        assert claims.nack(1, owner, delay=60.0)
        assert counted == [(1, 1)]  # before the delay ends
        await trio.sleep(61)
        assert counted == [(1, 1)]  # not again when it does
        assert claims.next_nowait(ALL, owner) == Delivery(1, SHARED, True, 2)
        assert claims.nack(1, owner, delay=60.0)
        assert dead == [(1, SHARED, 2)]
        await trio.sleep(61)
        assert claims.next_nowait(ALL, owner) is None
        nursery.cancel_scope.cancel()


async def test_lag_counts_undelivered_and_unacked(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SHARED), (3, SYSTEM)])
    owner = object()
    claims.next_nowait(parse_filter(SHARED), owner)
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
    assert claims.next_nowait(ALL, object()) == Delivery(1, SHARED, False, 1)


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
    claims.next_nowait(ALL, owner)  # 1 leased
    assert claims.low_water() == 1
    claims.begin_ack(1, owner)
    assert claims.low_water() == 1  # an ack not yet durable still holds it
    claims.finish_ack(1)
    assert claims.low_water() == 2
    claims.next_nowait(ALL, owner)  # 2
    claims.nack(2, owner, delay=5.0)
    assert claims.low_water() == 2  # a delayed nack holds it
    claims.next_nowait(ALL, owner)  # 3
    claims.begin_ack(3, owner)
    claims.finish_ack(3)
    assert claims.low_water() == 2
    await trio.sleep(6)
    delivery = claims.next_nowait(ALL, owner)
    assert delivery is not None and delivery.sort_key == 2
    claims.begin_ack(2, owner)
    claims.finish_ack(2)
    assert claims.low_water() == 4  # all settled: one past the last seen


# --- nothing costs in proportion to the crowd ----------------------------------------------


class CountingMatches:
    """Counts the subject/filter comparisons the coordinator makes: in the filters'
    indexes, on a tail, and for ``lag``. It patched
    the coordinator's module alone, where a record's way never compares, so it counted 0
    whatever the cost."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from cmdbus_trio.bus import _cursor, _owed, _queues

        self.calls = 0
        real = _queues.matches

        def counting(filter_tokens: tuple[str, ...], subject: str) -> bool:
            self.calls += 1
            return real(filter_tokens, subject)

        for module in (_queues, _cursor, _owed):
            monkeypatch.setattr(module, "matches", counting)


async def park(claims: Claims, nursery: trio.Nursery, filter: str, got: list[Delivery]) -> None:
    async def consumer() -> None:
        got.append(await claims.next(parse_filter(filter), object()))

    nursery.start_soon(consumer)


async def test_a_record_goes_to_the_oldest_matching_waiter_only(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    first: list[Delivery] = []
    later: list[Delivery] = []
    other: list[Delivery] = []
    async with trio.open_nursery() as nursery:
        await park(claims, nursery, "commands.>", first)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(3):
            await park(claims, nursery, "commands.shared.>", later)
        await park(claims, nursery, "commands.system.>", other)
        await trio.testing.wait_all_tasks_blocked()
        claims.add(1, SHARED)
        await trio.testing.wait_all_tasks_blocked()
        assert [d.sort_key for d in first] == [1] and later == []  # the oldest matching
        claims.add_many([(2, SHARED), (3, SHARED)])
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(d.sort_key for d in later) == [2, 3] and other == []
        assert claims.leased == 3
        nursery.cancel_scope.cancel()


async def test_waiters_on_other_filters_cost_a_record_nothing(
    claims: Claims, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 consumers parked on other pools (and 1,000 on one other filter): a record
    for the shared pool is compared with the few filters in use, not with the waiters."""
    got: list[Delivery] = []
    async with trio.open_nursery() as nursery:
        for n in range(1000):
            await park(claims, nursery, f"commands.pool{n % 10}.>", [])
            await park(claims, nursery, "commands.crowd.>", [])
        await park(claims, nursery, "commands.shared.>", got)
        await trio.testing.wait_all_tasks_blocked()
        counting = CountingMatches(monkeypatch)
        claims.add(1, SHARED)
        first_record = counting.calls
        for key in range(2, 102):
            claims.add(key, SHARED)
        await trio.testing.wait_all_tasks_blocked()
        assert 0 < first_record <= 12  # the 12 filters in use, once for the new subject
        assert counting.calls == first_record  # then nothing per record
        assert [d.sort_key for d in got] == [1]
        nursery.cancel_scope.cancel()


async def test_take_does_not_walk_every_subject(
    claims: Claims, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20,000 subjects ever seen, all of them settled: a next is not a walk of them."""
    owner = object()
    claims.add_many((n, f"events.type_{n}") for n in range(1, 20_001))
    for _ in range(20_000):  # every subject drained
        delivery = claims.next_nowait(ALL, owner)
        assert delivery is not None and claims.begin_ack(delivery.sort_key, owner)
        claims.finish_ack(delivery.sort_key)
    claims.add(20_001, SHARED)
    counting = CountingMatches(monkeypatch)
    assert claims.next_nowait(parse_filter("commands.>"), owner) == Delivery(
        20_001, SHARED, False, 1
    )
    assert 0 < counting.calls <= 2  # the new filter's index: built from the one live subject
    assert claims.total == 1


async def test_a_lease_has_one_timer_entry_however_often_extended(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add(1, SHARED)
    owner = object()
    claims.next_nowait(ALL, owner)
    for _ in range(1000):
        await trio.sleep(0.01)
        assert claims.extend(1, owner)
    assert len(claims._leases._expiries) == 1
    await trio.sleep(claims.ack_wait - 1)  # still within the last extension
    assert claims.leased == 1
    await trio.sleep(2)  # past it: redelivered
    assert claims.next_nowait(ALL, object()) == Delivery(1, SHARED, True, 2)


async def test_a_record_handed_to_a_waiter_that_left_goes_to_the_next(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    got: list[Delivery] = []
    async with trio.open_nursery() as nursery:
        leaving = trio.CancelScope()
        nursery.start_soon(_wait_in, claims, leaving, got)
        await trio.testing.wait_all_tasks_blocked()
        await park(claims, nursery, ">", got)
        await trio.testing.wait_all_tasks_blocked()
        claims.add(1, SHARED)  # handed to the first waiter...
        leaving.cancel()  # ...which leaves before it runs
        await trio.testing.wait_all_tasks_blocked()
        assert got == [Delivery(1, SHARED, False, 1)]  # given back, then to the next
        nursery.cancel_scope.cancel()


async def _wait_in(claims: Claims, scope: trio.CancelScope, got: list[Delivery]) -> None:
    with scope:
        got.append(await claims.next(ALL, object()))


async def test_filter_indexes_stay_bounded(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    """An index nobody takes from (a filter used once) does not grow with the traffic,
    and filters used once are forgotten beyond a bound."""
    claims.has(parse_filter("commands.>"))  # used once, never again
    owner = object()
    for n in range(1, 5001):
        claims.add(n, f"commands.shared.shard.{n % 7}")
        delivery = claims.next_nowait(parse_filter("commands.shared.>"), owner)
        assert delivery is not None and claims.begin_ack(delivery.sort_key, owner)
        claims.finish_ack(delivery.sort_key)
    stale = claims._queues.indexes[parse_filter("commands.>")]
    assert len(stale.fresh) <= 2 * 7 + 64
    for n in range(1000):
        claims.has(parse_filter(f"commands.once{n}.>"))
    assert len(claims._queues.indexes) <= 256 + 1


async def test_a_next_that_times_out_leaves_nothing_behind(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    """20,000 ``next`` calls time out, on one filter and on 20,000 distinct ones: no waiter
    stays parked, and the filters' indexes fall back to the idle cap (they used to keep
    every waiter, so an index of only departed waiters was never idle, and every publish
    walked them all)."""
    from cmdbus_trio.bus._queues import MAX_IDLE_FILTERS

    live: list[Delivery] = []
    async with trio.open_nursery() as nursery:
        await park(claims, nursery, "commands.live.>", live)  # a waiter that stays
        for n in range(20_000):
            for filter_text in ("commands.crowd.>", f"commands.pool{n}.>"):
                with trio.move_on_after(0.001):
                    await claims.next(parse_filter(filter_text), object())
        queues = claims._queues
        assert claims._parked.count == 1
        assert sum(len(index.waiters) for index in queues.indexes.values()) == 1
        # the live waiter's, the idle ones kept, and the newest (trimmed when the next comes)
        assert len(queues.indexes) <= 1 + MAX_IDLE_FILTERS + 1
        claims.add(1, "commands.live.shard.0")
        await trio.testing.wait_all_tasks_blocked()
        assert [d.sort_key for d in live] == [1]  # the live waiter was not lost among them
        assert claims._parked.count == 0
        nursery.cancel_scope.cancel()


async def test_a_waiter_that_leaves_is_skipped_and_the_next_oldest_served(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    first: list[Delivery] = []
    second: list[Delivery] = []
    async with trio.open_nursery() as nursery:
        leaving = trio.CancelScope()
        nursery.start_soon(_wait_in, claims, leaving, first)
        await trio.testing.wait_all_tasks_blocked()
        await park(claims, nursery, "commands.>", second)
        await trio.testing.wait_all_tasks_blocked()
        leaving.cancel()
        await trio.testing.wait_all_tasks_blocked()
        claims.add(1, SHARED)
        await trio.testing.wait_all_tasks_blocked()
        assert first == [] and [d.sort_key for d in second] == [1]
        assert claims.leased == 1  # the one that left leased nothing
        nursery.cancel_scope.cancel()


def _delivered(subject: str, family: str = "cmdbus_deliveries_total") -> float:
    return REGISTRY.get_sample_value(family, {"subject": subject}) or 0.0


async def test_next_many_leases_what_next_one_at_a_time_would(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A batch leases the same records, in the same order, with the same delivery counts
    and metrics, as as many single ``next_nowait`` calls: redeliveries first, then fresh
    ones, only what the filter matches, and no more than ``most``."""
    one_by_one = Claims("commands", ack_wait=30.0)
    batched = Claims("commands", ack_wait=30.0)
    system = parse_filter("commands.system.>")
    owner, worker = object(), object()
    for claims in (one_by_one, batched):
        claims.add_many([(n, SYSTEM if n % 3 == 0 else SHARED) for n in range(1, 13)])
        for _ in range(4):  # 1, 2, 3 and 4 are delivered, 2 and 3 given back by a nack
            claims.next_nowait(ALL, worker)
        assert claims.nack(3, worker) and claims.nack(2, worker)
    delivered = _delivered(SHARED), _delivered(SYSTEM)
    again = _delivered(SHARED, "cmdbus_redeliveries_total")
    singles = [one_by_one.next_nowait(ALL, owner) for _ in range(5)]
    singles += [one_by_one.next_nowait(system, owner) for _ in range(3)]
    singles_counted = _delivered(SHARED) - delivered[0], _delivered(SYSTEM) - delivered[1]
    assert _delivered(SHARED, "cmdbus_redeliveries_total") - again == 1  # 2
    many = batched.next_many_nowait(ALL, owner, 5) + batched.next_many_nowait(system, owner, 3)
    assert many == singles[:7]  # the filter matches two more of the system pool's: 9, 12
    assert singles[7] is None
    assert [d.sort_key for d in many] == [2, 3, 5, 6, 7, 9, 12]
    assert [d.redelivered for d in many[:2]] == [True, True]
    assert batched.next_many_nowait(system, owner, 3) == []
    assert (
        _delivered(SHARED) - delivered[0] - singles_counted[0],
        _delivered(SYSTEM) - delivered[1] - singles_counted[1],
    ) == singles_counted
    assert _delivered(SHARED, "cmdbus_redeliveries_total") - again == 2  # 2, twice
    assert batched.leased == one_by_one.leased == 9


async def test_a_batch_taken_through_one_filter_leaves_the_others_right(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    """A batch moves each subject's head in every filter's index: a record it took is
    not offered through another filter, and the subject's next one is."""
    claims.add_many([(n, SYSTEM if n % 3 == 0 else SHARED) for n in range(1, 10)])
    system = parse_filter("commands.system.>")
    assert claims.has(system) and claims.has(ALL)  # both indexes built
    owner = object()
    assert [d.sort_key for d in claims.next_many_nowait(ALL, owner, 4)] == [1, 2, 3, 4]
    assert [d.sort_key for d in claims.next_many_nowait(system, owner, 5)] == [6, 9]
    assert [d.sort_key for d in claims.next_many_nowait(ALL, owner, 9)] == [5, 7, 8]
    assert claims.next_many_nowait(ALL, owner, 9) == []
    assert not claims.has(system)


async def test_a_batch_shares_one_timer_entry_and_comes_back_oldest_first(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    """The leases of one batch expire together, oldest first (to the waiters parked
    longest), whatever order the batch took them in; one extended meanwhile stays."""
    claims.add_many([(1, SYSTEM), (2, SHARED), (3, SHARED), (4, SYSTEM), (5, SHARED), (6, SHARED)])
    worker = object()
    claims.next_nowait(parse_filter(SHARED), worker)  # 2
    assert claims.nack(2, worker)  # 2 comes first in the batch: a redelivery
    batch = claims.next_many_nowait(ALL, worker, 4)
    assert [d.sort_key for d in batch] == [2, 1, 3, 4]
    claims.next_nowait(ALL, worker)  # 5, at the same (mock) instant: an entry of its own
    assert len(claims._leases._expiries) == 3  # 2's first lease, the batch's, 5's
    handed: dict[int, int] = {}  # the waiter (in the order they parked): its record

    async def wait_for_one(waiter: int) -> None:
        handed[waiter] = (await claims.next(ALL, object())).sort_key

    async with trio.open_nursery() as nursery:
        for waiter in range(4):  # parked in this order; 6 goes to the first at once
            nursery.start_soon(wait_for_one, waiter)
            await trio.sleep(1)
        await trio.sleep(10)
        assert claims.extend(3, worker)
        await trio.sleep(claims.ack_wait - 11)  # past the batch's deadline, not 3's
    assert handed == {0: 6, 1: 1, 2: 2, 3: 4}
    assert claims.leased == 4  # 3 still the worker's; 5 and 6 came back, no one waiting
    assert claims.next_nowait(ALL, object()) == Delivery(5, SHARED, True, 2)


async def test_the_acks_of_a_batch_settle_each_record_once(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    claims.add_many([(1, SHARED), (2, SYSTEM), (3, SHARED), (4, SHARED)])
    owner, other = object(), object()
    claims.next_many_nowait(ALL, owner, 3)
    claims.next_nowait(ALL, other)  # 4
    begun = claims.begin_acks([1, 2, 2, 4, 99, 3], owner)
    assert begun == [True, True, False, False, False, True]  # 2 twice, 4 not its, 99 none
    assert claims.lag() == {SHARED: 3, SYSTEM: 1}  # not settled yet
    claims.finish_acks([1, 2, 3])
    assert claims.lag() == {SHARED: 1}
    assert not claims.holds(owner) and claims.holds(other)
    assert claims.begin_acks([1, 4], other) == [False, True]
    assert claims.begin_acks([4], owner) == [False]  # an owner holding nothing


async def test_a_settle_naming_a_lease_settles_only_that_lease(
    claims: Claims, autojump_clock: trio.testing.MockClock
) -> None:
    """A record leased twice to one owner (the first lease lapsed): a settle naming the
    first lease's token is refused and leaves the second alone; one naming the second,
    or no token at all, settles it. Every delivery gets a token of its own."""
    claims.add_many([(1, SHARED), (2, SHARED)])
    owner = object()
    first = claims.next_nowait(ALL, owner)
    assert first is not None and first.lease is not None
    await trio.sleep(31)  # past the ack wait: the lease lapses, the record comes again
    second = claims.next_nowait(ALL, owner)
    assert second is not None and second.sort_key == first.sort_key
    assert second.lease not in (None, first.lease)
    assert not claims.extend(1, owner, first.lease)
    assert not claims.nack(1, owner, 0.0, first.lease)
    assert claims.begin_acks([1], owner, (first.lease,)) == [False]
    assert claims.extend(1, owner, second.lease)
    assert claims.begin_acks([1], owner, (second.lease,)) == [True]
    claims.finish_ack(1)
    other = claims.next_nowait(ALL, owner)
    assert other is not None and other.sort_key == 2 and other.lease != second.lease
    assert claims.begin_acks([2], owner) == [True]  # no token: whatever lease it holds
