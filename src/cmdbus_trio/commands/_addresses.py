"""Where a command finds a face: ``--addr`` (or ``--url``) when given; else the face's
default port on ``--server`` (or ``$CMDBUS_SERVER``); else the writer's ports file
(``$CMDBUS_PORTS_FILE``); else the face's default port on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from cmdbus_trio.config import DEFAULT_PORTS, SETTINGS_BY_NAME

from ._output import UsageError
from ._scrape import control_url

PORTS_FILE: Final = SETTINGS_BY_NAME["ports_file"].env

SERVER_VARIABLE: Final = "CMDBUS_SERVER"

STARTING_WAIT: Final = 5.0
"""Seconds a command waits for a writer that is starting (no ports file yet, or a port
that still refuses connections): a session pasted whole starts the writer and talks to
it at once. Nothing is sent before a connection is made, so every command may wait."""


def server_host(text: str) -> str:
    """``--server``'s value: the writer's host (a name, an IPv4 address, an IPv6 address
    with or without brackets), without a port: every face is at its default port. The
    members of a pair: their hosts, comma-separated (a client goes to the primary).

    Error handling: :class:`ValueError` naming what is wrong (a port, a scheme)."""
    if "," in text:
        return ",".join(server_host(one) for one in text.split(",") if one.strip())
    host = text.strip()
    if not host or "://" in host or "/" in host:
        raise UsageError(f"--server {text!r}: expected a host, like 10.0.0.7 or cmdbus-0")
    if host.startswith("[") and host.endswith("]"):
        return host
    if host.count(":") == 1:
        raise ValueError(
            f"--server {text!r}: a host without a port (every face is at its default "
            "port; give one face's address with --addr)"
        )
    return f"[{host}]" if ":" in host else host


def add_server_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        metavar="HOST",
        help=f"the writer's host, every face at its default port (default ${SERVER_VARIABLE}, "
        "else the ports file's, else 127.0.0.1); --addr and --url win",
    )


def add_control_url_arguments(
    parser: argparse.ArgumentParser, *, url_into: argparse._ActionsContainer | None = None
) -> None:
    """``--url`` (the control face; into ``url_into``, a group of the parser's, when
    given) and ``--server``."""
    (url_into or parser).add_argument(
        "--url",
        type=control_url,
        help="control face (http:// may be left out; default :9090 on --server)",
    )
    add_server_argument(parser)


def server_of(args: argparse.Namespace) -> str | None:
    """``--server``, else ``$CMDBUS_SERVER``, checked (:func:`server_host`); None: neither."""
    given = getattr(args, "server", None) or os.environ.get(SERVER_VARIABLE)
    return server_host(given) if given else None


def default_address(face: str, *, server: str | None = None, wait: float = STARTING_WAIT) -> str:
    """``host:port`` of ``face``: its default port on ``server`` when given; else from the
    file ``CMDBUS_PORTS_FILE`` names, when it is set (as ``serve`` writes it once it
    listens; waited for up to ``wait`` seconds); else ``127.0.0.1`` and the face's
    default port.

    Error handling: :class:`ValueError` when the file does not come, is not a ports
    file, or does not name the face (it is off)."""
    if server is not None:
        hosts = server.split(",")  # (a pair's members; a control face: the first one's)
        port = DEFAULT_PORTS.get(face, 0)
        return ",".join(f"{host}:{port}" for host in (hosts[:1] if face == "control" else hosts))
    named = os.environ.get(PORTS_FILE)
    if not named:
        return f"127.0.0.1:{DEFAULT_PORTS.get(face, 0)}"
    path, deadline = Path(named), time.monotonic() + wait
    while not path.exists():
        if time.monotonic() >= deadline:
            raise ValueError(f"{PORTS_FILE}={named}: no such file (is the writer running?)")
        time.sleep(0.05)
    try:
        address = json.loads(path.read_text())[face]
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{PORTS_FILE}={named}: not a ports file: {exc}") from None
    except KeyError:
        raise ValueError(f"{PORTS_FILE}={named}: the writer serves no {face} face") from None
    return str(address)


def default_control_url(*, server: str | None = None, wait: float = STARTING_WAIT) -> str:
    """The control face's URL when none is given (see :func:`default_address`)."""
    return control_url(default_address("control", server=server, wait=wait))


def write_ports_file(path: Path, addresses: Mapping[str, str]) -> None:
    """Write ``{face: "host:port"}`` atomically: readers see the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(dict(addresses), out, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
