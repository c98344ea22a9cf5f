"""Each data face's Gate, from the settings: how many requests it serves at once, how many
wait, and how long; and the tier's write lane."""

from __future__ import annotations

from collections.abc import Mapping

from ..admission import Gate
from ..config import Config, cpu_quota
from ..protocol.tier import WRITE_OPS as TIER_WRITE_OPS

CLAIM_MAX_READS = 64
"""Deliveries per claim face whose body is being read at once (at most this many bodies,
each at most max_request_bytes, are in memory for reads)."""


ADMITTED_OPS: Mapping[str, tuple[str, ...]] = {
    "tier": ("append", "append_batch", "read_execution", "scan"),
    "cmd_ingest": ("publish", "publish_batch"),
    "evt_ingest": ("publish", "publish_batch"),
    "cmd_claim": ("next", "dead", "requeue", "purge", "lag"),
    "evt_claim": ("next", "dead", "requeue", "purge", "lag"),
    "evt_subscribe": ("subscribe",),
}
"""The ops that ask each face's Gate for a slot (their shed counters start at 0)."""


def lanes_for(face: str, config: Config) -> dict[str, Gate]:
    """The ops of ``face`` admitted by a Gate of their own: the tier face's writes
    (``CMDBUS_TIER_WRITES=lane``), with the reads' waiters and shed rule. Reads page
    through big executions and hold their slots long; in NoETL the appends are the
    critical path, and sharing the Gate had them shed as ``busy`` by a crowd of readers.

    Its slots (``tier_max_pending_writes``) are appends queued for or in the tier's group
    commit, which takes every one waiting into one transaction, and deletes. One slot at
    a time runs a thread of its own (a delete): SQLite takes one writer, so a second
    writing thread only waited for the write lock, where the Gate can neither see nor
    shed it (`benchmarks/stall.py`: the appends beside the readers)."""
    if face != "tier" or config.tier_writes != "lane":
        return {}
    writes = Gate(
        "tier",
        name="tier_writes",
        max_inflight=config.tier_max_pending_writes,
        max_waiters=config.tier_max_waiters,
        shed_after=config.tier_shed_after_ms / 1000,
        default_budget=config.default_budget_ms / 1000,
        max_threads=1,
        ops=TIER_WRITE_OPS,
    )
    return dict.fromkeys(TIER_WRITE_OPS, writes)


def gate_for(face: str, config: Config) -> Gate:
    """The Gate of a data face: the tier face's from its settings; an ingest face's slots
    are publishes pending a group commit; a claim face's, deliveries whose body is being
    read; the subscribe face's, catch-up page reads (the CPU quota)."""
    budget = config.default_budget_ms / 1000
    if face in ("cmd_ingest", "evt_ingest"):
        # Slots are publishes queued for or in a group commit (see bus/committer.py).
        pending = config.ingest_max_pending
        return Gate(
            face,
            max_inflight=pending,
            max_waiters=pending,
            shed_after=1.0,
            default_budget=budget,
            ops=ADMITTED_OPS[face],
        )
    if face == "tier":
        return Gate(
            face,
            max_inflight=config.tier_max_inflight,
            max_waiters=config.tier_max_waiters,
            shed_after=config.tier_shed_after_ms / 1000,
            default_budget=budget,
            ops=ADMITTED_OPS[face],
        )
    quota = cpu_quota()
    if face in ("cmd_claim", "evt_claim"):
        # Slots are mostly deliveries whose body is queued for or in a batched read
        # (bus/bodies.py): they bound the bodies held in memory. The thread work slots
        # run (`dead` listings) stays within the CPU quota.
        return Gate(
            face,
            max_inflight=CLAIM_MAX_READS,
            max_waiters=8 * CLAIM_MAX_READS,
            shed_after=1.0,
            default_budget=budget,
            max_threads=quota,
            ops=ADMITTED_OPS[face],
        )
    # evt_subscribe: every slot is a catch-up page read in a thread.
    return Gate(
        face,
        max_inflight=quota,
        max_waiters=8 * quota,
        shed_after=1.0,
        default_budget=budget,
        ops=ADMITTED_OPS[face],
    )
