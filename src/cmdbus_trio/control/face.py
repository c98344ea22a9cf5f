"""The control face: /livez /readyz /healthz /metrics over HTTP, for Kubernetes and
Prometheus; and NoETL's old lag ports (:9102, :9106), which serve one bus's lag series
to any GET, as the NoETL writer's did.

A plain ASGI app served by hypercorn's connection handler in the control nursery
(docs/architecture.md says why it is not a quart-trio app), behind an accept loop of our
own: hypercorn's takes every connection, and a flood of them took descriptors the data
faces' caps were fitted around (:mod:`cmdbus_trio.config.descriptors`). Handlers read
in-memory state only: they never await a data-plane lock, limiter or store, so they
answer however saturated the data plane is.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from typing import Any, ClassVar, Final

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

from .. import metrics
from ..config import Bind, descriptors
from ..loop import turns
from . import _debug
from ._debug import Scope, _json
from .health import Health

log = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


PROBES = frozenset({"/livez", "/readyz", "/healthz"})
HA_ACTIONS = frozenset({"/ha/switchover", "/ha/promote"})
"""A pair's operations (``cmdbus-trio ha``): POST, with the auth token when one is set."""
"""Paths answered ahead of the others when the control face's share is spent."""
ENDPOINTS: Final = {
    "/livez": "200 while the event loop turns and no face or task has crashed (liveness)",
    "/readyz": "200 when serving; 503 with the reasons while starting, draining or poisoned",
    "/ha": "this member's role in its pair: primary, standby, starting, draining or single",
    "/healthz": "the writer's state as JSON: loop, faces, Gates, stores",
    "/metrics": "Prometheus metrics",
}
"""What ``/`` lists, for a person who opens the port in a browser or with curl."""
REUSE_FOR = 1.0
"""Seconds a rendered exposition is served again while scrapes come faster than the
control face's share (a render of every family takes ~6 ms of the loop); otherwise each
scrape renders anew."""


class _PlainApp:
    """An ASGI application answering each HTTP request whole, from :meth:`_route`'s
    ``(status, content type, body)`` (no body for HEAD), never cached by a client.
    Requests are paced to the control face's share of the loop (``turns.ControlShare``),
    probes first."""

    share: turns.ControlShare

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # HTTP only: the accept loop runs no ASGI lifespan (hypercorn's serve did).
        if scope["type"] == "http":
            await self.share.admit(first=scope["path"] in PROBES)
            status, content_type, body = await self._route(scope)
            headers = [
                (b"content-type", content_type),
                (b"cache-control", b"no-store"),
                (b"content-length", b"%d" % len(body)),  # not chunked: less to parse
            ]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if scope["method"] == "HEAD":
                body = b""
            await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _route(self, scope: Scope) -> tuple[int, bytes, bytes]:
        raise NotImplementedError


class ControlApp(_PlainApp):
    """The ASGI application of the control face."""

    def __init__(
        self, health: Health, *, debug_hooks: bool = False, auth_token: str | None = None
    ) -> None:
        self.health = health
        self.debug_hooks = debug_hooks
        self._debug_credentials = None if auth_token is None else f"Bearer {auth_token}".encode()
        self.share = turns.current().control
        self._exposition = _Exposition(self.share)

    async def _route(self, scope: Scope) -> tuple[int, bytes, bytes]:
        path, method = scope["path"], scope["method"]
        if path in _debug.HOOKS and self.debug_hooks:
            if method != "POST":
                return _json(405, {"error": "use POST"})
            if not self._debug_allowed(scope):
                return _json(401, {"error": "debug hooks need Authorization: Bearer <token>"})
            return _debug.HOOKS[path](self.health, scope)
        if path in HA_ACTIONS:
            if method != "POST":
                return _json(405, {"error": "use POST"})
            if not self._debug_allowed(scope):
                return _json(401, {"error": f"{path} needs Authorization: Bearer <token>"})
            act = self.health.ha_actions.get(path.removeprefix("/ha/"))
            if act is None:
                return _json(409, {"error": "this writer is not one of a pair (CMDBUS_HA_LEASE)"})
            status, document = act(b"force=1" in scope.get("query_string", b""))
            return _json(status, document)
        handler = self._GET.get(path)
        if handler is None:
            return _json(404, {"error": f"no such path {path}"})
        if method not in ("GET", "HEAD"):
            return _json(405, {"error": "use GET"})
        return await handler(self)

    def _debug_allowed(self, scope: Scope) -> bool:
        """With an auth token set, a debug hook needs it (the control port may listen on
        every interface); compared in constant time, as the data faces' hello is."""
        if self._debug_credentials is None:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self._debug_credentials)

    async def _livez(self) -> tuple[int, bytes, bytes]:
        loop = self.health.heartbeat.statistics()
        if loop.stalled:
            return _json(503, {"status": "stalled", "reason": loop.reason})
        if dead := self.health.dead_faces():
            return _json(503, {"status": "face_crashed", "reason": "; ".join(dead)})
        if dead := self.health.dead_tasks():
            return _json(503, {"status": "task_crashed", "reason": "; ".join(dead)})
        return _json(200, {"status": "ok"})

    async def _readyz(self) -> tuple[int, bytes, bytes]:
        readiness = self.health.readiness()
        if not readiness.ready:
            return _json(503, {"status": "not_ready", "reasons": list(readiness.reasons)})
        return _json(200, {"status": "ready"})

    async def _healthz(self) -> tuple[int, bytes, bytes]:
        # One trip through the scheduler: a health check that never yields cannot see
        # a starved loop, this one reports how long the trip took.
        before = trio.current_time()
        await trio.lowlevel.checkpoint()
        summary = self.health.summary()
        summary["loop"]["turn_ms"] = round((trio.current_time() - before) * 1000, 3)
        return _json(200, summary)

    async def _metrics(self) -> tuple[int, bytes, bytes]:
        return self._exposition.render()

    async def _ha(self) -> tuple[int, bytes, bytes]:
        return _json(200, self.health.ha())

    async def _index(self) -> tuple[int, bytes, bytes]:
        return _json(200, {"service": "cmdbus-trio", "endpoints": ENDPOINTS})

    _GET: ClassVar = {
        "/": _index,
        "/livez": _livez,
        "/readyz": _readyz,
        "/healthz": _healthz,
        "/metrics": _metrics,
        "/ha": _ha,
    }


class _Exposition:
    """One registry's Prometheus text, rendered anew for each scrape unless scrapes come
    faster than the control face's share: then one render serves for :data:`REUSE_FOR`."""

    def __init__(self, share: turns.ControlShare, port: str | None = None) -> None:
        self._share = share
        self._port = port
        self._rendered: tuple[int, bytes, bytes] | None = None
        self._rendered_at = -REUSE_FOR

    def render(self) -> tuple[int, bytes, bytes]:
        started = time.perf_counter()
        if (
            self._rendered is not None
            and started - self._rendered_at < REUSE_FOR
            and self._share.pressed
        ):
            return self._rendered
        body, content_type = metrics.exposition(self._port)
        self._rendered, self._rendered_at = (200, content_type.encode(), body), started
        return self._rendered


class LagPortApp(_PlainApp):
    """The ASGI application of a NoETL lag port: its bus's lag series for any GET (the
    NoETL writer answered every path with them), read from memory like /metrics."""

    def __init__(self, port: str) -> None:
        self.port = port
        self.share = turns.current().control
        self._exposition = _Exposition(self.share, port)

    async def _route(self, scope: Scope) -> tuple[int, bytes, bytes]:
        if scope["method"] not in ("GET", "HEAD"):
            return _json(405, {"error": "use GET"})
        return self._exposition.render()


async def serve(
    health: Health,
    bind: Bind,
    *,
    keepalive: float = 5.0,
    debug_hooks: bool = False,
    auth_token: str | None = None,
    max_connections: int = descriptors.CONTROL_CONNECTIONS,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control face on ``bind`` until ``shutdown`` is set (or cancelled);
    reports the bound ``host:port``. At most ``max_connections`` are held (see
    :class:`_Connections`). With ``debug_hooks``, ``auth_token`` (when set) guards them.

    Cancellation: in-flight probe requests are abandoned; they hold nothing.
    """
    await _serve_http(
        ControlApp(health, debug_hooks=debug_hooks, auth_token=auth_token),
        bind,
        _Connections("control", max_connections),
        keepalive=keepalive,
        shutdown=shutdown,
        task_status=task_status,
    )


async def serve_lag_port(
    port: str,
    bind: Bind,
    *,
    keepalive: float = 5.0,
    max_connections: int = descriptors.LAG_PORT_CONNECTIONS,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the NoETL lag port ``port`` (``cmd_lag`` or ``evt_lag``) on ``bind`` until
    ``shutdown`` is set (or cancelled); reports the bound ``host:port``.

    Cancellation: as :func:`serve`."""
    await _serve_http(
        LagPortApp(port),
        bind,
        _Connections(port, max_connections),
        keepalive=keepalive,
        shutdown=shutdown,
        task_status=task_status,
    )


class _Connections:
    """The open connections of one HTTP port, at most ``cap`` of them.

    A connection accepted at the cap closes the one quiet the longest: accepted, or done
    with its last request, longest ago. Connections held idle, or trickling a request's
    headers, are then the first to go, and a probe always gets in (refusing it, or
    waiting for a free place, would hold the kubelet out for as long as a flood lasts).
    A request in flight is made the most recent, so it is closed last."""

    def __init__(self, port: str, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"max_connections must be at least 1, got {cap}")
        self.port = port
        self.cap = cap
        self._quietest_first: OrderedDict[object, trio.CancelScope] = OrderedDict()
        metrics.CONTROL_CONNECTIONS.labels(port=port).set_function(
            lambda: len(self._quietest_first)
        )

    def heard_from(self, peer: object) -> None:
        if peer in self._quietest_first:
            self._quietest_first.move_to_end(peer)

    async def handle(
        self, serve_one: Callable[[trio.SocketStream], Awaitable[None]], stream: trio.SocketStream
    ) -> None:
        try:
            peer = tuple(stream.socket.getpeername()[:2])
        except OSError:  # reset before it was accepted: nothing to serve
            await trio.aclose_forcefully(stream)
            return
        while len(self._quietest_first) >= self.cap:
            _, quietest = self._quietest_first.popitem(last=False)
            quietest.cancel()
            metrics.CONTROL_CONNECTIONS_CLOSED.labels(port=self.port).inc()
        scope = self._quietest_first[peer] = trio.CancelScope()
        try:
            with scope:
                await serve_one(stream)
        finally:
            if self._quietest_first.get(peer) is scope:
                del self._quietest_first[peer]
            # The socket closes before any checkpoint, cancelled or not.
            await trio.aclose_forcefully(stream)


async def _serve_http(
    app: _PlainApp,
    bind: Bind,
    connections: _Connections,
    *,
    keepalive: float,
    shutdown: trio.Event | None,
    task_status: trio.TaskStatus[str],
) -> None:
    config = HypercornConfig()
    config.keep_alive_timeout = keepalive
    config.graceful_timeout = 1.0
    config.accesslog = None
    http_log = logging.getLogger("cmdbus_trio.control.http")
    if http_log.level == logging.NOTSET:
        http_log.setLevel(logging.WARNING)  # hypercorn's info lines are sentences, not events
    config.errorlog = http_log
    config.include_server_header = False
    stop = shutdown if shutdown is not None else trio.Event()

    async def heard(scope: Scope, receive: Receive, send: Send) -> None:
        peer = tuple(scope.get("client") or ())
        connections.heard_from(peer)  # a request in flight is closed last
        try:
            await app(scope, receive, send)
        finally:
            connections.heard_from(peer)  # quiet from here

    # hypercorn's typed ASGI union is narrower than our plain mappings.
    asgi = wrap_app(heard, config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
    context = WorkerContext(None)

    async def serve_one(stream: trio.SocketStream) -> None:
        state = ConnectionState({})
        # Typed as an SSL stream in hypercorn 0.18; it takes a plain one as its serve does.
        await TCPServer(asgi, config, context, state, stream).run()  # type: ignore[arg-type]

    # Every task serving HTTP here goes first in the loop's turns (bounded; loop/turns.py):
    # a probe's ~17 turns then each hold one unit of the data plane, not 1 ms of it.
    turns.current().put_first(trio.lowlevel.current_task())
    listeners = await trio.open_tcp_listeners(bind.port, host=bind.host or None)
    async with trio.open_nursery() as handlers:
        async with trio.open_nursery() as accepting:
            await accepting.start(
                partial(
                    trio.serve_listeners,
                    partial(connections.handle, serve_one),
                    listeners,
                    handler_nursery=handlers,
                )
            )
            host, port = listeners[0].socket.getsockname()[:2]
            task_status.started(str(Bind(host, port)))
            await stop.wait()
            accepting.cancel_scope.cancel()
        for listener in listeners:  # new connections are refused from here
            await listener.aclose()
        # As hypercorn's own serve: connections finish the request they are on, then
        # close; whatever is left after the graceful timeout is cancelled.
        await context.terminated.set()
        handlers.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
