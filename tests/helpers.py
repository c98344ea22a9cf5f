"""Test helpers: a tiny HTTP/1.1 client on h11 that shows connection closes, and a
writer running in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import h11
import pytest
import trio

from cmdbus_trio.app import Writer
from cmdbus_trio.bus.committer import GroupCommitter, Ticket
from cmdbus_trio.config import Config
from cmdbus_trio.faces import FaceServe
from cmdbus_trio.protocol.bus import PublishRecord
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage.buslog import BusEntry, BusLog


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


class FrameClient:
    """A data-face client for tests: frames over a real socket, using our codec."""

    def __init__(self, stream: trio.SocketStream) -> None:
        from cmdbus_trio.protocol import FrameDecoder

        self.stream = stream
        self.decoder = FrameDecoder(max_bytes=(1 << 32) - 1)
        self.next_id = 0

    @classmethod
    async def connect(cls, address: str) -> FrameClient:
        host, port = address.rsplit(":", 1)
        return cls(await trio.open_tcp_stream(host, int(port)))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def send(self, body: bytes) -> None:
        from cmdbus_trio.protocol import encode_frame

        await self.stream.send_all(encode_frame(body))

    async def receive(self) -> bytes | None:
        """The next frame, or None when the server closed the connection."""
        from cmdbus_trio.protocol import CLOSED, NEED_DATA

        while True:
            frame = self.decoder.next_frame()
            if isinstance(frame, bytes):
                return frame
            if frame is CLOSED:
                return None
            assert frame is NEED_DATA
            try:
                data = await self.stream.receive_some(1 << 20)
            except trio.BrokenResourceError:
                data = b""
            self.decoder.receive_data(data)

    async def receive_json(self) -> Any:
        frame = await self.receive()
        assert frame is not None, "the server closed the connection"
        return json.loads(frame)

    async def hello(self) -> dict[str, Any]:
        await self.send(b'{"hello": {"protocol": 2, "client": "tests"}}')
        reply: dict[str, Any] = await self.receive_json()
        return reply

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one v2 request and return its reply (no other request in flight)."""
        self.next_id += 1
        await self.send(json.dumps({"id": self.next_id, "op": op, **fields}).encode())
        reply: dict[str, Any] = await self.receive_json()
        assert reply["id"] == self.next_id, reply
        return reply

    async def v1(self, body: bytes | dict[str, Any]) -> bytes | None:
        await self.send(body if isinstance(body, bytes) else json.dumps(body).encode())
        return await self.receive()


@asynccontextmanager
async def frame_client(address: str, *, v2: bool = True) -> AsyncIterator[FrameClient]:
    client = await FrameClient.connect(address)
    try:
        if v2:
            await client.hello()
        yield client
    finally:
        await client.aclose()


@contextmanager
def background(work: Callable[[threading.Event], None], threads: int = 1) -> Iterator[None]:
    """``work(stop)`` in ``threads`` threads for the block; ``stop`` is set at its end."""
    stop = threading.Event()
    workers = [threading.Thread(target=work, args=(stop,), daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)


# --- `cmdbus-trio serve` as a subprocess ----------------------------------------------

ALL_PORT_ZERO = {
    f"CMDBUS_{face}_BIND": "127.0.0.1:0"
    for face in (
        "CONTROL",
        "CMD_INGEST",
        "CMD_CLAIM",
        "EVT_INGEST",
        "EVT_CLAIM",
        "EVT_SUBSCRIBE",
        "TIER",
    )
}


def environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CMDBUS_")}
    env.update(ALL_PORT_ZERO)
    env.update(
        CMDBUS_DATA_DIR=str(tmp_path / "data"), CMDBUS_PORTS_FILE=str(tmp_path / "ports.json")
    )
    env.update(extra)
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cmdbus_trio", *args]


@contextmanager
def serving(
    tmp_path: Path, *args: str, file_size_limit: int | None = None, **env: str
) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """Run ``cmdbus-trio serve`` with every face on port 0; yields the process and its
    ports file. Its log goes to :func:`server_log` (a file: a pipe nobody reads while the
    test runs could fill up and block the server)."""
    ports_file = tmp_path / "ports.json"
    ports_file.unlink(missing_ok=True)
    with (tmp_path / "server.log").open("a") as log:
        process = subprocess.Popen(
            cli("serve", *args),
            env=environment(tmp_path, **env),
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
            preexec_fn=None if file_size_limit is None else partial(_limit_files, file_size_limit),
        )
    try:
        deadline = time.monotonic() + 30
        while not ports_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no ports file; log: {server_log(tmp_path)}")
            time.sleep(0.02)
        yield process, json.loads(ports_file.read_text())
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _limit_files(size: int) -> None:
    """In the child: the kernel refuses writes past ``size`` bytes (EFBIG), as a full disk
    would; Python ignores SIGXFSZ, so the write fails instead of killing the process."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def server_log(tmp_path: Path) -> str:
    return (tmp_path / "server.log").read_text()


# --- metrics ----------------------------------------------------------------------------


def metrics_text(ports: dict[str, str]) -> str:
    """One scrape of the writer's /metrics (blocking: call it from a thread in trio)."""
    with urllib.request.urlopen(f"http://{ports['control']}/metrics", timeout=5) as response:
        return str(response.read().decode())


def metric_sum(text: str, prefix: str) -> float:
    """Sum of the samples whose line starts with ``prefix`` (name and labels)."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


# --- publishing, at each level a test may need -------------------------------------------


def publish_to_log(log: BusLog, count: int, *, subject: str, size: int = 10) -> list[int]:
    """``count`` records straight into a bus log (no committer), each padded by ``size``
    bytes; their sort keys."""
    entries = [BusEntry(subject, json.dumps({"pad": "x" * size})) for _ in range(count)]
    return [p.sort_key for p in log.publish(entries)]


def publish_ticket(payload: str, n: int = 0) -> Ticket:
    """A ticket of one record (JSON text) for a bus's group committer."""
    return Ticket([(PublishRecord(n, payload), None, "record")])


async def publish_through(committer: GroupCommitter, payloads: Sequence[str]) -> list[int]:
    """One ticket per payload, queued on a running group committer in order; their sort
    keys once committed."""
    tickets = [publish_ticket(p, n) for n, p in enumerate(payloads)]
    for ticket in tickets:
        committer.enqueue(ticket)
    return [(await ticket.wait())[0].sort_key for ticket in tickets]


async def publish_over_wire(
    address: str, records: Sequence[dict[str, Any]], *, batch: int = 100
) -> list[int]:
    """``records`` through an ingest face's v2 ``publish_batch``, ``batch`` at a time;
    their sort keys."""
    keys: list[int] = []
    async with frame_client(address) as client:
        for first in range(0, len(records), batch):
            reply = await client.request("publish_batch", records=records[first : first + batch])
            assert reply["ok"], reply
            keys += reply["sort_keys"]
    return keys


async def commit_together(committer: Any, tickets: Sequence[Any]) -> None:
    """Queue every ticket before the committer (a bus's or the tier's) starts, so that it
    takes them in one go, and wait until each is settled (its ``on_settled`` called; a
    callback already there is called after)."""
    left = len(tickets)
    all_settled = trio.Event()

    def one_settled() -> None:
        nonlocal left
        left -= 1
        if not left:
            all_settled.set()

    def watch(then: Any) -> Any:
        def settled(ticket: Any) -> None:
            one_settled()
            if then is not None:
                then(ticket)

        return settled

    for ticket in tickets:
        ticket.on_settled = watch(ticket.on_settled)
        committer.enqueue(ticket)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            await all_settled.wait()
            nursery.cancel_scope.cancel()


def watch_the_write_lock(store: Any) -> list[bool]:
    """Whether the write lock was held each time a store's in-memory counts changed
    after a commit (the ``committed`` hook of ``_write``)."""
    held: list[bool] = []
    write = store._write

    def watched(work: Any, *, committed: Any = None) -> Any:
        def check(result: Any) -> None:
            held.append(store._write_lock.locked())
            committed(result)

        return write(work, committed=check if committed else None)

    store._write = watched
    return held


class Refusing:
    """A durability that refuses every batch, as a primary with no standby in sync
    (``strict``) does: it may be stored, it may not be acknowledged."""

    def sequence(self) -> int:
        return 0

    def when_durable(self, sequence: int, done: Any) -> None:
        refusal = StoreUnavailable("no standby is in sync")
        refusal.retry_after_ms = 500
        done(refusal)


def commit_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (r.levelname, r.getMessage(), {**r.cmdbus_fields, "traceback": bool(r.exc_info)})
        for r in caplog.records
        if r.getMessage().startswith("commit_")
    ]
