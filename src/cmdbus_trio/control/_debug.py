"""The control face's test and drill hooks (``CMDBUS_DEBUG_HOOKS``, each a ``POST
/debug/<name>``): faults injected into a running writer exactly where a real one would
strike, for tests and for drills of the runbook. Each takes the writer's
:class:`Health` and the request's scope, and answers ``(status, content type, body)``."""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

import trio

from ..admission import ByteBudget
from ..logs import event
from ..loop import census
from .health import Health

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Answer = tuple[int, bytes, bytes]
MAX_BLOCK_SECONDS = 600.0
_JSON = b"application/json"


def block_loop(health: Health, scope: Scope) -> Answer:
    """Test and drill hook (``CMDBUS_DEBUG_HOOKS``): block the event loop on purpose."""
    try:
        seconds = float(_param(scope, "seconds", "1"))
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_BLOCK_SECONDS:
        return _json(400, {"error": f"seconds must be in (0, {MAX_BLOCK_SECONDS}]"})
    event(log, logging.WARNING, "debug_block_loop", seconds=seconds)
    # Not a task of the control face's (its nursery's would be): the stall it makes
    # is the loop's, not the control face's work to pace.
    trio.lowlevel.spawn_system_task(_block, seconds)
    return _json(202, {"blocking_s": seconds})


def fail_writes(health: Health, scope: Scope) -> Answer:
    """Test and drill hook (``CMDBUS_DEBUG_HOOKS``): every later write transaction
    of a store fails as the disk would (``error``: ``eio`` or ``enospc``), which
    poisons the store exactly as a real fault does."""
    name, error = _param(scope, "store", ""), _param(scope, "error", "eio")
    store = health.stores.get(name)
    if store is None or error not in _DISK_ERRORS:
        return _json(
            400,
            {
                "error": f"store must be one of {sorted(health.stores)}, "
                f"error one of {sorted(_DISK_ERRORS)}"
            },
        )
    message = _DISK_ERRORS[error]

    def fail() -> None:
        raise sqlite3.OperationalError(message)

    store.before_commit = fail
    event(log, logging.WARNING, "debug_fail_writes", store=name, error=error)
    return _json(202, {"store": name, "error": error})


def slow_commits(health: Health, scope: Scope) -> Answer:
    """Test and drill hook (``CMDBUS_DEBUG_HOOKS``): every later write transaction of
    a store takes ``seconds`` longer before it commits, in its worker thread, as a
    slow disk's fsync would (the loop is not blocked). ``seconds=0`` ends it."""
    name = _param(scope, "store", "")
    try:
        seconds = float(_param(scope, "seconds", "0.5"))
    except ValueError:
        seconds = -1.0
    store = health.stores.get(name)
    if store is None or not 0 <= seconds <= MAX_BLOCK_SECONDS:
        return _json(
            400,
            {
                "error": f"store must be one of {sorted(health.stores)}, seconds "
                f"in [0, {MAX_BLOCK_SECONDS}]"
            },
        )
    store.before_commit = (lambda: time.sleep(seconds)) if seconds else None
    event(log, logging.WARNING, "debug_slow_commits", store=name, seconds=seconds)
    return _json(202, {"store": name, "slow_commits_s": seconds})


def hold_bytes(health: Health, scope: Scope) -> Answer:
    """Drill hook: the byte budget of the data face ``face`` is held whole for
    ``seconds``, as frames whose work never finishes would hold it: its connections
    queue for bytes and the face answers nothing (``diagnose`` says ``face stuck``),
    while the loop, the probes and every other face go on. 409 while it is not free."""
    name = _param(scope, "face", "")
    budget = health.budgets.get(name)
    try:
        seconds = float(_param(scope, "seconds", "1"))
    except ValueError:
        seconds = -1.0
    if budget is None or not 0 < seconds <= MAX_BLOCK_SECONDS:
        return _json(
            400,
            {
                "error": f"face must be one of {sorted(health.budgets)}, seconds in "
                f"(0, {MAX_BLOCK_SECONDS}]"
            },
        )
    try:
        held = budget.acquire_nowait(budget.total)
    except trio.WouldBlock:
        return _json(409, {"error": f"face {name}'s byte budget is in use; try again"})
    event(log, logging.WARNING, "debug_hold_bytes", face=name, seconds=seconds)
    trio.lowlevel.spawn_system_task(_give_back_after, budget, held, seconds)
    return _json(202, {"face": name, "held_bytes": held, "seconds": seconds})


async def _give_back_after(budget: ByteBudget, held: int, seconds: float) -> None:
    try:
        await trio.sleep(seconds)
    finally:
        budget.release(held)


def loop_census(health: Health, scope: Scope) -> Answer:
    """Measuring hook (``CMDBUS_DEBUG_HOOKS``): what the event loop did since the
    last call (its turns by cause, each task's steps: :mod:`cmdbus_trio.loop.census`),
    and counting starts again; ``stop=1`` stops counting. The first call returns
    ``{"census": null}``. Counting costs every task step a hook while it lasts."""
    stop = _param(scope, "stop", "0")
    if stop not in ("0", "1"):
        return _json(400, {"error": f"stop must be 0 or 1, not {stop!r}"})
    return _json(200, {"census": census.swap(again=stop == "0")})


def crash_face(health: Health, scope: Scope) -> Answer:
    """Drill hook: the face named ``face`` crashes as a bug in it would (a task of its
    nursery raises): it stops serving, ``/readyz`` names it, ``/livez`` fails after the
    liveness window, and every other face goes on."""
    name = _param(scope, "face", "")
    crash = health.crash_drills.get(name)
    if crash is None:
        return _json(400, {"error": f"face must be one of {sorted(health.crash_drills)}"})
    event(log, logging.WARNING, "debug_crash_face", face=name)
    crash()
    return _json(202, {"face": name})


class InjectedCrash(RuntimeError):
    """What a face crashed by ``/debug/crash-face`` raises."""


async def crashable(
    run: Callable[..., Any],
    health: Health,
    name: str,
    *,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the face ``run`` (a ``task_status`` function) so that ``/debug/crash-face``
    can crash it: with the hooks on, a face runs inside this."""

    async def raise_in_face() -> None:
        raise InjectedCrash(f"face {name} crashed by /debug/crash-face")

    try:
        async with trio.open_nursery() as nursery:
            task_status.started(await nursery.start(run))
            health.crash_drills[name] = lambda: nursery.start_soon(raise_in_face)
    finally:  # a face that ended takes no more drills: its nursery is closed
        health.crash_drills.pop(name, None)


HOOKS: dict[str, Callable[[Health, Scope], Answer]] = {
    "/debug/loop-census": loop_census,
    "/debug/block-loop": block_loop,
    "/debug/fail-writes": fail_writes,
    "/debug/slow-commits": slow_commits,
    "/debug/crash-face": crash_face,
    "/debug/hold-bytes": hold_bytes,
}

_DISK_ERRORS = {
    "eio": "disk I/O error (injected: EIO)",
    "enospc": "database or disk is full (injected: ENOSPC)",
}


async def _block(seconds: float) -> None:
    await trio.lowlevel.checkpoint()  # let the 202 go out first
    time.sleep(seconds)  # noqa: ASYNC251 - blocking the loop is the point of this hook


def _param(scope: Scope, name: str, default: str) -> str:
    """The first value of the query parameter ``name``, or ``default``."""
    query: dict[str, list[str]] = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return query.get(name, [default])[0]


def _json(status: int, document: dict[str, Any]) -> Answer:
    return status, _JSON, json.dumps(document).encode()
