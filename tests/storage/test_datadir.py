"""The data directory's checks, with the faults a root test process cannot make for real
(root reads and writes any file): a volume mounted without ``fsGroup``, a read-only or
full volume. tests/test_serve.py runs the real ones: a second writer, a store SQLite
cannot open, a path that cannot be created."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.storage import datadir


def test_claim_writes_the_pid_and_a_second_claim_names_it(tmp_path: Path) -> None:
    with datadir.claim(tmp_path / "data") as held:
        assert (tmp_path / "data" / "writer.lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(
            datadir.DataDirError, match=rf"in use by another writer \(pid {os.getpid()}\)"
        ):
            datadir.claim(tmp_path / "data")
        assert held.path == tmp_path / "data"
    datadir.claim(tmp_path / "data").release()  # released: free again


def test_a_directory_this_user_cannot_write_names_the_uid_and_fsgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datadir.os, "access", lambda *args, **kwargs: False)
    with pytest.raises(datadir.DataDirError) as info:
        datadir.claim(tmp_path)
    message = str(info.value)
    assert message.startswith(repr(str(tmp_path)))
    assert f"uid {os.getuid()}" in message and "fsGroup" in message


def test_a_store_this_user_cannot_write_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tier.sqlite3").write_bytes(b"")
    real_access = os.access
    monkeypatch.setattr(
        datadir.os,
        "access",
        lambda path, mode: not str(path).endswith("tier.sqlite3") and real_access(path, mode),
    )
    with pytest.raises(datadir.DataDirError, match=r"tier\.sqlite3 is not readable and writable"):
        datadir.claim(tmp_path)


@pytest.mark.parametrize(
    ("error", "why"),
    [
        (errno.EROFS, "the volume is read-only"),
        (errno.ENOSPC, "the volume is full"),
        (errno.EACCES, "fsGroup"),
        (errno.EIO, "cannot write in it"),
    ],
)
def test_a_volume_that_refuses_the_lock_file_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, why: str
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> int:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(datadir.os, "open", refuse)
    with pytest.raises(datadir.DataDirError, match=why):
        datadir.claim(tmp_path)


def test_the_writer_syncs_the_names_it_creates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's fsync does not make its name durable: the data directory (in its parent),
    the lock and each store's files are named on disk by a directory fsync of the
    writer's own, not left to SQLite's syncing the directory when it makes a WAL."""
    import stat

    from cmdbus_trio.storage.buslog import BusLog

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(datadir.os, "fsync", fsync)
    with datadir.claim(tmp_path / "new" / "data"):
        assert synced == [str(tmp_path / "new"), str(tmp_path / "new" / "data")]
        synced.clear()
        log = BusLog.open(tmp_path / "new" / "data" / "commands.sqlite3")
        log.close()
        assert synced == [str(tmp_path / "new" / "data")]
    synced.clear()
    with datadir.claim(tmp_path / "new" / "data"):  # there already: only the lock's
        assert synced == [str(tmp_path / "new" / "data")]


def test_a_key_floor_is_read_written_and_never_lowered(tmp_path: Path) -> None:
    from cmdbus_trio.storage.keys import KEY_FLOOR_NAME, read_key_floor, write_key_floor

    assert read_key_floor(tmp_path) == 0  # none: nothing restored here
    write_key_floor(tmp_path, 1 << 40)
    write_key_floor(tmp_path, 5)  # never lower
    assert read_key_floor(tmp_path) == 1 << 40
    (tmp_path / KEY_FLOOR_NAME).write_text("12x\n")
    with pytest.raises(datadir.DataDirError, match=r"keys\.floor: '12x' is not a whole number"):
        read_key_floor(tmp_path)


def test_every_key_counter_of_every_store_starts_at_the_floor(tmp_path: Path) -> None:
    """A data dir with only a key floor (a restore whose backup held none of these
    stores): each store the writer makes gives keys past the floor, in every keyed
    table (found by SQLite's own list of them, so a table or store added later is held
    to it too), and reopening changes nothing."""
    import sqlite3

    from cmdbus_trio.storage.buslog import BusLog
    from cmdbus_trio.storage.datadir import STORE_FILES
    from cmdbus_trio.storage.keys import KEYED_TABLES, write_key_floor
    from cmdbus_trio.storage.tier import TierStore

    floor = 1 << 41
    write_key_floor(tmp_path, floor)
    opened = {
        "commands.sqlite3": BusLog,
        "events.sqlite3": BusLog,
        "tier.sqlite3": TierStore,
    }
    assert set(opened) == set(STORE_FILES)  # a new store: say here how it opens
    for _ in range(2):
        for name, store_class in opened.items():
            store_class.open(tmp_path / name).close()
        for name in STORE_FILES:
            with sqlite3.connect(tmp_path / name) as connection:
                tables = [table for (table,) in connection.execute(KEYED_TABLES)]
                counters = dict(connection.execute("SELECT name, seq FROM sqlite_sequence"))
            assert tables, name
            assert all(counters.get(table) == floor for table in tables), (name, counters)
