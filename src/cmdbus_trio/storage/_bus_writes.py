"""The bus log's group-commit transaction: what one :meth:`BusLog.commit
<cmdbus_trio.storage.buslog.BusLog.commit>` writes, in order."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

import attrs

from cmdbus_trio.protocol.bus import Published
from cmdbus_trio.protocol.trace import TraceContext

MSG_ID_PRUNE_BATCH = 1000
"""msg_ids past the window deleted per publish at most, so pruning never makes one
transaction long."""


@attrs.frozen
class BusEntry:
    """A record to publish: its subject, the record as JSON text (as it will be
    delivered), an optional ``msg_id`` for deduplication, and the trace context it was
    published with, if any (stored beside it)."""

    subject: str
    record: str
    msg_id: str | None = None
    trace: TraceContext | None = None


@attrs.frozen(kw_only=True)
class Settlements:
    """What consumers settled and recorded, for :meth:`BusLog.commit
    <cmdbus_trio.storage.buslog.BusLog.commit>`. A consumer is a claim group
    ("commands" for the command bus)."""

    acks: Sequence[tuple[str, int]] = ()
    """``(consumer, sort_key)``."""
    dead: Sequence[tuple[str, int, int]] = ()
    """Dead letters, ``(consumer, sort_key, deliveries)``."""
    positions: Sequence[tuple[str, int]] = ()
    """``(consumer, settled_below)``: every record below it is acked or dead for that
    consumer, so its acks and counts there are no longer needed and are pruned."""
    counts: Sequence[tuple[str, int, int]] = ()
    """Delivery counts of unsettled records, ``(consumer, sort_key, deliveries)``."""
    dropped: Sequence[str] = ()
    """Groups deleted, with all they recorded (after the rest of the transaction, so an
    ack of theirs committed with it leaves nothing behind)."""
    dead_moves: Sequence[tuple[str, int, bool]] = ()
    """``(consumer, sort_key, requeue)``: a dead letter requeued (it is the consumer's
    again, with a fresh delivery count, and stays so across a restart even below the
    consumer's settled position: it is *owed*) or purged (settled for good)."""
    owe: Sequence[tuple[str, int, int]] = ()
    """``(consumer, after, through)``: the consumer's position passes records in that
    range that it has not settled (they stayed unsettled too long): each is recorded as
    owed, so that a restart still loads it, before the position moves. It goes with a
    position, never alone."""

    def __bool__(self) -> bool:
        """Whether there is anything to write (``owe`` goes with a position)."""
        return bool(
            self.acks
            or self.dead
            or self.positions
            or self.counts
            or self.dropped
            or self.dead_moves
        )


NOTHING_SETTLED = Settlements()


def settle(
    connection: sqlite3.Connection,
    done: Settlements,
    now: float,
    moved: list[tuple[str, int]] | None,
) -> None:
    """Record ``done``: the counts, acks and dead letters first, then what is owed, the
    positions (pruning below them), the dead letters moved and the groups dropped."""
    if done.counts:
        connection.executemany("INSERT OR REPLACE INTO deliveries VALUES (?, ?, ?)", done.counts)
    settled = [*done.acks, *((consumer, key) for consumer, key, _ in done.dead)]
    if settled:  # a settled record's count is no longer needed, nor is it owed
        for table in ("deliveries", "owed"):
            connection.executemany(
                f"DELETE FROM {table} WHERE consumer = ? AND sort_key = ?", settled
            )
    if done.acks:
        connection.executemany("INSERT OR IGNORE INTO acks VALUES (?, ?)", done.acks)
    if done.dead:
        connection.executemany(
            "INSERT OR REPLACE INTO dead VALUES (?, ?, ?, ?)",
            [(*letter, now) for letter in done.dead],
        )
    # After this batch's acks and dead letters, before the prune of acks below the new
    # position: what is not settled by then is owed.
    for consumer, after, through in done.owe:
        connection.execute(
            "INSERT OR IGNORE INTO owed SELECT ?, r.sort_key FROM records r "
            "WHERE r.sort_key > ? AND r.sort_key <= ? "
            "AND NOT EXISTS (SELECT 1 FROM acks a WHERE a.consumer = ? "
            "AND a.sort_key = r.sort_key) "
            "AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.consumer = ? "
            "AND d.sort_key = r.sort_key)",
            (consumer, after, through, consumer, consumer),
        )
    for consumer, settled_below in done.positions:
        connection.execute(
            "INSERT INTO positions VALUES (?, ?) ON CONFLICT (consumer) DO UPDATE "
            "SET settled_below = MAX(settled_below, excluded.settled_below)",
            (consumer, settled_below),
        )
        connection.execute(
            "DELETE FROM acks WHERE consumer = ? AND sort_key < ?", (consumer, settled_below)
        )
        connection.execute(  # an owed record keeps its count
            "DELETE FROM deliveries WHERE consumer = ? AND sort_key < ? AND sort_key "
            "NOT IN (SELECT sort_key FROM owed WHERE consumer = ?)",
            (consumer, settled_below, consumer),
        )
    for consumer, sort_key, requeue in done.dead_moves:
        key = (consumer, sort_key)
        if not connection.execute(
            "DELETE FROM dead WHERE consumer = ? AND sort_key = ?", key
        ).rowcount:
            continue  # not dead (any more): requeued or purged meanwhile
        connection.execute("DELETE FROM deliveries WHERE consumer = ? AND sort_key = ?", key)
        table = "owed" if requeue else "acks"
        connection.execute(f"INSERT OR IGNORE INTO {table} VALUES (?, ?)", key)
        if moved is not None:
            moved.append(key)
    for group in done.dropped:
        connection.execute("DELETE FROM groups WHERE name = ?", (group,))
        for table in ("acks", "dead", "deliveries", "positions", "owed"):
            connection.execute(f"DELETE FROM {table} WHERE consumer = ?", (group,))


def append(
    connection: sqlite3.Connection,
    entries: Sequence[BusEntry],
    now: float,
    dedup_window: float,
) -> list[Published]:
    """Append ``entries`` in order; an entry whose ``msg_id`` was seen within the window
    appends nothing and answers with the first record's sort key (and whether it was
    evicted since)."""
    oldest = now - dedup_window
    connection.execute(
        "DELETE FROM msg_ids WHERE msg_id IN "
        "(SELECT msg_id FROM msg_ids WHERE published_at < ? LIMIT ?)",
        (oldest, MSG_ID_PRUNE_BATCH),
    )
    results: list[Published] = []
    for entry in entries:
        if entry.msg_id is not None:
            seen = connection.execute(
                "SELECT sort_key, subject FROM msg_ids WHERE msg_id = ? AND published_at >= ?",
                (entry.msg_id, oldest),
            ).fetchone()
            if seen:
                floor = connection.execute("SELECT evicted_through FROM eviction_floor").fetchone()
                evicted = floor is not None and seen[0] <= floor[0]
                results.append(Published(seen[0], seen[1], duplicate=True, evicted=evicted))
                continue
        trace = entry.trace
        cursor = connection.execute(
            "INSERT INTO records (subject, record, traceparent, tracestate) VALUES (?, ?, ?, ?)",
            (
                entry.subject,
                entry.record,
                None if trace is None else trace.traceparent,
                None if trace is None else trace.tracestate,
            ),
        )
        assert cursor.lastrowid is not None
        if entry.msg_id is not None:
            connection.execute(
                "INSERT OR REPLACE INTO msg_ids VALUES (?, ?, ?, ?)",
                (entry.msg_id, cursor.lastrowid, entry.subject, now),
            )
        results.append(Published(cursor.lastrowid, entry.subject, duplicate=False))
    return results
