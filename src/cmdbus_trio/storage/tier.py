"""The tier store: per-execution event history in three tiers, on SQLite.

Threads, the pool, the write lock and poisoning come from :class:`SqliteStore`. An append
returns only after its transaction committed (``synchronous=FULL`` by default, so it is
on disk)."""

from __future__ import annotations

import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs

from cmdbus_trio.protocol.pages import Fragments
from cmdbus_trio.protocol.tier import TierRecord

from ._common import StoreState, StoreUnavailable
from ._guard import refuses_loop_thread
from ._sqlite import SqliteStore
from ._tier_appends import (
    TIERS,
    Appending,
    AppendResult,
    NewRecord,
    Outcome,
    VersionConflict,
    append_all,
    check_tier,
)
from ._tier_pages import (
    BOUNDED_PAGE_SQL,
    FRAGMENT_SQL,
    FRAGMENTS_SQL,
    encode_rows,
    joined_fragments,
    sqlite_writes_fragments,
)

Page = TypeVar("Page")

DELETE_BATCH: Final = 10_000
"""Records one transaction of :meth:`TierStore.delete_execution` deletes at most."""
PAGE_ROWS: Final = 256
"""Rows fetched per SQL query when iterating; callers check for cancellation between pages."""

_COLUMNS: Final = "global_sequence, execution_id, transaction_id, byte_len, payload"
"""A record's columns, in the order of :class:`TierRecord`."""
PAGE_BYTES: Final = 4 << 20
"""About the most payload bytes one page of :meth:`TierStore.iter_execution_encoded` holds
(always at least one record): records may be up to a request's size each, and a page of
:data:`PAGE_ROWS` of them is not held in memory at once."""


@attrs.frozen
class StoreStatistics:
    state: StoreState
    poisoned_reason: str | None
    record_counts: dict[str, int]
    write_lock_waits_over_threshold: int
    connections: int
    """SQLite connections open (in use or idle in the pool)."""


class TierStore(SqliteStore):
    """Open with :meth:`open`; share one instance between threads; :meth:`close` last.

    Error handling: :class:`StoreUnavailable` when poisoned or closed,
    :class:`VersionConflict` for a failed ``expected_version``; ``ValueError`` for an
    unknown tier (callers validate first).
    """

    name = "tier"

    def __init__(
        self, path: Path, *, wall_clock: Callable[[], float] = time.time, **options: object
    ) -> None:
        super().__init__(path, **options)  # type: ignore[arg-type]
        self._wall_clock = wall_clock  # executions' ages must mean the same after a restart
        self._counts: dict[str, int] = {}
        self.fragments_in_sqlite = False
        """Whether :meth:`iter_execution_encoded` has SQLite encode (else Python)."""
        self.visible_through: dict[str, int] | None = None
        """With a standby (:meth:`hold_back`): per tier, the newest record a read may
        return, one whose append could be acknowledged; the committer moves it on."""

    @refuses_loop_thread
    def hold_back(self) -> None:
        """From now on, reads return only records :attr:`visible_through` lets through
        (every record there is now, at first)."""
        with self._connection() as connection:
            self.visible_through = {
                tier: connection.execute(
                    f"SELECT coalesce(max(global_sequence), 0) FROM {tier}_records"
                ).fetchone()[0]
                for tier in TIERS
            }

    def _visible(
        self, tier: str, condition: str, head: tuple[object, ...]
    ) -> tuple[str, tuple[object, ...]]:
        through = None if self.visible_through is None else self.visible_through.get(tier, 0)
        if through is None:
            return condition, head
        return f"{condition} global_sequence <= ? AND", (*head, through)

    def _setup(self, connection: sqlite3.Connection) -> None:
        for tier in TIERS:
            connection.executescript(
                f"""
                CREATE TABLE IF NOT EXISTS {tier}_records (
                    global_sequence INTEGER PRIMARY KEY AUTOINCREMENT,
                    execution_id TEXT NOT NULL,
                    transaction_id TEXT NOT NULL,
                    event_id TEXT,
                    byte_len INTEGER NOT NULL,
                    payload TEXT NOT NULL
                );
                CREATE INDEX IF NOT EXISTS {tier}_by_execution
                    ON {tier}_records (execution_id, global_sequence);
                CREATE UNIQUE INDEX IF NOT EXISTS {tier}_by_event
                    ON {tier}_records (execution_id, event_id) WHERE event_id IS NOT NULL;
                CREATE TABLE IF NOT EXISTS {tier}_executions (
                    execution_id TEXT PRIMARY KEY,
                    record_count INTEGER NOT NULL,
                    last_at REAL
                ) WITHOUT ROWID;
                """
            )
            columns = {
                row[1] for row in connection.execute(f"PRAGMA table_info({tier}_executions)")
            }
            if "last_at" not in columns:  # a store made before tier retention
                connection.execute(f"ALTER TABLE {tier}_executions ADD COLUMN last_at REAL")
            # Executions of unknown age count from now: kept a whole window, never less.
            connection.execute(
                f"UPDATE {tier}_executions SET last_at = ? WHERE last_at IS NULL",
                (self._wall_clock(),),
            )
            connection.execute(
                f"CREATE INDEX IF NOT EXISTS {tier}_executions_by_age "
                f"ON {tier}_executions (last_at)"
            )
        connection.execute(
            "CREATE TABLE IF NOT EXISTS tier_counts "
            "(tier TEXT PRIMARY KEY, record_count INTEGER NOT NULL) WITHOUT ROWID"
        )
        for tier in TIERS:
            connection.execute("INSERT OR IGNORE INTO tier_counts VALUES (?, 0)", (tier,))
        self._counts = dict(connection.execute("SELECT tier, record_count FROM tier_counts"))
        self.fragments_in_sqlite = sqlite_writes_fragments(connection)

    @property
    def records(self) -> int:
        """Records in every tier. A plain read: never blocks."""
        return sum(self._counts.values())

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            state=self.state,
            poisoned_reason=self.poisoned_reason,
            record_counts=dict(self._counts),
            write_lock_waits_over_threshold=self.write_lock_waits_over_threshold,
            connections=self.connections,
        )

    # --- writes ----------------------------------------------------------------------

    @refuses_loop_thread
    def append(
        self,
        tier: str,
        execution_id: str,
        record: NewRecord,
        *,
        expected_version: int | None = None,
    ) -> AppendResult:
        """Append one record (or find its duplicate by ``event_id``), durably."""
        return self.append_batch(tier, execution_id, [record], expected_version=expected_version)[0]

    @refuses_loop_thread
    def append_batch(
        self,
        tier: str,
        execution_id: str,
        records: Sequence[NewRecord],
        *,
        expected_version: int | None = None,
    ) -> list[AppendResult]:
        """Append records in one transaction (one fsync); all or nothing.

        A record whose ``event_id`` is already stored for this execution and tier (or
        earlier in the batch) is not stored again: its result has ``deduplicated`` and the
        first record's sequence. ``expected_version`` is the execution's record count
        before the batch; a mismatch raises :class:`VersionConflict` and stores nothing.
        """
        (outcome,) = self._append_in_one([Appending(tier, execution_id, records, expected_version)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    @refuses_loop_thread
    def append_many(self, requests: Sequence[Appending]) -> list[Outcome]:
        """Each request as :meth:`append_batch` would do it, one after another, all in
        one transaction (one fsync: the group commit of the tier's writes); each
        request's results, or the exception that refused it.

        A request refused (:class:`VersionConflict`, an unknown tier) stores nothing and
        does not touch the others. Should the transaction fail for a reason that is not
        the store's (a bug met by one request's input), each request is then appended
        in a transaction of its own, so that only its own fails.

        Error handling: :class:`StoreUnavailable` (raised) fails every request.
        """
        try:
            return self._append_in_one(requests)
        except StoreUnavailable:
            raise
        except Exception:
            if len(requests) == 1:
                raise
        outcomes: list[Outcome] = []
        for request in requests:
            try:
                outcomes += self._append_in_one([request])
            except StoreUnavailable:
                raise
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _append_in_one(self, requests: Sequence[Appending]) -> list[Outcome]:
        """The requests in one transaction; the in-memory counts once it committed (and
        before the next writer reads them)."""

        def append(connection: sqlite3.Connection) -> tuple[list[Outcome], Counter[str]]:
            return append_all(connection, requests, self._counts, self._wall_clock())

        def count(appended: tuple[list[Outcome], Counter[str]]) -> None:
            for tier, added in appended[1].items():
                self._counts[tier] += added

        return self._write(append, committed=count)[0]

    @refuses_loop_thread
    def delete_execution(
        self, tier: str, execution_id: str, *, idle_for: float | None = None
    ) -> int:
        """Delete the execution's records in ``tier``, durably; the number deleted (0: it
        had none). With ``idle_for``, only if nothing was appended to it for that many
        seconds (retention).

        The records deleted are those it had when the deletion began: one appended
        meanwhile is kept. In transactions of at most :data:`DELETE_BATCH` records, so a
        big execution never holds the write lock long: a crash part way leaves the rest,
        and deleting again finishes. Sequences are never reused (``AUTOINCREMENT``)."""
        check_tier(tier)
        through: int | None = None  # the newest record when the deletion began

        def step(connection: sqlite3.Connection) -> int:
            nonlocal through
            if through is None:
                row = connection.execute(
                    f"SELECT last_at FROM {tier}_executions WHERE execution_id = ?",
                    (execution_id,),
                ).fetchone()
                if row is None or (idle_for is not None and row[0] > self._wall_clock() - idle_for):
                    return 0
                (through,) = connection.execute(
                    f"SELECT max(global_sequence) FROM {tier}_records WHERE execution_id = ?",
                    (execution_id,),
                ).fetchone()
            deleted = connection.execute(
                f"DELETE FROM {tier}_records WHERE global_sequence IN (SELECT global_sequence "
                f"FROM {tier}_records WHERE execution_id = ? AND global_sequence <= ? LIMIT ?)",
                (execution_id, through or 0, DELETE_BATCH),
            ).rowcount
            if deleted:
                connection.execute(
                    f"UPDATE {tier}_executions SET record_count = record_count - ? "
                    "WHERE execution_id = ?",
                    (deleted, execution_id),
                )
                connection.execute(
                    f"DELETE FROM {tier}_executions WHERE execution_id = ? AND record_count <= 0",
                    (execution_id,),
                )
                connection.execute(
                    "UPDATE tier_counts SET record_count = record_count - ? WHERE tier = ?",
                    (deleted, tier),
                )
            return int(deleted)

        def count(deleted: int) -> None:
            self._counts[tier] -= deleted

        total = 0
        while deleted := self._write(step, committed=count):
            total += deleted
        return total

    @refuses_loop_thread
    def idle_executions(self, tier: str, idle_for: float, limit: int) -> list[str]:
        """Up to ``limit`` executions of ``tier`` that nothing was appended to for
        ``idle_for`` seconds (wall clock, kept across restarts), the longest idle first."""
        check_tier(tier)
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT execution_id FROM {tier}_executions WHERE last_at <= ? "
                "ORDER BY last_at LIMIT ?",
                (self._wall_clock() - idle_for, limit),
            ).fetchall()
        return [str(row[0]) for row in rows]

    @refuses_loop_thread
    def execution_count(self, tier: str, execution_id: str) -> int | None:
        """The execution's record count, or ``None`` if it has none in this tier."""
        check_tier(tier)
        with self._connection() as connection:
            row = connection.execute(
                f"SELECT record_count FROM {tier}_executions WHERE execution_id = ?",
                (execution_id,),
            ).fetchone()
        return None if row is None else int(row[0])

    @refuses_loop_thread
    def iter_execution(
        self, tier: str, execution_id: str, *, after: int = 0
    ) -> Iterator[list[TierRecord]]:
        """The execution's records with ``global_sequence > after``, ascending, in pages
        of :data:`PAGE_ROWS`. Uses the execution index: the cost is proportional to the
        execution, never to the store."""
        check_tier(tier)
        condition, head = self._visible(tier, "execution_id = ? AND", (execution_id,))
        return self._records(tier, condition, head, after)

    @refuses_loop_thread
    def iter_execution_encoded(
        self, tier: str, execution_id: str, *, after: int = 0
    ) -> Iterator[Fragments]:
        """As :meth:`iter_execution`, each record as its reply fragment
        (:func:`~cmdbus_trio.protocol.tier.record_fragment`, keyed by ``global_sequence``),
        in pages of at most :data:`PAGE_ROWS` records and about :data:`PAGE_BYTES` of
        payload."""
        check_tier(tier)
        condition, head = self._visible(tier, "execution_id = ? AND", (execution_id,))
        return self._encoded(tier, condition, head, after)

    @refuses_loop_thread
    def iter_scan(self, tier: str, *, after: int = 0) -> Iterator[list[TierRecord]]:
        """Every record of the tier with ``global_sequence > after``, ascending, in pages."""
        check_tier(tier)
        return self._records(tier, *self._visible(tier, "", ()), after)

    @refuses_loop_thread
    def iter_scan_encoded(self, tier: str, *, after: int = 0) -> Iterator[Fragments]:
        """As :meth:`iter_scan`, encoded and bounded as :meth:`iter_execution_encoded`."""
        check_tier(tier)
        return self._encoded(tier, *self._visible(tier, "", ()), after)

    def _records(
        self, tier: str, condition: str, head: tuple[object, ...], after: int
    ) -> Iterator[list[TierRecord]]:
        sql = (
            f"SELECT {_COLUMNS} FROM {tier}_records WHERE {condition} "
            "global_sequence > ? ORDER BY global_sequence LIMIT ?"
        )
        for rows in self._pages(sql, head, after, _as_rows):
            yield [TierRecord(*row) for row in rows]
            if len(rows) < PAGE_ROWS:
                return

    def _encoded(
        self, tier: str, condition: str, head: tuple[object, ...], after: int
    ) -> Iterator[Fragments]:
        table = f"{tier}_records"
        if not self.fragments_in_sqlite:
            sql = BOUNDED_PAGE_SQL.format(columns=_COLUMNS, table=table, condition=condition)
            return self._pages(sql, head, after, encode_rows, PAGE_BYTES)
        columns = f"global_sequence, {FRAGMENT_SQL} AS fragment"
        page = BOUNDED_PAGE_SQL.format(columns=columns, table=table, condition=condition)
        sql = FRAGMENTS_SQL.format(page=page)
        return self._pages(sql, head, after, joined_fragments, PAGE_BYTES)

    def _pages(
        self,
        sql: str,
        head: tuple[object, ...],
        after: int,
        convert: Callable[[list[Any]], tuple[Page, int | None]],
        *tail: object,
    ) -> Iterator[Page]:
        """The pages of ``sql`` (parameters ``head``, then the sort key after which a page
        starts, :data:`PAGE_ROWS`, then ``tail``) until one is empty. ``convert`` makes a
        page of the rows, and says its last key (``None``: the page is empty)."""
        # One short query per page, on a connection taken for that page: neither a read
        # transaction nor a connection of the (fixed) pool is held while the caller
        # encodes a page, waits for a slow client, or drops the iteration.
        while True:
            with self._connection() as connection:
                rows = connection.execute(sql, (*head, after, PAGE_ROWS, *tail)).fetchall()
            page, last = convert(rows)
            if last is None:
                return
            yield page
            after = last


def _as_rows(rows: list[Any]) -> tuple[list[Any], int | None]:
    return rows, rows[-1][0] if rows else None


__all__ = [
    "TIERS",
    "AppendResult",
    "Appending",
    "NewRecord",
    "StoreStatistics",
    "TierStore",
    "VersionConflict",
]
