"""bus.py's load generators: asyncio, one connection per client, each request pipelined as
its workload says, the same way for every server (our codec over asyncio streams for
cmdbus-trio and the floor, RESP for Redis, NATS's text protocol; no client library, each
of which spent more CPU than the server it measured). Run in worker processes:

    python benchmarks/_generators.py TARGET ADDRESS KIND CLIENTS COUNT START_AT SECONDS

KIND: publish (COUNT requests in flight), batched (COUNT records a request), claim+ack,
produce (COUNT records a second per client, each carrying its publish time) or consume
(claim+ack, timing each record from its publish to its delivery, the reply to the claim
in hand, and to its ack's confirmation). START_AT is a time.monotonic() instant
(CLOCK_MONOTONIC, the same in every process of the machine): every worker starts then, so
the parent can sample the server's CPU over exactly the window. Prints one JSON line:
ops, latencies (seconds; consume: to delivery), acked (consume: to the ack's
confirmation), published (produce: to the publish's acknowledgement) and the worker's own
CPU seconds over the window.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import struct
import sys
import time
from typing import Any

SUBJECT = "commands.shared.shard.0"
HEADER = struct.Struct(">I")


PAD_VARIABLE = "CMDBUS_BENCH_PAD_BYTES"
PAD = "x" * int(os.environ.get(PAD_VARIABLE, "200"))
"""Each record's padding (bus.py's --pad-bytes sets it for every generator)."""


def body(n: int, sent_at: float | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"n": n, "pad": PAD}
    if sent_at is not None:
        payload["ts"] = sent_at
    return {"execution_id": n, "payload": json.dumps(payload)}


def sent_at(record: dict[str, Any]) -> float:
    """When a record of the steady workload was published (its payload's stamp)."""
    return float(json.loads(record["payload"])["ts"])


class CmdbusClient:
    """cmdbus-trio's v2 (or the floor's): frames over an asyncio stream, no client
    library, so the generator costs what the protocol costs."""

    def __init__(self, ingest: Any, claim: Any) -> None:
        self.ingest, self.claims = ingest, claim
        self.next_id = 0

    @classmethod
    async def open(cls, address: str) -> CmdbusClient:
        ports = json.loads(address)
        ingest = await _dial(ports["cmd_ingest"])
        claim = ingest if ports["cmd_claim"] == ports["cmd_ingest"] else None
        return cls(ingest, claim or await _dial(ports["cmd_claim"]))

    def _frame(self, op: str, **fields: Any) -> bytes:
        self.next_id += 1
        data = json.dumps({"id": self.next_id, "op": op, **fields}).encode()
        return HEADER.pack(len(data)) + data

    async def _calls(self, streams: Any, frames: list[bytes]) -> list[dict[str, Any]]:
        reader, writer = streams
        writer.write(b"".join(frames))
        return [await _reply(reader) for _ in frames]

    async def publish(self, n: int, count: int, batched: bool, sent_at: float | None) -> None:
        if batched:
            frames = [self._frame("publish_batch", records=[body(n)] * count)]
        else:
            frames = [self._frame("publish", record=body(n, sent_at)) for _ in range(count)]
        for reply in await self._calls(self.ingest, frames):
            assert reply["ok"], reply

    async def claim(self, batch: int) -> tuple[list[dict[str, Any]], float]:
        """One next (waiting up to 1 s) and the ack of what it got: the records, and when
        they were in hand (before the ack). With ``batch`` > 1, ``next`` with ``max`` and
        one ``ack`` of every sort key."""
        asked = {"max": batch} if batch > 1 else {}
        (got,) = await self._calls(
            self.claims, [self._frame("next", filter="commands.>", timeout_ms=1000, **asked)]
        )
        delivered = time.monotonic()
        deliveries = got["deliveries"] if batch > 1 else [got["delivery"]] * bool(got["delivery"])
        if not deliveries:
            return [], delivered
        keys = [delivery["sort_key"] for delivery in deliveries]
        settle = {"sort_keys": keys} if batch > 1 else {"sort_key": keys[0]}
        (acked,) = await self._calls(self.claims, [self._frame("ack", **settle)])
        assert acked["acked"], acked
        return [delivery["record"] for delivery in deliveries], delivered


async def _dial(address: str) -> Any:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(_hello())
    await _reply(reader)
    return reader, writer


def _hello() -> bytes:
    data = b'{"hello": {"protocol": 2, "client": "bench"}}'
    return HEADER.pack(len(data)) + data


async def _reply(reader: asyncio.StreamReader) -> dict[str, Any]:
    (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    reply: dict[str, Any] = json.loads(await reader.readexactly(length))
    return reply


class RedisClient:
    """Redis Streams over RESP on an asyncio stream, no client library (redis-py's asyncio
    client spent more CPU than the server it measured): one connection per client,
    pipelined as the workload says."""

    def __init__(self, reader: asyncio.StreamReader, writer: Any, name: str) -> None:
        self.reader, self.writer, self.name = reader, writer, name

    @classmethod
    async def open(cls, address: str, name: str) -> RedisClient:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, name)

    async def _commands(self, commands: list[list[Any]]) -> list[Any]:
        self.writer.write(b"".join(_resp(command) for command in commands))
        return [await _resp_reply(self.reader) for _ in commands]

    async def publish(self, n: int, count: int, batched: bool, sent_at: float | None) -> None:
        del batched  # no multi-record XADD: a pipeline is Redis's way to batch
        fields = [item for pair in body(n, sent_at).items() for item in pair]
        await self._commands([["XADD", "commands", "*", *fields] for _ in range(count)])

    async def claim(self, batch: int) -> tuple[list[dict[str, Any]], float]:
        """``XREADGROUP COUNT batch`` (waiting up to 1 s), then one ``XACK`` of every id."""
        read = ["XREADGROUP", "GROUP", "workers", self.name, "COUNT", batch, "BLOCK", 1000]
        (got,) = await self._commands([[*read, "STREAMS", "commands", ">"]])
        delivered = time.monotonic()
        if not got:
            return [], delivered
        entries = got[0][1]
        await self._commands([["XACK", "commands", "workers", *(key for key, _ in entries)]])
        records = [
            {fields[i].decode(): fields[i + 1].decode() for i in range(0, len(fields), 2)}
            for _, fields in entries
        ]
        return records, delivered


def _resp(command: list[Any]) -> bytes:
    parts = [b"*%d\r\n" % len(command)]
    for item in command:
        data = item if isinstance(item, bytes) else str(item).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


async def _resp_reply(reader: asyncio.StreamReader) -> Any:
    line = (await reader.readline())[:-2]
    kind, rest = line[:1], line[1:]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        return None if size < 0 else (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        size = int(rest)
        return None if size < 0 else [await _resp_reply(reader) for _ in range(size)]
    raise RuntimeError(f"unexpected RESP reply {line!r}")


class NatsClient:
    """NATS JetStream over its text protocol on an asyncio stream, no client library
    (nats-py spent more CPU than the server it measured): publishes acked by the stream,
    a durable pull consumer with explicit acks, each ack confirmed, as nats-py's
    ``ack_sync`` does."""

    def __init__(self, reader: asyncio.StreamReader, writer: Any, inbox: str) -> None:
        self.reader, self.writer, self.inbox = reader, writer, inbox

    @classmethod
    async def open(cls, address: str, name: str) -> NatsClient:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        await reader.readline()  # INFO
        options = {"verbose": False, "pedantic": False, "headers": True, "protocol": 1}
        inbox = f"_INBOX.{name}"
        writer.write(f"CONNECT {json.dumps(options)}\r\nSUB {inbox}.* 1\r\nPING\r\n".encode())
        while (await reader.readline()).strip() != b"PONG":
            pass
        return cls(reader, writer, inbox)

    def _pub(self, subject: str, reply: str, data: bytes) -> bytes:
        return b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply.encode(), len(data), data)

    async def _message(self) -> tuple[bytes, bytes, bytes]:
        """The next message to this client: (its reply subject, headers, data)."""
        while True:
            line = await self.reader.readline()
            if line.startswith(b"PING"):
                self.writer.write(b"PONG\r\n")
                continue
            if line.startswith(b"-ERR"):
                raise RuntimeError(line.decode())
            parts = line.split()
            if parts[:1] == [b"MSG"]:
                reply = parts[3] if len(parts) == 5 else b""
                data = (await self.reader.readexactly(int(parts[-1]) + 2))[:-2]
                return reply, b"", data
            if parts[:1] == [b"HMSG"]:
                reply = parts[3] if len(parts) == 6 else b""
                headers, total = int(parts[-2]), int(parts[-1])
                raw = (await self.reader.readexactly(total + 2))[:-2]
                return reply, raw[:headers], raw[headers:]

    async def publish(self, n: int, count: int, batched: bool, sent_at: float | None) -> None:
        del batched
        data = json.dumps(body(n, sent_at)).encode()
        self.writer.write(
            b"".join(self._pub(SUBJECT, f"{self.inbox}.p", data) for _ in range(count))
        )
        for _ in range(count):
            _, _, ack = await self._message()
            assert b'"seq"' in ack, ack

    async def claim(self, batch: int) -> tuple[list[dict[str, Any]], float]:
        """A pull of up to ``batch`` messages, then each acked, the acks pipelined and
        every one confirmed. A batch pull asks with ``no_wait`` first, as nats-py's
        ``fetch(n)`` does: what is there now, then a 404 status; only when nothing was
        there does it ask again, for one, waiting up to 1 s."""
        records: list[dict[str, Any]] = []
        acks: list[bytes] = []
        asks = [{"batch": batch, "no_wait": True}] if batch > 1 else []
        asks.append({"batch": 1, "expires": 1_000_000_000})  # 1 s, in nanoseconds
        for ask in asks:
            request = json.dumps(ask).encode()
            subject = "$JS.API.CONSUMER.MSG.NEXT.COMMANDS.workers"
            self.writer.write(self._pub(subject, f"{self.inbox}.f", request))
            while len(records) < ask["batch"]:
                ack_subject, headers, data = await self._message()
                if headers or not data:  # a status: 404 (none now), 408 (none in time)
                    break
                acks.append(ack_subject)
                records.append(json.loads(data))
            if records:
                break
        delivered = time.monotonic()
        self.writer.write(b"".join(self._pub(a.decode(), f"{self.inbox}.a", b"") for a in acks))
        for _ in acks:
            await self._message()  # each ack confirmed
        return records, delivered


class Scraper:
    """A Prometheus server gone wrong: one keep-alive HTTP/1.1 connection asking for
    ``path`` again as soon as each answer is in (the scrape flood)."""

    def __init__(self, reader: asyncio.StreamReader, writer: Any, request: bytes) -> None:
        self.reader, self.writer, self.request = reader, writer, request

    @classmethod
    async def open(cls, address: str) -> Scraper:
        host_port, path = address.split("/", 1)
        host, port = host_port.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        request = f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\n\r\n".encode()
        return cls(reader, writer, request)

    async def scrape(self) -> None:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lengths = [
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ]
        if lengths:
            await self.reader.readexactly(lengths[0])
            return
        while size := int((await self.reader.readuntil(b"\r\n")).strip(), 16):  # chunked
            await self.reader.readexactly(size + 2)
        await self.reader.readuntil(b"\r\n")


async def open_client(target: str, address: str, index: int, kind: str) -> Any:
    if target == "http":  # address: HOST:PORT/PATH, one of them a client
        return await Scraper.open(address.split(",")[index % len(address.split(","))])
    if target == "redis":
        return await RedisClient.open(address, f"c{index}-{time.monotonic_ns()}")
    if target == "nats":
        return await NatsClient.open(address, f"c{index}x{time.monotonic_ns()}")
    return await CmdbusClient.open(address)


async def run(
    target: str, address: str, kind: str, clients: int, count: float, start_at: float, span: float
) -> dict[str, Any]:
    """``count``: records a second per client (produce), else requests in flight or
    records a request (claims: at most)."""
    opened = [await open_client(target, address, i, kind) for i in range(clients)]
    ops = [0] * clients
    empty = [0] * clients  # claims that found nothing: the backlog ran out
    claims = [0] * clients  # claim requests that found records
    latencies: list[float] = []
    acked: list[float] = []  # consume: from publish to the ack's confirmation
    published: list[float] = []  # produce: from publish to its acknowledgement
    end_at = start_at + span

    async def client(index: int) -> None:
        c = opened[index]
        n = index * 10_000_000
        if kind == "produce":  # an open loop: COUNT records a second, staggered
            tick = start_at + index / (clients * count)
            while tick < end_at and time.monotonic() < end_at:  # behind: not past the end
                await asyncio.sleep(max(0.0, tick - time.monotonic()))
                sent = time.monotonic()
                await c.publish(n, 1, False, sent)
                published.append(time.monotonic() - sent)
                ops[index] += 1
                n += 1
                tick += 1 / count
            return
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < end_at:
            if kind == "scrape":
                await c.scrape()
                ops[index] += 1
                continue
            if kind in ("publish", "batched"):
                await c.publish(n, int(count), kind == "batched", None)
                ops[index] += int(count)
                n += 1
                continue
            started = time.monotonic()
            records, delivered = await c.claim(int(count))  # count: records a request at most
            done = time.monotonic()
            ops[index] += len(records)
            empty[index] += not records
            claims[index] += bool(records)
            if kind == "consume":
                latencies.extend(delivered - sent_at(record) for record in records)
                acked.extend(done - sent_at(record) for record in records)
            elif records:
                latencies.append(done - started)

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    cpu_before = _cpu()
    await asyncio.gather(*(client(i) for i in range(clients)))
    cpu = _cpu() - cpu_before
    return {
        "ops": sum(ops),
        "latencies": latencies,
        "acked": acked,
        "published": published,
        "cpu": cpu,
        "empty": sum(empty),
        "claims": sum(claims),
    }


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    _, target, address, kind, clients, count, start_at, seconds = sys.argv
    result = asyncio.run(
        run(target, address, kind, int(clients), float(count), float(start_at), float(seconds))
    )
    print(json.dumps(result))
