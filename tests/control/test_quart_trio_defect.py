"""The upstream defect the control face avoids (docs/architecture.md, "Control face").

quart-trio 0.12 under hypercorn 0.17/0.18 never closes an HTTP connection itself:
quart-trio cancels its handler nursery when hypercorn reports the disconnect from inside
the final ``send()``, so hypercorn never finishes the response cycle. Kubelet opens a
connection per probe, so a quart-trio control face leaks one per probe.

These tests run a stock QuartTrio app and are expected to fail (strict): if upstream fixes
the defect they pass, the suite fails, and we can reconsider (see the control face).
"""

from __future__ import annotations

from functools import partial

import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart_trio import QuartTrio

from ..helpers import http_connection


def stock_app() -> QuartTrio:
    app = QuartTrio(__name__)

    @app.route("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    return app


async def serve_stock_app(nursery: trio.Nursery, keepalive: float) -> str:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = keepalive
    config.accesslog = None
    urls = await nursery.start(
        lambda task_status: serve(stock_app(), config, task_status=task_status)  # type: ignore[arg-type]
    )
    return str(urls[0]).split("://", 1)[1]


async def server_closed_within(seconds: float, keepalive: float, headers: dict[str, str]) -> bool:
    closed = False
    async with trio.open_nursery() as nursery:
        address = await serve_stock_app(nursery, keepalive)
        async with http_connection(address) as connection:
            assert (await connection.request("GET", "/livez", headers)).status == 200
            with trio.move_on_after(seconds):
                await connection.wait_closed_by_server()
                closed = True
        nursery.cancel_scope.cancel()
    return closed


@pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="quart-trio 0.12 ignores Connection: close"
)
def test_stock_quart_trio_closes_after_connection_close() -> None:
    # Synchronous test running its own trio.run, so the AssertionError is not wrapped in
    # pytest-trio's exception group and `raises=` can tell it from any other failure.
    assert trio.run(partial(server_closed_within, 2.0, 5.0, {"connection": "close"}))


@pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="quart-trio 0.12 never idles out keep-alive"
)
def test_stock_quart_trio_closes_idle_keepalive() -> None:
    assert trio.run(partial(server_closed_within, 2.0, 0.2, {}))
