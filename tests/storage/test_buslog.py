from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from cmdbus_trio.protocol.trace import TraceContext
from cmdbus_trio.storage import StoreState, StoreUnavailable
from cmdbus_trio.storage.buslog import MAX_READ_MANY, BusEntry, BusLog, Published, Settlements

from ..helpers import watch_the_write_lock


@pytest.fixture
def log(tmp_path: Path) -> Iterator[BusLog]:
    opened = BusLog.open(tmp_path / "commands.sqlite3")
    yield opened
    opened.close()


def entry(
    n: int = 0, msg_id: str | None = None, subject: str = "commands.shared.shard.0"
) -> BusEntry:
    return BusEntry(subject, f'{{"execution_id":{n},"payload":"{{}}"}}', msg_id)


def test_sort_keys_ascend_from_1(log: BusLog) -> None:
    assert log.last_sort_key == 0
    results = log.publish([entry(1), entry(2, subject="commands.system.shard.0")])
    assert results == [
        Published(1, "commands.shared.shard.0", False),
        Published(2, "commands.system.shard.0", False),
    ]
    assert log.publish([entry(3)])[0].sort_key == 3
    assert log.last_sort_key == 3
    stored = log.read_after(1, 10)
    assert [(r.sort_key, r.subject) for r in stored] == [
        (2, "commands.system.shard.0"),
        (3, "commands.shared.shard.0"),
    ]
    assert stored[0].record == '{"execution_id":2,"payload":"{}"}'


def test_sort_keys_survive_reopen_and_are_never_reused(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    log = BusLog.open(path)
    log.publish([entry(), entry(), entry()])
    log.close()
    raw = sqlite3.connect(path)
    raw.execute("DELETE FROM records WHERE sort_key = 3")
    raw.commit()
    raw.close()
    log = BusLog.open(path)
    assert log.last_sort_key == 3
    assert log.publish([entry()])[0].sort_key == 4
    log.close()


@attrs.define
class Clocks:
    """A wall clock and a monotonic clock: time passes on both; a step moves the wall
    clock alone; a restart may start the monotonic clock anywhere."""

    wall: float = 1000.0
    monotonic: float = 50.0

    def passes(self, seconds: float) -> None:
        self.wall += seconds
        self.monotonic += seconds

    def open(self, path: Path, window: float) -> BusLog:
        return BusLog.open(
            path, dedup_window=window, wall_clock=lambda: self.wall,
            monotonic=lambda: self.monotonic,
        )  # fmt: skip


def test_msg_id_dedup_within_the_window_survives_restart(tmp_path: Path) -> None:
    clocks, path = Clocks(), tmp_path / "c.sqlite3"
    log = clocks.open(path, 120.0)
    first = log.publish([entry(1, "m-1")])[0]
    assert log.publish([entry(1, "m-1")])[0] == Published(first.sort_key, first.subject, True)
    log.close()
    clocks.passes(60)
    clocks.monotonic = 7.0  # another process
    log = clocks.open(path, 120.0)
    assert log.publish([entry(1, "m-1")])[0].duplicate  # still in the window after a restart
    clocks.passes(61)  # 121 s after the first publish: out of the window
    again = log.publish([entry(1, "m-1")])[0]
    assert not again.duplicate and again.sort_key == first.sort_key + 1
    log.close()


@pytest.mark.parametrize("step", [86_400.0, -86_400.0])
def test_a_wall_clock_stepped_while_the_log_is_open_changes_no_msg_ids_age(
    tmp_path: Path, step: float
) -> None:
    """Forward: an id is not forgotten inside its window; back: not kept past it."""
    clocks = Clocks()
    log = clocks.open(tmp_path / "c.sqlite3", 120.0)
    first = log.publish([entry(1, "m-1")])[0]
    clocks.wall += step
    clocks.passes(119)
    assert log.publish([entry(1, "m-1")])[0].sort_key == first.sort_key
    clocks.passes(2)
    assert not log.publish([entry(1, "m-1")])[0].duplicate
    log.close()


def test_a_wall_clock_set_back_across_a_restart_keeps_ids_no_longer_than_their_window(
    tmp_path: Path,
) -> None:
    clocks, path = Clocks(), tmp_path / "c.sqlite3"
    log = clocks.open(path, 120.0)
    first = log.publish([entry(1, "m-1")])[0]
    log.close()
    clocks.passes(30)
    clocks.wall -= 86_400.0  # set back a day while the writer was down: counts as no time
    log = clocks.open(path, 120.0)
    clocks.passes(119)
    assert log.publish([entry(1, "m-1")])[0].sort_key == first.sort_key
    clocks.passes(2)  # 121 s of the writer's running time since the first publish
    assert not log.publish([entry(1, "m-1")])[0].duplicate
    log.close()


def test_dedup_within_one_batch(log: BusLog) -> None:
    results = log.publish([entry(1, "x"), entry(1, "x"), entry(2)])
    assert [(r.sort_key, r.duplicate) for r in results] == [(1, False), (1, True), (2, False)]


def test_expired_msg_ids_are_pruned(tmp_path: Path) -> None:
    clocks = Clocks()
    log = clocks.open(tmp_path / "c.sqlite3", 10.0)
    log.publish([entry(i, f"m{i}") for i in range(50)])
    clocks.passes(100)
    log.publish([entry()])
    log.close()
    count = (
        sqlite3.connect(tmp_path / "c.sqlite3")
        .execute("SELECT COUNT(*) FROM msg_ids")
        .fetchone()[0]
    )
    assert count == 0


def test_a_failed_batch_stores_nothing(log: BusLog) -> None:
    def fail() -> None:
        raise RuntimeError("crash before commit")

    log.before_commit = fail
    with pytest.raises(RuntimeError):
        log.publish([entry(), entry()])
    log.before_commit = None
    assert log.read_after(0, 10) == []
    assert log.last_sort_key == 0


def test_io_error_poisons(log: BusLog) -> None:
    def io_error() -> None:
        error = sqlite3.OperationalError("disk I/O error")
        error.sqlite_errorcode = 10  # type: ignore[attr-defined]
        raise error

    log.before_commit = io_error
    with pytest.raises(StoreUnavailable, match="commands store is poisoned"):
        log.publish([entry()])
    assert log.state is StoreState.POISONED


def test_publishes_from_many_threads(log: BusLog) -> None:
    keys: list[int] = []
    lock = threading.Lock()

    def publish() -> None:
        for _ in range(50):
            key = log.publish([entry()])[0].sort_key
            with lock:
                keys.append(key)

    threads = [threading.Thread(target=publish) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(keys) == list(range(1, 301))


def test_positions_prune_acks_and_start_the_reload(log: BusLog) -> None:
    log.publish([entry(i) for i in range(10)])
    log.commit(done=Settlements(acks=[("commands", key) for key in (1, 2, 3, 5)]))
    assert [key for key, *_ in log.unsettled("commands", 0, 100)] == [4, 6, 7, 8, 9, 10]
    # 1-3 settled: their acks are not needed
    log.commit(done=Settlements(positions=[("commands", 4)]))
    assert log.settled_below("commands") == 4
    with log._connection() as connection:
        acks = connection.execute("SELECT sort_key FROM acks ORDER BY sort_key").fetchall()
    assert acks == [(5,)]
    assert [key for key, *_ in log.unsettled("commands", 0, 100)] == [4, 6, 7, 8, 9, 10]
    log.commit(done=Settlements(positions=[("commands", 2)]))  # a position never goes back
    assert log.settled_below("commands") == 4
    assert log.settled_below("someone-else") == 0


def test_read_many_reads_the_keys_that_exist(log: BusLog) -> None:
    log.publish([entry(1), entry(2), entry(3)])
    records = log.read_many([3, 1, 99])
    assert sorted(records) == [1, 3]
    assert records[3].record == '{"execution_id":3,"payload":"{}"}'
    assert log.read_many([]) == {}


def test_read_many_refuses_more_than_its_bound(log: BusLog) -> None:
    assert log.read_many(list(range(1, MAX_READ_MANY + 1))) == {}
    with pytest.raises(ValueError, match=f"at most {MAX_READ_MANY} sort keys"):
        log.read_many(list(range(MAX_READ_MANY + 1)))


def test_delivery_counts_are_kept_until_the_record_settles(log: BusLog) -> None:
    log.publish([entry(i) for i in range(6)])
    log.commit(done=Settlements(counts=[("commands", key, key) for key in range(1, 7)]))
    # the latest count wins
    log.commit(done=Settlements(counts=[("commands", 1, 4), ("other", 1, 9)]))
    counts = {key: count for key, _, count in log.unsettled("commands", 0, 100)}
    assert counts == {1: 4, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}
    assert [c for k, _, c in log.unsettled("other", 0, 100) if k == 1] == [9]
    log.commit(done=Settlements(acks=[("commands", 2)], dead=[("commands", 3, 3)]))
    log.commit(done=Settlements(positions=[("commands", 5)]))  # 1-4 settled for "commands"
    with log._connection() as connection:
        rows = connection.execute(
            "SELECT consumer, sort_key FROM deliveries ORDER BY consumer, sort_key"
        ).fetchall()
    assert rows == [("commands", 5), ("commands", 6), ("other", 1)]


def test_the_logs_counts_change_under_the_write_lock(log: BusLog) -> None:
    """The committer's appends and retention's deletes, in two threads, both change the
    record count: each change is made under the write lock."""
    held = watch_the_write_lock(log)
    log.commit([entry(1), entry(2)])
    log.evict(1)
    assert len(held) == 2 and all(held)
    assert log.records == 1


def test_trace_context_is_stored_beside_the_record_and_survives_reopen(tmp_path: Path) -> None:
    """Issue 49, item 1: every read a delivery is made from returns the context the record
    was published with (None for one published without), also after a restart."""
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    traced = TraceContext(parent, 'a=1,b="2"')
    opened = BusLog.open(tmp_path / "commands.sqlite3")
    plain, with_state, parent_only = (
        entry(1),
        attrs.evolve(entry(2), trace=traced),
        attrs.evolve(entry(3), trace=TraceContext(parent)),
    )
    opened.publish([plain, with_state, parent_only])
    opened.commit(done=Settlements(dead=[("commands", 2, 5)]))
    opened.close()
    log = BusLog.open(tmp_path / "commands.sqlite3")
    try:
        expected = {1: None, 2: traced, 3: TraceContext(parent)}
        assert {r.sort_key: r.trace for r in log.read_after(0, 10)} == expected
        assert {k: r.trace for k, r in log.read_many([1, 2, 3]).items()} == expected
        assert [getattr(log.read(k), "trace", "gone") for k in (1, 2, 3)] == [*expected.values()]
        assert [(d.sort_key, d.trace) for page in log.iter_dead("commands") for d in page] == [
            (2, traced)
        ]
        texts = [e.record for e in (plain, with_state, parent_only)]
        assert [r.record for r in log.read_after(0, 10)] == texts  # the text untouched
    finally:
        log.close()


def test_a_store_made_before_trace_context_opens_and_takes_it(tmp_path: Path) -> None:
    """An older store's records table has no trace columns: opening adds them; its
    records read as published without context, and new ones keep theirs."""
    path = tmp_path / "commands.sqlite3"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE records (sort_key INTEGER PRIMARY KEY AUTOINCREMENT, "
        "subject TEXT NOT NULL, record TEXT NOT NULL)"
    )
    old.execute("INSERT INTO records (subject, record) VALUES ('commands.shared.shard.0', '{}')")
    old.commit()
    old.close()
    log = BusLog.open(path)
    try:
        traced = TraceContext("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        log.publish([attrs.evolve(entry(2), trace=traced)])
        assert [(r.sort_key, r.record, r.trace) for r in log.read_after(0, 10)] == [
            (1, "{}", None),
            (2, entry(2).record, traced),
        ]
    finally:
        log.close()


def test_only_reads_that_reach_traced_records_read_the_trace_columns(tmp_path: Path) -> None:
    """Two more columns on every body read cost a claim+ack 5%: a log reads them only for
    keys in the range where it stored trace context, which an append widens before it
    returns and a reopen finds again (the partial index). Reads on either side of the
    range, and across it, are as correct as before."""
    traced = TraceContext("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    path = tmp_path / "commands.sqlite3"
    log = BusLog.open(path)
    try:
        log.publish([entry(n) for n in range(1, 4)])
        assert log._traced is None and log._columns(1, 3) == "sort_key, subject, record"
        log.publish(
            [attrs.evolve(entry(4, msg_id="m"), trace=traced), entry(5), entry(6, msg_id="m")]
        )  # the third is a duplicate of the first: no record, nothing traced
        log.publish([attrs.evolve(entry(7), trace=traced), entry(8)])
        assert log._traced == (4, 6)
        assert log._columns(1, 3) == "sort_key, subject, record"
        assert log._columns(7, 9) == "sort_key, subject, record"
        assert "traceparent" in log._columns(1, 4) and "traceparent" in log._columns(6, 100)
        expected = {1: None, 2: None, 3: None, 4: traced, 5: None, 6: traced, 7: None}
        assert {k: r.trace for k, r in log.read_many([1, 2, 3, 4, 5, 6, 7]).items()} == expected
        assert [log.read(k).trace for k in (3, 4)] == [None, traced]  # type: ignore[union-attr]
        assert [r.trace for r in log.read_after(6, 10)] == [None]
        assert [r.trace for r in log.read_after(0, 10)] == list(expected.values())
    finally:
        log.close()
    reopened = BusLog.open(path)
    try:
        assert reopened._traced == (4, 6)
        assert reopened.read_many([4])[4].trace == traced
    finally:
        reopened.close()
