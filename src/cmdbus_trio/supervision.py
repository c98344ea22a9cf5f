"""Supervision: a face or a background task that crashes after it started is logged,
counted and named by the health report, and takes nothing else down; one that cannot
start is a start-up error naming its setting."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .config import Bind
from .logs import event, leaf, why

log = logging.getLogger("cmdbus_trio.app")

StartFn = Callable[..., Awaitable[None]]


class StartupError(Exception):
    """A face could not start (typically: its address is in use)."""

    def __init__(self, face: str, bind: Bind, cause: BaseException) -> None:
        setting = f"CMDBUS_{face.upper()}_BIND (--{face.replace('_', '-')}-bind)"
        why = f"{leaf(cause)}; choose another address with {setting}"
        super().__init__(f"cannot start the {face} face on {bind}: {why}")
        self.face = face


async def supervised(run: StartFn, task_status: trio.TaskStatus[Any], kind: str, name: str) -> bool:
    """Run ``run`` (a ``task_status`` function) in a nursery of its own; returns True when
    it ended, False when it crashed after it started (logged as ``<kind>_crashed``).

    Error handling: an error before it started is raised (a start-up failure)."""
    started = False
    try:
        async with trio.open_nursery() as nursery:
            value = await nursery.start(run)
            started = True
            task_status.started(value)
    except Exception as exc:
        if not started:
            raise
        event(log, logging.ERROR, f"{kind}_crashed", **{kind: name}, error=why(exc), exc_info=exc)
        return False
    return True
