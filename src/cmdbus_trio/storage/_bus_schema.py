"""The bus log's tables, created or brought up to date when a store opens."""

from __future__ import annotations

import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    sort_key INTEGER PRIMARY KEY AUTOINCREMENT,
    subject TEXT NOT NULL,
    record TEXT NOT NULL,
    traceparent TEXT,
    tracestate TEXT
);
CREATE TABLE IF NOT EXISTS msg_ids (
    msg_id TEXT PRIMARY KEY,
    sort_key INTEGER NOT NULL,
    subject TEXT NOT NULL,
    published_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS msg_ids_by_age ON msg_ids (published_at);
CREATE TABLE IF NOT EXISTS acks (
    consumer TEXT NOT NULL,
    sort_key INTEGER NOT NULL,
    PRIMARY KEY (consumer, sort_key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS positions (
    consumer TEXT PRIMARY KEY,
    settled_below INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS groups (
    name TEXT PRIMARY KEY,
    start_after INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dead (
    consumer TEXT NOT NULL,
    sort_key INTEGER NOT NULL,
    deliveries INTEGER NOT NULL,
    died_at REAL,
    PRIMARY KEY (consumer, sort_key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS deliveries (
    consumer TEXT NOT NULL,
    sort_key INTEGER NOT NULL,
    deliveries INTEGER NOT NULL,
    PRIMARY KEY (consumer, sort_key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS owed (
    consumer TEXT NOT NULL,
    sort_key INTEGER NOT NULL,
    PRIMARY KEY (consumer, sort_key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS dead_by_key ON dead (sort_key);
CREATE INDEX IF NOT EXISTS owed_by_key ON owed (sort_key);
CREATE TABLE IF NOT EXISTS retention_floor (
    only INTEGER PRIMARY KEY CHECK (only = 0),
    deleted_through INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS eviction_floor (
    only INTEGER PRIMARY KEY CHECK (only = 0),
    evicted_through INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS marks (
    at REAL PRIMARY KEY,
    newest INTEGER NOT NULL,
    settled INTEGER NOT NULL
) WITHOUT ROWID;
"""


def create(connection: sqlite3.Connection, now: float) -> tuple[int, int, int]:
    """Create the tables, or upgrade an older store's; returns what the log counts
    without reading the store: its records, the newest sort key retention deleted, and
    the newest sort key handed out."""
    connection.executescript(SCHEMA)
    columns = {row[1] for row in connection.execute("PRAGMA table_info(records)")}
    if "traceparent" not in columns:  # a store made before trace context: no record has any
        connection.execute("ALTER TABLE records ADD COLUMN traceparent TEXT")
        connection.execute("ALTER TABLE records ADD COLUMN tracestate TEXT")
    # Only traced records are in it: an untraced append does not touch it.
    connection.execute(
        "CREATE INDEX IF NOT EXISTS records_traced ON records (sort_key) "
        "WHERE traceparent IS NOT NULL"
    )
    columns = {row[1] for row in connection.execute("PRAGMA table_info(dead)")}
    if "died_at" not in columns:  # a store made before retention
        connection.execute("ALTER TABLE dead ADD COLUMN died_at REAL")
    # After the column exists: in the script above, an old store's dead table has none.
    connection.execute("CREATE INDEX IF NOT EXISTS dead_by_age ON dead (died_at)")
    # Dead letters of unknown age count from now: kept a whole window, never less.
    connection.execute("UPDATE dead SET died_at = ? WHERE died_at IS NULL", (now,))
    records = int(connection.execute("SELECT count(*) FROM records").fetchone()[0])
    row = connection.execute("SELECT deleted_through FROM retention_floor").fetchone()
    deleted_through = int(row[0]) if row else 0
    row = connection.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
    return records, deleted_through, int(row[0]) if row else 0


def traced_range(connection: sqlite3.Connection) -> tuple[int, int] | None:
    """The lowest and highest sort keys of records stored with trace context (from the
    partial index), or None when there are none."""
    low, high = connection.execute(
        "SELECT min(sort_key), max(sort_key) FROM records WHERE traceparent IS NOT NULL"
    ).fetchone()
    return None if low is None else (int(low), int(high))
