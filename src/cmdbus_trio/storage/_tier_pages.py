"""How the tier store reads a page of reply fragments: the SQL that has SQLite write them
(where it escapes exactly as our encoder does) and the conversion of its rows."""

from __future__ import annotations

import sqlite3
from typing import Any, Final

from cmdbus_trio.protocol.pages import Fragments
from cmdbus_trio.protocol.tier import record_fragment

# A record's reply fragment made by SQLite, which escapes the payload without the GIL: a
# reader's page then holds the GIL only to copy bytes, not to escape a megabyte of JSON
# (issue 16 item 1: the appends and the probes get that time). Used only where SQLite
# writes exactly the bytes of protocol.tier.record_fragment (checked at open).
FRAGMENT_SQL: Final = (
    "CAST(json_object('global_sequence', global_sequence, "
    "'execution_id', execution_id, 'transaction_id', transaction_id, "
    "'byte_len', byte_len, 'payload', payload) AS BLOB)"
)
# A bounded page: up to PAGE_ROWS records after a sort key, chosen by their lengths first so
# that nothing past PAGE_BYTES is read (the payload is read only for the records chosen).
BOUNDED_PAGE_SQL: Final = (
    "SELECT {columns} FROM ("
    "SELECT global_sequence, sum(byte_len) OVER (ORDER BY global_sequence) - byte_len AS before "
    "FROM (SELECT global_sequence, byte_len FROM {table} WHERE {condition} "
    "global_sequence > ? ORDER BY global_sequence LIMIT ?)"
    ") AS page JOIN {table} USING (global_sequence) WHERE page.before < ? "
    "ORDER BY global_sequence"
)
# The page's fragments in one result row: the sequences and byte lengths comma-separated,
# then the fragments comma-separated as a reply lists them (group_concat keeps the order
# the subquery feeds it; a test holds it). The sqlite3 module releases and retakes the GIL
# for every row, and beside a busy loop each retake can wait: pages of one row per record
# read at about half speed (docs/benchmarks.md). A reply then takes a page's records by
# slicing the blob (protocol.pages.Fragments), with no Python code per record.
FRAGMENTS_SQL: Final = (
    "SELECT group_concat(global_sequence), group_concat(length(fragment)), "
    "CAST(group_concat(fragment, ',') AS BLOB) FROM ({page})"
)
# Every character class JSON escapes differently across encoders.
_ESCAPE_SAMPLE: Final = "".join(map(chr, range(0x20))) + '"\\/\x7f\u00e9\u2028\U0001f600'


def encode_rows(rows: list[Any]) -> tuple[Fragments, int | None]:
    page = Fragments.of((row[0], record_fragment(*row)) for row in rows)
    return page, page.keys[-1] if rows else None


def joined_fragments(rows: list[Any]) -> tuple[Fragments, int | None]:
    [(sequences, lengths, blob)] = rows
    if sequences is None:  # no records: group_concat of nothing
        return Fragments((), (), b""), None
    keys = list(map(int, sequences.split(",")))
    return Fragments.joined(keys, map(int, lengths.split(",")), blob), keys[-1]


def sqlite_writes_fragments(connection: sqlite3.Connection) -> bool:
    """Whether this SQLite has ``json_object`` and escapes as our encoder does."""
    row = (1, _ESCAPE_SAMPLE, "", 2, _ESCAPE_SAMPLE)
    try:
        written = connection.execute(
            f"SELECT 0, {FRAGMENT_SQL} FROM (SELECT ? AS global_sequence, ? AS execution_id, "
            "? AS transaction_id, ? AS byte_len, ? AS payload)",
            row,
        ).fetchone()[1]
    except sqlite3.Error:  # built without JSON
        return False
    return bool(written == record_fragment(*row))
