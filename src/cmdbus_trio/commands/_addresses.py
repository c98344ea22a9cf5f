"""Where a command finds a face when it is not told: the writer's ports file, else the
face's default port on 127.0.0.1."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Final

from cmdbus_trio.config import DEFAULT_PORTS, SETTINGS_BY_NAME

from ._scrape import control_url

PORTS_FILE: Final = SETTINGS_BY_NAME["ports_file"].env

STARTING_WAIT: Final = 5.0
"""Seconds a command waits for a writer that is starting (no ports file yet, or a port
that still refuses connections): a session pasted whole starts the writer and talks to
it at once. Nothing is sent before a connection is made, so every command may wait."""


def default_address(face: str, *, wait: float = STARTING_WAIT) -> str:
    """``host:port`` of ``face``: from the file ``CMDBUS_PORTS_FILE`` names, when it is
    set (as ``serve`` writes it once it listens; waited for up to ``wait`` seconds), else
    ``127.0.0.1`` and the face's default port.

    Error handling: :class:`ValueError` when the file does not come, is not a ports
    file, or does not name the face (it is off)."""
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


def default_control_url(*, wait: float = STARTING_WAIT) -> str:
    """The control face's URL when none is given (see :func:`default_address`)."""
    return control_url(default_address("control", wait=wait))
