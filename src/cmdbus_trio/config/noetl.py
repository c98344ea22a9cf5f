"""The NoETL writer's environment names, read as their ``CMDBUS_*`` equivalents.

A pod spec written for NoETL's ``noetl-cmdbus-writer`` keeps working: each ``NOETL_*``
variable that has an equivalent sets it, unless the ``CMDBUS_*`` variable or the flag is
given (they win); ``NOETL_COMMAND_BUS_HOST`` / ``NOETL_EVENT_BUS_HOST`` = ``false`` turn a
bus's faces off, ``true`` opens its lag port (:9102 / :9106) as a NoETL writer does.
Every alias used is logged once at start, and every other ``NOETL_*`` variable is named
in one warning line: none is silently ignored. docs/migrating.md has the whole map.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from . import SETTINGS_BY_NAME, Bind, ConfigError, Setting
from ._values import boolean, host_value

PREFIX = "NOETL_"


def _same(text: str) -> str:
    return text


def _seconds_to_ms(text: str) -> str:
    try:
        return str(round(float(text.strip()) * 1000))
    except ValueError:
        return text  # the setting's own check names the bad value


ALIASES: Mapping[str, tuple[str, Callable[[str], str]]] = {
    "NOETL_COMMAND_BUS_INGEST_BIND": ("cmd_ingest_bind", _same),
    "NOETL_COMMAND_BUS_CLAIM_BIND": ("cmd_claim_bind", _same),
    "NOETL_COMMAND_BUS_METRICS_BIND": ("cmd_lag_bind", _same),
    "NOETL_EVENT_BUS_INGEST_BIND": ("evt_ingest_bind", _same),
    "NOETL_EVENT_BUS_CLAIM_BIND": ("evt_claim_bind", _same),
    "NOETL_EVENT_BUS_METRICS_BIND": ("evt_lag_bind", _same),
    "NOETL_COMMAND_BUS_SHARD": ("shard", _same),
    "NOETL_EVENT_BUS_SHARD": ("shard", _same),
    "NOETL_COMMAND_SHARD_COUNT": ("shard_count", _same),
    "NOETL_EVENT_SHARD_COUNT": ("shard_count", _same),
    "NOETL_COMMAND_BUS_ACK_WAIT_SECS": ("ack_wait_ms", _seconds_to_ms),
    "NOETL_EVENT_BUS_ACK_WAIT_SECS": ("ack_wait_ms", _seconds_to_ms),
    "NOETL_EHDB_TIER_MAX_INFLIGHT": ("tier_max_inflight", _same),
    "NOETL_EHDB_TIER_MAX_WAITERS": ("tier_max_waiters", _same),
    "NOETL_EHDB_TIER_SHED_AFTER_MS": ("tier_shed_after_ms", _same),
}
"""``NOETL_*`` name -> (setting, how its value reads as the setting's)."""

HOST_SWITCHES: Mapping[str, tuple[str, ...]] = {
    "NOETL_COMMAND_BUS_HOST": ("cmd_ingest_bind", "cmd_claim_bind", "cmd_lag_bind"),
    "NOETL_EVENT_BUS_HOST": (
        "evt_ingest_bind",
        "evt_claim_bind",
        "evt_subscribe_bind",
        "evt_lag_bind",
    ),
}
"""``true`` made a NoETL worker binary host that bus's writer; ``false`` here turns the
bus's faces off (an empty bind); ``true`` leaves them on and opens the bus's lag port."""

LAG_PORTS: Mapping[str, tuple[str, int]] = {
    "NOETL_COMMAND_BUS_HOST": ("cmd_lag_bind", 9102),
    "NOETL_EVENT_BUS_HOST": ("evt_lag_bind", 9106),
}
"""The lag port a NoETL writer of that bus serves (KEDA scrapes it), at NoETL's port on
``CMDBUS_BIND_HOST``, unless a bind for it is given."""


class AliasError(ConfigError):
    """A bad value of a ``NOETL_*`` variable: the line names that variable, the one the
    operator set, and the setting it is read as."""

    def __init__(self, variable: str, setting: Setting, value: str, allowed: str) -> None:
        super().__init__(setting, value, allowed)
        self.args = (f"invalid setting {variable} (read as {setting.env}): {value!r}: {allowed}",)


@attrs.frozen
class Translation:
    environ: dict[str, str]
    """The environment with each alias's ``CMDBUS_*`` equivalent added."""
    used: tuple[tuple[str, str], ...]
    """``(NOETL_* name, CMDBUS_* name)`` of each alias that set a setting."""
    ignored: tuple[str, ...]
    """``NOETL_*`` names with no equivalent here, or overridden by ``CMDBUS_*`` / a flag."""

    def explain(self, error: ConfigError) -> str:
        """``error``'s line, naming the ``NOETL_*`` variable the operator set when the
        bad value came from one (not the ``CMDBUS_*`` name it was read as)."""
        aliases = [alias for alias, env in self.used if env == error.setting.env]
        if not aliases:
            return str(error)
        return str(AliasError(" / ".join(aliases), error.setting, error.value, error.allowed))


def translate(
    environ: Mapping[str, str], flags: Mapping[str, str | None] | None = None
) -> Translation:
    """Read the ``NOETL_*`` variables of ``environ`` as settings.

    Error handling: :class:`ConfigError` when two aliases of one setting disagree (say
    ``NOETL_COMMAND_BUS_ACK_WAIT_SECS=30`` and ``NOETL_EVENT_BUS_ACK_WAIT_SECS=60``: one
    writer has one ack wait), or a host switch is neither true nor false."""
    flags = flags or {}
    values: dict[str, tuple[str, list[str]]] = {}  # setting -> (value, the aliases setting it)
    overridden: set[str] = set()  # aliases whose value is not used
    for alias, (name, convert) in ALIASES.items():
        if alias not in environ:
            continue
        value = convert(environ[alias])
        earlier = values.setdefault(name, (value, []))
        if earlier[0] != value:
            setting = SETTINGS_BY_NAME[name]
            raise ConfigError(
                setting,
                value,
                f"{alias} and {earlier[1][0]} both set it, differently; set {setting.env}",
            )
        earlier[1].append(alias)
    for switch, names in HOST_SWITCHES.items():
        if switch not in environ:
            continue
        try:
            served = boolean(environ[switch])
        except ValueError as exc:
            setting = SETTINGS_BY_NAME[names[0]]
            raise AliasError(switch, setting, environ[switch], str(exc)) from None
        if not served:  # the bus is not served: its binds given too are not used
            for name in names:
                overridden.update(values.get(name, ("", []))[1])
                values[name] = ("", [switch])
        else:
            lag, port = LAG_PORTS[switch]
            values.setdefault(lag, (str(Bind(_bind_host(environ, flags), port)), [switch]))
    out = dict(environ)
    used: set[tuple[str, str]] = set()
    for name, (value, aliases) in values.items():
        setting = SETTINGS_BY_NAME[name]
        if setting.env in environ or flags.get(name) is not None:
            overridden.update(aliases)
            continue
        out[setting.env] = value
        used.update((alias, setting.env) for alias in aliases)
    known = set(ALIASES) | set(HOST_SWITCHES)
    aliases_used = {alias for alias, _ in used}
    ignored = sorted(
        name
        for name in environ
        if name.startswith(PREFIX) and (name not in known or name in overridden - aliases_used)
    )
    return Translation(out, tuple(sorted(used)), tuple(ignored))


def _bind_host(environ: Mapping[str, str], flags: Mapping[str, str | None]) -> str:
    """``CMDBUS_BIND_HOST`` as ``load`` will read it (a bad one is reported by ``load``,
    under its own name)."""
    setting = SETTINGS_BY_NAME["bind_host"]
    text = flags.get(setting.name) or environ.get(setting.env) or setting.default
    try:
        return host_value(text)
    except ValueError:
        return host_value(setting.default)
