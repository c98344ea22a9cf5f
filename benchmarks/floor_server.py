"""The floor: the least a trio server can do per request of this protocol.

    python benchmarks/floor_server.py PORTS_FILE [--durable DB [--strict]]

It speaks just enough v2 for `bus.py`'s workloads (hello, publish, publish_batch, next
waiting up to its timeout_ms, with or without max, ack of one sort key or of many) on
one port, one task per connection, with our frame codec and the standard json module,
and keeps records in memory: no disk, no fsync, no admission, no metrics, no pipelining
concurrency beyond answering frames in order. No
real server can be cheaper per request on the same loop, so whatever it reaches bounds
what cmdbus-trio can reach with one trio loop on this machine. `bus.py --floor` runs it
beside the others. Never a product: it loses everything on exit and checks nothing.

``--durable DB`` (`bus.py --floor` runs it as "floor+disk") adds the least durability
costs: before a read's replies go out, its publishes and acks are committed to SQLite
(WAL, synchronous=FULL: an fsync per commit) by one worker thread, every write waiting at
that moment in one transaction (group commit). What it reaches bounds what a durable
server on one trio loop and one SQLite file can reach (generously: it hands a record to
`next` before the record is on disk, which a real server must not); the gap between the
two floors is the price of the fsync before the reply.

``--strict`` (`bus.py --floor`'s "floor+strict") hands a record to `next` only once its
commit is over, as the writer does: a record's publish and its ack can then never share
a commit, and a delivery waits for the commit's thread hop back. What it reaches bounds a
durable server that never delivers what a crash could lose.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sqlite3
import sys
from collections import deque
from typing import Any

import trio

from cmdbus_trio.protocol import CLOSED, FrameDecoder, encode_frame

SUBJECT = "commands.shared.shard.0"


class Memory:
    def __init__(self) -> None:
        self.sort_keys = itertools.count(1)
        self.records: deque[tuple[int, Any]] = deque()
        self.leased: dict[int, Any] = {}
        # The nexts waiting for records: a record wakes one of them, as the writer's
        # commits do, not all (which would cost more the fewer records come at a time).
        self.waiting = trio.lowlevel.ParkingLot()

    async def wait_for_records(self) -> None:
        while not self.records:
            await self.waiting.park()

    def make_visible(self, records: list[tuple[int, Any]]) -> None:
        """Hand records to ``next``."""
        self.records += records
        self.waiting.unpark(count=len(records))

    def answer(self, request: dict[str, Any], held: list[tuple[int, Any]]) -> dict[str, Any]:
        """The reply to a request; a publish's records go to ``held``, for `make_visible`."""
        reply: dict[str, Any] = {"id": request["id"], "ok": True}
        op = request["op"]
        if op == "publish":
            key = next(self.sort_keys)
            held.append((key, request["record"]))
            reply.update(sort_key=key, subject=SUBJECT, duplicate=False)
        elif op == "publish_batch":
            keys = []
            for record in request["records"]:
                keys.append(next(self.sort_keys))
                held.append((keys[-1], record))
            reply.update(sort_keys=keys)
        elif op == "next":
            # With ``max``, up to that many deliveries (none after timeout_ms: see
            # serve_connection); without, one or None.
            deliveries = []
            for _ in range(min(request.get("max", 1), len(self.records))):
                key, record = self.records.popleft()
                self.leased[key] = record
                deliveries.append(
                    {
                        "sort_key": key,
                        "subject": SUBJECT,
                        "redelivered": False,
                        "deliveries": 1,
                        "record": record,
                    }
                )
            if "max" in request:
                reply.update(deliveries=deliveries)
            else:
                reply.update(delivery=deliveries[0] if deliveries else None)
        elif op == "ack":
            keys = request["sort_keys"] if "sort_keys" in request else [request["sort_key"]]
            acked = [self.leased.pop(key, None) is not None for key in keys]
            reply.update(acked=all(acked))
        else:
            reply = {"id": request["id"], "ok": False, "error": {"code": "unsupported"}}
        return reply


class Disk:
    """Group commit: writes wait in memory until the thread's next transaction."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE records (sort_key INTEGER PRIMARY KEY, record TEXT)")
        self.db.execute("CREATE TABLE acks (sort_key INTEGER PRIMARY KEY)")
        self.records: list[tuple[int, str]] = []
        self.acks: list[tuple[int]] = []
        self.committed = trio.Event()  # set when what waits now is on disk
        self.waiting = trio.Event()

    async def write(self, records: list[tuple[int, str]], acks: list[tuple[int]]) -> None:
        self.records += records
        self.acks += acks
        self.waiting.set()
        await self.committed.wait()

    async def run(self) -> None:
        while True:
            await self.waiting.wait()
            self.waiting = trio.Event()
            records, acks, committed = self.records, self.acks, self.committed
            self.records, self.acks, self.committed = [], [], trio.Event()
            await trio.to_thread.run_sync(self._commit, records, acks)
            committed.set()

    def _commit(self, records: list[tuple[int, str]], acks: list[tuple[int]]) -> None:
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO records VALUES (?, ?)", records)
        self.db.executemany("INSERT OR IGNORE INTO acks VALUES (?)", acks)
        self.db.execute("COMMIT")


async def serve_connection(
    memory: Memory, disk: Disk | None, strict: bool, stream: trio.SocketStream
) -> None:
    decoder = FrameDecoder(1 << 20)
    records: list[tuple[int, str]] = []
    acks: list[tuple[int]] = []
    held: list[tuple[int, Any]] = []  # published; for next once on disk (strict) or at once

    async def send(replies: list[dict[str, Any]]) -> None:
        if disk is not None and (records or acks):
            await disk.write(records[:], acks[:])
            records.clear()
            acks.clear()
        memory.make_visible(held)
        held.clear()
        await stream.send_all(b"".join(_frames(replies)))

    while True:
        replies = []
        while isinstance(frame := decoder.next_frame(), bytes):
            request = json.loads(frame)
            if "hello" in request:
                replies.append({"ok": True, "protocol": 2, "server": "floor"})
                continue
            if request["op"] == "next" and not memory.records and request.get("timeout_ms"):
                # A next waits for a record, as the writer's does (the replies before it
                # go first: they are answered in order).
                await send(replies)
                replies = []
                with trio.move_on_after(request["timeout_ms"] / 1000):
                    await memory.wait_for_records()
            reply = memory.answer(request, held)
            replies.append(reply)
            if not strict:
                memory.make_visible(held)
                held.clear()
            if disk is not None:
                _note_writes(request, reply, records, acks)
        if replies:
            await send(replies)
        if frame is CLOSED:
            return
        decoder.receive_data(await stream.receive_some(65536))


def _note_writes(
    request: dict[str, Any],
    reply: dict[str, Any],
    records: list[tuple[int, str]],
    acks: list[tuple[int]],
) -> None:
    if request["op"] == "publish":
        records.append((reply["sort_key"], json.dumps(request["record"])))
    elif request["op"] == "publish_batch":
        records += zip(reply["sort_keys"], map(json.dumps, request["records"]), strict=True)
    elif request["op"] == "ack":
        keys = request["sort_keys"] if "sort_keys" in request else [request["sort_key"]]
        acks += [(key,) for key in keys]


def _frames(replies: list[dict[str, Any]]) -> list[bytes]:
    return [encode_frame(json.dumps(r).encode()) for r in replies]


async def main(ports_file: str, durable: str | None, strict: bool) -> None:
    memory = Memory()
    disk = Disk(durable) if durable else None
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    partial = trio.Path(ports_file + ".tmp")
    await partial.write_text(json.dumps({"cmd_ingest": address, "cmd_claim": address}))
    await partial.rename(ports_file)  # whole or absent for the reader

    async def handle(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await serve_connection(memory, disk, strict, stream)

    async with trio.open_nursery() as nursery:
        if disk is not None:
            nursery.start_soon(disk.run)
        await trio.serve_listeners(handle, listeners)


if __name__ == "__main__":
    durable = sys.argv[3] if sys.argv[2:3] == ["--durable"] else None
    trio.run(main, sys.argv[1], durable, sys.argv[4:5] == ["--strict"])
