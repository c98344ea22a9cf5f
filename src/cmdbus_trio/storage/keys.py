"""Keys that never name two records: the key floor a restore leaves in a data directory,
and the stores' key counters (``sqlite_sequence``) raised to it when they open."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

from .datadir import DataDirError, fsync_path

KEY_FLOOR_NAME: Final = "keys.floor"
"""The least key any counter of the directory's stores gives out after a restore: a
store or keyed table made after the restore (absent from the backup) starts there too,
so no key names two records whichever table the lost writer gave it in."""

KEYED_TABLES: Final = (
    "SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE '%AUTOINCREMENT%'"
)
"""The tables whose keys a counter (``sqlite_sequence``) gives out."""


def raise_key_counters(connection: sqlite3.Connection, floor: int) -> bool:
    """Every key counter of the store at ``floor`` at least, a table's that never counted
    too (:func:`read_key_floor`): so a keyed table or a store made after a restore starts
    past every key the lost writer gave. True when a counter moved."""
    if floor <= 0:
        return False
    tables = [name for (name,) in connection.execute(KEYED_TABLES)]
    if not tables:
        return False
    moved = 0
    connection.execute("BEGIN IMMEDIATE")
    try:
        for table in tables:
            moved += connection.execute(
                "UPDATE sqlite_sequence SET seq = ? WHERE name = ? AND seq < ?",
                (floor, table, floor),
            ).rowcount
            moved += connection.execute(
                "INSERT INTO sqlite_sequence (name, seq) SELECT ?, ? "
                "WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = ?)",
                (table, floor, table),
            ).rowcount
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    return moved > 0


def read_key_floor(data_dir: Path) -> int:
    """The directory's key floor (:data:`KEY_FLOOR_NAME`), 0 where it has none.

    Error handling: :class:`DataDirError` naming the file when it is not a whole number:
    a floor not known is not taken for none (keys could be given twice)."""
    path = data_dir / KEY_FLOOR_NAME
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return 0
    if not text.isdigit():
        raise DataDirError(data_dir, f"{KEY_FLOOR_NAME}: {text[:40]!r} is not a whole number")
    return int(text)


def write_key_floor(data_dir: Path, floor: int) -> None:
    """Set the directory's key floor to ``floor`` (never lower), durably."""
    floor = max(floor, read_key_floor(data_dir))
    partial = data_dir / f"{KEY_FLOOR_NAME}.partial"
    partial.write_text(f"{floor}\n")
    fsync_path(partial)
    partial.rename(data_dir / KEY_FLOOR_NAME)
    fsync_path(data_dir)
