"""Retention (issue 17): a bus log deletes what no one needs any more, in bounded steps,
never sooner than its window, keeping its ages across restarts, never reusing a sort key,
and giving the space back to the file system."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import trio

from cmdbus_trio.bus import Bus
from cmdbus_trio.bus.retention import RetentionPolicy
from cmdbus_trio.client.trio import SubscribeClient
from cmdbus_trio.config import Config
from cmdbus_trio.protocol.trace import TraceContext
from cmdbus_trio.storage.buslog import (
    RETENTION_BATCH,
    BusEntry,
    BusLog,
    Retained,
    Settlements,
    Windows,
)

from ..helpers import frame_client, metric_sum, metrics_text, publish_to_log, serving


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def open_log(path: Path, clock: Clock) -> BusLog:
    return BusLog.open(path, name="commands", wall_clock=clock)


def publish(log: BusLog, count: int, size: int = 10) -> list[int]:
    return publish_to_log(log, count, subject="commands.shared.x", size=size)


def keys(log: BusLog) -> list[int]:
    return [r.sort_key for r in log.read_after(0, 100_000)]


def retain(log: BusLog, **policy: Any) -> Retained:
    options: dict[str, Any] = {
        "consumers": {"commands": 0},
        "keep_settled": 10.0,
        "keep_published": None,
        "keep_dead": 100.0,
        "mark_every": 1.0,
    }
    return log.retain(Windows(**(options | policy)))


def test_an_acked_command_goes_after_its_window_a_dead_letter_after_its_own(
    tmp_path: Path, clock: Clock
) -> None:
    log = open_log(tmp_path / "commands.sqlite3", clock)
    publish(log, 10)
    log.commit(
        done=Settlements(acks=[("commands", k) for k in range(1, 6)], dead=[("commands", 6, 3)])
    )
    log.commit(done=Settlements(dead=[("commands", 7, 3)]))
    log.commit(done=Settlements(dead_moves=[("commands", 7, True)]))  # requeued: owed, not settled
    log.commit(done=Settlements(positions=[("commands", 8)]))  # 8, 9, 10 are still queued
    assert retain(log) == Retained(records=0, dead_letters=0, more=False)
    clock.now += 9.9  # within the window: kept
    assert retain(log).records == 0
    clock.now += 0.2  # the first mark (settled below 8) is now 10.1 s old
    assert retain(log) == Retained(records=5, dead_letters=0, more=False, through=5)
    assert log.deleted_through == 5
    assert keys(log) == [6, 7, 8, 9, 10] and log.records == 5
    clock.now += 100  # the dead letter's window has passed
    assert retain(log) == Retained(records=0, dead_letters=1, more=False)
    assert retain(log).records == 1  # then its record, no one needing it any more
    assert keys(log) == [7, 8, 9, 10]
    assert list(log.iter_dead("commands")) == []
    log.close()


def test_an_event_goes_once_every_group_settled_it_and_its_window_passed(
    tmp_path: Path, clock: Clock
) -> None:
    log = BusLog.open(tmp_path / "events.sqlite3", name="events", wall_clock=clock)
    for group in ("fast", "slow"):
        log.create_group(group, 0)
    publish(log, 10)
    log.commit(done=Settlements(positions=[("fast", 11), ("slow", 4)]))
    events = {"consumers": None, "keep_settled": None, "keep_published": 10.0}
    assert retain(log, **events).records == 0  # younger than the window
    clock.now += 11
    assert retain(log, **events).records == 3  # the slow group settled 1..3 only
    log.commit(done=Settlements(positions=[("slow", 11)]))
    assert retain(log, **events).records == 7
    publish(log, 2)
    for group in ("fast", "slow"):
        log.commit(done=Settlements(dropped=[group]))
    clock.now += 5
    assert retain(log, **events).records == 0  # no group: kept for the window
    clock.now += 11
    assert retain(log, **events).records == 2
    log.close()


def test_a_group_created_after_retention_starts_after_what_it_deleted(
    tmp_path: Path, clock: Clock
) -> None:
    """Found by the system-level test: a group made from the beginning was handed a
    deleted record (its key was still in the shared tail) and answered `internal`."""
    log = BusLog.open(tmp_path / "events.sqlite3", name="events", wall_clock=clock)
    log.create_group("old", 0)
    publish(log, 5)
    log.commit(done=Settlements(positions=[("old", 6)]))
    events = {"consumers": None, "keep_settled": None, "keep_published": 0.0}
    assert retain(log, **events) == Retained(records=5, dead_letters=0, more=False, through=5)
    assert log.create_group("new", 0) == 5
    assert log.create_group("newer", 7) == 7  # a later start stays
    log.close()
    log = BusLog.open(tmp_path / "events.sqlite3", name="events", wall_clock=clock)
    assert log.deleted_through == 5 and log.create_group("after-restart", 0) == 5
    log.close()


def test_sort_keys_are_never_reused_after_the_log_was_emptied_and_reopened(
    tmp_path: Path, clock: Clock
) -> None:
    path = tmp_path / "commands.sqlite3"
    log = open_log(path, clock)
    publish(log, 5)
    log.commit(
        done=Settlements(acks=[("commands", k) for k in range(1, 6)], positions=[("commands", 6)])
    )
    assert retain(log, keep_settled=0.0).records == 5
    assert keys(log) == [] and log.records == 0
    log.close()
    log = open_log(path, clock)
    assert log.last_sort_key == 5 and log.records == 0
    assert publish(log, 1) == [6]
    log.close()


def test_a_step_deletes_a_bounded_batch_and_says_when_there_is_more(
    tmp_path: Path, clock: Clock
) -> None:
    log = open_log(tmp_path / "commands.sqlite3", clock)
    total = 2 * RETENTION_BATCH + 7
    publish(log, total)
    log.commit(done=Settlements(positions=[("commands", total + 1)]))
    steps = [retain(log, keep_settled=0.0) for _ in range(3)]
    assert [(s.records, s.more) for s in steps] == [
        (RETENTION_BATCH, True),
        (RETENTION_BATCH, True),
        (7, False),
    ]
    log.close()


def test_marks_stay_bounded_and_survive_a_restart(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "commands.sqlite3"
    log = open_log(path, clock)
    publish(log, 3)
    log.commit(
        done=Settlements(acks=[("commands", k) for k in (1, 2, 3)], positions=[("commands", 4)])
    )
    retain(log)  # marks: settled below 4, now
    log.close()
    clock.now += 10.5  # the writer was down meanwhile: the mark in the log still counts
    log = open_log(path, clock)
    assert retain(log).records == 3
    for _ in range(200):
        clock.now += 1
        retain(log)
    with sqlite3.connect(path) as connection:
        (marks,) = connection.execute("SELECT count(*) FROM marks").fetchone()
    assert marks <= 12  # the 10 s window at one mark a second, and the one before it
    log.close()


def test_deleted_records_give_their_space_back(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "commands.sqlite3"
    log = open_log(path, clock)
    assert log.returns_space
    total = 4000
    for _ in range(4):
        publish(log, total // 4, size=1000)
    log.commit(done=Settlements(positions=[("commands", total + 1)]))
    checkpoint(path)
    full = log.disk_bytes()
    while retain(log, keep_settled=0.0).more:
        pass
    while log.vacuum_step(2048):
        pass
    checkpoint(path)
    assert log.disk_bytes() < full / 4, (log.disk_bytes(), full)
    log.close()


def test_a_checkpointed_wal_is_cut_back_to_its_limit(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cmdbus_trio.storage import _sqlite

    limit = 64 * 1024  # small, to see it; 64 MiB in the writer
    monkeypatch.setattr(_sqlite, "WAL_SIZE_LIMIT", limit)
    log = open_log(tmp_path / "commands.sqlite3", clock)
    wal = tmp_path / "commands.sqlite3-wal"
    for _ in range(8):
        publish(log, 100, size=1000)  # the WAL grows past the limit
    assert wal.stat().st_size > limit
    checkpoint(tmp_path / "commands.sqlite3", mode="PASSIVE")
    publish(log, 1)  # the next write starts the WAL over, cut back to the limit
    assert wal.stat().st_size <= limit
    log.close()


def test_a_wal_larger_than_its_database_is_trimmed_after_the_vacuum(
    tmp_path: Path, clock: Clock
) -> None:
    """A drained backlog: the database shrinks back, and the WAL, kept at its high-water
    mark by SQLite, is cut to nothing by the vacuum step that follows (the data dir
    returns near its size before the backlog). A WAL smaller than its database (a steady
    rate) is left alone."""
    from cmdbus_trio.storage import _sqlite

    path = tmp_path / "commands.sqlite3"
    wal = tmp_path / "commands.sqlite3-wal"
    log = open_log(path, clock)
    for _ in range(2):  # the database holds them, the WAL is reused: a steady rate
        publish(log, 2000, size=1000)
        checkpoint(path, mode="PASSIVE")
    log.commit(done=Settlements(positions=[("commands", 4001)]))
    before = wal.stat().st_size
    assert before > _sqlite.WAL_TRIM_FLOOR
    log.vacuum_step(1)
    assert wal.stat().st_size == before < path.stat().st_size  # left alone
    while retain(log, keep_settled=0.0).more:
        pass
    while log.vacuum_step(2048):
        pass
    assert wal.stat().st_size == 0
    assert log.disk_bytes() < 600_000, log.disk_bytes()
    publish(log, 1)  # it goes on writing
    log.close()


def test_a_trim_waits_for_a_reader_no_longer_than_its_wait(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader still on the WAL (an open read transaction, held far longer than the
    trim's wait): the trim gives up after its wait, and the next, once the reader is
    done, trims."""
    from cmdbus_trio.storage import _sqlite

    monkeypatch.setattr(_sqlite, "WAL_TRIM_FLOOR", 0)
    monkeypatch.setattr(_sqlite, "WAL_TRIM_WAIT_MS", 20)
    path = tmp_path / "commands.sqlite3"
    log = open_log(path, clock)
    publish(log, 10, size=1000)
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM sqlite_schema").fetchone()  # holds a snapshot
    publish(log, 300, size=1000)  # past the database's size, after the reader's snapshot
    started = time.monotonic()
    assert not log._trim_wal()
    assert time.monotonic() - started < 5  # its wait, not the 30 s busy timeout
    reader.execute("COMMIT")
    reader.close()
    assert log._trim_wal()
    assert (tmp_path / "commands.sqlite3-wal").stat().st_size == 0
    log.close()


def test_a_store_made_before_auto_vacuum_keeps_its_size_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "commands.sqlite3"
    with sqlite3.connect(path) as connection:  # an old file: tables, no auto_vacuum
        connection.execute("CREATE TABLE old (x)")
    log = BusLog.open(path)
    assert not log.returns_space
    assert log.vacuum_step(100) == 0
    log.close()


def test_a_bus_log_made_before_retention_opens_and_keeps_its_dead_letters_a_window(
    tmp_path: Path, clock: Clock
) -> None:
    path = tmp_path / "commands.sqlite3"
    with sqlite3.connect(path) as connection:  # the old schema: a dead table without died_at
        connection.execute(
            "CREATE TABLE dead (consumer TEXT NOT NULL, sort_key INTEGER NOT NULL, "
            "deliveries INTEGER NOT NULL, PRIMARY KEY (consumer, sort_key)) WITHOUT ROWID"
        )
        connection.execute("INSERT INTO dead VALUES ('commands', 3, 5)")
    log = open_log(path, clock)
    clock.now += 99  # within the dead letter's window, counted from this open
    assert retain(log).dead_letters == 0
    clock.now += 2
    assert retain(log).dead_letters == 1
    log.close()


def checkpoint(path: Path, mode: str = "TRUNCATE") -> None:
    with sqlite3.connect(path) as connection:
        connection.execute(f"PRAGMA wal_checkpoint({mode})")


def test_marks_are_noted_at_most_a_thousandth_of_the_longest_window_apart() -> None:
    week = 7 * 86_400.0
    events = RetentionPolicy(keep_settled=None, keep_published=week, keep_dead=week, interval=10)
    assert events.mark_every == week / 1000
    commands = RetentionPolicy(keep_settled=3600, keep_published=None, keep_dead=week, interval=10)
    assert commands.mark_every == 10


RETENTION = {
    "CMDBUS_TIER_BIND": "",
    "CMDBUS_CMD_KEEP_ACKED_MS": "300",
    "CMDBUS_EVT_RETENTION_MS": "300",
    "CMDBUS_DEAD_RETENTION_MS": "300",
    "CMDBUS_RETENTION_INTERVAL_MS": "50",
    "CMDBUS_MAX_DELIVER": "1",
    "CMDBUS_EVT_GROUPS": "fast,slow",
}


@pytest.mark.once
async def test_a_writer_deletes_what_its_windows_let_go_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    """Every window set small, every wait longer than its window: acked commands and a
    dead letter go; events stay while one group lags, then go; a restart after the log
    emptied hands out the next sort key."""
    with trio.fail_after(60):
        with serving(tmp_path, **RETENTION) as (process, ports):
            commands = [{"execution_id": n, "payload": json.dumps({"n": n})} for n in range(20)]
            events = [
                {"execution_id": n, "payload": json.dumps({"event_type": "e"})} for n in range(5)
            ]
            async with frame_client(ports["cmd_ingest"]) as ingest:
                reply = await ingest.request("publish_batch", records=commands)
                command_keys = reply["sort_keys"]
            async with frame_client(ports["evt_ingest"]) as ingest:
                await ingest.request("publish_batch", records=events)
            async with frame_client(ports["cmd_claim"]) as claim:
                for n, _ in enumerate(command_keys):
                    delivery = (await claim.request("next", filter=">", timeout_ms=2000))[
                        "delivery"
                    ]
                    op = "nack" if n == 0 else "ack"  # max_deliver 1: the first one dies
                    assert (await claim.request(op, sort_key=delivery["sort_key"]))["ok"]
            async with frame_client(ports["evt_claim"]) as claim:
                for _ in events:
                    delivery = (
                        await claim.request("next", filter=">", group="fast", timeout_ms=2000)
                    )["delivery"]
                    await claim.request("ack", sort_key=delivery["sort_key"], group="fast")
                await trio.sleep(1.5)  # five times every window
                text = metrics_text(ports)
                assert records(text, "commands") == 0
                assert retained(text, "commands", "records") == 20
                assert retained(text, "commands", "dead_letters") == 1
                assert records(text, "events") == 5  # the slow group has settled none
                for _ in events:
                    delivery = (
                        await claim.request("next", filter=">", group="slow", timeout_ms=2000)
                    )["delivery"]
                    await claim.request("ack", sort_key=delivery["sort_key"], group="slow")
                await trio.sleep(1.5)
                text = metrics_text(ports)
                assert records(text, "events") == 0
                assert metric_sum(text, 'cmdbus_store_bytes{store="commands"}') > 0
                capacity = metric_sum(text, "cmdbus_data_dir_capacity_bytes ")
                assert 0 < metric_sum(text, "cmdbus_data_dir_free_bytes ") <= capacity
            # A subscriber replaying from before what was deleted is told so first.
            async with frame_client(ports["evt_subscribe"]) as subscriber:
                first = await subscriber.request("subscribe", **{"from": 0})
                assert first == {"id": 1, "ok": True, "records": [], "deleted_through": 5}
            async with frame_client(ports["evt_claim"]) as claim:  # a group made now
                first = await claim.request(
                    "next", filter=">", group="late", timeout_ms=100, **{"from": "beginning"}
                )
                assert first == {"id": 1, "ok": True, "delivery": None, "deleted_through": 5}
                again = await claim.request("next", filter=">", group="late", timeout_ms=100)
                assert again == {"id": 2, "ok": True, "delivery": None}
            async with await SubscribeClient.connect(ports["evt_subscribe"]) as client:
                async for batch in client.subscribe(0):
                    assert (list(batch), batch.deleted_through) == ([], 5)
                    break
            async with await SubscribeClient.connect(ports["evt_subscribe"]) as client:
                with trio.move_on_after(0.5):  # after what was deleted: nothing to say
                    async for batch in client.subscribe(5):
                        raise AssertionError(f"nothing is kept after 5, got {batch}")
            process.terminate()
            process.wait(timeout=20)
        with serving(tmp_path, **RETENTION) as (_, ports):
            async with frame_client(ports["cmd_ingest"]) as ingest:
                reply = await ingest.request("publish_batch", records=commands[:1])
                assert reply["sort_keys"] == [command_keys[-1] + 1], reply


def records(text: str, store: str) -> float:
    return metric_sum(text, f'cmdbus_store_records{{store="{store}"}}')


def retained(text: str, store: str, kind: str) -> float:
    return metric_sum(text, f'cmdbus_retention_deleted_total{{kind="{kind}",store="{store}"}}')


def test_an_idle_execution_is_found_and_deleted_only_while_still_idle(
    tmp_path: Path, clock: Clock
) -> None:
    from cmdbus_trio.storage.tier import NewRecord, TierStore

    store = TierStore.open(tmp_path / "tier.sqlite3", wall_clock=clock)
    store.append_batch("eventlog", "old", [NewRecord("{}"), NewRecord("{}")])
    clock.now += 5
    store.append("eventlog", "fresh", NewRecord("{}"))
    assert store.idle_executions("eventlog", 3.0, 10) == ["old"]
    assert store.delete_execution("eventlog", "fresh", idle_for=3.0) == 0  # not idle: kept
    store.append("eventlog", "old", NewRecord("{}"))  # active again before the deletion
    assert store.delete_execution("eventlog", "old", idle_for=3.0) == 0
    clock.now += 4
    assert sorted(store.idle_executions("eventlog", 3.0, 10)) == ["fresh", "old"]
    assert store.delete_execution("eventlog", "old", idle_for=3.0) == 3
    store.close()


def test_a_record_appended_while_its_execution_is_deleted_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cmdbus_trio.storage import tier as tier_module
    from cmdbus_trio.storage.tier import NewRecord, TierStore

    class AppendingBetweenBatches(TierStore):
        appended: ClassVar[list[int]] = []

        def _write(self, work: Any, **options: Any) -> Any:
            result = super()._write(work, **options)
            if not self.appended and work.__name__ == "step":  # after the first batch
                self.appended.append(self.append("eventlog", "e", NewRecord("{}")).global_sequence)
            return result

    monkeypatch.setattr(tier_module, "DELETE_BATCH", 2)
    store = AppendingBetweenBatches.open(tmp_path / "tier.sqlite3")
    store.append_batch("eventlog", "e", [NewRecord("{}") for _ in range(5)])
    assert store.delete_execution("eventlog", "e") == 5
    kept = [r.global_sequence for page in store.iter_execution("eventlog", "e") for r in page]
    assert kept == store.appended == [6]
    assert store.execution_count("eventlog", "e") == 1
    store.close()


def test_a_tier_store_made_before_tier_retention_counts_its_executions_from_now(
    tmp_path: Path, clock: Clock
) -> None:
    from cmdbus_trio.storage.tier import TierStore

    path = tmp_path / "tier.sqlite3"
    with sqlite3.connect(path) as connection:  # the old schema: no last_at
        for tier in ("eventlog", "projection", "catalog"):
            connection.execute(
                f"CREATE TABLE {tier}_executions (execution_id TEXT PRIMARY KEY, "
                "record_count INTEGER NOT NULL) WITHOUT ROWID"
            )
        connection.execute("INSERT INTO eventlog_executions VALUES ('old', 0)")
    store = TierStore.open(path, wall_clock=clock)
    assert store.idle_executions("eventlog", 10.0, 10) == []  # a whole window from now
    clock.now += 11
    assert store.idle_executions("eventlog", 10.0, 10) == ["old"]
    store.close()


@pytest.mark.once
async def test_a_tier_with_a_window_deletes_idle_executions_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    """The eventlog tier with a 300 ms window, the others without: an execution idle
    longer goes, one appended to all along and every execution of the other tiers stay."""
    settings = {
        "CMDBUS_TIER_EVENTLOG_RETENTION_MS": "300",
        "CMDBUS_RETENTION_INTERVAL_MS": "50",
    }
    with trio.fail_after(60), serving(tmp_path, **settings) as (_, ports):
        async with frame_client(ports["tier"]) as tier:
            await tier.request("append_batch", execution_id="idle", payloads=["1", "2"])
            await tier.request("append", execution_id="idle", tier="catalog", payload="{}")
            for _ in range(15):  # 1.5 s: five windows, "busy" never idle for one
                await tier.request("append", execution_id="busy", payload="{}")
                await trio.sleep(0.1)
            gone = await tier.request("read_execution", execution_id="idle")
            busy = await tier.request("read_execution", execution_id="busy")
            catalog = await tier.request("read_execution", execution_id="idle", tier="catalog")
        assert (gone["exists"], busy["record_count"], catalog["record_count"]) == (False, 15, 1)
        assert retained(metrics_text(ports), "tier", "records") == 2


async def test_retention_skips_a_poisoned_store_and_the_writer_stays_live(
    make_config: Callable[..., Config],
) -> None:
    """A poisoned store fails readiness and waits for the operator's restart; retention
    must not turn it into a crashed task (which fails liveness and restarts a writer that
    still serves reads)."""
    from ..helpers import get, running_writer

    binds = {f"{face}_bind": "127.0.0.1:0" for face in ("cmd_ingest", "evt_ingest", "tier")}
    config = make_config(
        liveness_window_ms=300,
        retention_interval_ms=10,
        tier_eventlog_retention_ms=1,
        **binds,
    )
    with trio.fail_after(20):
        async with running_writer(config) as (writer, addresses):
            for store in writer._stores.values():
                (store.log if isinstance(store, Bus) else store.store)._poisoned = "injected"
            await trio.sleep(1.0)  # a hundred passes, three liveness windows
            assert (await get(addresses["control"], "/livez")).status == 200
            readyz = (await get(addresses["control"], "/readyz")).json()
            assert not [r for r in readyz["reasons"] if "crashed" in r]
            assert any("poisoned" in r for r in readyz["reasons"])


def test_trace_context_stays_with_the_records_retention_keeps(tmp_path: Path, clock: Clock) -> None:
    """Issue 49, item 1: a record's trace context lives and goes with it: the settled
    ones are deleted, the space returned (the vacuum step), and the kept ones still carry
    theirs."""
    log = open_log(tmp_path / "commands.sqlite3", clock)
    contexts = [TraceContext(f"00-{n:032x}-{n:016x}-01", f"k={n}") for n in range(1, 11)]
    log.publish(
        [
            BusEntry("commands.shared.x", json.dumps({"n": n}), trace=c)
            for n, c in enumerate(contexts)
        ]
    )
    log.commit(done=Settlements(acks=[("commands", k) for k in range(1, 6)]))
    log.commit(done=Settlements(positions=[("commands", 6)]))
    retain(log)
    clock.now += 11
    assert retain(log).records == 5
    while log.vacuum_step(1000):
        pass
    assert {r.sort_key: r.trace for r in log.read_after(0, 100)} == dict(
        zip(range(6, 11), contexts[5:], strict=True)
    )
    log.close()


def test_with_litestream_checkpointing_the_store_never_checkpoints_itself(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CMDBUS_CHECKPOINTS=litestream: no automatic checkpoint (3 MB written, the
    database file still holds none of it: all is in the WAL, for Litestream to copy and
    checkpoint) and no trim; its twin, the writer's own mode, does both."""
    from cmdbus_trio.storage import _sqlite

    monkeypatch.setattr(_sqlite, "WAL_TRIM_FLOOR", 0)
    for mode, autocheckpoint in (("litestream", 0), ("writer", 1000)):
        path = tmp_path / mode / "commands.sqlite3"
        wal = path.with_name(path.name + "-wal")
        log = BusLog.open(path, name="commands", wall_clock=clock, checkpoints=mode)
        with log._connection() as connection:
            assert connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == autocheckpoint
        publish(log, 3000, size=1000)  # past an automatic checkpoint's 1,000 pages
        checkpointed = path.stat().st_size > 1 << 20
        assert checkpointed is (mode == "writer"), (mode, path.stat().st_size)
        log.commit(done=Settlements(positions=[("commands", 3001)]))
        while retain(log, keep_settled=0.0).more:  # the database shrinks below its WAL
            pass
        before = wal.stat().st_size
        assert log._trim_wal() is (mode == "writer")
        assert (wal.stat().st_size == before) is (mode == "litestream")
        log.close()
    with pytest.raises(ValueError, match="checkpoints must be writer or litestream"):
        BusLog(tmp_path / "x.sqlite3", checkpoints="sometimes")
