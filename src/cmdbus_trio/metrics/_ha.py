"""The standby's families of the metric catalogue (:mod:`cmdbus_trio.metrics` exports
them): a member's role, its lease epoch, whether a standby is in sync, how far behind."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from ._registry import REGISTRY

HA_ROLE = Gauge(
    "cmdbus_ha_role",
    "1 for this member's role in its pair now (primary, standby, starting, draining), 0 "
    "for the others; no series on a writer without CMDBUS_HA_LEASE.",
    ["role"],
    registry=REGISTRY,
)
HA_EPOCH = Gauge(
    "cmdbus_ha_epoch",
    "The lease's epoch as this member last saw it: it grows with every acquisition.",
    registry=REGISTRY,
)
HA_IN_SYNC = Gauge(
    "cmdbus_ha_in_sync",
    "1 while acknowledgements wait for a standby the lease names in sync (on a primary), or "
    "while the lease names this standby in sync; 0 otherwise.",
    registry=REGISTRY,
)
HA_LAG_RECORDS = Gauge(
    "cmdbus_ha_replication_lag_records",
    "Transactions the primary committed that the standby has not confirmed yet (on either "
    "member, as far as it knows).",
    registry=REGISTRY,
)
HA_LAG_SECONDS = Gauge(
    "cmdbus_ha_replication_lag_seconds",
    "On the primary: how long the oldest transaction the standby has not confirmed has "
    "waited (0: all confirmed).",
    registry=REGISTRY,
)
HA_FAILOVERS = Counter(
    "cmdbus_ha_failovers",
    "Times this member became primary after another member held the lease (a failover or "
    "a switchover).",
    registry=REGISTRY,
)
HA_POD_LABEL_FAILURES = Counter(
    "cmdbus_ha_pod_label_failures",
    "Times a member could not label a pod with its role (CMDBUS_HA_POD_LABELS): the "
    "shard's Service may reach the wrong member until a retry succeeds.",
    registry=REGISTRY,
)
HA_WHILE_PRIMARY_EXITS = Counter(
    "cmdbus_ha_while_primary_exits",
    "Times the command run while primary (CMDBUS_HA_WHILE_PRIMARY) exited on its own; it "
    "is started again a second later.",
    registry=REGISTRY,
)
