"""The bus log: the durable record log of one bus (commands or events), on SQLite.

Records get writer-assigned sort keys: ascending from 1, never reused (``AUTOINCREMENT``),
stable across restarts. A publish carrying a ``msg_id`` seen within the dedup window
returns the first record's sort key and appends nothing; the window is kept in the
database, so it survives a restart. One :meth:`BusLog.publish` call is one transaction
(one fsync), however many entries it carries: the group committer batches into it.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Callable, Generator, Sequence
from functools import partial
from pathlib import Path

from cmdbus_trio.protocol.bus import Published
from cmdbus_trio.protocol.claim import MAX_SORT_KEYS
from cmdbus_trio.protocol.subjects import matches

from . import _bus_retention, _bus_schema, _bus_writes
from ._bus_retention import RETENTION_BATCH, Evicted, Retained, Windows
from ._bus_rows import HIGHEST, PLAIN, TRACED, DeadRecord, StoredRecord, stored_records, trace_of
from ._bus_writes import NOTHING_SETTLED, BusEntry, Settlements
from ._guard import refuses_loop_thread
from ._sqlite import SqliteStore

__all__ = [
    "DEAD_KEYS_PAGE",
    "MAX_READ_MANY",
    "RETENTION_BATCH",
    "BusEntry",
    "BusLog",
    "DeadRecord",
    "Evicted",
    "Published",
    "Retained",
    "Settlements",
    "StoredRecord",
    "Windows",
]

MAX_READ_MANY = 256
"""Most records :meth:`BusLog.read_many` reads in one query."""
DEAD_PAGE_ROWS = 16
"""Dead letters (bodies included) per query of :meth:`BusLog.iter_dead`: a page of 1 MiB
records stays small, and a reader that stops early has read little past it."""
DEAD_KEYS_PAGE = MAX_SORT_KEYS
"""Dead letters per query (and per requeue or purge transaction) when they are selected by
sort keys or a filter: as many as one request may name, so named ones take one query."""


class BusLog(SqliteStore):
    def __init__(
        self,
        path: Path,
        *,
        name: str = "commands",
        dedup_window: float = 120.0,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        **options: object,
    ) -> None:
        super().__init__(path, **options)  # type: ignore[arg-type]
        self.name = name
        self.dedup_window = dedup_window
        self._wall_clock = wall_clock  # msg_id ages must mean the same after a restart
        self._monotonic = monotonic
        self._dedup_epoch = (0.0, 0.0)  # the dedup clock's start: its time, monotonic's
        self._last_sort_key = 0
        self._records = 0
        self._deleted_through = 0
        self._traced: tuple[int, int] | None = None
        """The lowest and highest sort keys of records stored with trace context (None:
        none). Only reads of keys in that range read the trace columns: two more
        columns on every body read cost a claim+ack 5% (docs/benchmarks.md, "Tracing").
        Widened under the write lock before an append commits, so that a read that sees
        the record finds it in range once its SELECT is done (:meth:`_select`); never
        narrowed, by retention or a rollback (a stale range only reads more)."""

    def _setup(self, connection: sqlite3.Connection) -> None:
        counted = _bus_schema.create(connection, self._wall_clock())
        self._records, self._deleted_through, self._last_sort_key = counted
        self._traced = _bus_schema.traced_range(connection)
        newest = connection.execute("SELECT max(published_at) FROM msg_ids").fetchone()[0]
        self._dedup_epoch = (max(self._wall_clock(), newest or 0.0), self._monotonic())

    def _dedup_now(self) -> float:
        """The time msg_ids are stamped and aged by: the wall clock when the log opens
        (but never before the newest stamp: a clock set back while the writer was down
        keeps no id longer than its window), then the monotonic clock (a clock stepped
        while the writer runs neither forgets ids nor keeps them)."""
        started_at, monotonic_then = self._dedup_epoch
        return started_at + self._monotonic() - monotonic_then

    def _columns(self, lowest: int, highest: int) -> str:
        """The columns to read records with sort keys from ``lowest`` to ``highest`` by."""
        traced = self._traced
        if traced is None or highest < traced[0] or lowest > traced[1]:
            return PLAIN
        return TRACED

    def _select(
        self, where: str, parameters: Sequence[object], lowest: int, highest: int
    ) -> list[StoredRecord]:
        """``SELECT … FROM records <where>`` for keys from ``lowest`` to ``highest``,
        with the trace columns where the log may hold context for them. The columns are
        chosen before the SELECT, and a traced append may commit in between, seen by it:
        such a record would come without its context, for good (a scan of what is
        committed hears of a record before the commit's callback does). Its range is
        widened before its COMMIT, so the range is looked at again once the rows are
        in: if it now takes in the keys read plain, they are read again, traced."""
        columns = self._columns(lowest, highest)
        with self._connection() as connection:
            query = f"SELECT {columns} FROM records {where}"
            rows = connection.execute(query, parameters).fetchall()
            if columns == PLAIN and rows and self._columns(lowest, highest) == TRACED:
                columns = TRACED
                query = f"SELECT {columns} FROM records {where}"
                rows = connection.execute(query, parameters).fetchall()
        return stored_records(rows, columns)

    @property
    def last_sort_key(self) -> int:
        """The newest sort key handed out (0 when none). A plain read: never blocks."""
        return self._last_sort_key

    @refuses_loop_thread
    def publish(self, entries: Sequence[BusEntry]) -> list[Published]:
        """Append ``entries`` in one transaction, in order; all or nothing."""
        return self.commit(entries)

    @refuses_loop_thread
    def commit(
        self,
        entries: Sequence[BusEntry] = (),
        done: Settlements = NOTHING_SETTLED,
        moved: list[tuple[str, int]] | None = None,
    ) -> list[Published]:
        """One transaction (one fsync): append ``entries`` and record what consumers
        settled (:class:`Settlements` says what each field means). Each dead letter of
        ``done.dead_moves`` that was still dead is appended to ``moved``."""

        def write(connection: sqlite3.Connection) -> list[Published]:
            now = self._wall_clock()
            _bus_writes.settle(connection, done, now, moved)
            if not entries:
                return []
            results = _bus_writes.append(connection, entries, self._dedup_now(), self.dedup_window)
            self._widen_traced(results, entries)  # before the COMMIT: see _select
            return results

        return self._write(write, committed=partial(self._appended, entries=entries))

    def _appended(self, results: list[Published], entries: Sequence[BusEntry]) -> None:
        """After an appending transaction committed, under the write lock: a retention
        step in another thread reads and changes the same counts."""
        fresh = [r.sort_key for r in results if not r.duplicate]
        if fresh:
            self._last_sort_key = max(self._last_sort_key, *fresh)
            self._records += len(fresh)

    def _widen_traced(self, results: list[Published], entries: Sequence[BusEntry]) -> None:
        traced = [
            r.sort_key
            for r, entry in zip(results, entries, strict=True)
            if entry.trace is not None and not r.duplicate
        ]
        if traced:
            low, high = self._traced or (traced[0], traced[0])
            self._traced = (min(low, *traced), max(high, *traced))

    @property
    def records(self) -> int:
        """Records in the log. A plain read: never blocks."""
        return self._records

    @property
    def deleted_through(self) -> int:
        """The newest sort key retention has deleted (0: none): a reader starting before
        it misses records (dead letters and owed records below it may remain). A plain
        read: never blocks."""
        return self._deleted_through

    @refuses_loop_thread
    def retain(self, windows: Windows) -> Retained:
        """One bounded step of retention, in one write transaction: delete up to
        :data:`RETENTION_BATCH` records settled by every consumer and out of their keep
        windows, and up to as many dead letters older than ``keep_dead``. The fields of
        ``windows``:

        ``consumers``: name -> the sort key it starts after (records up to it are not
        its); None: the log's groups. A record is *settled* when it is below every
        consumer's settled position and is neither dead nor owed for any of them; with no
        consumer at all, every record is. ``keep_settled``: seconds a record is kept once
        settled (for inspection); ``keep_published``: seconds a record is kept once
        published (the replay window); None: no such window.

        Ages come from *marks*: at most every ``mark_every`` seconds the step notes the
        wall clock, the newest sort key and the settled position. A record counts as
        settled (or published) ``keep`` seconds ago when a mark at least that old says so:
        never sooner, and at most ``mark_every`` later. Marks are in the log, so a restart
        keeps the ages."""

        def write(connection: sqlite3.Connection) -> Retained:
            now = self._wall_clock()
            return _bus_retention.retain_step(
                connection, windows, now=now, newest=self._last_sort_key
            )

        return self._write(write, committed=lambda r: self._deleted(r.records, r.through))

    def _deleted(self, records: int, through: int) -> None:
        """After a deleting transaction committed, under the write lock (see
        :meth:`_appended`): the counts read without the store."""
        self._records -= records
        self._deleted_through = max(self._deleted_through, through)

    @refuses_loop_thread
    def used_bytes(self) -> int:
        """Bytes of the database's pages in use (records, indexes, acks; not the free
        pages a vacuum step has yet to return, nor the WAL)."""
        with self._connection() as connection:
            return _bus_retention.used_bytes(connection)

    @refuses_loop_thread
    def eviction_floor(self, over: int, down_to: int | None = None) -> int:
        """When the pages in use exceed ``over`` bytes, the newest sort key :meth:`evict`
        should delete through so that they fall to ``down_to`` (default: ``over``); else
        0. The oldest records, as many as the excess is of the pages in use in records
        (each record taken as its average share), at least one and at most
        :data:`RETENTION_BATCH`: a step estimates, the next measures again."""
        down_to = over if down_to is None else down_to
        with self._connection() as connection:
            return _bus_retention.eviction_floor(connection, self._records, over, down_to)

    @refuses_loop_thread
    def evict(self, through: int) -> Evicted:
        """Delete every record up to ``through`` whatever the consumers did with it, with
        all they recorded about it (dead letters, owed records, delivery counts, acks),
        in one write transaction: keep ``through`` to what :meth:`eviction_floor` said,
        so the transaction stays short. Readers see it as retention: a reader starting
        before ``through`` is told :attr:`deleted_through`."""
        return self._write(
            partial(_bus_retention.evict, through=through),
            committed=lambda e: self._deleted(e.records, through),
        )

    @refuses_loop_thread
    def groups(self) -> dict[str, int]:
        """The consumer groups: name -> the sort key they start after (records up to it
        are not theirs)."""
        with self._connection() as connection:
            rows = connection.execute("SELECT name, start_after FROM groups").fetchall()
        return {str(name): int(start) for name, start in rows}

    @refuses_loop_thread
    def create_group(self, name: str, start_after: int) -> int:
        """Create a group unless it exists; returns its start (the existing one if any).
        A group never starts before what retention deleted: read in the same transaction
        as the insert, so a retention step that commits just before is seen."""

        def write(connection: sqlite3.Connection) -> int:
            row = connection.execute("SELECT deleted_through FROM retention_floor").fetchone()
            start = max(start_after, int(row[0]) if row else 0)
            connection.execute("INSERT OR IGNORE INTO groups VALUES (?, ?)", (name, start))
            row = connection.execute(
                "SELECT start_after FROM groups WHERE name = ?", (name,)
            ).fetchone()
            return int(row[0])

        return self._write(write)

    @refuses_loop_thread
    def read(self, sort_key: int) -> StoredRecord | None:
        records = self._select("WHERE sort_key = ?", (sort_key,), sort_key, sort_key)
        return next(iter(records), None)

    @refuses_loop_thread
    def read_many(self, sort_keys: Sequence[int]) -> dict[int, StoredRecord]:
        """The records with these sort keys (one query), by sort key; at most
        :data:`MAX_READ_MANY` keys (SQLite's bound-parameter limit is far above it)."""
        if len(sort_keys) > MAX_READ_MANY:
            raise ValueError(f"at most {MAX_READ_MANY} sort keys, got {len(sort_keys)}")
        if not sort_keys:
            return {}
        marks = ", ".join("?" * len(sort_keys))
        where = f"WHERE sort_key IN ({marks})"
        records = self._select(where, tuple(sort_keys), min(sort_keys), max(sort_keys))
        return {record.sort_key: record for record in records}

    @refuses_loop_thread
    def settled_below(self, consumer: str) -> int:
        """Every record below this sort key is acked or dead for ``consumer`` (0: none
        recorded). Reloading starts here, so restarts do not scan the whole history."""
        with self._connection() as connection:
            row = connection.execute(
                "SELECT settled_below FROM positions WHERE consumer = ?", (consumer,)
            ).fetchone()
        return int(row[0]) if row else 0

    @refuses_loop_thread
    def unsettled(
        self, consumer: str, after: int, limit: int, through: int | None = None
    ) -> list[tuple[int, str, int]]:
        """``(sort_key, subject, deliveries)`` of records after ``after`` (and up to
        ``through``, when given) that ``consumer`` has neither acked nor parked as dead,
        ascending, with the deliveries recorded for them (0: none): what a claim
        coordinator loads. Starts at the consumer's settled position when that is further
        on."""
        after = max(after, self.settled_below(consumer) - 1)
        through = HIGHEST if through is None else through
        with self._connection() as connection:
            rows = connection.execute(
                "SELECT r.sort_key, r.subject, COALESCE(c.deliveries, 0) FROM records r "
                "LEFT JOIN deliveries c ON c.consumer = ? AND c.sort_key = r.sort_key "
                "WHERE r.sort_key > ? AND r.sort_key <= ? "
                "AND NOT EXISTS (SELECT 1 FROM acks a WHERE a.consumer = ? "
                "AND a.sort_key = r.sort_key) "
                "AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.consumer = ? "
                "AND d.sort_key = r.sort_key) ORDER BY r.sort_key LIMIT ?",
                (consumer, after, through, consumer, consumer, limit),
            ).fetchall()
        return [(int(key), str(subject), int(count)) for key, subject, count in rows]

    @refuses_loop_thread
    def subjects_between(self, after: int, through: int, limit: int) -> list[tuple[int, str]]:
        """``(sort_key, subject)`` of up to ``limit`` records after ``after`` and up to
        ``through``, ascending: what an event group's tail holds (no bodies)."""
        with self._connection() as connection:
            rows = connection.execute(
                "SELECT sort_key, subject FROM records WHERE sort_key > ? AND sort_key <= ? "
                "ORDER BY sort_key LIMIT ?",
                (after, through, limit),
            ).fetchall()
        return [(int(key), str(subject)) for key, subject in rows]

    @refuses_loop_thread
    def group_state(self, consumer: str, after: int) -> tuple[list[int], list[tuple[int, int]]]:
        """What an event group resumes with after ``after``: the sort keys it settled
        (acked or dead), and ``(sort_key, deliveries)`` recorded for the others."""
        with self._connection() as connection:
            settled = connection.execute(
                "SELECT sort_key FROM acks WHERE consumer = ? AND sort_key > ? "
                "UNION SELECT sort_key FROM dead WHERE consumer = ? AND sort_key > ?",
                (consumer, after, consumer, after),
            ).fetchall()
            counts = connection.execute(
                "SELECT sort_key, deliveries FROM deliveries WHERE consumer = ? AND sort_key > ?",
                (consumer, after),
            ).fetchall()
        return [int(row[0]) for row in settled], [(int(k), int(n)) for k, n in counts]

    @refuses_loop_thread
    def iter_dead(
        self, consumer: str, *, after: int = 0, filter: str | None = None
    ) -> Generator[list[DeadRecord], None, None]:
        """``consumer``'s dead letters with a sort key greater than ``after`` whose subject
        matches ``filter`` (a NATS filter; None: all), ascending, in pages of
        :data:`DEAD_PAGE_ROWS`: filtered in the query, so paging reaches every one. One
        short query per page, on a connection taken for that page: neither a read
        transaction nor a connection of the pool is held between pages."""
        while True:
            with self._connection() as connection:
                _with_subject_matches(connection)
                page = [
                    DeadRecord(row[0], row[1], row[2], row[3], trace_of(row[4], row[5]))
                    for row in connection.execute(
                        "SELECT r.sort_key, r.subject, r.record, d.deliveries, r.traceparent, "
                        "r.tracestate FROM dead d "
                        "JOIN records r ON r.sort_key = d.sort_key WHERE d.consumer = ? "
                        "AND d.sort_key > ? AND subject_matches(?, r.subject) "
                        "ORDER BY d.sort_key LIMIT ?",
                        (consumer, after, filter, DEAD_PAGE_ROWS),
                    )
                ]
            if not page:
                return
            yield page
            after = page[-1].sort_key

    @refuses_loop_thread
    def dead_subjects(
        self,
        consumer: str,
        *,
        after: int = 0,
        filter: str | None = None,
        sort_keys: Sequence[int] | None = None,
    ) -> list[tuple[int, str]]:
        """``(sort_key, subject)`` of up to :data:`DEAD_KEYS_PAGE` of ``consumer``'s dead
        letters after ``after``, ascending: those among ``sort_keys`` when given (at most
        :data:`DEAD_KEYS_PAGE`), else those whose subject matches ``filter``."""
        if sort_keys is not None and len(sort_keys) > DEAD_KEYS_PAGE:
            raise ValueError(f"at most {DEAD_KEYS_PAGE} sort keys, got {len(sort_keys)}")
        chosen = ""
        if sort_keys is not None:
            chosen = (
                f"AND d.sort_key IN ({', '.join('?' * len(sort_keys))}) " if sort_keys else "AND 0 "
            )
        with self._connection() as connection:
            _with_subject_matches(connection)
            rows = connection.execute(
                "SELECT d.sort_key, r.subject FROM dead d JOIN records r "
                "ON r.sort_key = d.sort_key WHERE d.consumer = ? AND d.sort_key > ? "
                f"AND subject_matches(?, r.subject) {chosen}ORDER BY d.sort_key LIMIT ?",
                (consumer, after, filter, *(sort_keys or ()), DEAD_KEYS_PAGE),
            ).fetchall()
        return [(int(key), str(subject)) for key, subject in rows]

    @refuses_loop_thread
    def owed(self, consumer: str, through: int) -> list[tuple[int, str, int]]:
        """``(sort_key, subject, deliveries)`` of the records owed to ``consumer`` at or
        below ``through`` though its settled position may have passed them (dead letters
        requeued, records that stayed unsettled too long), not settled since; those above
        ``through`` load as unsettled."""
        with self._connection() as connection:
            rows = connection.execute(
                "SELECT q.sort_key, r.subject, COALESCE(c.deliveries, 0) FROM owed q "
                "JOIN records r ON r.sort_key = q.sort_key "
                "LEFT JOIN deliveries c ON c.consumer = q.consumer AND c.sort_key = q.sort_key "
                "WHERE q.consumer = ? AND q.sort_key <= ? ORDER BY q.sort_key",
                (consumer, through),
            ).fetchall()
        return [(int(key), str(subject), int(count)) for key, subject, count in rows]

    @refuses_loop_thread
    def read_after(self, after: int, limit: int) -> list[StoredRecord]:
        """Up to ``limit`` records with ``sort_key > after``, ascending."""
        where = "WHERE sort_key > ? ORDER BY sort_key LIMIT ?"
        return self._select(where, (after, limit), after + 1, HIGHEST)


@functools.lru_cache(maxsize=256)
def _filter_tokens(filter: str) -> tuple[str, ...]:
    return tuple(filter.split("."))


def _subject_matches(filter: str | None, subject: str) -> bool:
    return filter is None or matches(_filter_tokens(filter), subject)


def _with_subject_matches(connection: sqlite3.Connection) -> None:
    """``subject_matches(filter, subject)`` in this connection's SQL (NATS filters)."""
    connection.create_function("subject_matches", 2, _subject_matches, deterministic=True)
