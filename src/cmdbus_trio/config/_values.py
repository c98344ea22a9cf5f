"""The settings' rows and values: text in, a value out, or ``ValueError`` saying what is
allowed."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import shlex
import ssl
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from cmdbus_trio.protocol.bus import GROUP_NAME, GROUP_NAME_RULE

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ENV_PREFIX = "CMDBUS_"


@attrs.frozen
class Setting:
    name: str
    default: str
    parse: Callable[[str], Any]
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return self.name.replace("_", "-")


class ConfigError(ValueError):
    """A setting's value is not allowed. ``str()`` is the one line shown to the user."""

    def __init__(self, setting: Setting, value: str, allowed: str) -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid setting {setting.env} (--{setting.flag}): {value!r}: {allowed}")


@attrs.frozen
class Bind:
    """A listening address. ``port`` 0 asks the kernel for a free port."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def loopback(self) -> bool:
        """Whether only this host can connect (127.0.0.0/8, ::1, ``localhost``)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything


# --- parsers: text -> value, raising ValueError with what is allowed -------------------------


def host_value(text: str) -> str:
    """A host to listen on: an IP address (IPv6 without brackets) or a name."""
    text = text.strip()
    try:
        bind = parse_bind(f"[{text}]:0" if ":" in text else f"{text}:0") if text else None
    except ValueError:
        bind = None
    if bind is None:
        raise ValueError("expected a host to listen on: 0.0.0.0, ::, 127.0.0.1, a name")
    return bind.host


def parse_bind(text: str) -> Bind | None:
    text = text.strip()
    if not text:
        return None  # an empty bind disables the face
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^:\[\]\s]+):(\d{1,5})", text)
    if match is None:
        raise ValueError("expected HOST:PORT (or [IPv6]:PORT), or empty to disable the face")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if port > 65535:
        raise ValueError("port must be 0..65535 (0 picks a free port)")
    return Bind(host, port)


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise ValueError(f"expected {allowed}") from None
        if value < low or (high is not None and value > high):
            raise ValueError(f"expected {allowed}")
        return value

    return parse


ORDINAL = re.compile(r"-(\d+)$")


MIN_EVT_MAX_BYTES = 1 << 20
"""The smallest event-log cap: an empty log's tables and indexes take about 100 KiB, and
a cap near that would evict every event as soon as it is published."""


def byte_cap(text: str) -> int:
    """0 (no cap), or a cap of at least :data:`MIN_EVT_MAX_BYTES`."""
    allowed = f"expected 0 (no cap) or an integer >= {MIN_EVT_MAX_BYTES} (1 MiB)"
    try:
        value = int_range(0)(text)
    except ValueError:
        raise ValueError(allowed) from None
    if 0 < value < MIN_EVT_MAX_BYTES:
        raise ValueError(allowed)
    return value


def shard_value(text: str) -> int | str:
    """A shard number, or ``auto``: resolved from the host name by :func:`load`."""
    if text.strip() == "auto":
        return "auto"
    try:
        return int_range(0)(text)
    except ValueError:
        raise ValueError("expected an integer >= 0 or auto") from None


def optional_int(low: int) -> Callable[[str], int | None]:
    parse_int = int_range(low)

    def parse(text: str) -> int | None:
        return None if text.strip() in ("", "auto") else parse_int(text)

    return parse


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError("expected one of " + ", ".join(choices))
        return value

    return parse


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def ha_lease_value(text: str) -> str | None:
    """``file:PATH`` or ``kubernetes:NAMESPACE/NAME``, or empty (no HA)."""
    text = text.strip()
    if not text:
        return None
    kind, _, where = text.partition(":")
    parts = where.split("/")
    if (kind == "file" and where) or (kind == "kubernetes" and len(parts) == 2 and all(parts)):
        return text
    raise ValueError("expected file:PATH or kubernetes:NAMESPACE/NAME")


def command_line(text: str) -> tuple[str, ...]:
    """A command and its arguments, split as a POSIX shell splits them (empty: none)."""
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:  # (an unclosed quote)
        raise ValueError(f"not a command line: {exc}") from None


def optional_text(text: str) -> str | None:
    return text or None


def optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def group_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if not GROUP_NAME.fullmatch(name):
            raise ValueError(f"group {name!r}: names are {GROUP_NAME_RULE}, comma-separated")
    if len(set(names)) != len(names):
        raise ValueError("group names must be unique")
    return names


def cidrs(text: str) -> tuple[IPNetwork, ...]:
    networks = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{part!r} is not a network like 10.0.0.0/8 or ::1/128") from None
    return tuple(networks)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a positive number") from None
    if not value > 0:
        raise ValueError("expected a positive number")
    return value


def cpu_quota(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: the cgroup v2 ``cpu.max`` quota rounded up, else the
    CPU count (affinity-aware), never less than 1."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    return max(1, count)


def unknown_variables(
    environ: Mapping[str, str], known: Iterable[str], prefix: str = "CMDBUS_"
) -> list[tuple[str, str | None]]:
    """Each variable named with ``prefix`` that is not ``known``, with the nearest known
    name (or None): a mistyped ``CMDBUS_SNYC=normal`` or ``CMDBUS_AUTH_TOKN`` used to be
    ignored without a word, and the writer started with ``sync=full``, or no auth."""
    names = sorted(set(known))
    return [
        (name, next(iter(difflib.get_close_matches(name, names, n=1, cutoff=0.6)), None))
        for name in sorted(environ)
        if name.startswith(prefix) and name not in names
    ]


def tls_problem(cert: Path, key: Path) -> tuple[str, str, str] | None:
    """Why the certificate and key cannot serve TLS, as ``(setting, value, why)`` naming
    the file at fault, or None. (A missing file used to fail the start naming neither
    the file nor the setting.)"""
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if not path.is_file():
            return name, str(path), "no such file"
        if not os.access(path, os.R_OK):
            return name, str(path), f"not readable by uid {os.getuid()}"
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        return "tls_cert", str(cert), f"not a PEM certificate matching {key}: {exc}"
    return None
