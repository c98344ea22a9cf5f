"""The pages each write transaction committed, read back from the store's WAL: what a
standby needs to hold the same database (the replication's unit, docs/architecture.md).

SQLite appends a committed transaction to the WAL as frames (sqlite.org/fileformat.html,
"WAL File Format"): a 24-byte header (page number; for the transaction's last frame, the
database's size in pages; the WAL's two salts; a checksum) and the page. A tap reads the
frames a commit appended, right after it, under the store's write lock, so transactions
come out in commit order and whole. When a checkpoint has copied the WAL back, the next
transaction starts the WAL again from its header with new salts; frames of the earlier
generation may still follow in the file, and the salts tell them apart. Frames past the
last commit frame are a rolled-back transaction's (its pages spilled early): never taken.

Another process may write and checkpoint the store too (Litestream does both: its own
tables, and checkpoints of its own). A checkpoint that copied the whole WAL back lets the
next writer start the WAL again over frames the tap has not read yet, so the tap holds a
read transaction of its own (the barrier) from before each commit until it has read it:
while a reader uses the WAL, SQLite checkpoints no frame it may need and starts no WAL
again, so the commit's frames stay where the tap reads them. A checkpoint the writer's
connection runs inside the commit (``wal_autocheckpoint``) stops at the barrier too, so
the tap checkpoints once it let go, as the writer would have, when it checkpoints.

Reading a file the same thread just wrote is served from the page cache; the tap costs
a ``pread`` per transaction and the barrier's three statements, and copies the pages once.
"""

from __future__ import annotations

import os
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path

import attrs

WAL_HEADER = struct.Struct(">IIIIII")  # magic, version, page size, checkpoint no, salts
FRAME_HEADER = struct.Struct(">IIII")  # page number, size after commit (or 0), salts
FRAME_HEADER_BYTES = 24
WAL_MAGIC = (0x377F0682, 0x377F0683)


Failed = Callable[[Exception], None]


@attrs.frozen
class Committed:
    """One write transaction's pages, in the order written (a later frame of a page
    replaces an earlier one), and the database's size in pages after it."""

    store: str
    page_size: int
    pages: tuple[tuple[int, bytes], ...]
    database_pages: int


READ_FRAMES = 64
"""Frames a read asks for at once (256 KiB of 4 KiB pages): a commit's are usually a few."""
CHECKPOINT_FRAMES = 1000
"""WAL frames past which the tap checkpoints (when the writer checkpoints): SQLite's
``wal_autocheckpoint`` default, which the barrier keeps from ever finishing."""


class WalTap:
    """Reads what each commit of a store appended to its WAL and hands it to
    ``committed``. Attach it before the snapshot a standby starts from is taken: its
    first read takes the whole current generation of the WAL, which holds no page
    older than that snapshot does (the rest is in the database file)."""

    def __init__(
        self,
        store: str,
        database: Path,
        committed: Callable[[Committed], None],
        failed: Failed,
        *,
        checkpoints: bool = True,
    ) -> None:
        self.store = store
        self.wal_path = database.with_name(database.name + "-wal")
        self.committed = committed
        self.failed = failed
        self.checkpoints = checkpoints
        """Whether the tap checkpoints a WAL past :data:`CHECKPOINT_FRAMES` (when the
        writer checkpoints the store, not Litestream)."""
        self._salts: tuple[int, int] | None = None  # the generation read so far
        self._offset = 0  # where its next frame starts
        self._page_size = 0
        self._file: int | None = None
        # (Opened in the thread that attaches, used by whichever holds the write lock.)
        self._barrier = sqlite3.connect(database, isolation_level=None, check_same_thread=False)

    def before_commit(self) -> None:
        """Called under the write lock before a write transaction: the barrier up."""
        try:
            self._barrier.execute("BEGIN")
            self._barrier.execute("SELECT count(*) FROM sqlite_schema").fetchone()
        except sqlite3.Error as exc:  # (no barrier: the tap may miss this commit)
            self._barrier.rollback()
            self.failed(exc)

    def after_commit(self) -> None:
        """Called under the write lock once a transaction committed (or failed to): its
        frames read, the barrier down. A WAL that cannot be read goes to ``failed``: the
        commit stands, the follower must start again."""
        try:
            found = self.read()
        except (OSError, ValueError) as exc:
            self.failed(exc)
            found = None
        finally:
            self._barrier.rollback()  # (a no-op without a transaction)
        if found is not None:
            self.committed(found)
        if self.checkpoints and self._offset > CHECKPOINT_FRAMES * (
            FRAME_HEADER_BYTES + self._page_size
        ):
            self._checkpoint()

    def _checkpoint(self) -> None:
        """A passive checkpoint, as ``wal_autocheckpoint`` runs: the next writer starts the
        WAL again once it finished (busy: the next commit tries again)."""
        try:
            self._barrier.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            self.failed(exc)

    def read(self) -> Committed | None:
        """The frames committed since the last read (None: none)."""
        if self._file is None:
            try:
                self._file = os.open(self.wal_path, os.O_RDONLY)
            except FileNotFoundError:
                return None
        header = os.pread(self._file, WAL_HEADER.size + 8, 0)
        if len(header) < WAL_HEADER.size + 8:
            return None  # truncated by a checkpoint, and nothing written since
        magic, _, page_size, _, salt1, salt2 = WAL_HEADER.unpack_from(header)
        if magic not in WAL_MAGIC:
            raise ValueError(f"{self.wal_path} is not a WAL (magic {magic:#x})")
        if (salt1, salt2) != self._salts:  # a new generation: from its first frame
            self._salts, self._offset = (salt1, salt2), WAL_HEADER.size + 8
            self._page_size = page_size
        frame_bytes = FRAME_HEADER_BYTES + page_size
        pages: list[tuple[int, bytes]] = []
        taken, database_pages = 0, 0  # frames up to the last commit frame, its size
        # A bounded read at a time, not to the end of the file: after a checkpoint the
        # WAL starts again from its top, and the file's tail is an earlier generation's
        # (megabytes a commit would copy only to throw away).
        at, more = self._offset, True
        while more:
            data = os.pread(self._file, READ_FRAMES * frame_bytes, at)
            view = memoryview(data)
            more = len(data) == READ_FRAMES * frame_bytes
            for start in range(0, len(data) - frame_bytes + 1, frame_bytes):
                number, after_commit, salt1, salt2 = FRAME_HEADER.unpack_from(view, start)
                if (salt1, salt2) != self._salts:
                    more = False  # an earlier generation's frame
                    break
                page = bytes(view[start + FRAME_HEADER_BYTES : start + frame_bytes])
                pages.append((number, page))
                if after_commit:
                    taken, database_pages = len(pages), after_commit
            at += len(data)
        if not taken:
            return None
        self._offset += taken * frame_bytes
        return Committed(self.store, page_size, tuple(pages[:taken]), database_pages)

    def close(self) -> None:
        self._barrier.close()
        if self._file is not None:
            os.close(self._file)
            self._file = None
