"""The processes of a NoETL-shaped deployment, for the system tests and
``benchmarks/workload.py``: servers that publish commands in bursts with idle gaps,
workers that wait for commands, run them, record their events in the tier and on the
event bus and ack them, materializers (event consumer groups), a push subscriber and a
reader of finished executions.

Each actor appends what it saw to its own file as JSON lines, one flushed line per fact,
so the test can check the whole run afterwards, also for a process that was SIGKILLed.
Every actor rides out a writer restart by itself: the clients' retry for idempotent calls,
and reconnecting for the rest.

    python harness/actors.py ROLE --ports PORTS.json --out FILE [options]
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import random
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import trio
from opentelemetry import trace

from cmdbus_trio.client import (
    Busy,
    ClientError,
    ConnectionLost,
    DeadlineExceeded,
    RetryBudget,
    RetryPolicy,
    Unavailable,
    blocking,
)
from cmdbus_trio.client import trio as trio_client
from cmdbus_trio.client._sockets import closed_by_peer

T = TypeVar("T")
TRANSIENT = (ConnectionLost, Unavailable, DeadlineExceeded, Busy, OSError)
"""What a writer restart (or a drain) looks like to a client: wait, then try again."""


def retry_policy() -> RetryPolicy:
    """Patient enough for a writer restart (a second or two)."""
    return RetryPolicy(
        attempts=60, base_delay=0.05, max_delay=0.5, budget=RetryBudget(initial=1000, cap=1000)
    )


class Recorder:
    def __init__(self, path: Path, actor: str) -> None:
        self._out = path.open("a", buffering=1)
        self.actor = actor

    def __call__(self, kind: str, **fields: Any) -> None:
        line = {"t": time.time(), "actor": self.actor, "kind": kind, **fields}
        self._out.write(json.dumps(line) + "\n")


async def persist(call: Callable[[], Any], record: Recorder, what: str) -> Any:
    """Await ``call()`` until it stops failing transiently (idempotent calls only)."""
    pause = 0.05
    while True:
        try:
            return await call()
        except TRANSIENT as exc:
            record("transient", what=what, error=type(exc).__name__)
            await trio.sleep(pause)
            pause = min(0.5, pause * 2)


def persist_blocking(call: Callable[[], T], record: Recorder, what: str) -> T:
    pause = 0.05
    while True:
        try:
            return call()
        except TRANSIENT as exc:
            record("transient", what=what, error=type(exc).__name__)
            time.sleep(pause)
            pause = min(0.5, pause * 2)


def command_record(execution_id: str, pool: str) -> dict[str, Any]:
    return {"execution_id": execution_id, "payload": json.dumps({"execution_pool": pool})}


def publisher_span(execution_id: str) -> tuple[str, trace.Span]:
    """A NoETL server's span for publishing one execution's command, as an application's
    tracing would make it (the API alone: a span context derived from the execution id,
    so the checker knows it): its ``traceparent``, and the span, to make current with
    ``trace.use_span`` around each attempt to publish."""
    digest = hashlib.blake2b(execution_id.encode(), digest_size=24).digest()
    trace_id, span_id = int.from_bytes(digest[:16]) or 1, int.from_bytes(digest[16:]) or 1
    context = trace.SpanContext(trace_id, span_id, False, trace.TraceFlags(1))
    traceparent = f"00-{trace_id:032x}-{span_id:016x}-01"
    return traceparent, trace.NonRecordingSpan(context)


def event_payload(execution_id: str, kind: str, sort_key: int) -> str:
    return json.dumps(
        {"event_id": f"{execution_id}-{kind}", "event_type": f"step.{kind}", "command": sort_key}
    )


EVENT_KINDS = ("started", "done")


# --- servers ------------------------------------------------------------------------------


def server(args: argparse.Namespace, record: Recorder) -> None:
    """Publish ``--executions`` commands in bursts of ``--burst`` with ``--gap`` seconds
    of silence between (longer than every timer of the writer), to both pools, each with
    a msg_id, some sent twice (a server's retry)."""
    rng = random.Random(args.seed)
    plan = []
    for n in range(args.executions):
        execution_id = f"{args.name}-{n}"
        pool = "system" if n % 3 == 0 else "shared"
        plan.append((execution_id, pool, f"cmd-{execution_id}", rng.random() < 0.1))
    if args.client == "trio":
        trio.run(_server_trio, args, record, plan)
    else:
        _server_blocking(args, record, plan)
    record("done")


async def _server_trio(
    args: argparse.Namespace, record: Recorder, plan: list[tuple[str, str, str, bool]]
) -> None:
    ingest = trio_client.IngestClient(args.ports["cmd_ingest"], retry=retry_policy())
    for n, (execution_id, pool, msg_id, again) in enumerate(plan):
        traceparent, span = publisher_span(execution_id)
        for attempt in range(2 if again else 1):
            with trace.use_span(span):
                published = await persist(
                    lambda e=execution_id, p=pool, m=msg_id: ingest.publish(
                        command_record(e, p), msg_id=m, timeout=30
                    ),
                    record,
                    "publish",
                )
            _published(record, execution_id, pool, msg_id, published, attempt, traceparent)
        if (n + 1) % args.burst == 0:
            await trio.sleep(args.gap)


def _server_blocking(
    args: argparse.Namespace, record: Recorder, plan: list[tuple[str, str, str, bool]]
) -> None:
    ingest = blocking.IngestClient(args.ports["cmd_ingest"], retry=retry_policy())
    for n, (execution_id, pool, msg_id, again) in enumerate(plan):
        traceparent, span = publisher_span(execution_id)
        for attempt in range(2 if again else 1):
            with trace.use_span(span):
                published = persist_blocking(
                    lambda e=execution_id, p=pool, m=msg_id: ingest.publish(
                        command_record(e, p), msg_id=m, timeout=30
                    ),
                    record,
                    "publish",
                )
            _published(record, execution_id, pool, msg_id, published, attempt, traceparent)
        if (n + 1) % args.burst == 0:
            time.sleep(args.gap)


def _published(
    record: Recorder,
    execution_id: str,
    pool: str,
    msg_id: str,
    published: Any,
    attempt: int,
    traceparent: str,
) -> None:
    record(
        "published" if attempt == 0 else "republished",
        execution_id=execution_id,
        pool=pool,
        msg_id=msg_id,
        sort_key=published.sort_key,
        duplicate=published.duplicate,
        traceparent=traceparent,
    )


# --- workers ------------------------------------------------------------------------------


class Plan:
    """What a worker does with one delivery: nack it (some, on a first delivery), run it
    long past ack_wait with extends (some; v2 only), or run it briefly."""

    def __init__(self, rng: random.Random, redelivered: bool, ack_wait: float, v2: bool) -> None:
        self.nack = not redelivered and rng.random() < 0.05
        self.long = v2 and not self.nack and rng.random() < 0.05
        self.seconds = 2.5 * ack_wait if self.long else rng.uniform(0.01, 0.15)
        self.extend_every = ack_wait / 3


def worker(args: argparse.Namespace, record: Recorder) -> None:
    if args.dialect == "trio":
        trio.run(_worker_trio, args, record)
    elif args.dialect == "blocking":
        _worker_blocking(args, record)
    else:
        _worker_v1(args, record)


BATCHED_SHARE = 0.5
"""Of a trio worker's claims, the share taken in batches (``next_batch``, ``ack_many``)."""
WORKER_BATCH = 4
"""Records a batched claim takes at most: short commands only, all run within ack_wait."""


async def _worker_trio(args: argparse.Namespace, record: Recorder) -> None:
    rng = random.Random(args.seed)
    filter = f"commands.{args.pool}.>"
    claim = trio_client.ClaimClient(args.ports["cmd_claim"], retry=retry_policy())
    tier = trio_client.TierClient(args.ports["tier"], retry=retry_policy())
    events = trio_client.IngestClient(args.ports["evt_ingest"], retry=retry_policy())

    async def run(delivery: Any, batched: bool) -> bool:
        """One command: nacked (False), or run, its events recorded (True: ack it)."""
        sort_key, execution_id = delivery.sort_key, str(delivery.record["execution_id"])
        plan = Plan(rng, delivery.redelivered, args.ack_wait, v2=not batched)
        if plan.nack:
            record("nacking", sort_key=sort_key)  # before: the nack redelivers at once
            record("nacked", sort_key=sort_key, ok=await claim.nack(sort_key))
            return False
        started = trio.current_time()
        while (left := plan.seconds - (trio.current_time() - started)) > 0:
            await trio.sleep(min(left, plan.extend_every))
            if plan.long and trio.current_time() - started < plan.seconds:
                record("extending", sort_key=sort_key)
                record("extended", sort_key=sort_key, ok=await claim.extend(sort_key))
        for kind in EVENT_KINDS:
            payload = event_payload(execution_id, kind, sort_key)
            await persist(lambda e=execution_id, p=payload: tier.append(e, p), record, "append")
            published = await events.publish(
                {"execution_id": execution_id, "payload": payload},
                msg_id=f"evt-{execution_id}-{kind}",
            )
            _event_published(record, published)
        return True

    record("ready")
    while True:
        batched = rng.random() < BATCHED_SHARE
        try:  # either waits as long as it takes
            if batched:
                deliveries = await claim.next_batch(filter, WORKER_BATCH)
            else:
                deliveries = [await claim.next(filter)]
        except TRANSIENT as exc:
            record("transient", what="next", error=type(exc).__name__)
            await trio.sleep(0.1)
            continue
        for delivery in deliveries:
            _claimed(
                record,
                delivery.sort_key,
                str(delivery.record["execution_id"]),
                delivery.redelivered,
                delivery.deliveries,
                batch=len(deliveries) if batched else None,
                traceparent=delivery.traceparent,
            )
        held = [delivery.sort_key for delivery in deliveries]
        try:
            done = [delivery.sort_key for delivery in deliveries if await run(delivery, batched)]
            for sort_key in done:
                record("acking", sort_key=sort_key)
            if batched and done:  # (an ack_many of nothing is refused: `invalid`)
                acked = await claim.ack_many(done)
            else:
                acked = [await claim.ack(k) for k in done]
            for sort_key, ok in zip(done, acked, strict=True):
                record("acked", sort_key=sort_key, ok=ok, dialect="v2")
        except TRANSIENT as exc:  # the writer went away mid-command: it comes back
            for sort_key in held:
                record("transient", what="command", error=type(exc).__name__, sort_key=sort_key)


def _worker_blocking(args: argparse.Namespace, record: Recorder) -> None:
    rng = random.Random(args.seed)
    filter = f"commands.{args.pool}.>"
    claim = blocking.ClaimClient(args.ports["cmd_claim"], retry=retry_policy())
    tier = blocking.TierClient(args.ports["tier"], retry=retry_policy())
    events = blocking.IngestClient(args.ports["evt_ingest"], retry=retry_policy())
    record("ready")
    while True:
        try:
            delivery = claim.next(filter, wait=5.0)  # longer than every timer of the writer
        except TRANSIENT as exc:
            record("transient", what="next", error=type(exc).__name__)
            time.sleep(0.1)
            continue
        if delivery is None:
            continue
        sort_key, execution_id = delivery.sort_key, str(delivery.record["execution_id"])
        _claimed(
            record,
            delivery.sort_key,
            execution_id,
            delivery.redelivered,
            delivery.deliveries,
            traceparent=delivery.traceparent,
        )
        plan = Plan(rng, delivery.redelivered, args.ack_wait, v2=True)
        try:
            if plan.nack:
                record("nacking", sort_key=sort_key)  # before: the nack redelivers at once
                record("nacked", sort_key=sort_key, ok=claim.nack(sort_key))
                continue
            started = time.monotonic()
            while (left := plan.seconds - (time.monotonic() - started)) > 0:
                time.sleep(min(left, plan.extend_every))
                if plan.long and time.monotonic() - started < plan.seconds:
                    record("extending", sort_key=sort_key)
                    record("extended", sort_key=sort_key, ok=claim.extend(sort_key))
            for kind in EVENT_KINDS:
                payload = event_payload(execution_id, kind, sort_key)
                persist_blocking(
                    lambda e=execution_id, p=payload: tier.append(e, p), record, "append"
                )
                published = events.publish(
                    {"execution_id": execution_id, "payload": payload},
                    msg_id=f"evt-{execution_id}-{kind}",
                )
                record(
                    "event_published", sort_key=published.sort_key, duplicate=published.duplicate
                )
            record("acking", sort_key=sort_key)
            record("acked", sort_key=sort_key, ok=claim.ack(sort_key), dialect="v2")
        except TRANSIENT as exc:
            record("transient", what="command", error=type(exc).__name__, sort_key=sort_key)


def _event_published(record: Recorder, published: Any) -> None:
    record("event_published", sort_key=published.sort_key, duplicate=published.duplicate)


def _claimed(
    record: Recorder,
    sort_key: int,
    execution_id: str,
    redelivered: bool,
    deliveries: int | None,
    batch: int | None = None,
    *,
    traceparent: str | None = None,
) -> None:
    """A delivery as its worker saw it; a v2 worker's with the trace context it carried
    (None: none), which v1 frames cannot carry (no ``traceparent`` key)."""
    record(
        "claimed",
        sort_key=sort_key,
        execution_id=execution_id,
        redelivered=redelivered,
        deliveries=deliveries,
        **({} if batch is None else {"batch": batch}),
        **({} if deliveries is None else {"traceparent": traceparent}),
    )


class V1:
    """NoETL's own dialect over plain sockets: length-prefixed JSON frames; the ingest
    faces answer 8 raw bytes."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        host, port = self.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.settimeout(None)  # a Next waits as long as it takes
        return sock

    def send(self, value: Any) -> None:
        """One request (v1 is one at a time: nothing is in flight before it). A
        connection the writer closed while it was idle is opened again first, as a
        careful NoETL client does."""
        if closed_by_peer(self.sock.fileno()):
            self.sock.close()
            self.sock = self._connect()
        body = json.dumps(value).encode()
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionLost("the writer closed the v1 connection")
            data += chunk
        return data

    def frame(self) -> bytes:
        (size,) = struct.unpack(">I", self.exactly(4))
        return self.exactly(size)

    def close(self) -> None:
        self.sock.close()


def _worker_v1(args: argparse.Namespace, record: Recorder) -> None:
    rng = random.Random(args.seed)
    filter = f"commands.{args.pool}.>"
    record("ready")
    while True:
        try:
            claim, tier, events = (
                V1(args.ports.get("v1", args.ports)[face])  # (a pair's: one address)
                for face in ("cmd_claim", "tier", "evt_ingest")
            )
        except OSError as exc:
            record("transient", what="connect", error=type(exc).__name__)
            time.sleep(0.2)
            continue
        holding: list[int] = []  # the sort key being worked on, if any
        try:
            _serve_v1(args, record, rng, filter, claim, tier, events, holding)
        except (OSError, ConnectionLost, ValueError) as exc:
            sort_key = holding[-1] if holding else None
            record("transient", what="v1", error=type(exc).__name__, sort_key=sort_key)
            time.sleep(0.1)
        finally:
            for connection in (claim, tier, events):
                connection.close()


def _serve_v1(
    args: argparse.Namespace,
    record: Recorder,
    rng: random.Random,
    filter: str,
    claim: V1,
    tier: V1,
    events: V1,
    holding: list[int],
) -> None:
    while True:
        holding.clear()
        claim.send({"Next": {"member": 1, "filter": filter}})
        delivery = json.loads(claim.frame())
        sort_key = delivery["sort_key"]
        holding.append(sort_key)
        execution_id = str(delivery["record"]["execution_id"])
        _claimed(record, sort_key, execution_id, delivery["redelivered"], None)
        plan = Plan(rng, delivery["redelivered"], args.ack_wait, v2=False)
        if plan.nack:
            claim.send({"Nack": {"sort_key": sort_key}})
            record("nacked", sort_key=sort_key, ok=claim.frame() == b"1")
            continue
        time.sleep(plan.seconds)
        for kind in EVENT_KINDS:
            payload = event_payload(execution_id, kind, sort_key)
            tier.send({"op": "append", "execution_id": execution_id, "payload": payload})
            reply = json.loads(tier.frame())
            if not reply.get("appended"):
                raise ValueError(f"v1 append refused: {reply}")
            events.send({"execution_id": execution_id, "payload": payload})
            (event_key,) = struct.unpack(">Q", events.exactly(8))
            record("event_published", sort_key=event_key, duplicate=False)
        record("acking", sort_key=sort_key)
        claim.send({"Ack": {"sort_key": sort_key}})
        record("acked", sort_key=sort_key, ok=claim.frame() == b"1", dialect="v1")


# --- materializers, subscriber, reader ----------------------------------------------------


def materializer(args: argparse.Namespace, record: Recorder) -> None:
    """One task and connection per group: consume every event, ack it. With
    ``--create-after``, the groups are created (from the beginning) that many seconds
    into the run, while everything else goes on."""
    trio.run(_materializer, args, record)


async def _materializer(args: argparse.Namespace, record: Recorder) -> None:
    await trio.sleep(args.create_after)
    async with trio.open_nursery() as nursery:
        for group in args.groups.split(","):
            nursery.start_soon(_consume_group, args, record, group)


async def _consume_group(args: argparse.Namespace, record: Recorder, group: str) -> None:
    claim = trio_client.ClaimClient(args.ports["evt_claim"], retry=retry_policy())
    start = "beginning" if args.create_after else None
    record("group_ready", group=group)
    while True:
        try:
            delivery = await claim.next("events.>", group=group, start=start)
            assert delivery is not None
            acked = await claim.ack(delivery.sort_key, group=group)
        except TRANSIENT as exc:
            record("transient", what=f"group {group}", error=type(exc).__name__)
            await trio.sleep(0.1)
            continue
        record("event", group=group, sort_key=delivery.sort_key, acked=acked)


def abandoner(args: argparse.Namespace, record: Recorder) -> None:
    """A group (``--groups``) someone started and gave up on: created from the tail
    ``--create-after`` seconds in, it takes a few events and stops; ``--gap`` seconds
    later, while its backlog grows, an operator deletes it. Undeleted, its lag would hold
    its alert (and the deployment's drain) forever."""
    trio.run(_abandoner, args, record)


async def _abandoner(args: argparse.Namespace, record: Recorder) -> None:
    await trio.sleep(args.create_after)
    claim = trio_client.ClaimClient(args.ports["evt_claim"], retry=retry_policy())
    group = args.groups
    taken = 0
    while taken < 3:
        try:
            delivery = await claim.next("events.>", group=group, start="tail")
            assert delivery is not None
            await claim.ack(delivery.sort_key, group=group)
            taken += 1
        except TRANSIENT as exc:
            record("transient", what="abandoned group", error=type(exc).__name__)
            await trio.sleep(0.1)
    record("group_abandoned", group=group)
    await trio.sleep(args.gap)
    while True:
        try:  # a retry after a writer restart may find it deleted already: False
            deleted = await claim.delete_group(group)
            break
        except TRANSIENT as exc:
            record("transient", what="delete_group", error=type(exc).__name__)
            await trio.sleep(0.1)
    record("group_deleted", group=group, deleted=deleted)


def subscriber(args: argparse.Namespace, record: Recorder) -> None:
    trio.run(_subscriber, args, record)


async def _subscriber(args: argparse.Namespace, record: Recorder) -> None:
    """Follow the event bus from the beginning; close and resume from the cursor once
    after ``--reconnect-after`` records (and whenever the writer goes away)."""
    cursor, seen, reconnected = 0, 0, False
    while True:
        client = trio_client.SubscribeClient(args.ports["evt_subscribe"])
        try:
            async for batch in client.subscribe(cursor):
                keys = [pushed.sort_key for pushed in batch]
                record("pushed", keys=keys)
                cursor, seen = keys[-1], seen + len(keys)
                if seen >= args.reconnect_after and not reconnected:
                    reconnected = True
                    record("resume", cursor=cursor)
                    break
        except (*TRANSIENT, ClientError) as exc:
            record("transient", what="subscribe", error=type(exc).__name__, cursor=cursor)
            await trio.sleep(0.1)
        finally:
            await client.aclose()


def reader(args: argparse.Namespace, record: Recorder) -> None:
    trio.run(_reader, args, record)


async def _reader(args: argparse.Namespace, record: Recorder) -> None:
    """Read the history of each execution a worker finished, one record a page."""
    tier = trio_client.TierClient(args.ports["tier"], retry=retry_policy())
    done: set[str] = set()
    while True:
        finished: set[str] = set()
        for path in await trio.Path(args.watch).glob("worker-*.jsonl"):
            lines = _lines(Path(path))
            executions = {x["sort_key"]: x["execution_id"] for x in lines if x["kind"] == "claimed"}
            finished |= {
                executions[x["sort_key"]] for x in lines if x["kind"] == "acked" and x["ok"]
            }
        for execution_id in sorted(finished - done):
            records = await persist(
                lambda e=execution_id: _read_paged(tier, e), record, "read_execution"
            )
            record(
                "read",
                execution_id=execution_id,
                event_ids=[json.loads(r.payload)["event_id"] for r in records],
                sequences=[r.global_sequence for r in records],
            )
            done.add(execution_id)
        await trio.sleep(0.5)


async def _read_paged(tier: trio_client.TierClient, execution_id: str) -> list[Any]:
    records, after = [], None
    while True:
        page = await tier.read_execution(execution_id, after=after, limit=1)
        records += page.records
        if page.next_after is None:
            return records
        after = page.next_after


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for text in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # the last line of a process killed mid-write
            out.append(json.loads(text))
    return out


ROLES = {
    "server": server,
    "worker": worker,
    "materializer": materializer,
    "abandoner": abandoner,
    "subscriber": subscriber,
    "reader": reader,
}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--ports", type=Path, required=True, help="the writer's ports file")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="actor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", choices=("trio", "blocking"), default="trio")
    parser.add_argument("--dialect", choices=("v1", "trio", "blocking"), default="trio")
    parser.add_argument("--pool", default="shared")
    parser.add_argument("--executions", type=int, default=100)
    parser.add_argument("--burst", type=int, default=10)
    parser.add_argument("--gap", type=float, default=2.5)
    parser.add_argument("--ack-wait", type=float, default=2.0)
    parser.add_argument("--groups", default="")
    parser.add_argument("--create-after", type=float, default=0.0)
    parser.add_argument("--reconnect-after", type=int, default=100)
    parser.add_argument("--watch", default=".")
    args = parser.parse_args(argv)
    args.ports = json.loads(args.ports.read_text())
    record = Recorder(args.out, args.name)
    # The deployment stops actors with SIGINT, which a process started from a shell's
    # background job inherits as ignored (and Python then leaves it so): take it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # An actor that does not stop on SIGINT is sent SIGUSR1 first: its stacks, in
    # actors.log, say where it was.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with contextlib.suppress(KeyboardInterrupt):
        ROLES[args.role](args, record)


if __name__ == "__main__":
    main(sys.argv[1:])
