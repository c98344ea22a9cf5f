"""What every SQLite store of the writer shares: a connection pool, one measured write
lock, explicit transactions, and poisoning.

Thread-safe and synchronous. Each call checks a connection out of a fixed pool and puts
it back (WAL lets readers run beside the one writer); a call that finds every connection
out waits for one. The whole pool is opened with the store, and temporary tables and
indexes live in memory, so a store takes every file descriptor it will use at start: a
flood of connections to any face cannot leave it short of one later (a store that could
not open its journal would be poisoned). Writes are serialized by a lock whose wait is
measured, so a contended store is visible. A write that fails leaving the disk state
unknown (I/O error, disk full, corruption, any failure of COMMIT) *poisons* the store:
writes then raise :class:`StoreUnavailable` until the process restarts and reopens it
cleanly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final, Self, TypeVar

from cmdbus_trio import metrics
from cmdbus_trio.logs import event
from cmdbus_trio.metrics import STORE_CONNECTION_WAITS

from ._common import StoreState, StoreUnavailable, WalState
from ._guard import refuses_loop_thread
from ._wal_tap import Committed, Failed, WalTap
from .datadir import fsync_path
from .keys import raise_key_counters, read_key_floor

T = TypeVar("T")

# SQLite primary result codes after which the file's state is unknown: stop writing.
_POISONING_CODES: Final = {
    10,  # SQLITE_IOERR (and its extended codes, whose low byte is 10)
    11,  # SQLITE_CORRUPT
    13,  # SQLITE_FULL
    14,  # SQLITE_CANTOPEN
    26,  # SQLITE_NOTADB
}


log = logging.getLogger(__name__)

WAL_SIZE_LIMIT: Final = 64 << 20
"""Bytes a WAL file is truncated to after a checkpoint."""
BUSY_TIMEOUT_MS: Final = 30_000
"""How long a connection waits for a lock another connection holds."""
WAL_TRIM_FLOOR: Final = 1 << 20
"""A WAL is trimmed (see :meth:`SqliteStore.vacuum_step`) only when larger than this and
than its database."""
WAL_HEADER_BYTES: Final = 32
"""A WAL file's header (sqlite.org/fileformat.html, "WAL File Format")."""
WAL_TRIM_WAIT_MS: Final = 100
"""How long a trim waits for readers still on the WAL before it gives up, until the next."""


class SqliteStore:
    """Base of the stores; subclasses set :attr:`name` and create their schema in
    :meth:`_setup`. Open with :meth:`open`, share between threads, :meth:`close` last."""

    name = "store"

    def __init__(
        self,
        path: Path,
        *,
        synchronous: str = "full",
        checkpoints: str = "writer",
        pool_size: int = 4,
        contention_threshold: float = 0.1,
        contention_memory: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if synchronous not in ("full", "normal"):
            raise ValueError(f"synchronous must be full or normal, got {synchronous!r}")
        if checkpoints not in ("writer", "litestream"):
            raise ValueError(f"checkpoints must be writer or litestream, got {checkpoints!r}")
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        self.checkpoints = checkpoints
        """``litestream``: Litestream checkpoints the WAL, and the store never does (no
        automatic checkpoint, no trim): a checkpoint of the store's own could reset the
        WAL under Litestream's read position, which it then recovers from with a whole
        new snapshot of the database."""
        self.path = path
        self.pool_size = pool_size
        self._synchronous = synchronous.upper()
        self._contention_threshold = contention_threshold
        self._contention_memory = contention_memory
        self._clock = clock
        self._idle: list[sqlite3.Connection] = []
        self._open_connections = 0
        self._pool_lock = threading.Lock()
        self._connection_returned = threading.Condition(self._pool_lock)
        self.connection_waits = 0
        """Calls that found every connection of the pool out and waited for one."""
        self._write_lock = threading.Lock()
        self._closed = False
        self._poisoned: str | None = None
        self._contended_at = -float("inf")
        self._contended_waits = 0
        self._asking: dict[object, float] = {}  # writers waiting for the lock: since when
        self.tap: WalTap | None = None
        """What each commit appended to the WAL goes to, when set (a standby follows)."""
        self.before_commit: Callable[[], None] | None = None
        """Test hook: called inside each write transaction, before COMMIT."""
        self.returns_space = False
        """Whether freed pages can go back to the file system: a file made before
        auto_vacuum was set keeps its size (it reuses its free pages)."""

    @classmethod
    @refuses_loop_thread
    def open(cls, path: Path, **options: object) -> Self:
        """Open (creating if needed) the store at ``path``, with its whole pool.

        Error handling: SQLite's errors (the file cannot be opened or is not a database,
        no descriptor is left for the pool); the store is closed again before they
        propagate."""
        store = cls(path, **options)  # type: ignore[arg-type]
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with store._connection() as connection:
                store._setup(connection)
                if raise_key_counters(connection, read_key_floor(path.parent)):
                    store._setup(connection)  # what it loaded of the counters is stale
                store.returns_space = connection.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
            with contextlib.ExitStack() as checked_out:  # all out at once: all opened
                for _ in range(store.pool_size):
                    checked_out.enter_context(store._connection())
            fsync_path(path.parent)  # the file and its WAL are named on disk
        except BaseException:
            store.close()
            raise
        return store

    def _setup(self, connection: sqlite3.Connection) -> None:
        """Create the schema if needed and load what the store keeps in memory."""

    @refuses_loop_thread
    def close(self) -> None:
        """Close the store's connections; one still in use is closed when it comes back."""
        with self._pool_lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open_connections -= len(idle)
            self._connection_returned.notify_all()  # waiters see the store closed
        for connection in idle:
            connection.close()
        if self.tap is not None:
            with self._write_lock:
                self.tap.close()

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        """A connection for this call (autocommit mode; transactions are explicit).

        Blocks while every connection of the pool is out. No call takes a second one
        while it holds one, so the wait always ends."""
        with self._pool_lock:
            while not self._idle and self._open_connections >= self.pool_size:
                if self._closed:
                    break
                self.connection_waits += 1
                STORE_CONNECTION_WAITS.labels(store=self.name).inc()
                self._connection_returned.wait()
            if self._closed:
                raise StoreUnavailable(f"{self.name} store is closed")
            connection = self._idle.pop() if self._idle else None
            if connection is None:
                self._open_connections += 1
        if connection is None:
            try:
                connection = self._new_connection()
            except BaseException:
                with self._pool_lock:
                    self._open_connections -= 1
                    self._connection_returned.notify()
                raise
        try:
            yield connection
        finally:
            with self._pool_lock:
                keep = not self._closed
                if keep:
                    self._idle.append(connection)
                    self._connection_returned.notify()
                else:
                    self._open_connections -= 1
            if not keep:
                connection.close()

    def _new_connection(self) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
        )
        try:
            # Only a new file takes it (before its first table, and before WAL): freed
            # pages can then go back to the file system (`vacuum_step`).
            connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
            connection.execute("PRAGMA journal_mode=WAL")
            # A checkpointed WAL is cut back to this, not kept at its largest.
            connection.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            connection.execute(f"PRAGMA synchronous={self._synchronous}")
            if self.checkpoints == "litestream":
                connection.execute("PRAGMA wal_autocheckpoint=0")
            # Sorts and statement journals in memory, never in a temp file: no file is
            # opened after start (see the module's docstring).
            connection.execute("PRAGMA temp_store=MEMORY")
            connection.execute("SELECT count(*) FROM sqlite_schema").fetchone()  # opens the WAL
        except BaseException:
            connection.close()
            raise
        return connection

    # --- state -----------------------------------------------------------------------

    @property
    def state(self) -> StoreState:
        """Never blocks: plain attribute reads, safe from a metrics scrape."""
        if self._poisoned is not None:
            return StoreState.POISONED
        now = self._clock()
        if now - self._contended_at < self._contention_memory:
            return StoreState.CONTENDED
        # A writer still waiting counts as soon as it has waited past the threshold: one
        # stuck behind the lock must not read "ok" until it gets it. (list() of a dict's
        # values is one step under the GIL: safe beside the writers' threads.)
        if now - min(list(self._asking.values()), default=now) > self._contention_threshold:
            return StoreState.CONTENDED
        return StoreState.OK

    @property
    def poisoned_reason(self) -> str | None:
        return self._poisoned

    @property
    def connections(self) -> int:
        """SQLite connections open (in use or idle in the pool)."""
        return self._open_connections

    @property
    def write_lock_waits_over_threshold(self) -> int:
        return self._contended_waits

    # --- writes ----------------------------------------------------------------------

    def _write(
        self,
        work: Callable[[sqlite3.Connection], T],
        *,
        committed: Callable[[T], None] | None = None,
        transaction: bool = True,
    ) -> T:
        """Run ``work`` in one write transaction and commit it; then ``committed(result)``,
        still holding the write lock, so that what the store keeps in memory (counts)
        changes before the next writer reads it. ``transaction=False``: ``work`` runs
        outside one (a checkpoint), still alone among the store's writers."""
        if self._poisoned is not None:
            raise StoreUnavailable(f"{self.name} store is poisoned: {self._poisoned}")
        if self._closed:
            raise StoreUnavailable(f"{self.name} store is closed")
        asked = self._clock()
        token = object()
        self._asking[token] = asked  # seen by `state` while it waits
        try:
            self._write_lock.acquire()
        finally:
            del self._asking[token]
        try:
            if self._clock() - asked > self._contention_threshold:
                self._contended_at = self._clock()
                self._contended_waits += 1
            tap = self.tap if transaction else None
            with self._connection() as connection:
                if tap is not None:
                    tap.before_commit()
                try:
                    result = self._transaction(connection, work, transaction)
                finally:
                    if tap is not None:
                        tap.after_commit()
            if committed is not None:
                committed(result)
            return result
        finally:
            self._write_lock.release()

    @refuses_loop_thread
    def vacuum_step(self, pages: int) -> int:
        """Return up to ``pages`` free pages to the file system (SQLite's incremental
        vacuum, one short write transaction), then trim the WAL if it outgrew the
        database (:meth:`_trim_wal`); the pages returned."""

        def step(connection: sqlite3.Connection) -> int:
            free = int(connection.execute("PRAGMA freelist_count").fetchone()[0])
            # The pragma frees one page per step of its statement, and the sqlite3 module
            # steps a statement without result columns once: one page per execute.
            for _ in range(min(pages, free)):
                connection.execute("PRAGMA incremental_vacuum(1)")
            return free - int(connection.execute("PRAGMA freelist_count").fetchone()[0])

        returned = self._write(step) if self.returns_space else 0
        self._trim_wal()
        return returned

    def _trim_wal(self) -> bool:
        """Cut the WAL back to nothing when it is larger than the database it journals,
        as after retention drained a backlog: SQLite reuses a WAL from its start but keeps
        the file at its high-water mark, and the data dir with it. At a steady rate the
        WAL is smaller than its database and this does nothing. A TRUNCATE checkpoint,
        holding the write lock; it waits at most :data:`WAL_TRIM_WAIT_MS` for readers still
        on the WAL (then the next pass tries again). Whether it trimmed."""
        if self.checkpoints == "litestream":
            return False  # Litestream's to do (see :attr:`checkpoints`)
        try:
            if self._wal_path.stat().st_size <= max(WAL_TRIM_FLOOR, self.path.stat().st_size):
                return False
        except FileNotFoundError:
            return False
        return self.truncate_wal()

    @refuses_loop_thread
    def truncate_wal(self) -> bool:
        """Checkpoint the whole WAL into the database and cut it back to nothing, whoever
        checkpoints it otherwise (also before Litestream starts on a store it did not
        watch: :mod:`cmdbus_trio.ha.while_primary`). Waits :data:`WAL_TRIM_WAIT_MS` at
        most for readers still on the WAL. Whether it did."""

        def checkpoint(connection: sqlite3.Connection) -> bool:
            connection.execute(f"PRAGMA busy_timeout={WAL_TRIM_WAIT_MS}")
            try:
                busy = connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            finally:
                connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            return not busy

        return self._write(checkpoint, transaction=False)

    @refuses_loop_thread
    def wal(self) -> WalState:
        """The WAL's size and its header's checkpoint sequence number: a checkpoint that
        copied the whole WAL back (the writer's, or Litestream's) starts it again with
        the number moved on, so a number that stays while the WAL grows means nothing
        checkpoints it."""
        try:
            with self._wal_path.open("rb") as wal:
                size = os.fstat(wal.fileno()).st_size
                header = wal.read(WAL_HEADER_BYTES)
        except FileNotFoundError:
            return WalState(0, None)
        if len(header) < WAL_HEADER_BYTES:
            return WalState(size, None)
        return WalState(size, int.from_bytes(header[12:16], "big"))

    @refuses_loop_thread
    def checkpoint_past(self, ceiling: int, age: float = 0.0) -> bool:
        """Checkpoint the WAL back to nothing if it is over ``ceiling`` bytes, whoever
        checkpoints it otherwise (``CMDBUS_WAL_CEILING_BYTES``: with
        ``checkpoints=litestream`` and no Litestream the WAL would grow without end; a
        checkpoint of ours costs Litestream a new snapshot, never data), and log why
        (``age``: seconds since the last full checkpoint). Waits
        :data:`WAL_TRIM_WAIT_MS` at most for readers still on the WAL (the next pass
        tries again). Whether it checkpointed."""
        try:
            size = self._wal_path.stat().st_size
        except FileNotFoundError:
            return False
        if size <= ceiling:
            return False
        checkpointed = self.truncate_wal()
        metrics.WAL_CEILING_CHECKPOINTS.labels(store=self.name).inc(checkpointed)
        event(
            log,
            logging.WARNING,
            "wal_ceiling_checkpoint" if checkpointed else "wal_ceiling_checkpoint_busy",
            store=self.name,
            wal_bytes=size,
            ceiling=ceiling,
            checkpoint_age_s=round(age, 1),
            why="the WAL outgrew CMDBUS_WAL_CEILING_BYTES: nothing else checkpoints it "
            "(with CMDBUS_CHECKPOINTS=litestream: is Litestream running?)",
        )
        return checkpointed

    @refuses_loop_thread
    def attach_tap(self, committed: Callable[[Committed], None], failed: Failed) -> WalTap:
        """From the next commit on, hand each one's pages to ``committed``, in commit
        order, under the write lock (see :class:`WalTap` for when to take a snapshot)."""
        with self._write_lock:
            checkpoints = self.checkpoints == "writer"
            self.tap = WalTap(self.name, self.path, committed, failed, checkpoints=checkpoints)
            return self.tap

    @property
    def _wal_path(self) -> Path:
        return self.path.with_name(self.path.name + "-wal")

    @refuses_loop_thread
    def disk_bytes(self) -> int:
        """Bytes the store's files take (the database and its WAL)."""
        total = 0
        for path in (self.path, self._wal_path):
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    def _transaction(
        self,
        connection: sqlite3.Connection,
        work: Callable[[sqlite3.Connection], T],
        transaction: bool = True,
    ) -> T:
        committing = False
        try:
            if not transaction:
                return work(connection)
            connection.execute("BEGIN IMMEDIATE")
            result = work(connection)
            if self.before_commit is not None:
                self.before_commit()
            committing = True
            connection.execute("COMMIT")
            return result
        except BaseException as exc:
            if connection.in_transaction:
                try:
                    connection.execute("ROLLBACK")
                except sqlite3.Error:
                    committing = True  # cannot even roll back: state unknown
            if isinstance(exc, sqlite3.Error) and (committing or _poisons(exc)):
                if self._poisoned is None:
                    self._poisoned = f"{type(exc).__name__}: {exc}"
                raise StoreUnavailable(f"{self.name} store is poisoned: {self._poisoned}") from exc
            raise


def _poisons(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        return isinstance(exc, sqlite3.DatabaseError) and "disk" in str(exc).lower()
    return (code & 0xFF) in _POISONING_CODES
