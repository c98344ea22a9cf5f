"""When a primary may acknowledge (cmdbus_trio/ha/sync.py), on trio's MockClock with a
source and a keeper the test drives: the order of the lease's writes against the
acknowledgements is the point of each test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs
import pytest
import trio
import trio.testing

from cmdbus_trio.ha.elector import SyncMode
from cmdbus_trio.ha.sync import SYNC_TIMEOUT, Synchronizer, Unavailable


@attrs.define
class FakeSource:
    epoch: int = 1
    sequence: int = 0
    confirmed: int = -1
    standby: str | None = None


@attrs.define
class FakeKeeper:
    primary: bool = True
    lease_writable: bool = True
    log: list[str] = attrs.Factory(list)
    """What happened, in order: lease writes and acknowledgements."""
    sync: Synchronizer | None = None
    epoch: int = 1

    def is_primary(self) -> bool:
        return self.primary

    async def record_sync(self, standby: str | None) -> bool:
        await trio.sleep(0.01)  # a write takes a moment
        assert self.sync is not None
        self.log.append(f"lease in_sync={standby} (counting on {self.sync.counting_on})")
        return self.lease_writable and self.primary


@attrs.define
class Pair:
    sync: Synchronizer
    source: FakeSource
    keeper: FakeKeeper
    outcomes: dict[int, Exception | None] = attrs.Factory(dict)

    def commit(self, sequence: int) -> None:
        self.source.sequence = max(self.source.sequence, sequence)

        def done(outcome: Exception | None) -> None:
            self.outcomes[sequence] = outcome
            self.keeper.log.append(f"{sequence}: {'acked' if outcome is None else outcome}")

        self.sync.when_durable(sequence, done)

    def confirm(self, sequence: int) -> None:
        self.source.confirmed = sequence
        self.sync.poke()


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def pair(nursery: trio.Nursery, mode: SyncMode) -> Pair:
    source, keeper = FakeSource(), FakeKeeper()
    sync = Synchronizer(mode, source, keeper)
    keeper.sync = sync
    await nursery.start(sync.run)
    return Pair(sync, source, keeper)


async def in_sync(p: Pair) -> None:
    """The standby connects and has confirmed all there is."""
    p.source.standby = "b"
    p.confirm(p.source.sequence)
    await trio.sleep(0.1)
    assert p.sync.counting_on == "b"


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as n:
        yield n
        n.cancel_scope.cancel()


async def test_off_and_on_without_a_standby_acknowledge_at_once_strict_does_not(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    off, on, strict = [
        await pair(nursery, mode) for mode in (SyncMode.OFF, SyncMode.ON, SyncMode.STRICT)
    ]
    for p in (off, on, strict):
        p.commit(1)
    assert off.outcomes == {1: None} and on.outcomes == {1: None}
    assert isinstance(strict.outcomes[1], Unavailable)
    assert "no standby is in sync" in str(strict.outcomes[1])


async def test_a_caught_up_standby_is_counted_on_before_the_lease_says_so(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    p = await pair(nursery, SyncMode.ON)
    p.commit(1)  # alone: none in sync yet
    await in_sync(p)
    assert p.keeper.log == ["1: acked", "lease in_sync=b (counting on b)"]
    p.commit(2)
    await trio.sleep(0.5)
    assert 2 not in p.outcomes  # it waits for the standby
    p.confirm(2)
    assert p.outcomes[2] is None  # at once, as the confirmation comes


async def test_a_standby_that_stops_confirming_is_recorded_out_of_sync_before_acks_go_alone(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The standby confirms nothing for longer (1.5 s) than the timeout (1 s)."""
    p = await pair(nursery, SyncMode.ON)
    await in_sync(p)
    p.keeper.log.clear()
    start = trio.current_time()
    p.commit(1)
    p.commit(2)
    await trio.sleep(SYNC_TIMEOUT * 1.5)
    assert p.keeper.log == ["lease in_sync=None (counting on None)", "1: acked", "2: acked"]
    assert p.sync.counting_on is None
    assert trio.current_time() - start >= SYNC_TIMEOUT
    p.commit(3)  # alone now, at once
    assert p.outcomes[3] is None
    p.sync.poke()  # (as the lease's turns do)
    await trio.sleep(SYNC_TIMEOUT * 1.5)  # still connected, close behind, confirming nothing:
    assert p.sync.counting_on is None  # not counted on again (each ack would wait 1 s)
    p.confirm(3)  # it confirms again
    await trio.sleep(0.1)
    assert p.sync.counting_on == "b"


async def test_strict_answers_unavailable_when_the_standby_stops(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    p = await pair(nursery, SyncMode.STRICT)
    await in_sync(p)
    p.commit(1)
    await trio.sleep(SYNC_TIMEOUT * 1.5)
    assert isinstance(p.outcomes[1], Unavailable)
    assert p.keeper.log[-2] == "lease in_sync=None (counting on None)"


async def test_a_deposed_primary_that_cannot_write_the_lease_acknowledges_nothing(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    p = await pair(nursery, SyncMode.ON)
    await in_sync(p)
    p.keeper.lease_writable = False  # another member took the lease
    p.commit(1)
    await trio.sleep(SYNC_TIMEOUT * 1.5)
    assert isinstance(p.outcomes[1], Unavailable)
    assert "cannot record in the lease" in str(p.outcomes[1])
    p.keeper.primary = False
    p.sync.poke()
    p.commit(2)
    assert isinstance(p.outcomes[2], Unavailable) and "not primary" in str(p.outcomes[2])


async def test_a_standby_whose_connection_ends_is_dropped_without_waiting_out_the_timeout(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    p = await pair(nursery, SyncMode.ON)
    await in_sync(p)
    p.commit(1)
    start = trio.current_time()
    p.source.standby = None
    p.sync.poke()
    while 1 not in p.outcomes:
        await trio.sleep(0.01)
    assert p.outcomes[1] is None and trio.current_time() - start < SYNC_TIMEOUT / 2


async def test_commits_waiting_when_the_role_is_lost_are_not_acknowledged(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    p = await pair(nursery, SyncMode.ON)
    await in_sync(p)
    p.commit(1)
    p.keeper.primary = False
    p.sync.poke()
    await trio.sleep(0.1)
    assert isinstance(p.outcomes[1], Unavailable)


async def test_a_synchronizer_of_an_earlier_epoch_writes_nothing_to_the_lease(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The member lost its lease and took it again (a new epoch, its own new source):
    what the old synchronizer still holds is not acknowledged, and it never records a
    standby in sync for an epoch whose acknowledgements do not wait for it."""
    p = await pair(nursery, SyncMode.ON)
    p.commit(1)
    p.keeper.epoch = 2  # taken again
    p.source.standby = "b"
    p.confirm(1)
    await trio.sleep(0.5)
    assert p.sync.counting_on is None
    assert not any(line.startswith("lease in_sync=b") for line in p.keeper.log)
    p.commit(2)
    assert isinstance(p.outcomes[2], Unavailable)


async def test_a_stopping_primary_settles_its_last_commits_before_its_committers_stop(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """``settled`` returns once no commit waits: at the confirmation, or (the standby
    silent for longer than the timeout) once the primary went on alone; never later than
    twice the timeout."""
    p = await pair(nursery, SyncMode.ON)
    start = trio.current_time()
    await p.sync.settled()  # nothing waits
    assert trio.current_time() == start
    await in_sync(p)
    p.commit(1)

    async def confirm_later() -> None:
        await trio.sleep(0.3)
        p.confirm(1)

    nursery.start_soon(confirm_later)
    start = trio.current_time()
    await p.sync.settled()
    assert p.outcomes[1] is None and trio.current_time() - start == pytest.approx(0.3)
    p.commit(2)  # never confirmed
    start = trio.current_time()
    await p.sync.settled()
    assert p.outcomes[2] is None  # acknowledged alone, once the lease said so
    assert SYNC_TIMEOUT <= trio.current_time() - start < SYNC_TIMEOUT * 2


class Stuck:
    """A committer that never goes quiet (its task stopped with tickets queued)."""

    async def wait_quiet(self) -> None:
        await trio.sleep_forever()


async def test_a_committer_that_never_goes_quiet_holds_settled_for_its_budget_no_longer(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """``settled`` waits for the committers first, within the same budget: twice the
    sync timeout, however long the committer would take (forever here)."""
    p = await pair(nursery, SyncMode.ON)
    start = trio.current_time()
    with trio.fail_after(SYNC_TIMEOUT * 3):
        await p.sync.settled([Stuck()])
    assert trio.current_time() - start == pytest.approx(SYNC_TIMEOUT * 2)


async def test_a_standby_under_a_steady_load_is_recorded_in_sync(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A commit is always on its way: when a confirmation comes, a newer commit has been
    made. The standby is counted on once it is close behind, and the lease names it once
    it has confirmed all that was acknowledged without it."""
    p = await pair(nursery, SyncMode.ON)
    p.source.standby = "b"
    for n in range(1, 40):
        p.commit(n + 1)  # the next one, before...
        p.confirm(n)  # ...the confirmation of the one before
        await trio.sleep(0.01)
    assert p.sync.in_sync and "lease in_sync=b (counting on b)" in p.keeper.log
    assert 40 not in p.outcomes  # it waits for the standby, which has not confirmed it
    p.confirm(40)
    assert all(outcome is None for outcome in p.outcomes.values()) and len(p.outcomes) == 39
