"""The election rules (cmdbus_trio/ha/elector.py) with a clock the test moves: who may
take the lease and when, how long a primary holds it, and the synchronous standby's
rules. Times are seconds; the lease lasts 5."""

from __future__ import annotations

import pytest

from cmdbus_trio.ha.elector import Elector, Intent, SyncMode
from cmdbus_trio.ha.lease import LeaseRecord, Versioned

DURATION = 5.0


class Store:
    """A lease store in memory, with the compare-and-swap the real ones have."""

    def __init__(self) -> None:
        self.current: Versioned | None = None
        self.writes = 0

    def write(self, intent: Intent) -> str | None:
        version = None if self.current is None else self.current.version
        if intent.version != version:
            return None
        self.writes += 1
        self.current = Versioned(intent.record, str(self.writes))
        return self.current.version


def turn(elector: Elector, store: Store, now: float) -> Intent | None:
    """One driver turn: read, decide, write (at once: the write starts at ``now``)."""
    elector.observe(store.current, now)
    intent = elector.intent(now, wall=1000 + now)
    if intent is None:
        return None
    version = store.write(intent)
    if version is None:
        elector.conflicted()
        return None
    elector.wrote(intent, version, started=now, now=now)
    return intent


def test_the_first_member_creates_the_lease_at_epoch_1() -> None:
    store, a = Store(), Elector("a", DURATION, faces={"ha": "127.0.0.1:7000"})
    intent = turn(a, store, 0.0)
    assert intent is not None and intent.acquiring and intent.version is None
    assert intent.record == LeaseRecord(
        "a", 1, 5000, renewed_at=1000.0, in_sync=None, last_primary="a",
        faces={"ha": "127.0.0.1:7000"},
    )  # fmt: skip
    assert a.holds(0.0) and a.epoch == 1 and a.primary == "a"


def test_a_primary_whose_renewals_fail_stops_before_a_standby_may_take_over() -> None:
    store, a, b = Store(), Elector("a", DURATION), Elector("b", DURATION)
    turn(a, store, 0.0)
    assert turn(b, store, 0.5) is None  # b sees version 1 first at 0.5
    intent = turn(a, store, 1.0)  # a renews (same epoch)
    assert intent is not None and not intent.acquiring and intent.record.epoch == 1
    assert turn(b, store, 1.2) is None  # b sees version 2 at 1.2: expires at 6.2 for b
    # a's renewals fail from now on (it cannot reach the store): it holds until
    # 1.0 + 5 - 1 (its margin), and b may take over from 6.2 on.
    assert a.margin == 1.0
    assert a.holds(4.99) and not a.holds(5.0)
    b.observe(store.current, 6.1)
    assert b.intent(6.1, 0) is None and not b.expired(6.1)
    assert b.expired(6.2)


def test_a_standby_in_sync_takes_an_expired_lease_at_the_next_epoch() -> None:
    store, a, b = Store(), Elector("a", DURATION), Elector("b", DURATION)
    turn(a, store, 0.0)
    synced = a.change_sync(0.1, 1000.1, "b")
    assert synced is not None and store.write(synced) is not None
    a.wrote(synced, store.current.version, started=0.1, now=0.1)  # type: ignore[union-attr]
    assert turn(b, store, 0.2) is None
    c = Elector("c", DURATION)  # a member the lease does not name in sync
    assert turn(c, store, 0.2) is None and turn(c, store, 5.2) is None
    assert turn(b, store, 5.19) is None  # not expired by b's clock
    taken = turn(b, store, 5.2)
    assert taken is not None and taken.acquiring
    assert (taken.record.holder, taken.record.epoch) == ("b", 2)
    assert taken.record.in_sync is None and taken.record.last_primary == "b"
    a.observe(store.current, 5.3)
    assert not a.holds(5.3)  # deposed: another holds it
    assert turn(a, store, 5.3) is None  # a is not in sync: it waits, as a standby


def test_a_standby_not_in_sync_never_takes_over_by_itself() -> None:
    store, a, b = Store(), Elector("a", DURATION), Elector("b", DURATION)
    turn(a, store, 0.0)  # in_sync: none
    for now in (1.0, 10.0, 100.0):
        assert turn(b, store, now) is None
    assert not b.may_take()
    b.forced = True  # an operator's forced promotion
    taken = turn(b, store, 101.0)
    assert taken is not None and taken.record.epoch == 2


def test_a_forced_promotion_still_waits_for_the_lease_to_expire() -> None:
    store, a, b = Store(), Elector("a", DURATION), Elector("b", DURATION)
    b.forced = True
    turn(a, store, 0.0)
    for now in (1.0, 2.0, 3.0, 4.0):
        turn(a, store, now - 0.5)  # a renews: never expired for b
        assert turn(b, store, now) is None


def test_with_sync_off_any_member_takes_an_expired_lease() -> None:
    store = Store()
    a, b = Elector("a", DURATION, SyncMode.OFF), Elector("b", DURATION, SyncMode.OFF)
    turn(a, store, 0.0)
    assert a.change_sync(0.1, 0, "b").record.in_sync is None  # type: ignore[union-attr]
    assert turn(b, store, 1.0) is None
    taken = turn(b, store, 6.0)
    assert taken is not None and taken.record.holder == "b"


def test_the_last_primary_takes_its_lease_back_when_none_was_in_sync() -> None:
    """The primary restarts on its own disk (a new elector): the lease names it and no
    standby in sync; it serves again at once, at a new epoch; the standby waits."""
    store, a, b = Store(), Elector("a", DURATION), Elector("b", DURATION)
    turn(a, store, 0.0)
    restarted = Elector("a", DURATION)
    again = turn(restarted, store, 2.0)
    assert again is not None and again.acquiring and again.record.epoch == 2
    assert turn(b, store, 30.0) is None  # long expired for b: still not its to take


def test_a_member_with_an_empty_data_dir_takes_no_lease_written_before() -> None:
    store = Store()
    fresh = Elector("a", DURATION, empty=True)
    assert turn(fresh, store, 0.0) is not None  # the lease's first write: nothing to lose
    replaced = Elector("a", DURATION, empty=True)  # its disk lost, then restarted
    assert turn(replaced, store, 1.0) is None
    assert turn(replaced, store, 60.0) is None
    replaced.forced = True
    assert turn(replaced, store, 61.0) is None  # nothing of the shard: force is no help


def test_a_hand_over_lets_the_standby_in_sync_take_the_lease_at_once() -> None:
    store, a, b = Store(), Elector("a", DURATION), Elector("b", DURATION)
    turn(a, store, 0.0)
    synced = a.change_sync(0.1, 0, "b")
    assert synced is not None and store.write(synced)
    a.wrote(synced, store.current.version, started=0.1, now=0.1)  # type: ignore[union-attr]
    turn(b, store, 0.2)
    a.release()
    released = turn(a, store, 0.3)
    assert released is not None and released.record.holder is None
    assert released.record.faces == {} and released.record.in_sync == "b"
    assert not a.holds(0.3)
    taken = turn(b, store, 0.4)  # not waiting out the duration
    assert taken is not None and taken.record.epoch == 2
    assert turn(a, store, 0.5) is None  # a released it: nothing more to write


def test_a_primary_released_with_none_in_sync_is_waited_for() -> None:
    store, a, b = Store(), Elector("a", DURATION), Elector("b", DURATION)
    turn(a, store, 0.0)
    a.release()
    turn(a, store, 0.5)
    assert turn(b, store, 1.0) is None and turn(b, store, 20.0) is None
    back = turn(Elector("a", DURATION), store, 21.0)  # a, restarted
    assert back is not None and back.record.epoch == 2  # the epoch grows, same member


def test_sync_changes_only_while_the_lease_is_held() -> None:
    store, a = Store(), Elector("a", DURATION)
    assert a.change_sync(0.0, 0, "b") is None
    turn(a, store, 0.0)
    assert a.change_sync(3.9, 0, "b") is not None
    assert a.change_sync(4.0, 0, "b") is None  # past its own deadline: it may not act
    a.conflicted()
    assert not a.holds(0.1)


def test_a_lease_duration_must_be_positive() -> None:
    with pytest.raises(ValueError, match="duration must be positive"):
        Elector("a", 0)
