"""How the tier store appends: many requests in one write transaction (the tier's group
commit), each request checked before it writes anything, the counts written once."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Final, TypeAlias

import attrs

TIERS: Final = ("eventlog", "projection", "catalog")


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
class Appending:
    """One append request: records for one execution of one tier; with
    ``expected_version``, the execution's record count before them must be that."""

    tier: str
    execution_id: str
    records: Sequence[NewRecord]
    expected_version: int | None = None


@attrs.frozen
class AppendResult:
    global_sequence: int
    log_record_count: int
    deduplicated: bool


Outcome: TypeAlias = list[AppendResult] | Exception
"""A request's results, or the exception that refused it."""


def check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; tiers: {', '.join(TIERS)}")


def append_all(
    connection: sqlite3.Connection,
    requests: Sequence[Appending],
    tier_counts: Mapping[str, int],
    now: float,
) -> tuple[list[Outcome], Counter[str]]:
    """Append the requests, one after another, inside the caller's transaction; each
    request's outcome, and the records added per tier.

    A request is refused (its outcome a :class:`VersionConflict` or ``ValueError``)
    before it writes anything, so the others go on. A record whose ``event_id`` is
    stored for its execution (or was earlier in this transaction) is not stored again;
    a request whose ``expected_version`` has passed because this same write is stored
    (the same event ids from that version on) is answered as deduplicated, not refused.
    ``tier_counts`` are the tiers' counts before the transaction (for
    ``log_record_count``, the tier's count after each request); ``now`` is the
    executions' ``last_at``."""
    # The counts (each execution's, each tier's) are written once per transaction, not
    # once per request: every statement gives up the GIL and then waits to take it back
    # from a busy loop (`benchmarks/lane_gil.py`).
    executions: dict[tuple[str, str], int] = {}  # each one's count, as of this transaction
    added: Counter[tuple[str, str]] = Counter()
    tier_added: Counter[str] = Counter()
    outcomes: list[Outcome] = []
    for request in requests:
        key = (request.tier, request.execution_id)
        try:
            check_tier(request.tier)
            if key not in executions:
                executions[key] = _execution_count(connection, *key)
            expected = request.expected_version
            if expected is not None and expected != executions[key]:
                stored = _stored_at(connection, request, expected)
                if stored is None:
                    raise VersionConflict(expected, executions[key])
                tier_count = tier_counts[request.tier] + tier_added[request.tier]
                outcomes.append([AppendResult(seq, tier_count, True) for seq in stored])
                continue
        except (ValueError, VersionConflict) as exc:
            outcomes.append(exc)
            continue
        results = [_insert(connection, request, record) for record in request.records]
        count = sum(1 for _, deduplicated in results if not deduplicated)
        executions[key] += count
        added[key] += count
        tier_added[request.tier] += count
        tier_count = tier_counts[request.tier] + tier_added[request.tier]
        outcomes.append([AppendResult(seq, tier_count, dedup) for seq, dedup in results])
    for (tier, execution_id), count in added.items():
        if count:
            connection.execute(
                f"INSERT INTO {tier}_executions VALUES (?, ?, ?) ON CONFLICT (execution_id) "
                "DO UPDATE SET record_count = record_count + excluded.record_count, "
                "last_at = excluded.last_at",
                (execution_id, count, now),
            )
    for tier, count in tier_added.items():
        if count:
            connection.execute(
                "UPDATE tier_counts SET record_count = record_count + ? WHERE tier = ?",
                (count, tier),
            )
    return outcomes, tier_added


def _execution_count(connection: sqlite3.Connection, tier: str, execution_id: str) -> int:
    row = connection.execute(
        f"SELECT record_count FROM {tier}_executions WHERE execution_id = ?", (execution_id,)
    ).fetchone()
    return int(row[0]) if row else 0


def _stored_at(
    connection: sqlite3.Connection, request: Appending, expected: int
) -> list[int] | None:
    """The global sequences of the request's records if this very write is stored
    already: each record's ``event_id`` found, at the execution's positions from
    ``expected`` on (a repeat after a lost reply). None when it is not: a record without
    an ``event_id``, one not stored, or stored at another position (another write)."""
    tier, execution_id = request.tier, request.execution_id
    stored = []
    for position, record in enumerate(request.records, expected):
        if record.event_id is None:
            return None
        found = connection.execute(
            f"SELECT global_sequence FROM {tier}_records WHERE execution_id = ? AND event_id = ?",
            (execution_id, record.event_id),
        ).fetchone()
        if found is None:
            return None
        before = connection.execute(  # its position: the execution's records before it
            f"SELECT COUNT(*) FROM {tier}_records WHERE execution_id = ? AND global_sequence < ?",
            (execution_id, found[0]),
        ).fetchone()
        if before[0] != position:
            return None
        stored.append(int(found[0]))
    return stored or None


def _insert(
    connection: sqlite3.Connection, request: Appending, record: NewRecord
) -> tuple[int, bool]:
    """Store one record: (its global_sequence, False); or find its duplicate: (the
    first one's, True)."""
    tier, execution_id = request.tier, request.execution_id
    if record.event_id is not None:
        found = connection.execute(
            f"SELECT global_sequence FROM {tier}_records WHERE execution_id = ? AND event_id = ?",
            (execution_id, record.event_id),
        ).fetchone()
        if found:
            return int(found[0]), True
    cursor = connection.execute(
        f"INSERT INTO {tier}_records (execution_id, transaction_id, event_id, byte_len, payload) "
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
    return cursor.lastrowid, False
