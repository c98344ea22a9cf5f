"""The crowd part of ``benchmarks/idle.py``: a working consumer beside crowds that must
cost it nothing (waiters, subscribers, groups, subjects, a mass disconnect)."""

from __future__ import annotations

import json
import resource
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from _client import Client, http_get, percentiles
from cmdbus_trio.commands.spawn import spawn_writer

FACES = ("cmd_ingest", "cmd_claim", "evt_ingest", "evt_claim", "evt_subscribe")
TARGET = 1.5
PER_CONNECTION = 25  # parked requests per crowd connection (a connection may have 32)


class Worker:
    """publish + next + ack, on the command bus or (``group``) the event bus."""

    def __init__(self, ports: dict[str, str], *, events: bool) -> None:
        self.ports = ports
        self.events = events

    async def open(self) -> None:
        kind = "evt" if self.events else "cmd"
        self.ingest = await Client.connect(self.ports[f"{kind}_ingest"])
        self.claim = await Client.connect(self.ports[f"{kind}_claim"])
        self.group: dict[str, Any] = {"group": "bench"} if self.events else {}
        if self.events:  # the worker's own group, from now on
            reply = await self.claim.call(
                "next", filter="events.work", timeout_ms=0, **self.group, **{"from": "tail"}
            )
            assert reply["ok"], reply

    async def round_trips(self, count: int) -> list[float]:
        samples = []
        filter = "events.work" if self.events else "commands.work.>"
        payload = json.dumps({"execution_pool": "work", "event_type": "work"})
        for n in range(count):
            begin = time.perf_counter()
            reply = await self.ingest.call(
                "publish", record={"execution_id": n, "payload": payload}
            )
            assert reply["ok"], reply
            reply = await self.claim.call("next", filter=filter, timeout_ms=5000, **self.group)
            assert reply["ok"] and reply["delivery"], reply
            reply = await self.claim.call(
                "ack", sort_key=reply["delivery"]["sort_key"], **self.group
            )
            assert reply["ok"] and reply["acked"], reply
            samples.append(time.perf_counter() - begin)
        return samples


async def park(address: str, count: int, request: Callable[[int], dict[str, Any]]) -> list[Client]:
    """``count`` requests that wait (parked `next`s, subscriptions), PER_CONNECTION a
    connection; their replies are never read."""
    clients = []
    for first in range(0, count, PER_CONNECTION):
        client = await Client.connect(address)
        frames = b""
        for n in range(first, min(count, first + PER_CONNECTION)):
            client.next_id += 1
            body = json.dumps({"id": client.next_id, **request(n)}).encode()
            frames += len(body).to_bytes(4, "big") + body
        await client.stream.send_all(frames)
        clients.append(client)
    return clients


async def publish_many(address: str, records: list[dict[str, Any]]) -> None:
    client = await Client.connect(address)
    for start in range(0, len(records), 1000):
        reply = await client.call("publish_batch", records=records[start : start + 1000])
        assert reply["ok"], reply
    await client.aclose()


Setup = Callable[[dict[str, str]], Awaitable[Callable[[], Awaitable[None]] | None]]


async def other_pools(ports: dict[str, str]) -> None:
    await park(ports["cmd_claim"], 1000, lambda n: {"op": "next", "filter": f"commands.pool{n}.>"})


async def one_other_filter(ports: dict[str, str]) -> None:
    await park(ports["cmd_claim"], 1000, lambda n: {"op": "next", "filter": "commands.crowd.>"})


async def subscribers(ports: dict[str, str]) -> None:
    await park(
        ports["evt_subscribe"],
        1000,
        lambda n: {"op": "subscribe", "from": 1 << 40, "filter": f"events.other_{n % 100}"},
    )


async def groups(ports: dict[str, str]) -> None:
    client = await Client.connect(ports["evt_claim"])
    for n in range(100):
        fields = {"group": f"crowd{n}", "from": "tail", "timeout_ms": 0}
        reply = await client.call("next", filter="events.>", **fields)
        assert reply["ok"], reply


async def subjects(ports: dict[str, str]) -> None:
    """100,000 event types, each with a record the default groups have not consumed."""
    await publish_many(
        ports["evt_ingest"],
        [
            {"execution_id": n, "payload": json.dumps({"event_type": f"kind_{n}"})}
            for n in range(100_000)
        ],
    )


async def mass_disconnect(ports: dict[str, str]) -> Callable[[], Awaitable[None]]:
    """1,000 consumers holding 50 leases each; returns what disconnects them all."""
    await publish_many(
        ports["cmd_ingest"],
        [
            {"execution_id": n, "payload": json.dumps({"execution_pool": "mass"})}
            for n in range(50_000)
        ],
    )
    holders = []
    for _ in range(1000):
        client = await Client.connect(ports["cmd_claim"])
        frames = b""
        for _ in range(50):
            client.next_id += 1
            body = json.dumps(
                {"id": client.next_id, "op": "next", "filter": "commands.mass.>", "timeout_ms": 0}
            ).encode()
            frames += len(body).to_bytes(4, "big") + body
        await client.stream.send_all(frames)
        for _ in range(50):
            reply = json.loads(await client.receive())
            assert reply["ok"] and reply["delivery"], reply
        holders.append(client)

    async def disconnect() -> None:
        for client in holders:
            client.stream.socket.close()  # at once, no goodbye

    return disconnect


async def pipelined(client: Client, requests: list[dict[str, Any]]) -> None:
    """Send every request at once, then read every reply (each must be ``ok``)."""
    frames = bytearray()
    for request in requests:
        client.next_id += 1
        body = json.dumps({"id": client.next_id, **request}).encode()
        frames += len(body).to_bytes(4, "big") + body
    await client.stream.send_all(bytes(frames))
    for _ in requests:
        reply = json.loads(await client.receive())
        assert reply["ok"], reply


async def timed_out_nexts(ports: dict[str, str]) -> None:
    """Issue 38: 20,000 `next`s that time out at once, each on a filter of its own."""
    client = await Client.connect(ports["cmd_claim"])
    for first in range(0, 20_000, 1000):
        await pipelined(
            client,
            [
                {"op": "next", "filter": f"commands.gone{n}.>", "timeout_ms": 0}
                for n in range(first, first + 1000)
            ],
        )
    await client.aclose()


async def lagging_groups(ports: dict[str, str]) -> None:
    """Issue 38: 100 groups from the tail that never consume, 15,000 events behind,
    past the stuck window (the writer runs with CMDBUS_STUCK_AFTER_MS=500)."""
    await groups(ports)
    await publish_many(
        ports["evt_ingest"],
        [{"execution_id": n, "payload": json.dumps({"event_type": "lag"})} for n in range(15_000)],
    )
    await trio.sleep(2.5)  # the groups' sampler, every second, past the stuck window


BEHIND = 500_000
"""Records a group is behind for the crowd of new filters."""


async def new_filters_far_behind(ports: dict[str, str]) -> Callable[[], Awaitable[None]]:
    """Issue 38: a group BEHIND records behind; returns what names 120 new filters on it
    (none matches, so each looks through the whole backlog)."""
    await publish_many(
        ports["evt_ingest"],
        [{"execution_id": n, "payload": json.dumps({"event_type": "old"})} for n in range(BEHIND)],
    )
    client = await Client.connect(ports["evt_claim"])
    fields = {"group": "behind", "timeout_ms": 0}
    await pipelined(
        client, [{"op": "next", "filter": "events.none", "from": "beginning", **fields}]
    )

    async def name_filters() -> None:
        await pipelined(
            client, [{"op": "next", "filter": f"events.new_{n}", **fields} for n in range(120)]
        )

    return name_filters


CROWDS: dict[str, tuple[Setup, bool]] = {
    "1,000 waiters on 1,000 other pools": (other_pools, False),
    "1,000 waiters on one other filter": (one_other_filter, False),
    "1,000 subscribers of other types": (subscribers, True),
    "100 more consumer groups": (groups, True),
    "100,000 subjects with a backlog": (subjects, True),
    "1,000 consumers, 50k leases, all leave": (mass_disconnect, False),  # type: ignore[dict-item]
    "20,000 nexts timed out, 20,000 filters": (timed_out_nexts, False),
    "100 groups never consuming, 15k behind": (lagging_groups, True),
    "120 new filters, a group 500k behind": (new_filters_far_behind, True),  # type: ignore[dict-item]
}


async def one_crowd(
    ports: dict[str, str], setup: Setup, events: bool, requests: int
) -> dict[str, Any]:
    worker = Worker(ports, events=events)
    await worker.open()
    await worker.round_trips(50)  # warm-up
    alone = percentiles(await worker.round_trips(requests))
    action = await setup(ports)
    await trio.sleep(1.0)  # every parked request read and parked
    livez: list[int] = []
    livez_seconds: list[float] = []
    if action is None:
        crowded = percentiles(await worker.round_trips(requests))
    else:
        samples: list[float] = []
        async with trio.open_nursery() as nursery:

            async def probe() -> None:
                while True:
                    began = time.perf_counter()
                    livez.append(await http_get(ports["control"], "/livez"))
                    livez_seconds.append(time.perf_counter() - began)
                    await trio.sleep(0.05)

            nursery.start_soon(probe)
            await action()
            samples = await worker.round_trips(requests)
            nursery.cancel_scope.cancel()
        crowded = percentiles(samples)
    ratio = {q: crowded[q] / alone[q] for q in ("p50", "p99")}
    probed = percentiles(livez_seconds) if livez_seconds else None
    return {"alone": alone, "crowd": crowded, "ratio": ratio, "livez": livez, "probed": probed}


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 8192), hard), hard))


def run_crowds(requests: int, only: str = "") -> None:
    raise_fd_limit()
    print(
        f"\npublish + next + ack round trip, {requests} each, ms (p50 / p99); a fresh writer"
        " for each crowd, CMDBUS_SYNC=normal (so that fsync noise does not hide the cost):"
    )
    print(f"  {'crowd':40} {'alone':>15} {'beside it':>15}   ratio (target <= {TARGET}x)")
    results = {}
    for name, (setup, events) in CROWDS.items():
        if not name.startswith(only):
            continue
        workdir = Path(tempfile.mkdtemp(prefix="cmdbus-crowd-"))
        process, ports = spawn_writer(
            workdir,
            FACES,
            env={
                "CMDBUS_MAX_CONNECTIONS": "2000",
                "CMDBUS_SYNC": "normal",
                "CMDBUS_STUCK_AFTER_MS": "500",  # lagging groups: past it in seconds
            },
            preexec_fn=raise_fd_limit,
        )
        try:
            result = trio.run(one_crowd, ports, setup, events, requests)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
        alone, crowd, ratio = result["alone"], result["crowd"], result["ratio"]
        verdict = "ok" if max(ratio.values()) <= TARGET else "OVER"
        livez = result["livez"]
        probes = f"; /livez {livez.count(200)}/{len(livez)} 200" if livez else ""
        if result["probed"]:
            probed = result["probed"]
            probes += f", p50/p99 {probed['p50']:.0f}/{probed['p99']:.0f} ms"
        print(
            f"  {name:40} {alone['p50']:6.2f} / {alone['p99']:6.2f} "
            f"{crowd['p50']:6.2f} / {crowd['p99']:6.2f}   "
            f"{ratio['p50']:.2f}x / {ratio['p99']:.2f}x {verdict}{probes}"
        )
        results[name] = result
    print(json.dumps(results))
