"""Retention at a steady rate: does the data dir stay flat, and do publishes pay for it?

    python benchmarks/retention.py                  # 2 targets x 180 s at 400 commands/s
    python benchmarks/retention.py --duration 60    # shorter

Runs the same workload twice in one run, one writer at a time: producers publish
~230-byte commands at a steady --rate (open loop, one publish per tick over 8
connections), consumers claim and ack them as they come. Target "retention" keeps an
acked command --keep seconds (CMDBUS_CMD_KEEP_ACKED_MS) and runs retention every second;
target "keep all" sets the window to a year (the writer before retention). Every --every
seconds it prints the data dir's size (database and WAL), the records the log holds, the
rows retention deleted, and publish latency (p50 / p99) over that interval. The load
generator runs in its own process, so the writer's figures are its own.
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
from _client import Client, percentiles

from cmdbus_trio.commands.spawn import spawn_writer

TARGETS = {
    "retention": {},
    "keep all": {"CMDBUS_CMD_KEEP_ACKED_MS": str(365 * 86_400_000)},
}
PRODUCERS = 8
CONSUMERS = 8


async def generate(ports: dict[str, str], rate: float, duration: float, every: float) -> None:
    """Publish at ``rate`` and consume everything; print one JSON line of latencies per
    ``every`` seconds (read by the parent)."""
    latencies: list[float] = []
    payload = json.dumps({"execution_pool": "shared", "step": "x" * 180})
    stop = trio.current_time() + duration

    async def producer(n: int) -> None:
        client = await Client.connect(ports["cmd_ingest"])
        tick = trio.current_time() + n / rate
        i = 0
        while tick < stop:
            await trio.sleep_until(tick)
            started = trio.current_time()
            record = {"execution_id": f"{n}-{i}", "payload": payload}
            reply = await client.call("publish", record=record)
            assert reply.get("ok"), reply
            latencies.append(trio.current_time() - started)
            tick += PRODUCERS / rate
            i += 1

    async def consumer() -> None:
        client = await Client.connect(ports["cmd_claim"])
        while trio.current_time() < stop + 5:
            reply = await client.call("next", filter=">", timeout_ms=1000)
            delivery = reply.get("delivery")
            if delivery:
                await client.call("ack", sort_key=delivery["sort_key"])

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


def scrape(control: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://{control}/metrics", timeout=10) as response:
        text = response.read().decode()
    wanted = {
        'cmdbus_store_records{store="commands"}': "records",
        'cmdbus_retention_deleted_total{kind="records",store="commands"}': "deleted",
    }
    found = {}
    for line in text.splitlines():
        for prefix, name in wanted.items():
            if line.startswith(prefix + " "):
                found[name] = float(line.split()[-1])
    return found


def run_target(
    kind: str, workdir: Path, rate: float, duration: float, every: float, keep: float
) -> list[dict[str, Any]]:
    shutil.rmtree(workdir, ignore_errors=True)
    env = {
        "CMDBUS_CMD_KEEP_ACKED_MS": str(int(keep * 1000)),
        "CMDBUS_RETENTION_INTERVAL_MS": "1000",
        **TARGETS[kind],
    }
    process, ports = spawn_writer(workdir, ("cmd_ingest", "cmd_claim"), env=env)
    rows: list[dict[str, Any]] = []
    try:
        load = [json.dumps(ports), str(rate), str(duration), str(every)]
        generator = subprocess.Popen(
            [sys.executable, __file__, "--load-gen", *load],
            stdout=subprocess.PIPE,
            text=True,
        )
        started = time.monotonic()
        assert generator.stdout is not None
        for line in generator.stdout:
            row = json.loads(line)
            row |= scrape(ports["control"])
            row |= {"t": time.monotonic() - started, "mib": dir_bytes(workdir / "data") / 2**20}
            rows.append(row)
            print(
                f"{kind:<10}{row['t']:>6.0f} s{row['mib']:>9.1f} MiB{row.get('records', 0):>9.0f}"
                f"{row.get('deleted', 0):>10.0f}{row['p50']:>9.2f}{row['p99']:>9.2f}",
                flush=True,
            )
        assert generator.wait() == 0
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
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cmdbus-retention-"))
    print(
        f"machine: {os.cpu_count()} CPUs; {args.rate:.0f} commands/s for {args.duration:.0f} s "
        f"per target; acked commands kept {args.keep:.0f} s"
    )
    print(
        f"{'target':<10}{'time':>8}{'data dir':>13}{'records':>9}{'deleted':>10}"
        f"{'p50 ms':>9}{'p99 ms':>9}"
    )
    results = {
        kind: run_target(
            kind, workdir / kind.replace(" ", "-"), args.rate, args.duration, args.every, args.keep
        )
        for kind in TARGETS
    }
    print()
    for kind, rows in results.items():
        steady = [r for r in rows if r["t"] > 2 * args.keep]  # once deletion runs
        first, last = rows[0], rows[-1]
        p99 = max(r["p99"] for r in steady) if steady else float("nan")
        print(
            f"{kind:<10} data dir {first['mib']:.1f} -> {last['mib']:.1f} MiB "
            f"(max {max(r['mib'] for r in rows):.1f}); publish p50 "
            f"{sum(r['p50'] for r in rows) / len(rows):.2f} ms (mean of rows), "
            f"worst p99 after {2 * args.keep:.0f} s {p99:.2f} ms"
        )


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--load-gen":
        _, _, ports_arg, rate_arg, duration_arg, every_arg = sys.argv
        trio.run(
            generate, json.loads(ports_arg), float(rate_arg), float(duration_arg), float(every_arg)
        )
    else:
        main()
