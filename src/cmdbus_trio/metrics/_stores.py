"""The storage families of the metric catalogue (:mod:`cmdbus_trio.metrics` exports
them): the stores' files, connections, WAL and retention."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from ._registry import REGISTRY

STORE_CONNECTION_WAITS = Counter(
    "cmdbus_store_connection_waits",
    "Calls on a store that found every SQLite connection of its pool in use and waited for "
    "one. The pool is fixed at start (the stores open no file later); a steady rate means "
    "the store's calls outnumber its connections: CPU or the disk is the limit.",
    ["store"],
    registry=REGISTRY,
)
RETAINED = Counter(
    "cmdbus_retention_deleted",
    "Rows deleted by retention or clean-up, by store and kind: a bus log's records (settled "
    "by every consumer and out of their keep windows) and dead_letters (older than "
    "CMDBUS_DEAD_RETENTION_MS); the event log's evicted records (the oldest, deleted "
    "whatever the groups did to keep it under CMDBUS_EVT_MAX_BYTES); the tier's records "
    "(delete_execution).",
    ["store", "kind"],
    registry=REGISTRY,
)
EVICTED_UNCONSUMED = Counter(
    "cmdbus_evicted_unconsumed",
    "Events evicted to keep the event log under CMDBUS_EVT_MAX_BYTES before the group "
    "acked them (undelivered, in flight, waiting for a redelivery, or dead letters), by "
    "consumer group: events that group never processed.",
    ["group"],
    registry=REGISTRY,
)
STORE_BYTES = Gauge(
    "cmdbus_store_bytes",
    "Bytes the store's files take on disk (database and WAL), measured every "
    "CMDBUS_RETENTION_INTERVAL_MS in a worker thread.",
    ["store"],
    registry=REGISTRY,
)
STORE_WAL_BYTES = Gauge(
    "cmdbus_store_wal_bytes",
    "Bytes of the store's WAL file, measured with the store sizes.",
    ["store"],
    registry=REGISTRY,
)
STORE_CHECKPOINT_AGE = Gauge(
    "cmdbus_store_checkpoint_age_seconds",
    "Seconds since the store's WAL was last checkpointed in full (by the writer or by "
    "Litestream: its header's checkpoint number moved, or it was truncated), or since "
    "the writer started; measured with the store sizes. It grows while the store takes "
    "no writes, and also while nothing checkpoints a WAL that grows.",
    ["store"],
    registry=REGISTRY,
)
STORE_WAL_CEILING = Gauge(
    "cmdbus_store_wal_ceiling_bytes", "The setting CMDBUS_WAL_CEILING_BYTES.", registry=REGISTRY
)
WAL_CEILING_CHECKPOINTS = Counter(
    "cmdbus_store_wal_ceiling_checkpoints_total",
    "Checkpoints the writer made because a store's WAL was past CMDBUS_WAL_CEILING_BYTES "
    "(with CMDBUS_CHECKPOINTS=litestream: Litestream is not checkpointing).",
    ["store"],
    registry=REGISTRY,
)
DATA_DIR_FREE = Gauge(
    "cmdbus_data_dir_free_bytes",
    "Bytes free for the writer on the data dir's file system (its volume), measured with "
    "the store sizes.",
    registry=REGISTRY,
)
DATA_DIR_CAPACITY = Gauge(
    "cmdbus_data_dir_capacity_bytes",
    "Size of the data dir's file system (its volume).",
    registry=REGISTRY,
)
STORE_RECORDS = Gauge(
    "cmdbus_store_records",
    "Records the store holds (bus logs: records of the log; tier: records of every tier). "
    "Read from memory.",
    ["store"],
    registry=REGISTRY,
)
