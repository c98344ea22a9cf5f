"""The settings that follow from others, and the checks across settings."""

from __future__ import annotations

import shlex
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._values import ORDINAL, Bind, ConfigError, Setting, cpu_quota, tls_problem


def resolve_derived(
    values: dict[str, Any],
    cgroup_root: Path,
    environ: Mapping[str, str],
    settings: Mapping[str, Setting],
    faces: tuple[str, ...],
) -> None:
    """The settings that follow from others (``auto``, unset), and the checks that
    take two settings: raises :class:`ConfigError` naming the one at fault."""
    if values["shard"] == "auto":
        # Kubernetes sets HOSTNAME to the pod name: <statefulset>-<ordinal>.
        host = environ.get("HOSTNAME") or socket.gethostname()
        ordinal = ORDINAL.search(host)
        if ordinal is None:
            raise ConfigError(
                settings["shard"],
                "auto",
                f"host name {host!r} does not end in a StatefulSet ordinal (-N)",
            )
        values["shard"] = int(ordinal.group(1))
    if values["tier_max_inflight"] is None:
        values["tier_max_inflight"] = cpu_quota(cgroup_root)
    if values["tier_max_waiters"] is None:
        values["tier_max_waiters"] = 8 * values["tier_max_inflight"]
    if values["shard"] >= values["shard_count"]:
        raise ConfigError(
            settings["shard"],
            str(values["shard"]),
            f"must be below {settings['shard_count'].env}={values['shard_count']}",
        )
    if (values["tls_cert"] is None) != (values["tls_key"] is None):
        raise ConfigError(
            settings["tls_key" if values["tls_key"] is None else "tls_cert"],
            "",
            "TLS needs both CMDBUS_TLS_CERT and CMDBUS_TLS_KEY",
        )
    tls = (values["tls_cert"], values["tls_key"])
    if None not in tls and (problem := tls_problem(*tls)):
        raise ConfigError(settings[problem[0]], *problem[1:])
    control = values["control_bind"]
    if values["debug_hooks"] and values["auth_token"] is None and control and not control.loopback:
        raise ConfigError(
            settings["debug_hooks"],
            "true",
            f"the control face binds {control}, beyond this host: set CMDBUS_AUTH_TOKEN too",
        )
    lease = values["ha_lease"]
    if values["ha_pod_labels"] and not (lease or "").startswith("kubernetes:"):
        raise ConfigError(
            settings["ha_pod_labels"],
            "true",
            "pod labels need a kubernetes: lease (CMDBUS_HA_LEASE=kubernetes:NAMESPACE/NAME)",
        )
    command = values["ha_while_primary"]
    if command and lease is None:
        raise ConfigError(settings["ha_while_primary"], shlex.join(command),
                          "a command run while primary needs CMDBUS_HA_LEASE")  # fmt: skip
    if command and shutil.which(command[0]) is None:
        raise ConfigError(settings["ha_while_primary"], shlex.join(command),
                          f"{command[0]}: no such program (on PATH, or executable)")  # fmt: skip
    seen: dict[Bind, str] = {}
    for face in faces:
        bind = values[f"{face}_bind"]
        if bind is None or bind.port == 0:
            continue
        if bind in seen:
            setting = settings[f"{face}_bind"]
            raise ConfigError(setting, str(bind), f"already used by the {seen[bind]} face")
        seen[bind] = face
