"""Idle crowds: does a crowd of idle clients, waiters, subscribers, groups or subjects
slow a working one?

    python benchmarks/idle.py                   # both parts below
    python benchmarks/idle.py --only connections --idle 500 --requests 500
    python benchmarks/idle.py --only crowd --requests 300
    python benchmarks/idle.py --only crowd --crowd 120   # one crowd, by the start of its name

connections: one client's append + read_execution round trips on the tier face, first
alone, then with --idle connections open and idle (v2 hello done, spread over every data
face), in the same run against the same writer. Target: p50 and p99 at most 2x.

crowd: one worker's publish + next + ack round trips (commands; on the event bus for the
event crowds), first alone, then beside each crowd, each on a fresh writer: 1,000 `next`s
parked on 1,000 other pools, 1,000 parked on one other filter, 1,000 subscribers of other
event types, 100 more consumer groups, 100,000 distinct subjects with a backlog, and
1,000 consumers holding 50,000 leases that disconnect at once (with /livez probed
meanwhile); and issue 38's: 20,000 `next`s that timed out on 20,000 filters, 100 groups
from the tail that never consume, 15,000 events behind (past a 500 ms stuck window), and
120 new filters named on a group 500,000 events behind (with /livez probed meanwhile).
Target: p50 and p99 within 1.5x of the lone worker's (waiting is free: docs/architecture.md,
"Decisions").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from cmdbus_trio.commands.spawn import spawn_writer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _client import Client, percentiles

FACES = ("tier", "cmd_ingest", "cmd_claim", "evt_ingest", "evt_claim", "evt_subscribe")


def raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


async def working_client(address: str, requests: int) -> list[float]:
    client = await Client.connect(address)
    samples = []
    for n in range(requests):
        begin = time.perf_counter()
        reply = await client.call("append", execution_id=f"w-{n % 50}", payload="{}")
        assert reply["ok"], reply
        reply = await client.call("read_execution", execution_id=f"w-{n % 50}", limit=10)
        assert reply["ok"], reply
        samples.append(time.perf_counter() - begin)
    await client.aclose()
    return samples


async def measure(ports: dict[str, str], idle: int, requests: int) -> dict[str, Any]:
    baseline = percentiles(await working_client(ports["tier"], requests))
    crowd: list[Client] = []
    for n in range(idle):
        crowd.append(await Client.connect(ports[FACES[n % len(FACES)]]))
    loaded = percentiles(await working_client(ports["tier"], requests))
    # Still open: each answers a request after the measurement.
    answered = sum([(await client.call("lag"))["id"] > 0 for client in crowd[:: len(FACES)]])
    for client in crowd:
        await client.aclose()
    return {"baseline": baseline, "with_idle": loaded, "idle_checked_open": answered}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--only", choices=("connections", "crowd"))
    parser.add_argument("--crowd", default="", help="only the crowds whose name starts so")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    if args.only != "crowd":
        connections(args)
    if args.only != "connections":
        from _crowd import run_crowds

        run_crowds(min(args.requests, 500), args.crowd)


def connections(args: argparse.Namespace) -> None:
    raise_fd_limit(args.idle + 1000)
    workdir = Path(tempfile.mkdtemp(prefix="cmdbus-idle-"))
    process, ports = spawn_writer(
        workdir,
        FACES,
        env={"CMDBUS_MAX_CONNECTIONS": str(args.idle + 100)},
        preexec_fn=lambda: raise_fd_limit(args.idle + 1000),
    )
    try:
        result = trio.run(measure, ports, args.idle, args.requests)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    base, loaded = result["baseline"], result["with_idle"]
    print(f"append + read round trip, {args.requests} each, ms (p50 / p99):")
    print(f"  alone:                   {base['p50']:.3f} / {base['p99']:.3f}")
    print(f"  with {args.idle} idle connections: {loaded['p50']:.3f} / {loaded['p99']:.3f}")
    ratios = {q: loaded[q] / base[q] for q in ("p50", "p99")}
    print(f"  ratio: p50 {ratios['p50']:.2f}x, p99 {ratios['p99']:.2f}x (target <= 2x)")
    print(json.dumps({**result, "ratio": ratios}))


if __name__ == "__main__":
    main()
