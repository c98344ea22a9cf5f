"""What `cmdbus-trio backup` costs a writer that is serving: publish latency and the
writer's CPU at a steady rate, without a backup and while one runs.

    python benchmarks/backup_cost.py                     # a 1 GiB data dir, 500 publishes/s
    python benchmarks/backup_cost.py --size-mib 100 --rate 200 --json

A writer is started on a fresh data directory and filled to --size-mib of commands
(batches of 1 KiB records, never consumed). Then a publisher sends --rate publishes a
second, one at a time as a worker's server would, for --seconds without a backup; then
for as long as a backup of the data directory runs (at least --seconds). Printed for
each phase: publishes, latency p50 / p99 / max (ms, from send to reply), the writer's
CPU in cores, and for the backup its duration and size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from cmdbus_trio.client import blocking
from cmdbus_trio.commands.spawn import spawn_writer

RECORD_BYTES = 1024
BATCH = 800  # under the 1 MiB request cap with their msg_ids


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fill(address: str, data_dir: Path, size_mib: int) -> int:
    """Publish batches until the commands store (and its WAL) is ``size_mib``."""
    payload = json.dumps({"pad": "x" * (RECORD_BYTES - 20)})
    records = [{"execution_id": n, "payload": payload} for n in range(BATCH)]
    published = 0
    store = data_dir / "commands.sqlite3"
    with blocking.IngestClient(address) as ingest:
        while store.stat().st_size < size_mib * 2**20:
            published += len(ingest.publish_batch(records, timeout=60))
    return published


def steady(address: str, rate: float, until: threading.Event) -> list[float]:
    """Publish one record every 1/rate s until ``until``; each latency in seconds."""
    latencies: list[float] = []
    with blocking.IngestClient(address) as ingest:
        next_at = time.monotonic()
        while not until.is_set():
            started = time.monotonic()
            ingest.publish({"execution_id": 1, "payload": "{}"}, timeout=30)
            latencies.append(time.monotonic() - started)
            next_at += 1 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
    return latencies


def phase(
    pid: int, address: str, rate: float, seconds: float, during: list[str] | None
) -> dict[str, Any]:
    """Publish steadily for ``seconds``, or while the command ``during`` runs (at
    least ``seconds``)."""
    until = threading.Event()
    result: list[list[float]] = []
    publisher = threading.Thread(target=lambda: result.append(steady(address, rate, until)))
    cpu, started = cpu_seconds(pid), time.monotonic()
    publisher.start()
    backup: dict[str, Any] = {}
    if during is not None:
        done = subprocess.run(during, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"the backup failed: {done.stderr}")
        backup["backup_s"] = round(time.monotonic() - started, 2)
    time.sleep(max(0.0, started + seconds - time.monotonic()))
    until.set()
    publisher.join()
    elapsed = time.monotonic() - started
    latencies = sorted(result[0])
    return {
        "publishes": len(latencies),
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 2),
        "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 2),
        "max_ms": round(1000 * latencies[-1], 2),
        "writer_cores": round((cpu_seconds(pid) - cpu) / elapsed, 3),
        **backup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rate", type=float, default=500.0, help="publishes a second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.size_mib < 1 or args.rate <= 0 or args.seconds <= 0:
        parser.error("--size-mib, --rate and --seconds must be positive")
    with tempfile.TemporaryDirectory(prefix="cmdbus-backup-cost-") as workdir:
        root = Path(workdir)
        writer, ports = spawn_writer(root / "writer", ("cmd_ingest",))
        try:
            data_dir = root / "writer" / "data"
            filled = fill(ports["cmd_ingest"], data_dir, args.size_mib)
            time.sleep(2)  # the fill's commits settle
            command = [sys.executable, "-m", "cmdbus_trio", "backup", "--data-dir",
                       str(data_dir), "--to", str(root / "backup"), "--json"]  # fmt: skip
            result = {
                "size_mib": args.size_mib,
                "records": filled,
                "rate": args.rate,
                "no_backup": phase(writer.pid, ports["cmd_ingest"], args.rate, args.seconds, None),
                "backup": phase(writer.pid, ports["cmd_ingest"], args.rate, args.seconds, command),
            }
            result["backup_mib"] = round(
                sum(p.stat().st_size for p in (root / "backup").iterdir()) / 2**20, 1
            )
        finally:
            writer.terminate()
            writer.wait(timeout=60)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['records']} records ({args.size_mib} MiB), {args.rate:g} publishes/s")
    print(f"{'phase':<12}{'publishes':>10}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'cores':>8}")
    for name in ("no_backup", "backup"):
        row = result[name]
        print(
            f"{name:<12}{row['publishes']:>10}{row['p50_ms']:>9}{row['p99_ms']:>9}"
            f"{row['max_ms']:>9}{row['writer_cores']:>8}"
        )
    print(f"the backup: {result['backup']['backup_s']} s, {result['backup_mib']} MiB")


if __name__ == "__main__":
    main()
