"""The replication's unit (storage/_wal_tap.py, storage/replica.py): the pages each
commit appended to a store's WAL, taken under the write lock, journaled by a replica and
folded into its copy, give the same database, whatever the store did meanwhile (WAL
generations started again by checkpoints, truncations, a vacuum, retention), and a
replica that stopped mid-journal recovers to its last whole transaction."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest

from cmdbus_trio.storage import _wal_tap
from cmdbus_trio.storage._bus_writes import Settlements
from cmdbus_trio.storage._tier_appends import NewRecord
from cmdbus_trio.storage._wal_tap import Committed
from cmdbus_trio.storage.buslog import BusEntry, BusLog
from cmdbus_trio.storage.replica import Position, Replica, ReplicaError
from cmdbus_trio.storage.tier import TierStore


def dump(path: Path) -> list[str]:
    connection = sqlite3.connect(path)
    try:
        return list(connection.iterdump())
    finally:
        connection.close()


def snapshot(source: Path, target: Path) -> None:
    """A standby's base copy, as SQLite's online backup takes it."""
    with sqlite3.connect(source) as reading, sqlite3.connect(target) as writing:
        reading.backup(writing)
    reading.close()
    writing.close()


def integrity(path: Path) -> str:
    connection = sqlite3.connect(path)
    try:
        return str(connection.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        connection.close()


def journal(replica: Replica, tapped: list[Committed], *, epoch: int) -> None:
    """What the tap handed over since, appended to ``replica`` in order (then forgotten)."""
    for committed in tapped:
        replica.append(Position(epoch, replica.position.sequence + 1), committed)
    tapped.clear()


def bus_work(log: BusLog, rng: random.Random, step: int) -> None:
    """One of what a command bus does, chosen at random, or a checkpoint."""
    choice = rng.random()
    if choice < 0.55:
        body = json.dumps({"n": step, "pad": "x" * rng.randrange(3000)})
        entries = [
            BusEntry(f"commands.p{rng.randrange(5)}", body, msg_id=f"m{rng.randrange(400)}")
            for _ in range(rng.randrange(1, 20))
        ]
        log.publish(entries)
    elif choice < 0.75 and log.last_sort_key:
        keys = rng.sample(range(1, log.last_sort_key + 1), min(10, log.last_sort_key))
        log.commit(done=Settlements(acks=[("commands", key) for key in keys]))
    elif choice < 0.85:
        log.truncate_wal()  # a checkpoint that starts the WAL again from nothing
    elif choice < 0.9:
        log.vacuum_step(64)
    else:
        log.checkpoint_past(0)


@pytest.mark.parametrize(
    ("seed", "lose", "frames"), [(1, None, 64), (2, None, 64), (3, None, 1), (1, 50, 64)]
)
def test_a_replica_of_a_bus_log_holds_what_the_primary_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, lose: int | None, frames: int
) -> None:
    """``lose``: the negative control, a replica that misses one transaction differs.
    ``frames``: the tap's reads at a time (1: every commit takes several reads, and one
    after a checkpoint stops at the earlier generation's tail)."""
    monkeypatch.setattr(_wal_tap, "READ_FRAMES", frames)
    rng = random.Random(seed)
    primary_path, replica_path = tmp_path / "primary.sqlite3", tmp_path / "replica.sqlite3"
    log = BusLog.open(primary_path, name="commands")
    tapped: list[Committed] = []
    failures: list[Exception] = []
    for step in range(30):  # before the standby came: in the base copy
        bus_work(log, rng, step)
    log.attach_tap(tapped.append, failures.append)
    for step in range(30, 40):  # after the tap, before the snapshot
        bus_work(log, rng, step)
    snapshot(primary_path, replica_path)
    replica = Replica.open(replica_path)
    for step in range(40, 200):
        bus_work(log, rng, step)
        while tapped:
            committed = tapped.pop(0)
            if step != lose:
                replica.append(Position(1, replica.position.sequence + 1), committed)
        replica.sync()
        if rng.random() < 0.1:
            replica.fold()
    replica.fold()
    replica.close()
    log.close()
    assert not failures
    if lose is not None:
        try:
            same = integrity(replica_path) == "ok" and dump(replica_path) == dump(primary_path)
        except sqlite3.DatabaseError:  # (malformed, typically)
            same = False
        assert not same
        return
    assert integrity(replica_path) == "ok"
    assert dump(replica_path) == dump(primary_path)


def test_a_replica_of_the_tier_store_holds_what_the_primary_holds(tmp_path: Path) -> None:
    rng = random.Random(7)
    primary_path, replica_path = tmp_path / "tier.sqlite3", tmp_path / "replica.sqlite3"
    tier = TierStore.open(primary_path)
    tapped: list[Committed] = []
    tier.attach_tap(tapped.append, pytest.fail)
    snapshot(primary_path, replica_path)
    replica = Replica.open(replica_path)
    for step in range(150):
        execution = f"e{rng.randrange(20)}"
        if rng.random() < 0.85:
            ids = [f"{step}-{i}" for i in range(rng.randrange(1, 8))]
            pad = "y" * rng.randrange(2000)
            records = [NewRecord(json.dumps({"event_id": id, "x": pad}), event_id=id) for id in ids]
            tier.append_batch("eventlog", execution, records)
        else:
            tier.delete_execution("eventlog", execution)
        if step % 40 == 39:
            tier.truncate_wal()
        journal(replica, tapped, epoch=2)
    replica.sync()
    replica.fold()
    tier.close()
    assert integrity(replica_path) == "ok"
    assert dump(replica_path) == dump(primary_path)
    assert (
        replica.position == Position(2, replica.position.sequence)
        and replica.folded == replica.position
    )


def test_a_replica_stopped_mid_journal_recovers_its_last_whole_transaction(
    tmp_path: Path,
) -> None:
    primary_path, replica_path = tmp_path / "primary.sqlite3", tmp_path / "replica.sqlite3"
    log = BusLog.open(primary_path, name="commands")
    tapped: list[Committed] = []
    log.attach_tap(tapped.append, pytest.fail)
    snapshot(primary_path, replica_path)
    replica = Replica.open(replica_path)
    for n in range(5):
        log.publish([BusEntry("commands.a", json.dumps({"n": n}))])
    expected = dump(primary_path)  # the state after five records
    log.publish([BusEntry("commands.a", json.dumps({"n": 5}))])
    for sequence, committed in enumerate(tapped, start=1):
        replica.append(Position(1, sequence), committed)
    replica.sync()
    replica.close()
    journal = tmp_path / "replica.sqlite3-replica"
    whole = journal.read_bytes()
    # Cut the sixth record short: as if the standby stopped while appending it.
    sizes = []
    offset = 0
    while offset < len(whole):
        length = int.from_bytes(whole[offset + 4 : offset + 8], "big")
        sizes.append(8 + length)
        offset += 8 + length
    journal.write_bytes(whole[: sum(sizes[:5]) + sizes[5] // 2])
    recovered = Replica.open(replica_path)
    assert recovered.position == Position(1, 5)
    assert journal.stat().st_size == 0  # folded
    recovered.close()
    log.close()
    assert integrity(replica_path) == "ok"
    assert dump(replica_path) == expected
    again = Replica.open(replica_path)  # its position survives the empty journal
    assert again.position == Position(1, 5)
    with pytest.raises(ReplicaError, match="does not follow"):
        again.append(Position(1, 5), tapped[-1])
    again.close()


def test_a_damaged_position_file_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "replica.sqlite3-replica.json").write_text("{")
    with pytest.raises(ReplicaError, match=r"replica\.sqlite3-replica\.json is damaged"):
        Replica.open(tmp_path / "replica.sqlite3")


def publish_one(log: BusLog, n: int) -> None:
    log.publish([BusEntry("commands.a", json.dumps({"n": n}), msg_id=f"m{n}")])


@pytest.mark.parametrize("barrier", [True, False])
def test_a_replica_holds_every_commit_while_another_process_checkpoints_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, barrier: bool
) -> None:
    """Litestream writes a table of its own into a store and checkpoints it. Between
    each commit and the tap's read, another connection checkpoints the WAL and writes:
    the tap's barrier keeps the commit's frames for it to read. ``barrier=False``, the
    negative control: the write starts the WAL again over them, and the replica misses
    commits."""
    primary_path, replica_path = tmp_path / "primary.sqlite3", tmp_path / "replica.sqlite3"
    log = BusLog.open(primary_path, name="commands")
    other = sqlite3.connect(primary_path, isolation_level=None, timeout=0)
    other.execute("CREATE TABLE _litestream_seq (id INTEGER PRIMARY KEY, seq INTEGER)")
    tapped: list[Committed] = []
    failures: list[Exception] = []
    log.attach_tap(tapped.append, failures.append)
    snapshot(primary_path, replica_path)
    replica = Replica.open(replica_path)
    if not barrier:
        monkeypatch.setattr(_wal_tap.WalTap, "before_commit", lambda tap: None)
    read = _wal_tap.WalTap.read

    def checkpointed_and_written_meanwhile(tap: _wal_tap.WalTap) -> Committed | None:
        other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        other.execute(
            "INSERT INTO _litestream_seq VALUES (1, 1) ON CONFLICT (id) DO UPDATE SET seq = seq + 1"
        )
        return read(tap)

    monkeypatch.setattr(_wal_tap.WalTap, "read", checkpointed_and_written_meanwhile)
    for n in range(20):
        publish_one(log, n)
        journal(replica, tapped, epoch=1)
    replica.sync()
    replica.fold()
    replica.close()
    other.close()
    log.close()
    assert not failures
    published = "SELECT count(*) FROM records"
    with sqlite3.connect(replica_path) as copy:
        copied = copy.execute(published).fetchone()[0]
    copy.close()
    if barrier:
        assert (integrity(replica_path), copied) == ("ok", 20)
        assert dump(replica_path) == dump(primary_path)
    else:
        assert copied < 20


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_tapped_store_keeps_its_wal_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoints: bool
) -> None:
    """The barrier keeps the checkpoint SQLite runs inside a commit from ever finishing,
    so the tap checkpoints once it let go. ``checkpoints=False``, the negative control:
    the WAL grows by every commit."""
    monkeypatch.setattr(_wal_tap, "CHECKPOINT_FRAMES", 50)
    if not checkpoints:
        monkeypatch.setattr(_wal_tap.WalTap, "_checkpoint", lambda tap: None)
    log = BusLog.open(tmp_path / "primary.sqlite3", name="commands")
    log.attach_tap(lambda committed: None, pytest.fail)
    for n in range(1500):
        publish_one(log, n)
    frames = (log.wal().bytes - 32) // (24 + 4096)
    log.close()
    if checkpoints:
        assert frames < 200
    else:
        assert frames > 1500
