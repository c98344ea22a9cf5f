"""A minimal v2 client and timing helpers for the benchmarks (trio, our own codec); the
writer starter is `cmdbus_trio.commands.spawn`."""

from __future__ import annotations

import json
import statistics
from collections.abc import AsyncIterator
from typing import Any

import trio

from cmdbus_trio.protocol import CLOSED, NEED_DATA, FrameDecoder, encode_frame


class Client:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder(max_bytes=(1 << 32) - 1)
        self.next_id = 0

    @classmethod
    async def connect(cls, address: str, *, hello: bool = True) -> Client:
        host, port = address.rsplit(":", 1)
        client = cls(await trio.open_tcp_stream(host, int(port)))
        if hello:
            await client.stream.send_all(
                encode_frame(b'{"hello": {"protocol": 2, "client": "bench"}}')
            )
            await client.receive()
        return client

    async def receive(self) -> bytes:
        while True:
            frame = self.decoder.next_frame()
            if isinstance(frame, bytes):
                return frame
            if frame is CLOSED:
                raise EOFError("server closed the connection")
            assert frame is NEED_DATA
            self.decoder.receive_data(await self.stream.receive_some(1 << 20))

    async def call_raw(self, op: str, **fields: Any) -> bytes:
        self.next_id += 1
        await self.stream.send_all(
            encode_frame(json.dumps({"id": self.next_id, "op": op, **fields}).encode())
        )
        return await self.receive()

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        reply: dict[str, Any] = json.loads(await self.call_raw(op, **fields))
        return reply

    async def aclose(self) -> None:
        await self.stream.aclose()


async def http_get(address: str, path: str) -> int:
    """One GET on a new connection, as a kubelet probe or a scrape does; returns the status.
    Raises :class:`OSError` when there is no whole answer (a probe loop counts it failed)."""
    host, port = address.rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        data = b""
        try:
            await stream.send_all(
                f"GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode()
            )
            while chunk := await stream.receive_some(1 << 16):
                data += chunk
        except trio.BrokenResourceError as exc:  # a reset: not an OSError in trio
            raise ConnectionError(f"{address}{path}: {exc!r}") from None
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise ConnectionError(f"{address}{path}: not an HTTP answer: {data[:40]!r}") from None


async def open_loop(n: int, clients: int, rate: float, until: float) -> AsyncIterator[int]:
    """Open loop for client ``n`` of ``clients`` sharing ``rate`` requests a second:
    yields the request count at each of its ticks, staggered and whatever the replies
    take, until trio's clock passes ``until``."""
    tick = trio.current_time() + n / rate
    sent = 0
    while tick < until:
        await trio.sleep_until(tick)
        yield sent
        tick += clients / rate
        sent += 1


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50 / p99 / max in milliseconds."""
    if not samples:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {"p50": statistics.median(ordered) * 1000, "p99": p99 * 1000, "max": ordered[-1] * 1000}


class BlockingClient:
    """The same v2 client over a blocking socket, for load generators in threads."""

    def __init__(self, address: str) -> None:
        import socket

        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = FrameDecoder(max_bytes=(1 << 32) - 1)
        self.next_id = 0
        self.send_raw(encode_frame(b'{"hello": {"protocol": 2, "client": "bench"}}'))
        self.receive()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request_frame(self, op: str, **fields: Any) -> bytes:
        self.next_id += 1
        return encode_frame(json.dumps({"id": self.next_id, "op": op, **fields}).encode())

    def receive(self) -> dict[str, Any]:
        while True:
            frame = self.decoder.next_frame()
            if isinstance(frame, bytes):
                reply: dict[str, Any] = json.loads(frame)
                return reply
            if frame is CLOSED:
                raise EOFError("server closed the connection")
            self.decoder.receive_data(self.sock.recv(1 << 20))

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.send_raw(self.request_frame(op, **fields))
        return self.receive()
