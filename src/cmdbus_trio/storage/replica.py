"""A standby's copy of one store: the primary's committed pages, made durable in the
order they were committed, then folded into the database file.

A transaction from the primary (:class:`~._wal_tap.Committed`, with the epoch and the
sequence number the replication gave it) is appended to a journal beside the database,
each record checked by a CRC, and :meth:`Replica.sync` makes the journal durable: that is
when the standby may confirm it. :meth:`Replica.fold` writes the journal's pages into the
database file, makes it durable, records the position folded through, and empties the
journal. Nothing opens the database with SQLite while it is a replica: on promotion the
journal is folded, and the writer opens the file as after any restart.

Recovery (:meth:`Replica.open`): the journal's whole records are folded again (a page
write is the same however often it is done, and the last record's size is applied at
the end), a torn last record is cut off (it was never confirmed: confirmation waits for
:meth:`Replica.sync`). The position is the last whole record's, else the one recorded by
the last fold.

Synchronous and blocking, like every store: the entry points refuse the loop thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import attrs

from ._guard import refuses_loop_thread
from ._sqlite import SqliteStore
from ._wal_tap import Committed
from .datadir import fsync_path

PREFIX = struct.Struct(">II")  # a record's CRC-32 and the length of the rest
HEAD = struct.Struct(">QQII")  # epoch, sequence, database size in pages, pages in it
PAGE_NUMBER = struct.Struct(">I")
JOURNAL_SUFFIX = "-replica"
POSITION_SUFFIX = "-replica.json"


T = TypeVar("T")


class ReplicaError(Exception):
    """The replica cannot go on (its files are not what it wrote); ``str()`` says why."""


@attrs.frozen(order=True)
class Position:
    """How far a replica has the primary's transactions: the epoch of the primary that
    committed the last one, and its sequence number (0, 0: none)."""

    epoch: int = 0
    sequence: int = 0


class Replica:
    def __init__(self, path: Path, page_size: int | None, position: Position) -> None:
        self.path = path
        self.page_size = page_size
        self.position = position
        """The last transaction appended (durable once :meth:`sync` returned)."""
        self.folded = position
        self._journal = os.open(_journal_path(path), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._unfolded = 0  # bytes in the journal

    @classmethod
    @refuses_loop_thread
    def open(cls, path: Path) -> Replica:
        """The replica of the database at ``path`` (its base copy already there),
        recovered: the journal folded in."""
        position = _read_position(path)
        replica = cls(path, None, position)
        replica._unfolded = os.fstat(replica._journal).st_size
        replica.fold()
        return replica

    @refuses_loop_thread
    def append(self, position: Position, committed: Committed) -> None:
        """Journal one transaction (durable after :meth:`sync`). Its position must come
        after the last one's."""
        if position <= self.position:
            raise ReplicaError(f"{self.path.name}: {position} does not follow {self.position}")
        if self.page_size is None:
            self.page_size = committed.page_size
        elif committed.page_size != self.page_size:
            raise ReplicaError(
                f"{self.path.name}: pages of {committed.page_size} bytes, not {self.page_size}"
            )
        body = b"".join((PAGE_NUMBER.pack(number) + page for number, page in committed.pages))
        head = HEAD.pack(
            position.epoch, position.sequence, committed.database_pages, len(committed.pages)
        )
        crc = zlib.crc32(body, zlib.crc32(head))
        record = PREFIX.pack(crc, len(head) + len(body)) + head + body
        os.write(self._journal, record)
        self._unfolded += len(record)
        self.position = position

    @refuses_loop_thread
    def sync(self) -> None:
        """Make every transaction appended so far durable."""
        os.fsync(self._journal)

    @property
    def unfolded_bytes(self) -> int:
        return self._unfolded

    @refuses_loop_thread
    def fold(self) -> None:
        """Write the journal into the database file, durably, and empty it."""
        if self._unfolded == 0:
            return
        last: tuple[Position, int] | None = None  # the last whole record's, its size
        database = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            for position, size, pages, page_size in _records(self._journal):
                if self.page_size is None:
                    self.page_size = page_size
                for number, page in pages:
                    os.pwrite(database, page, (number - 1) * page_size)
                last = (position, size * page_size)
            if last is not None:
                os.ftruncate(database, last[1])
            os.fsync(database)
        finally:
            os.close(database)
        if last is not None:
            self.folded = self.position = max(self.position, last[0])
            _write_position(self.path, self.folded)
        os.ftruncate(self._journal, 0)
        os.fsync(self._journal)
        self._unfolded = 0  # (a torn tail past the whole records goes with the rest)

    def close(self) -> None:
        os.close(self._journal)


@refuses_loop_thread
def install_base(path: Path, copy: Path, position: Position) -> None:
    """Make ``copy`` (a base copy from the primary, durable) the replica at ``path``,
    holding every transaction through ``position``: what the replica had goes (its
    journal, any WAL of a database the member once served)."""
    for stale in (_journal_path(path), path.with_name(path.name + "-wal"),
                  path.with_name(path.name + "-shm")):  # fmt: skip
        stale.unlink(missing_ok=True)
    os.replace(copy, path)
    _write_position(path, position)


@refuses_loop_thread
def snapshot(store: SqliteStore, target: Path, at: Callable[[], T]) -> T:
    """Copy ``store`` to ``target`` (a new file) as of one instant, and return what
    ``at()`` said at that instant: it is called under the store's write lock, as the
    copy's read transaction begins, so the copy holds exactly the commits made before
    (a standby's base copy, and the replication's position then). The copy is SQLite's
    online backup: writers go on meanwhile."""
    with store._connection() as connection:
        with store._write_lock:
            connection.execute("BEGIN")
            connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
            position = at()
        try:
            copy = sqlite3.connect(target)
            try:
                connection.backup(copy)
            finally:
                copy.close()
        finally:
            connection.execute("COMMIT")
    return position


def _records(journal: int) -> Iterator[tuple[Position, int, list[tuple[int, bytes]], int]]:
    """The journal's whole records: each one's position, the database's size in pages
    after it, its pages, and their size. Stops at a torn or damaged record."""
    data = os.pread(journal, os.fstat(journal).st_size, 0)
    offset = 0
    while offset + PREFIX.size <= len(data):
        crc, length = PREFIX.unpack_from(data, offset)
        start, end = offset + PREFIX.size, offset + PREFIX.size + length
        if end > len(data) or zlib.crc32(data[start:end]) != crc or length < HEAD.size:
            return  # torn: appended, never synced, never confirmed
        epoch, sequence, size, count = HEAD.unpack_from(data, start)
        body = memoryview(data)[start + HEAD.size : end]
        if count == 0 or len(body) % count:
            return
        page_size = len(body) // count - PAGE_NUMBER.size
        pages = [
            (PAGE_NUMBER.unpack_from(body, at)[0], bytes(body[at + 4 : at + 4 + page_size]))
            for at in range(0, len(body), page_size + PAGE_NUMBER.size)
        ]
        yield Position(epoch, sequence), size, pages, page_size
        offset = end


def _journal_path(path: Path) -> Path:
    return path.with_name(path.name + JOURNAL_SUFFIX)


def _position_path(path: Path) -> Path:
    return path.with_name(path.name + POSITION_SUFFIX)


def _read_position(path: Path) -> Position:
    try:
        value = json.loads(_position_path(path).read_text())
        return Position(int(value["epoch"]), int(value["sequence"]))
    except FileNotFoundError:
        return Position()
    except (ValueError, KeyError, TypeError) as exc:
        raise ReplicaError(f"{_position_path(path)} is damaged: {exc}") from None


def _write_position(path: Path, position: Position) -> None:
    target = _position_path(path)
    temporary = target.with_name(target.name + ".tmp")
    with open(temporary, "w") as file:
        json.dump(attrs.asdict(position), file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, target)
    fsync_path(path.parent)
