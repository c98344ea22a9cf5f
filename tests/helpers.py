"""Test helpers: a tiny HTTP/1.1 client on h11 that shows connection closes, and a
writer running in-process."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import trio

from cmdbus_trio.app import Writer
from cmdbus_trio.config import Config
from cmdbus_trio.faces import FaceServe


@attrs.frozen
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class HttpConnection:
    def __init__(self, stream: trio.SocketStream, host: str) -> None:
        self.stream = stream
        self.host = host
        self.h11 = h11.Connection(h11.CLIENT)

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None
    ) -> Response:
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        all_headers = {"host": self.host, **(headers or {})}
        await self.stream.send_all(
            self.h11.send(
                h11.Request(method=method, target=path, headers=list(all_headers.items()))
            )
            + self.h11.send(h11.EndOfMessage())
        )
        status, response_headers, body = 0, {}, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                response_headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return Response(status, response_headers, body)
            else:
                raise AssertionError(f"unexpected {event!r}")

    async def wait_closed_by_server(self) -> None:
        """Return when the server closes the connection; fails on any data."""
        while True:
            data = await self.stream.receive_some(65536)
            if not data:
                return
            raise AssertionError(f"unexpected data after the response: {data!r}")


@asynccontextmanager
async def http_connection(address: str) -> AsyncIterator[HttpConnection]:
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        yield HttpConnection(stream, address)


async def get(address: str, path: str, method: str = "GET") -> Response:
    async with http_connection(address) as connection:
        return await connection.request(method, path, {"connection": "close"})


@asynccontextmanager
async def running_writer(
    config: Config, faces: dict[str, FaceServe] | None = None
) -> AsyncIterator[tuple[Writer, dict[str, str]]]:
    """A Writer serving in this test's loop; drained (and waited for) on exit."""
    writer = Writer(config) if faces is None else Writer(config, faces=faces)
    async with trio.open_nursery() as nursery:
        addresses = await nursery.start(writer.run)
        try:
            yield writer, addresses
        finally:
            writer.request_drain()
