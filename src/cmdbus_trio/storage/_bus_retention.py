"""The bus log's deleting transactions: retention by age and settlement, and eviction
by size. Each deletes a bounded batch in one short transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping

import attrs

RETENTION_BATCH = 1000
"""Records (and, apart, dead letters) one retention step deletes at most: one short
transaction, so a publish never waits long behind it."""


@attrs.frozen
class Retained:
    """What one step of :meth:`BusLog.retain` deleted."""

    records: int
    dead_letters: int
    more: bool
    """A batch was full: there may be more to delete now."""
    through: int = 0
    """The newest sort key of the records deleted (0: none)."""


@attrs.frozen
class Evicted:
    """What one :meth:`BusLog.evict` deleted."""

    records: int
    dead_letters: dict[str, int]
    """Per consumer, its dead letters deleted with their records."""
    through: int


@attrs.frozen(kw_only=True)
class Windows:
    """How long a bus log keeps what (see :meth:`BusLog.retain`)."""

    consumers: Mapping[str, int] | None
    keep_settled: float | None
    keep_published: float | None
    keep_dead: float
    mark_every: float


def retain_step(
    connection: sqlite3.Connection, windows: Windows, *, now: float, newest: int
) -> Retained:
    """One step of retention (``newest``: the newest sort key handed out)."""
    settled = _settled_by_all(connection, windows.consumers, newest)
    newest_mark = connection.execute("SELECT max(at) FROM marks").fetchone()[0]
    if newest_mark is None or newest_mark <= now - windows.mark_every:
        connection.execute("INSERT OR REPLACE INTO marks VALUES (?, ?, ?)", (now, newest, settled))
    below = settled
    if windows.keep_settled is not None:
        below = min(below, _mark(connection, "settled", now - windows.keep_settled))
    if windows.keep_published is not None:
        below = min(below, _mark(connection, "newest", now - windows.keep_published) + 1)
    gone = connection.execute(
        "DELETE FROM records WHERE sort_key IN (SELECT sort_key FROM records r "
        "WHERE r.sort_key < ? "
        "AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.sort_key = r.sort_key) "
        "AND NOT EXISTS (SELECT 1 FROM owed o WHERE o.sort_key = r.sort_key) "
        "ORDER BY r.sort_key LIMIT ?) RETURNING sort_key",
        (below, RETENTION_BATCH),
    ).fetchall()
    deleted = len(gone)
    through = max((key for (key,) in gone), default=0)
    raise_floor(connection, through)
    # The letter goes; its record follows in a later step once no one needs it.
    dead = connection.execute(
        "DELETE FROM dead WHERE (consumer, sort_key) IN (SELECT consumer, sort_key "
        "FROM dead WHERE died_at <= ? ORDER BY died_at LIMIT ?)",
        (now - windows.keep_dead, RETENTION_BATCH),
    ).rowcount
    # Marks older than the longest window but the newest of them are not needed.
    windows_kept = (windows.keep_settled, windows.keep_published, 0.0)
    longest = max(w for w in windows_kept if w is not None)
    connection.execute(
        "DELETE FROM marks WHERE at < (SELECT max(at) FROM marks WHERE at <= ?)",
        (now - longest,),
    )
    more = deleted == RETENTION_BATCH or dead == RETENTION_BATCH
    return Retained(records=deleted, dead_letters=dead, more=more, through=through)


def evict(connection: sqlite3.Connection, through: int) -> Evicted:
    """Delete every record up to ``through`` with all the consumers recorded about it."""
    gone = connection.execute("DELETE FROM records WHERE sort_key <= ?", (through,)).rowcount
    dead: dict[str, int] = {}
    for (consumer,) in connection.execute(
        "DELETE FROM dead WHERE sort_key <= ? RETURNING consumer", (through,)
    ).fetchall():
        dead[consumer] = dead.get(consumer, 0) + 1
    connection.execute("DELETE FROM owed WHERE sort_key <= ?", (through,))
    consumers = [
        row[0]
        for row in connection.execute(
            "SELECT name FROM groups UNION SELECT consumer FROM positions"
        )
    ]
    for table in ("acks", "deliveries"):  # by their primary key, per consumer
        connection.executemany(
            f"DELETE FROM {table} WHERE consumer = ? AND sort_key <= ?",
            [(consumer, through) for consumer in consumers],
        )
    raise_floor(connection, through)
    # Apart from the retention floor: a msg_id retry of an evicted record must say so,
    # one of a record retention deleted (settled by every group) need not.
    connection.execute(
        "INSERT INTO eviction_floor VALUES (0, ?) ON CONFLICT (only) DO UPDATE "
        "SET evicted_through = max(evicted_through, excluded.evicted_through)",
        (through,),
    )
    return Evicted(records=gone, dead_letters=dead, through=through)


def eviction_floor(connection: sqlite3.Connection, records: int, over: int, down_to: int) -> int:
    """See :meth:`BusLog.eviction_floor` (``records``: the log's count)."""
    used = used_bytes(connection)
    if used <= over or not records:
        return 0
    excess = used - min(down_to, over)
    count = min(RETENTION_BATCH, max(1, -(-records * excess // used)))
    row = connection.execute(
        "SELECT max(sort_key) FROM (SELECT sort_key FROM records ORDER BY sort_key LIMIT ?)",
        (count,),
    ).fetchone()
    return int(row[0] or 0)


def raise_floor(connection: sqlite3.Connection, through: int) -> None:
    """In a deleting transaction: readers starting before ``through`` are told so."""
    if through:
        connection.execute(
            "INSERT INTO retention_floor VALUES (0, ?) ON CONFLICT (only) DO UPDATE "
            "SET deleted_through = MAX(deleted_through, excluded.deleted_through)",
            (through,),
        )


def used_bytes(connection: sqlite3.Connection) -> int:
    pages = connection.execute("PRAGMA page_count").fetchone()[0]
    free = connection.execute("PRAGMA freelist_count").fetchone()[0]
    size = connection.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)


def _settled_by_all(
    connection: sqlite3.Connection, consumers: Mapping[str, int] | None, newest: int
) -> int:
    if consumers is None:
        consumers = dict(connection.execute("SELECT name, start_after FROM groups"))
    positions = dict(connection.execute("SELECT consumer, settled_below FROM positions"))
    return min(
        (max(positions.get(name, 0), start + 1) for name, start in consumers.items()),
        default=newest + 1,
    )


def _mark(connection: sqlite3.Connection, column: str, at_or_before: float) -> int:
    """``column`` of the newest mark made at or before the time; 0 when none is that old."""
    row = connection.execute(
        f"SELECT {column} FROM marks WHERE at <= ? ORDER BY at DESC LIMIT 1", (at_or_before,)
    ).fetchone()
    return int(row[0]) if row else 0
