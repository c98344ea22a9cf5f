"""The metric catalogue: every family the writer exports, in one place (the storage
families are written in ``_stores.py``, the standby's in ``_ha.py``, and exported here).

Names are part of the contract (docs/architecture.md, "Decisions"); HELP texts say exactly what the
code measures. This module never imports trio, so the storage layer may count into it.
Nothing here blocks: gauges that mirror live state read in-memory numbers only.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Info

from . import _tools
from ._ha import HA_EPOCH as HA_EPOCH
from ._ha import HA_FAILOVERS as HA_FAILOVERS
from ._ha import HA_IN_SYNC as HA_IN_SYNC
from ._ha import HA_LAG_RECORDS as HA_LAG_RECORDS
from ._ha import HA_LAG_SECONDS as HA_LAG_SECONDS
from ._ha import HA_POD_LABEL_FAILURES as HA_POD_LABEL_FAILURES
from ._ha import HA_ROLE as HA_ROLE
from ._ha import HA_WHILE_PRIMARY_EXITS as HA_WHILE_PRIMARY_EXITS
from ._registry import LATENCY_BUCKETS as LATENCY_BUCKETS
from ._registry import LOOP_LAG_BUCKETS as LOOP_LAG_BUCKETS
from ._registry import REGISTRY as REGISTRY
from ._stores import DATA_DIR_CAPACITY as DATA_DIR_CAPACITY
from ._stores import DATA_DIR_FREE as DATA_DIR_FREE
from ._stores import EVICTED_UNCONSUMED as EVICTED_UNCONSUMED
from ._stores import RETAINED as RETAINED
from ._stores import STORE_BYTES as STORE_BYTES
from ._stores import STORE_CHECKPOINT_AGE as STORE_CHECKPOINT_AGE
from ._stores import STORE_CONNECTION_WAITS as STORE_CONNECTION_WAITS
from ._stores import STORE_RECORDS as STORE_RECORDS
from ._stores import STORE_WAL_BYTES as STORE_WAL_BYTES
from ._stores import STORE_WAL_CEILING as STORE_WAL_CEILING
from ._stores import WAL_CEILING_CHECKPOINTS as WAL_CEILING_CHECKPOINTS
from ._tools import SubjectSeries as SubjectSeries
from ._tools import child as child

BUILD_INFO = Info("cmdbus_build", "Version of the running cmdbus-trio writer.", registry=REGISTRY)

REQUEST_DURATION = Histogram(
    "cmdbus_request_duration_seconds",
    "Seconds from a request's arrival (its frame fully read) to its reply being handed to the "
    "socket, including time queued for admission; recorded for every outcome, sheds included.",
    ["face", "op", "outcome"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "cmdbus_queue_wait_seconds",
    "Seconds an admitted request waited for a Gate slot (0 when one was free at once); "
    "shed requests are not in here but in cmdbus_shed_total.",
    ["face", "op"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SERVICE = Histogram(
    "cmdbus_service_seconds",
    "Seconds an admitted request held its Gate slot: from admission until its work "
    "(including any worker thread) returned.",
    ["face", "op"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
INFLIGHT = Gauge(
    "cmdbus_inflight",
    "Gate slots held right now: requests admitted whose work has not returned.",
    ["face"],
    registry=REGISTRY,
)
WAITERS = Gauge(
    "cmdbus_waiters",
    "Requests queued for a Gate slot right now.",
    ["face"],
    registry=REGISTRY,
)
CAPACITY = Gauge(
    "cmdbus_capacity",
    "Gate slots (max_inflight) of the face.",
    ["face"],
    registry=REGISTRY,
)
SHED = Counter(
    "cmdbus_shed_total",
    "Requests refused by admission control, by reason: waiters_full (queue full on arrival), "
    "queue_timeout (waited shed_after without a slot), deadline (the request's budget ran out "
    "before it could start).",
    ["face", "op", "reason"],
    registry=REGISTRY,
)
CONNECTIONS = Counter(
    "cmdbus_connections_total",
    "Data-face connections by outcome: accepted when opened; closed, protocol_error, "
    "write_error, too_large, idle_timeout, hello_timeout (no first frame within "
    "CMDBUS_HELLO_TIMEOUT_MS), unavailable (v1 only: a store that cannot "
    "write), unauthorized (no or wrong auth token; v1 when refused), over_capacity "
    "(closed at once: the face had CMDBUS_MAX_CONNECTIONS open) or internal_error (a bug, "
    "logged with its traceback) when they ended.",
    ["face", "outcome"],
    registry=REGISTRY,
)
FACE_CRASHES = Counter(
    "cmdbus_face_crashes_total",
    "Times a face's server task died with an unexpected error (the traceback is logged).",
    ["face"],
    registry=REGISTRY,
)
TASK_CRASHES = Counter(
    "cmdbus_task_crashes_total",
    "Times a background task (a bus's committer or body reader, claim timers, lag "
    "sampler, consumer groups, a face's shed watcher) died with an unexpected error (the "
    "traceback is logged; /readyz names it, /livez fails after the liveness window).",
    ["task"],
    registry=REGISTRY,
)
BODY_READS = Counter(
    "cmdbus_body_reads_total",
    "Record bodies a claim face handed to `next`, by where they came from: `memory` (the "
    "newest committed ones, kept) or `store` (read back in a worker thread).",
    ["store", "source"],
    registry=REGISTRY,
)
COMMIT_BATCH = Histogram(
    "cmdbus_commit_batch_records",
    "Records appended per group-commit transaction (one fsync each) of a store: a bus "
    "log, or the tier store.",
    ["store"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    registry=REGISTRY,
)
COMMIT_SECONDS = Histogram(
    "cmdbus_commit_seconds",
    "Duration of each group-commit transaction of a store (a bus log, the tier store), "
    "fsync included, as the committer's thread measured it: a slow disk shows here first.",
    ["store"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
DELIVERIES = Counter(
    "cmdbus_deliveries",
    "Records leased to a consumer (first deliveries and redeliveries), by subject: with "
    "the backlog, says whether a backlog is being worked at all.",
    ["subject"],
    registry=REGISTRY,
)
LOOP_LAG = Histogram(
    "cmdbus_loop_lag_seconds",
    "How late the event loop's heartbeat woke up compared with when it asked to: time the "
    "loop spent unable to run ready tasks.",
    buckets=LOOP_LAG_BUCKETS,
    registry=REGISTRY,
)
LOOP_TURNS_DEFERRED = Counter(
    "cmdbus_loop_turns_deferred",
    "Times a unit of data-plane work (a read, a batch of requests, a settling step) "
    "waited a turn of the event loop because the turn's data-plane share was spent: "
    "the data plane alone could fill the loop, and the share keeps the control face "
    "answering. Synced with each heartbeat.",
    registry=REGISTRY,
)
LOOP_TURNS = Counter(
    "cmdbus_loop_turns",
    "Turns of the event loop, each a wake-up (I/O, a timer, a thread's result, a task "
    "ready): what the loop's CPU follows at a steady rate. Synced with each heartbeat.",
    registry=REGISTRY,
)
LOOP_BUSY = Counter(
    "cmdbus_loop_busy_seconds",
    "Seconds the event loop spent running tasks rather than waiting for I/O or a timer; "
    "its rate is the loop's utilisation (1 = full: every further request waits for a "
    "turn). Synced with each heartbeat.",
    registry=REGISTRY,
)
LOOP_CONTROL_FIRST = Counter(
    "cmdbus_loop_control_first_seconds",
    "Seconds of event-loop turns in which the data plane waited, giving way to "
    "a ready control-face task (a probe or a scrape); at most a quarter of the loop's "
    "time. Synced with each heartbeat.",
    registry=REGISTRY,
)
LOOP_CONTROL = Counter(
    "cmdbus_loop_control_seconds",
    "CPU seconds the control face's tasks (probes, scrapes, the lag ports) ran on the event "
    "loop; paced to at most a tenth of it once a burst is spent. Synced with each heartbeat.",
    registry=REGISTRY,
)
CONTROL_PACED = Counter(
    "cmdbus_control_paced_seconds",
    "Seconds control-face requests waited because the control face had used its share of "
    "the event loop (a scrape flood; probes wait least). Synced with each heartbeat.",
    registry=REGISTRY,
)
CONTROL_CONNECTIONS = Gauge(
    "cmdbus_control_connections",
    "Open connections of the control face (port=control) or a NoETL lag port "
    "(cmd_lag, evt_lag); each holds at most a fixed number (64, 16 for a lag port).",
    ["port"],
    registry=REGISTRY,
)
CONTROL_CONNECTIONS_CLOSED = Counter(
    "cmdbus_control_connections_crowded_out",
    "Connections of the control face or a lag port closed to make room for a new one at "
    "the port's cap: the one quiet the longest (idle, or trickling a request) goes first. "
    "Above 0: something holds many connections to the port.",
    ["port"],
    registry=REGISTRY,
)
LOOP_BLOCKING_CALLS = Counter(
    "cmdbus_loop_blocking_calls_total",
    "Storage entry points called on the event-loop thread (refused; any non-zero is a bug).",
    ["entry"],
    registry=REGISTRY,
)
STORE_STATE = Gauge(
    "cmdbus_store_state",
    "1 for the store's current state, 0 for the others: ok; contended (a writer is "
    "waiting, or waited within the last 10 s, longer than the contention threshold for "
    "the write lock); "
    "poisoned (a write failed leaving the disk state unknown: writes are refused until "
    "restart). Read from memory; a scrape never waits for the store.",
    ["store", "state"],
    registry=REGISTRY,
)
REDELIVERIES = Counter(
    "cmdbus_redeliveries",
    "Deliveries of a record that had been delivered before (lease expired, nacked, or its "
    "consumer's connection closed), by subject.",
    ["subject"],
    registry=REGISTRY,
)
LEASES_RELEASED = Counter(
    "cmdbus_leases_released_total",
    "Leases ended because the connection holding them ended, by claim face and by the "
    "connection's outcome (as in cmdbus_connections_total): each record is redelivered "
    "at once. A worker that lost its connection mid-command finds its ack refused.",
    ["face", "outcome"],
    registry=REGISTRY,
)
SETTLES_REFUSED = Counter(
    "cmdbus_settles_refused_total",
    "Acks, nacks and extends answered false, by claim face, op and why (the reply's "
    "`why`): not_leased (settled already, its lease ran out, or no such record), "
    "leased_elsewhere (another consumer holds it now), lease_replaced (the same "
    "connection holds it by a newer lease). A rise of the first two says workers take "
    "longer than CMDBUS_ACK_WAIT_MS.",
    ["face", "op", "why"],
    registry=REGISTRY,
)
DEAD = Counter(
    "cmdbus_dead",
    "Records parked as dead letters after CMDBUS_MAX_DELIVER deliveries without an ack, "
    "by subject.",
    ["subject"],
    registry=REGISTRY,
)
FEED_SUBJECT_LAG = Gauge(
    "ehdb_feed_subject_lag",
    "Command backlog per subject (undelivered + delivered-unacked; dead letters excluded), "
    "sampled every second, never computed at scrape time.",
    ["subject"],
    registry=REGISTRY,
)
FEED_TOTAL_LAG = Gauge(
    "ehdb_feed_total_lag",
    "Command backlog over all subjects (the sum of ehdb_feed_subject_lag), sampled.",
    registry=REGISTRY,
)
FEED_SHARD_LAG = Gauge(
    "ehdb_feed_shard_lag",
    "Command backlog of this writer's shard (NoETL's name; equal to ehdb_feed_total_lag, "
    "one shard per writer), sampled.",
    ["shard"],
    registry=REGISTRY,
)
FEED_SHARD_COMMITTED = Gauge(
    "ehdb_feed_shard_committed",
    "The command bus's durable settled position minus one: every command up to it is acked "
    "or dead, and a restarted writer reloads what follows (NoETL's committed cursor).",
    ["shard"],
    registry=REGISTRY,
)
FEED_SHARD_INFLIGHT = Gauge(
    "ehdb_feed_shard_inflight",
    "Commands leased to a consumer and not yet acked, in this writer's shard: with "
    "ehdb_feed_shard_lag, high lag and 0 in flight is a stalled consumer.",
    ["shard"],
    registry=REGISTRY,
)
FEED_TOTAL_INFLIGHT = Gauge(
    "ehdb_feed_total_inflight",
    "Commands leased to a consumer and not yet acked (ehdb_feed_shard_inflight summed).",
    registry=REGISTRY,
)
EVENTS_GROUP_LAG = Gauge(
    "ehdb_events_group_lag",
    "Event backlog per consumer group (undelivered + delivered-unacked; dead letters "
    "excluded), sampled every second.",
    ["group"],
    registry=REGISTRY,
)
GROUPS_TAIL_LOADED = Counter(
    "cmdbus_groups_tail_loaded_records",
    "Event records (a key and a subject each) the consumer groups read back from the store: "
    "at start, from the lowest settled position of any group, and for a group created.",
    registry=REGISTRY,
)
SUBSCRIBERS = Gauge(
    "cmdbus_subscribers",
    "Live subscriptions on the event subscribe face.",
    registry=REGISTRY,
)
SUBSCRIBERS_DROPPED = Counter(
    "cmdbus_subscribers_dropped",
    "Subscribers cut off as slow consumers: more than CMDBUS_SUBSCRIBER_BUFFER records "
    "behind the live stream.",
    registry=REGISTRY,
)
READY = Gauge("cmdbus_ready", "1 when /readyz answers 200, else 0.", registry=REGISTRY)


SUBJECT_FOLDS = Counter(
    "cmdbus_subject_folds",
    'Subject-labelled samples counted under subject="_other" because the writer already '
    "exports CMDBUS_SUBJECT_SERIES subjects with their own series (subjects are client "
    "data: each one would be a series held forever).",
    registry=REGISTRY,
)
OTHER_SUBJECTS = "_other"
PENDING_BYTES = Gauge(
    "cmdbus_pending_bytes",
    "Request bytes a data face has taken in and not yet finished with (frames larger than "
    "a read from when their header is in, parsed, queued for or in their work), by face; "
    "at most CMDBUS_FACE_PENDING_BYTES: a flood of big frames waits in its sockets instead "
    "of in memory.",
    ["face"],
    registry=REGISTRY,
)
PENDING_BYTES_WAITERS = Gauge(
    "cmdbus_pending_bytes_waiters",
    "Connections of a data face queued right now for room in its byte budget, holding none "
    "of it: waiters that stay while the face answers nothing mean work that never finishes.",
    ["face"],
    registry=REGISTRY,
)
UNSENT_WAITS = Counter(
    "cmdbus_unsent_waits",
    "Times a connection stopped taking its client's requests, or a reply or push waited "
    "before it was queued, because the connection's unsent replies passed "
    "CMDBUS_CONNECTION_UNSENT_BYTES (a client that does not read), by face.",
    ["face"],
    registry=REGISTRY,
)
GROUPS_REFUSED = Counter(
    "cmdbus_groups_refused",
    "Event consumer groups not created because CMDBUS_EVT_MAX_GROUPS exist already.",
    registry=REGISTRY,
)
GROUPS_DELETED = Counter(
    "cmdbus_groups_deleted",
    "Event consumer groups deleted (delete_group), with everything they recorded.",
    registry=REGISTRY,
)


def series_of_subjects(limit: int) -> SubjectSeries:
    """A table of at most ``limit`` subject labels, folding the rest into
    :data:`OTHER_SUBJECTS` (counted in ``cmdbus_subject_folds``)."""
    return SubjectSeries(limit, SUBJECT_FOLDS, OTHER_SUBJECTS)


SUBJECTS = series_of_subjects(500)
"""The writer's one table of exported subjects (its limit set from CMDBUS_SUBJECT_SERIES
at start)."""


LAG_PORT_SAMPLES: dict[str, tuple[str, ...]] = {
    "cmd_lag": ("ehdb_feed_shard_lag", "ehdb_feed_shard_committed", "ehdb_feed_shard_inflight",
                "ehdb_feed_total_inflight", "ehdb_feed_total_lag", "ehdb_feed_subject_lag"),
    "evt_lag": ("ehdb_events_group_lag",),
}  # fmt: skip
"""The samples each NoETL lag port serves: its bus's lag series, nothing else, so that a
scrape of the old ports beside the control port adds no other series twice."""


def exposition(port: str | None = None) -> tuple[bytes, str]:
    """The Prometheus text of every family (or of one lag port's, by its name in
    :data:`LAG_PORT_SAMPLES`), and its content type."""
    return _tools.exposition(REGISTRY, None if port is None else LAG_PORT_SAMPLES[port])
