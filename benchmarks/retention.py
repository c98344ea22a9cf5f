"""Retention at a steady rate: does the data dir stay flat, and do publishes pay for it?

    python benchmarks/retention.py                  # 2 targets x 180 s at 400 commands/s
    python benchmarks/retention.py --duration 60    # shorter
    python benchmarks/retention.py --bus events     # the event log's byte cap

Runs the same workload twice in one run, one writer at a time: producers publish
~230-byte records at a steady --rate (open loop, one publish per tick over 8
connections), consumers claim and ack them as they come.

On the command bus, target "retention" keeps an acked command --keep seconds
(CMDBUS_CMD_KEEP_ACKED_MS) and runs retention every second; target "keep all" sets the
window to a year (the writer before retention).

On the event bus, group "fast" consumes every event and group "slow" none (a
materializer that is down): retention can delete nothing. Target "capped" sets
CMDBUS_EVT_MAX_BYTES to --cap MiB, so the oldest events are evicted; target "no cap" keeps
them all (the default).

Every --every seconds it prints the data dir's size (every file: databases, WALs, shared
memory), the records the log holds, the rows deleted (evicted, on the event bus), and
publish latency (p50 / p99) over that interval; then, for --settle seconds after the load
ends, the same without latency, and at the end each file of the data dir and its size
against the peak. The load generator runs in its own process, so the writer's figures
are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _client import Client, open_loop, percentiles
from cmdbus_trio.commands.spawn import spawn_writer

TARGETS = {
    "commands": {
        "retention": {},
        "keep all": {"CMDBUS_CMD_KEEP_ACKED_MS": str(365 * 86_400_000)},
    },
    "events": {"capped": {}, "no cap": {"CMDBUS_EVT_MAX_BYTES": "0"}},
}
FACES = {"commands": ("cmd_ingest", "cmd_claim"), "events": ("evt_ingest", "evt_claim")}
DELETED = {"commands": "records", "events": "evicted"}
PRODUCERS = 8
CONSUMERS = 8


async def generate(
    ports: dict[str, str], rate: float, duration: float, every: float, bus: str
) -> None:
    """Publish at ``rate`` and consume everything (on the event bus, as group "fast");
    print one JSON line of latencies per ``every`` seconds (read by the parent)."""
    latencies: list[float] = []
    payload = json.dumps({"execution_pool": "shared", "event_type": "e", "step": "x" * 180})
    stop = trio.current_time() + duration
    ingest, claim = FACES[bus]
    group = {"group": "fast"} if bus == "events" else {}

    async def producer(n: int) -> None:
        client = await Client.connect(ports[ingest])
        async for i in open_loop(n, PRODUCERS, rate, stop):
            started = trio.current_time()
            record = {"execution_id": f"{n}-{i}", "payload": payload}
            reply = await client.call("publish", record=record)
            assert reply.get("ok"), reply
            latencies.append(trio.current_time() - started)

    async def consumer() -> None:
        client = await Client.connect(ports[claim])
        while trio.current_time() < stop + 5:
            reply = await client.call("next", filter=">", timeout_ms=1000, **group)
            delivery = reply.get("delivery")
            if delivery:
                await client.call("ack", sort_key=delivery["sort_key"], **group)

    async def report() -> None:
        while trio.current_time() < stop:
            await trio.sleep(every)
            taken, latencies[:] = list(latencies), []
            print(json.dumps(percentiles(taken) | {"n": len(taken)}), flush=True)

    async with trio.open_nursery() as nursery:
        for n in range(PRODUCERS):
            nursery.start_soon(producer, n)
        for _ in range(CONSUMERS):
            nursery.start_soon(consumer)
        nursery.start_soon(report)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def scrape(control: str, bus: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://{control}/metrics", timeout=10) as response:
        text = response.read().decode()
    wanted = {
        f'cmdbus_store_records{{store="{bus}"}}': "records",
        f'cmdbus_retention_deleted_total{{kind="{DELETED[bus]}",store="{bus}"}}': "deleted",
    }
    found = {}
    for line in text.splitlines():
        for prefix, name in wanted.items():
            if line.startswith(prefix + " "):
                found[name] = float(line.split()[-1])
    return found


def run_target(
    bus: str, kind: str, workdir: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    shutil.rmtree(workdir, ignore_errors=True)
    env = {
        "CMDBUS_CMD_KEEP_ACKED_MS": str(int(args.keep * 1000)),
        "CMDBUS_EVT_MAX_BYTES": str(int(args.cap * 2**20)),
        "CMDBUS_EVT_GROUPS": "fast,slow",
        "CMDBUS_RETENTION_INTERVAL_MS": "1000",
        **TARGETS[bus][kind],
    }
    process, ports = spawn_writer(workdir, FACES[bus], env=env)
    rows: list[dict[str, Any]] = []
    try:
        load = [json.dumps(ports), str(args.rate), str(args.duration), str(args.every), bus]
        generator = subprocess.Popen(
            [sys.executable, __file__, "--load-gen", *load],
            stdout=subprocess.PIPE,
            text=True,
        )
        started = time.monotonic()

        def sample(row: dict[str, Any]) -> dict[str, Any]:
            row |= scrape(ports["control"], bus)
            row |= {"t": time.monotonic() - started, "mib": dir_bytes(workdir / "data") / 2**20}
            rows.append(row)
            return row

        assert generator.stdout is not None
        for line in generator.stdout:
            row = sample(json.loads(line))
            print(
                f"{kind:<10}{row['t']:>6.0f} s{row['mib']:>9.1f} MiB{row.get('records', 0):>9.0f}"
                f"{row.get('deleted', 0):>10.0f}{row['p50']:>9.2f}{row['p99']:>9.2f}",
                flush=True,
            )
        assert generator.wait() == 0
        # The load is over: retention deletes what is left past its window, and the data
        # dir should come back down (every file counted, WAL and shared memory too).
        settle_until = time.monotonic() + args.settle
        while time.monotonic() < settle_until:
            time.sleep(args.every)
            row = sample({"settling": True})
            print(
                f"{kind:<10}{row['t']:>6.0f} s{row['mib']:>9.1f} MiB{row.get('records', 0):>9.0f}"
                f"{row.get('deleted', 0):>10.0f}   (no load)",
                flush=True,
            )
        peak = max(r["mib"] for r in rows)
        for path in sorted((workdir / "data").iterdir()):
            if path.is_file():
                print(f"{'':<10}  {path.name:<32}{path.stat().st_size / 2**20:>9.2f} MiB")
        print(
            f"{'':<10}  now {rows[-1]['mib']:.2f} MiB of a {peak:.2f} MiB peak "
            f"({rows[-1]['mib'] / peak:.2f}x)"
        )
    finally:
        process.terminate()
        process.wait(timeout=30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=400.0, help="commands per second")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds per target")
    parser.add_argument("--every", type=float, default=15.0, help="seconds per printed row")
    parser.add_argument("--keep", type=float, default=20.0, help="acked commands kept, s")
    parser.add_argument("--bus", choices=sorted(TARGETS), default="commands")
    parser.add_argument("--cap", type=float, default=4.0, help="the event log's cap, MiB")
    parser.add_argument(
        "--settle", type=float, help="seconds watched after the load (default: --keep + 15)"
    )
    parser.add_argument(
        "--reverse", action="store_true", help="run the baseline first (to see order effects)"
    )
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    if args.settle is None:
        args.settle = args.keep + 15
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cmdbus-retention-"))
    kept = (
        f"acked commands kept {args.keep:.0f} s"
        if args.bus == "commands"
        else f"one group of two consuming; cap {args.cap:.0f} MiB"
    )
    print(
        f"machine: {os.cpu_count()} CPUs; {args.rate:.0f} {args.bus}/s for "
        f"{args.duration:.0f} s per target; {kept}"
    )
    print(
        f"{'target':<10}{'time':>8}{'data dir':>13}{'records':>9}{'deleted':>10}"
        f"{'p50 ms':>9}{'p99 ms':>9}"
    )
    results = {
        kind: run_target(args.bus, kind, workdir / kind.replace(" ", "-"), args)
        for kind in sorted(
            TARGETS[args.bus], key=list(TARGETS[args.bus]).index, reverse=args.reverse
        )
    }
    print()
    for kind, rows in results.items():
        loaded = [r for r in rows if not r.get("settling")]
        steady = [r for r in loaded if r["t"] > 2 * args.keep]  # once deletion runs
        first, last = rows[0], loaded[-1]
        p99 = max(r["p99"] for r in steady) if steady else float("nan")
        print(
            f"{kind:<10} data dir {first['mib']:.1f} -> {last['mib']:.1f} MiB "
            f"(max {max(r['mib'] for r in rows):.1f}); publish p50 "
            f"{sum(r['p50'] for r in loaded) / len(loaded):.2f} ms (mean of rows), "
            f"worst p99 after {2 * args.keep:.0f} s {p99:.2f} ms; "
            f"{args.settle:.0f} s after the load {rows[-1]['mib']:.1f} MiB "
            f"({rows[-1]['mib'] / max(r['mib'] for r in rows):.2f}x of the peak)"
        )


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--load-gen":
        _, _, ports_arg, rate_arg, duration_arg, every_arg, bus_arg = sys.argv
        trio.run(
            generate,
            json.loads(ports_arg),
            float(rate_arg),
            float(duration_arg),
            float(every_arg),
            bus_arg,
        )
    else:
        main()
