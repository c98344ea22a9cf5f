"""``serve``'s flags: one per setting, grouped by what they are about, each showing the
values it takes (from the setting's own parser, so help and checks never disagree) and
its default. A yes/no setting is a flag: ``--allow-v1`` alone means true."""

from __future__ import annotations

import argparse
from typing import Final

from cmdbus_trio.config import SETTINGS, Setting

SECTIONS: Final = {
    "storage": ("data_dir", "sync", "checkpoints", "wal_ceiling_bytes"),
    "listening": (
        "bind_host", "control_bind", "cmd_ingest_bind", "cmd_claim_bind", "evt_ingest_bind",
        "evt_claim_bind", "evt_subscribe_bind", "tier_bind", "cmd_lag_bind", "evt_lag_bind",
        "ports_file", "max_connections", "control_keepalive_ms",
    ),
    "shards": ("shard", "shard_count"),
    "the standby": (
        "ha_lease", "ha_name", "ha_bind", "ha_advertise", "ha_lease_ms", "ha_sync",
        "ha_while_primary", "ha_pod_labels", "ha_kube_service_account",
    ),
    "the buses": (
        "ack_wait_ms", "max_deliver", "stuck_after_ms", "ingest_max_pending",
        "dedup_window_ms", "evt_groups", "evt_max_groups", "subject_series",
        "subscriber_buffer", "subscriber_buffer_bytes",
    ),
    "the tier service": (
        "tier_max_inflight", "tier_max_waiters", "tier_shed_after_ms", "tier_writes",
        "tier_max_pending_writes",
    ),
    "requests and replies": (
        "default_budget_ms", "max_request_bytes", "face_pending_bytes",
        "connection_unsent_bytes", "max_reply_bytes",
    ),
    "timeouts and liveness": (
        "shutdown_timeout_ms", "idle_timeout_ms", "read_timeout_ms", "hello_timeout_ms",
        "liveness_threshold_ms", "liveness_window_ms", "switch_interval_ms",
    ),
    "retention": (
        "cmd_keep_acked_ms", "evt_retention_ms", "evt_max_bytes", "dead_retention_ms",
        "tier_eventlog_retention_ms", "tier_projection_retention_ms",
        "tier_catalog_retention_ms", "retention_interval_ms",
    ),
    "security": ("auth_token", "allow_v1", "v1_cidrs", "tls_cert", "tls_key"),
    "logs and debugging": ("log_format", "log_level", "debug_hooks"),
}  # fmt: skip
"""Every setting in exactly one section (a test holds it to that)."""

NAMED: Final = {
    "data_dir": "DIR",
    "ports_file": "PATH",
    "tls_cert": "PATH",
    "tls_key": "PATH",
    "bind_host": "HOST",
    "auth_token": "TOKEN",
    "v1_cidrs": "CIDR,...",
    "evt_groups": "NAME,...",
    "ha_lease": "file:PATH|kubernetes:NS/NAME",
    "ha_while_primary": "'COMMAND ARG ...'",
    "ha_name": "NAME",
    "ha_advertise": "HOST[:PORT]",
    "ha_kube_service_account": "DIR",
}


def allowed(setting: Setting) -> str:
    """What the setting takes, as its parser says when it refuses a value ("" when its
    parser takes any text)."""
    try:
        setting.parse("\0?")
    except ValueError as refusal:
        text = str(refusal)
        return text.removeprefix("expected ") if text.startswith("expected ") else ""
    return ""


def metavar(setting: Setting, takes: str) -> str:
    if setting.name in NAMED:
        return NAMED[setting.name]
    if takes.startswith("one of "):
        return "{" + takes.removeprefix("one of ").replace(", ", ",") + "}"
    if takes.startswith("HOST:PORT"):
        return "HOST:PORT"
    if "integer" in takes or "number" in takes:
        unit = next((u for u in ("ms", "bytes") if setting.name.endswith(f"_{u}")), "")
        number = unit.upper() or "N"
        return f"{number}|auto" if setting.default == "auto" or "auto" in takes else number
    return "VALUE"


def add_setting_arguments(serve: argparse.ArgumentParser) -> None:
    by_name = {setting.name: setting for setting in SETTINGS}
    for title, names in SECTIONS.items():
        group = serve.add_argument_group(title)
        for name in names:
            setting = by_name[name]
            takes = allowed(setting)
            default = setting.default or "unset"
            if takes == "true or false":
                group.add_argument(
                    f"--{setting.flag}",
                    dest=setting.name,
                    nargs="?",
                    const="true",
                    metavar="true|false",
                    help=f"{setting.help}. A flag (alone: true); default {default} [{setting.env}]",
                )
                continue
            shown = "" if not takes or takes.startswith("one of ") else f"{takes}; "
            group.add_argument(
                f"--{setting.flag}",
                dest=setting.name,
                metavar=metavar(setting, takes),
                help=f"{setting.help}. {shown}default {default} [{setting.env}]",
            )
