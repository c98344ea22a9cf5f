"""The tier store: per-execution event history in three tiers, on SQLite.

Threads, the pool, the write lock and poisoning come from :class:`SqliteStore`. An append
returns only after its transaction committed (``synchronous=FULL`` by default, so it is
on disk)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import attrs

from ._common import StoreState
from ._guard import refuses_loop_thread
from ._sqlite import SqliteStore

TIERS: Final = ("eventlog", "projection", "catalog")
PAGE_ROWS: Final = 256
"""Rows fetched per SQL query when iterating; callers check for cancellation between pages."""


class VersionConflict(Exception):
    def __init__(self, expected: int, actual: int) -> None:
        super().__init__(f"expected_version {expected} but the execution has {actual} records")
        self.expected = expected
        self.actual = actual


@attrs.frozen
class NewRecord:
    """A record to append: its payload (JSON text), its transaction id, and the
    ``event_id`` found in the payload (``None`` when it has none)."""

    payload: str
    transaction_id: str = ""
    event_id: str | None = None


@attrs.frozen
class AppendResult:
    global_sequence: int
    log_record_count: int
    deduplicated: bool


@attrs.frozen
class TierRecord:
    global_sequence: int
    execution_id: str
    transaction_id: str
    byte_len: int
    payload: str


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

    def __init__(self, path: Path, **options: object) -> None:
        super().__init__(path, **options)  # type: ignore[arg-type]
        self._counts: dict[str, int] = {}

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
                    record_count INTEGER NOT NULL
                ) WITHOUT ROWID;
                """
            )
        connection.execute(
            "CREATE TABLE IF NOT EXISTS tier_counts "
            "(tier TEXT PRIMARY KEY, record_count INTEGER NOT NULL) WITHOUT ROWID"
        )
        for tier in TIERS:
            connection.execute("INSERT OR IGNORE INTO tier_counts VALUES (?, 0)", (tier,))
        self._counts = dict(connection.execute("SELECT tier, record_count FROM tier_counts"))

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
        _check_tier(tier)

        def write(connection: sqlite3.Connection) -> tuple[list[AppendResult], int]:
            row = connection.execute(
                f"SELECT record_count FROM {tier}_executions WHERE execution_id = ?",
                (execution_id,),
            ).fetchone()
            execution_count = row[0] if row else 0
            if expected_version is not None and expected_version != execution_count:
                raise VersionConflict(expected_version, execution_count)
            tier_count = self._counts[tier]
            results: list[tuple[int, bool]] = []
            for record in records:
                if record.event_id is not None:
                    found = connection.execute(
                        f"SELECT global_sequence FROM {tier}_records "
                        "WHERE execution_id = ? AND event_id = ?",
                        (execution_id, record.event_id),
                    ).fetchone()
                    if found:
                        results.append((found[0], True))
                        continue
                cursor = connection.execute(
                    f"INSERT INTO {tier}_records "
                    "(execution_id, transaction_id, event_id, byte_len, payload) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (
                        execution_id,
                        record.transaction_id,
                        record.event_id,
                        len(record.payload.encode()),
                        record.payload,
                    ),
                )
                assert cursor.lastrowid is not None
                results.append((cursor.lastrowid, False))
            added = sum(1 for _, deduplicated in results if not deduplicated)
            if added:
                connection.execute(
                    f"INSERT INTO {tier}_executions VALUES (?, ?) ON CONFLICT (execution_id) "
                    "DO UPDATE SET record_count = record_count + excluded.record_count",
                    (execution_id, added),
                )
                connection.execute(
                    "UPDATE tier_counts SET record_count = record_count + ? WHERE tier = ?",
                    (added, tier),
                )
            tier_count += added
            # log_record_count: the tier's count after the operation.
            return [AppendResult(seq, tier_count, dedup) for seq, dedup in results], added

        results, added = self._write(write)
        self._counts[tier] += added
        return results

    @refuses_loop_thread
    def execution_count(self, tier: str, execution_id: str) -> int | None:
        """The execution's record count, or ``None`` if it has none in this tier."""
        _check_tier(tier)
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
        _check_tier(tier)
        return self._pages(
            f"SELECT global_sequence, execution_id, transaction_id, byte_len, payload "
            f"FROM {tier}_records WHERE execution_id = ? AND global_sequence > ? "
            "ORDER BY global_sequence LIMIT ?",
            (execution_id,),
            after,
        )

    @refuses_loop_thread
    def iter_scan(self, tier: str, *, after: int = 0) -> Iterator[list[TierRecord]]:
        """Every record of the tier with ``global_sequence > after``, ascending, in pages."""
        _check_tier(tier)
        return self._pages(
            f"SELECT global_sequence, execution_id, transaction_id, byte_len, payload "
            f"FROM {tier}_records WHERE global_sequence > ? ORDER BY global_sequence LIMIT ?",
            (),
            after,
        )

    def _pages(self, sql: str, head: tuple[object, ...], after: int) -> Iterator[list[TierRecord]]:
        # One short query per page, so no read transaction stays open while the caller
        # encodes a page (or stops early). The connection goes back to the pool when the
        # iteration ends or is dropped.
        with self._connection() as connection:
            while True:
                rows = connection.execute(sql, (*head, after, PAGE_ROWS)).fetchall()
                if not rows:
                    return
                yield [TierRecord(*row) for row in rows]
                if len(rows) < PAGE_ROWS:
                    return
                after = rows[-1][0]


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
