"""The replication face (``CMDBUS_HA_BIND``): where a standby connects to its primary.

On a primary each connection is served by the :class:`~cmdbus_trio.ha.source.Source`
(the standby's hello, base copies, then every commit's pages); a member that is not
primary says so, with its epoch and who is primary, and closes. Connections past
:data:`MAX_CONNECTIONS` are closed at once: a flood of them costs the primary nothing
but the accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from cmdbus_trio.config import Bind
from cmdbus_trio.logs import event, why

from . import _wire as wire
from .elector import Elector
from .source import Source

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 4
"""Connections served at once (one standby, reconnecting)."""


async def serve(
    bind: Bind,
    source: Callable[[], Source | None],
    elector: Elector,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``bind`` and serve each standby from ``source()`` (None: not primary)."""
    listeners = await trio.open_tcp_listeners(bind.port, host=bind.host)
    host, port = listeners[0].socket.getsockname()[:2]
    slots = trio.CapacityLimiter(MAX_CONNECTIONS)

    async def connection(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                slots.acquire_nowait()
            except trio.WouldBlock:
                return  # (closed at once)
            try:
                await _replicate_to(stream, source(), elector)
            finally:
                slots.release()

    task_status.started(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    await trio.serve_listeners(connection, listeners)


async def _replicate_to(stream: trio.SocketStream, source: Source | None, elector: Elector) -> None:
    try:
        if source is None:  # not primary: it says so, and who is
            refused = wire.Refused("not primary", elector.epoch, elector.primary)
            await stream.send_all(wire.encode(refused))
            return
        await source.serve(stream)
    except Exception as exc:  # (in a group, from its nursery) this stream's end only
        event(log, logging.INFO, "standby_disconnected", why=why(exc))
