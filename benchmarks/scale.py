"""Aggregate durable publish rate with 1, 2 and 3 sharded writers on this machine.

    python benchmarks/scale.py                  # 10 s per step
    python benchmarks/scale.py --duration 3

16 producers (4 processes x 4 threads, blocking clients) publish single records through
the shard router (`cmdbus_trio.client.blocking.Router`), one at a time each, for
--duration seconds, against 1, then 2, then 3 writers (each its own process and data
dir, CMDBUS_SHARD_COUNT = N), all on this machine. The writers and the load generator
share its cores: on 2 cores more writers cannot add CPU, only spread the work; see
docs/benchmarks.md, "Scale-out".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from cmdbus_trio.commands.spawn import spawn_writer

HERE = Path(__file__).resolve()

PROCESSES, THREADS = 4, 4


def producer_process(shard_map: str, duration: float, offset: int) -> int:
    from cmdbus_trio.client import ShardMap
    from cmdbus_trio.client.blocking import Router

    counts = [0] * THREADS
    end = time.monotonic() + duration

    def run(index: int) -> None:
        with Router(ShardMap.parse(shard_map)) as router:
            n = (offset * THREADS + index) * 10_000_000
            while time.monotonic() < end:
                record = {"execution_id": n, "payload": json.dumps({"n": n, "pad": "x" * 200})}
                router.publish(record, timeout=10)
                counts[index] += 1
                n += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts)


def measure(writers: int, duration: float, workdir: Path) -> dict[str, Any]:
    started = [
        spawn_writer(
            workdir / f"n{writers}-w{shard}",
            ("cmd_ingest",),
            env={"CMDBUS_SHARD": str(shard), "CMDBUS_SHARD_COUNT": str(writers)},
        )
        for shard in range(writers)
    ]
    shard_map = ",".join(
        f"{shard}@{ports['cmd_ingest']}" for shard, (_, ports) in enumerate(started)
    )
    try:
        command = [sys.executable, str(HERE), "--producer", shard_map, str(duration)]
        producers = [
            subprocess.Popen([*command, str(i)], stdout=subprocess.PIPE, text=True)
            for i in range(PROCESSES)
        ]
        total = sum(int(p.communicate(timeout=duration + 120)[0]) for p in producers)
    finally:
        for process, _ in started:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    return {"writers": writers, "rate": total / duration}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cmdbus-scale-"))
    print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    results = [measure(n, args.duration, workdir) for n in (1, 2, 3)]
    base = results[0]["rate"]
    print(f"{'writers':>8} {'publishes/s':>12} {'vs 1 writer':>12}")
    for result in results:
        print(f"{result['writers']:>8} {result['rate']:>12.0f} {result['rate'] / base:>11.2f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--producer":
        print(producer_process(sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
    else:
        main()
