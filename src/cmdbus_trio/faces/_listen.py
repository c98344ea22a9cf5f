"""A data face's listeners: TLS, the accept loop, and the drain of its connections."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from functools import partial

import trio

from cmdbus_trio.config import Config

from . import FaceContext
from ._connection import Connection, OpenCount
from ._handler import FaceHandler, Sender


async def serve(
    ctx: FaceContext,
    make_handler: Callable[[Sender], FaceHandler],
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``ctx.bind`` and serve connections until ``ctx.draining``; then stop
    accepting, let every connection finish its in-flight requests, and return.
    ``make_handler`` gives each connection its handler (stateless faces share one); it is
    given the connection's sender, for faces that push frames (subscriptions)."""
    tls = _tls_context(ctx.config)  # before binding: a bad certificate fails the start
    sockets = await trio.open_tcp_listeners(ctx.bind.port, host=ctx.bind.host)
    listeners: list[trio.abc.Listener[trio.abc.Stream]] = list(sockets)
    if tls is not None:
        # The handshake happens on the connection's first read, under its idle timeout.
        listeners = [trio.SSLListener(listener, tls) for listener in sockets]
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as acceptor:
            handle = partial(Connection.run, ctx, make_handler, OpenCount())
            await acceptor.start(
                partial(trio.serve_listeners, handle, listeners, handler_nursery=connections)
            )
            host, port = sockets[0].socket.getsockname()[:2]
            task_status.started(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
            await ctx.draining.wait()
            acceptor.cancel_scope.cancel()
        for listener in listeners:  # new clients are refused; connections finish
            await listener.aclose()


def _tls_context(config: Config) -> ssl.SSLContext | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context
