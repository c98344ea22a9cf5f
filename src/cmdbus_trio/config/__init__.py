"""Settings: one table, loaded from flags, then ``CMDBUS_*`` variables, then defaults.

Every setting has exactly one flag and one environment name, derived from its
field name, so the two can never drift apart. A bad value raises
:class:`ConfigError` naming the setting, the value and what is allowed; the CLI
turns that into one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ._derived import resolve_derived
from ._values import (
    ENV_PREFIX,
    MIN_EVT_MAX_BYTES,
    Bind,
    ConfigError,
    IPNetwork,
    Setting,
    boolean,
    byte_cap,
    choice,
    cidrs,
    command_line,
    cpu_quota,
    group_names,
    ha_lease_value,
    host_value,
    int_range,
    optional_int,
    optional_path,
    optional_text,
    parse_bind,
    positive_float,
    shard_value,
    unknown_variables,
)

FACE_NAMES = (
    "control",
    "cmd_ingest",
    "cmd_claim",
    "evt_ingest",
    "evt_claim",
    "evt_subscribe",
    "tier",
)
DATA_FACE_NAMES = FACE_NAMES[1:]
LAG_PORT_NAMES = ("cmd_lag", "evt_lag")
"""NoETL's lag ports (/metrics of one bus's lag series), served by the control nursery."""

HA_PORT = 9120
"""The replication face's default port (``CMDBUS_HA_BIND``)."""
KUBE_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Kubernetes mounts a pod's service account (its token and the cluster's CA)."""
DEFAULT_PORTS = {
    "control": 9090,
    "cmd_ingest": 9100,
    "cmd_claim": 9101,
    "evt_ingest": 9103,
    "evt_claim": 9104,
    "evt_subscribe": 9108,
    "tier": 9110,
}


# --- the table ---------------------------------------------------------------------------------


def _setting(default: str, parse: Callable[[str], Any], help: str) -> Any:
    """A :class:`Config` field that is a setting: its default (the text a flag or a
    ``CMDBUS_*`` variable would carry), its parser and its help line."""
    return attrs.field(metadata={"setting": (default, parse, help)})


def _face_bind(face: str) -> Any:
    return _setting(
        f"127.0.0.1:{DEFAULT_PORTS[face]}",
        parse_bind,
        f"address of the {face} face; port 0 picks a free port",
    )


def _lag_bind(what: str, port: int) -> Any:
    return _setting(
        "",
        parse_bind,
        f"address serving NoETL's {what} lag series at /metrics (the NoETL writer's :{port})",
    )


def _tier_retention(tier: str) -> Any:
    return _setting(
        "0",
        int_range(0),
        f"the {tier} tier deletes the history of an execution nothing was appended to "
        "for this long; 0: kept for ever",
    )


@attrs.frozen(kw_only=True)
class Config:
    """Every setting of the writer, validated. Build it with :func:`load`.

    Its fields are the settings table: :data:`SETTINGS` (the flags, the ``CMDBUS_*``
    variables, their defaults and help) is derived from them, in this order."""

    data_dir: Path = _setting("./cmdbus-data", Path, "directory holding the stores")
    bind_host: str = _setting(
        "127.0.0.1",
        host_value,
        "host of each face bind left at its default (HOST:its port); the image sets 0.0.0.0",
    )
    control_bind: Bind | None = _face_bind("control")
    cmd_ingest_bind: Bind | None = _face_bind("cmd_ingest")
    cmd_claim_bind: Bind | None = _face_bind("cmd_claim")
    evt_ingest_bind: Bind | None = _face_bind("evt_ingest")
    evt_claim_bind: Bind | None = _face_bind("evt_claim")
    evt_subscribe_bind: Bind | None = _face_bind("evt_subscribe")
    tier_bind: Bind | None = _face_bind("tier")
    cmd_lag_bind: Bind | None = _lag_bind("command-bus", 9102)
    evt_lag_bind: Bind | None = _lag_bind("event-bus", 9106)
    ports_file: Path | None = _setting(
        "",
        optional_path,
        'when set, {face: "host:port"} of every enabled face is written there, once all listen',
    )
    shard: int = _setting(
        "0",
        shard_value,
        "the shard this writer owns; auto: the StatefulSet pod ordinal (host name suffix -N)",
    )
    shard_count: int = _setting("1", int_range(1), "how many shards the cluster has")
    ack_wait_ms: int = _setting(
        "30000", int_range(1), "lease of a claimed record before redelivery"
    )
    max_deliver: int = _setting(
        "0", int_range(0), "deliveries before a record is dead; 0: unlimited"
    )
    stuck_after_ms: int = _setting(
        "60000",
        int_range(1),
        "a record unsettled this long stops holding back its group's settled position",
    )
    tier_max_inflight: int = _setting(
        "auto",
        optional_int(1),
        "tier requests running at once; auto: the cgroup CPU quota, else the CPU count",
    )
    tier_max_waiters: int = _setting(
        "auto",
        optional_int(0),
        "tier requests queued for a slot before shedding; auto: 8 x tier_max_inflight",
    )
    tier_shed_after_ms: int = _setting(
        "1000", int_range(1), "longest wait for a tier slot before shedding"
    )
    tier_writes: str = _setting(
        "lane",
        choice("lane", "shared"),
        "lane: appends have a Gate of their own, so reads never shed them; shared: one Gate",
    )
    tier_max_pending_writes: int = _setting(
        "64",
        int_range(1),
        "tier writes (lane) queued for or in a group commit; more wait, then are shed",
    )
    default_budget_ms: int = _setting(
        "10000", int_range(1), "time budget of a data request that carries no deadline_ms"
    )
    ingest_max_pending: int = _setting(
        "4096",
        int_range(1),
        "publish requests per ingest face queued for or in a group commit; more: busy",
    )
    max_request_bytes: int = _setting(str(1 << 20), int_range(64), "largest request frame body")
    face_pending_bytes: int = _setting(
        str(8 << 20),
        int_range(1),
        "request bytes a data face takes in before it stops reading more (then they wait)",
    )
    connection_unsent_bytes: int = _setting(
        str(8 << 20),
        int_range(1),
        "unsent reply bytes of one connection before it stops taking that client's requests",
    )
    max_reply_bytes: int = _setting(str(16 << 20), int_range(64), "largest reply frame body")
    sync: str = _setting(
        "full", choice("full", "normal"), "full: answer once on disk; normal: once committed"
    )
    checkpoints: str = _setting(
        "writer",
        choice("writer", "litestream"),
        "who checkpoints the stores' WALs: the writer, or Litestream replicating them",
    )
    wal_ceiling_bytes: int = _setting(
        str(256 << 20), int_range(1 << 20), "a WAL past this is checkpointed by the writer"
    )
    shutdown_timeout_ms: int = _setting(
        "15000",
        int_range(0),
        "after SIGTERM, how long in-flight work may run before it is cancelled",
    )
    idle_timeout_ms: int = _setting(
        "300000", int_range(1), "close a data connection idle this long"
    )
    read_timeout_ms: int = _setting(
        "30000", int_range(1), "close a connection stalled mid-frame this long"
    )
    hello_timeout_ms: int = _setting(
        "5000", int_range(1), "close a data connection whose first frame (hello) is not in by then"
    )
    dedup_window_ms: int = _setting(
        "120000", int_range(0), "how long a publish msg_id is remembered"
    )
    cmd_keep_acked_ms: int = _setting(
        str(3_600_000),
        int_range(0),
        "an acked command is kept this long (for inspection), then deleted",
    )
    evt_retention_ms: int = _setting(
        str(7 * 86_400_000),
        int_range(0),
        "an event is deleted once every group has settled it and it is older than this "
        "(the subscribers' replay window)",
    )
    evt_max_bytes: int = _setting(
        "0",
        byte_cap,
        "the event log's pages in use are kept under this many bytes by evicting the oldest "
        "events, whatever the groups did (counted in cmdbus_evicted_unconsumed_total)",
    )
    dead_retention_ms: int = _setting(
        str(7 * 86_400_000),
        int_range(0),
        "a dead letter not requeued or purged is deleted after this long",
    )
    tier_eventlog_retention_ms: int = _tier_retention("eventlog")
    tier_projection_retention_ms: int = _tier_retention("projection")
    tier_catalog_retention_ms: int = _tier_retention("catalog")
    retention_interval_ms: int = _setting(
        "10000", int_range(1), "how often retention runs (and store sizes are measured)"
    )
    evt_groups: tuple[str, ...] = _setting(
        "noetl_materializer,noetl_result_materializer,noetl_state_materializer",
        group_names,
        "event consumer groups, comma-separated",
    )
    evt_max_groups: int = _setting(
        "1000",
        int_range(1),
        "event consumer groups the writer keeps; creating one more is refused (invalid)",
    )
    subject_series: int = _setting(
        "500",
        int_range(1),
        "subjects exported with their own metric series; later ones count under _other",
    )
    subscriber_buffer: int = _setting(
        "10000", int_range(1), "records buffered per subscriber before cut"
    )
    subscriber_buffer_bytes: int = _setting(
        str(32 << 20), int_range(1), "bytes of records buffered per subscriber before cut"
    )
    liveness_threshold_ms: int = _setting(
        "5000",
        int_range(1),
        "/livez fails when the event loop stalled longer than this in the last liveness window",
    )
    liveness_window_ms: int = _setting(
        "10000", int_range(1), "how long a loop stall keeps /livez failing after it ended"
    )
    control_keepalive_ms: int = _setting(
        "5000",
        int_range(1),
        "control face: close an idle keep-alive HTTP connection after this long",
    )
    switch_interval_ms: float = _setting(
        "1",
        positive_float,
        "sys.setswitchinterval while serving, so worker threads cannot hog the GIL",
    )
    ha_lease: str | None = _setting(
        "",
        ha_lease_value,
        "where the two members of a shard agree who is primary: file:PATH or "
        "kubernetes:NAMESPACE/NAME (unset: one writer, no standby)",
    )
    ha_name: str = _setting("", str.strip, "this member's name in its shard (unset: the host name)")
    ha_bind: Bind | None = _setting(
        f"127.0.0.1:{HA_PORT}", parse_bind, "the replication face (with CMDBUS_HA_LEASE)"
    )
    ha_advertise: str | None = _setting(
        "", optional_text, "HOST[:PORT] the other member reaches this one at (unset: as bound)"
    )
    ha_lease_ms: int = _setting(
        "5000", int_range(1000), "the lease: a primary that has not renewed it this long is gone"
    )
    ha_sync: str = _setting(
        "on",
        choice("on", "strict", "off"),
        "on: acknowledge once on both members (alone, once the lease says no standby is in "
        "sync); strict: never alone; off: never wait (a failover may lose the last records)",
    )
    ha_pod_labels: bool = _setting(
        "false",
        boolean,
        "label the members' pods with their roles (cmdbus-trio.io/role), for a Service that "
        "selects the primary (with a kubernetes: lease; member names are pod names)",
    )
    ha_while_primary: tuple[str, ...] = _setting(
        "",
        command_line,
        "a command run while this member is primary and stopped before it follows, such as "
        "'litestream replicate -config FILE': only the primary's stores replicated off the node",
    )
    ha_kube_service_account: Path = _setting(
        KUBE_SERVICE_ACCOUNT,
        Path,
        "the directory of the token and ca.crt a kubernetes: lease and the pod labels use",
    )
    auth_token: str | None = _setting(
        "", optional_text, "shared token required in the v2 hello (unset: off)"
    )
    allow_v1: bool = _setting(
        "false",
        boolean,
        "with an auth token set, still accept v1 (token-less) connections from v1_cidrs",
    )
    v1_cidrs: tuple[IPNetwork, ...] = _setting(
        "127.0.0.0/8,::1/128",
        cidrs,
        "networks v1 connections may come from when allow_v1 is on, comma-separated",
    )
    max_connections: int = _setting(
        "1024",
        int_range(1),
        "open connections per data face; more are accepted and closed at once (counted)",
    )
    tls_cert: Path | None = _setting(
        "", optional_path, "TLS certificate for the data faces (unset: off)"
    )
    tls_key: Path | None = _setting(
        "", optional_path, "TLS private key for the data faces (unset: off)"
    )
    log_format: str = _setting(
        "auto", choice("auto", "json", "console"), "log line format; auto: console on a tty"
    )
    log_level: str = _setting(
        "info", choice("debug", "info", "warning", "error"), "lowest level logged"
    )
    debug_hooks: bool = _setting(
        "false",
        boolean,
        "enable POST /debug/block-loop, /debug/fail-writes, /debug/slow-commits, "
        "/debug/crash-face, /debug/hold-bytes and /debug/loop-census on the control face "
        "(for tests, drills and benchmarks; never in prod); with an auth token set they "
        "need 'Authorization: Bearer <token>', and a control bind beyond loopback needs one",
    )

    def bind(self, face: str) -> Bind | None:
        bind: Bind | None = getattr(self, f"{face}_bind")
        return bind

    def enabled_faces(self) -> dict[str, Bind]:
        return {face: bind for face in FACE_NAMES if (bind := self.bind(face)) is not None}

    def redacted(self, *, changed_only: bool = False) -> dict[str, Any]:
        """The effective settings as JSON values, secrets hidden (for the start-up log);
        ``changed_only``: only those that differ from their defaults."""
        out: dict[str, Any] = {}
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if setting.name == "auth_token" and value is not None:
                value = "***"
            elif isinstance(value, (Bind, Path)):
                value = str(value)
            elif setting.name == "v1_cidrs":
                value = [str(network) for network in value]
            out[setting.name] = value
        defaults = load({}, environ={}).redacted() if changed_only else {}
        return {k: v for k, v in out.items() if not changed_only or defaults.get(k) != v}


SETTINGS: tuple[Setting, ...] = tuple(
    Setting(field.name, *field.metadata["setting"]) for field in attrs.fields(Config)
)
SETTINGS_BY_NAME = {setting.name: setting for setting in SETTINGS}


def load(
    flags: Mapping[str, str | None] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> Config:
    """Resolve every setting: a flag (by setting name) wins over ``CMDBUS_*``, which wins over
    the default. Raises :class:`ConfigError` for the first bad value."""
    flags = flags or {}
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    defaulted: set[str] = set()
    for setting in SETTINGS:
        raw = flags.get(setting.name)
        if raw is None:
            raw = environ.get(setting.env)
        if raw is None:
            raw = setting.default
            defaulted.add(setting.name)
        try:
            values[setting.name] = setting.parse(raw)
        except ValueError as exc:
            raise ConfigError(setting, raw, str(exc)) from None
    for face in FACE_NAMES:  # a bind given stays as given; a default one takes the host
        if f"{face}_bind" in defaulted:
            values[f"{face}_bind"] = Bind(values["bind_host"], DEFAULT_PORTS[face])
    if "ha_bind" in defaulted:
        values["ha_bind"] = Bind(values["bind_host"], HA_PORT)
    values["ha_name"] = values["ha_name"] or environ.get("HOSTNAME") or socket.gethostname()
    binds = (*FACE_NAMES, *LAG_PORT_NAMES, *(("ha",) if values["ha_lease"] else ()))
    resolve_derived(values, cgroup_root, environ, SETTINGS_BY_NAME, binds)
    return Config(**values)


__all__ = [
    "DATA_FACE_NAMES",
    "DEFAULT_PORTS",
    "ENV_PREFIX",
    "FACE_NAMES",
    "LAG_PORT_NAMES",
    "MIN_EVT_MAX_BYTES",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "Bind",
    "Config",
    "ConfigError",
    "IPNetwork",
    "Setting",
    "cpu_quota",
    "load",
    "unknown_variables",
]
