"""What continuous replication with Litestream loses when the disk is lost, and how long
a restore from the replica takes: the RPO and the RTO, measured.

    python benchmarks/replication.py                          # 10 kills at 200/s; 100 MiB
    python benchmarks/replication.py --kills 20 --rate 500 --sizes 100,1024 --json

RPO: a writer (CMDBUS_CHECKPOINTS=litestream) and `litestream replicate` to a file target;
a publisher sends --rate publishes a second and notes each acknowledged sort key and when;
at a random moment (2 to 6 s in) the writer and Litestream are SIGKILLed together, as a
node lost with its disk; the commands store is restored from the replica, and what was
acknowledged but is not in it is counted: records, and seconds (from the newest record
restored to the kill). Repeated --kills times.

RTO: for each of --sizes MiB of commands, the time from an empty volume to a writer
answering /readyz: `litestream restore` of every store, `cmdbus-trio restore
--after-litestream`, and the writer's start.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from cmdbus_trio.client import blocking
from cmdbus_trio.commands.spawn import spawn_writer
from cmdbus_trio.storage.datadir import STORE_FILES

LITESTREAM = str(Path(sys.executable).parent / "litestream")
RECORD = {"execution_id": 1, "payload": json.dumps({"pad": "x" * 200})}


def litestream_config(workdir: Path) -> Path:
    data, replica = workdir / "data", workdir / "replica"
    text = "dbs:\n" + "".join(
        f"  - path: {data / name}\n    replica:\n      type: file\n"
        f"      path: {replica / name.removesuffix('.sqlite3')}\n"
        for name in STORE_FILES
    )
    path = workdir / "litestream.yml"
    path.write_text(text)
    return path


def start(workdir: Path, env: dict[str, str] | None = None) -> tuple[Any, dict[str, str], Any]:
    """A writer in Litestream's checkpoint mode, and Litestream replicating it."""
    settings = {"CMDBUS_CHECKPOINTS": "litestream", **(env or {})}
    writer, ports = spawn_writer(workdir, ("cmd_ingest",), env=settings)
    config = litestream_config(workdir)
    replicate = subprocess.Popen(
        [LITESTREAM, "replicate", "-config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return writer, ports, replicate


def restore(workdir: Path) -> float:
    """Every store from its replica into the (empty) data dir, then the key step."""
    started = time.monotonic()
    config = workdir / "litestream.yml"
    for name in STORE_FILES:
        subprocess.run(
            [LITESTREAM, "restore", "-config", str(config), "-if-replica-exists",
             str(workdir / "data" / name)],
            check=True, capture_output=True,
        )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "cmdbus_trio", "restore", "--after-litestream", "--data-dir",
         str(workdir / "data"), "--json"],
        check=True, capture_output=True,
    )  # fmt: skip
    return time.monotonic() - started


def one_kill(workdir: Path, rate: float, rng: random.Random) -> dict[str, float]:
    writer, ports, replicate = start(workdir)
    acked: list[tuple[float, int]] = []
    stop = threading.Event()

    def publish() -> None:
        with blocking.IngestClient(ports["cmd_ingest"], reconnect_for=0) as ingest:
            next_at = time.monotonic()
            while not stop.is_set():
                try:
                    key = ingest.publish(RECORD, timeout=5).sort_key
                except Exception:
                    return  # the writer is gone
                acked.append((time.monotonic(), key))
                next_at += 1 / rate
                time.sleep(max(0.0, next_at - time.monotonic()))

    publisher = threading.Thread(target=publish)
    publisher.start()
    time.sleep(rng.uniform(2.0, 6.0))
    killed_at = time.monotonic()
    for process in (writer, replicate):  # together: the node and its disk are gone
        process.send_signal(signal.SIGKILL)
    for process in (writer, replicate):
        process.wait()
    stop.set()
    publisher.join()
    shutil.rmtree(workdir / "data")
    restore(workdir)
    with sqlite3.connect(workdir / "data" / "commands.sqlite3") as connection:
        (restored,) = connection.execute(
            "SELECT coalesce(max(sort_key), 0) FROM records"
        ).fetchone()
    lost = [(at, key) for at, key in acked if key > restored]
    kept = [at for at, key in acked if key <= restored]
    seconds = killed_at - max(kept) if kept else killed_at
    shutil.rmtree(workdir)
    return {"acknowledged": len(acked), "lost": len(lost), "lost_s": round(seconds, 3)}


def recovery_time(workdir: Path, size_mib: int) -> dict[str, float]:
    writer, ports, replicate = start(workdir)
    payload = json.dumps({"pad": "x" * 1000})
    records = [{"execution_id": n, "payload": payload} for n in range(800)]
    with blocking.IngestClient(ports["cmd_ingest"]) as ingest:
        while (workdir / "data" / "commands.sqlite3").stat().st_size + _wal(workdir) < (
            size_mib << 20
        ):
            ingest.publish_batch(records, timeout=60)
    time.sleep(5)  # Litestream has the last of it
    for process in (writer, replicate):
        process.send_signal(signal.SIGKILL)
        process.wait()
    shutil.rmtree(workdir / "data")
    restoring = restore(workdir)
    started = time.monotonic()
    writer, ports = spawn_writer(workdir, ("cmd_ingest",), env={"CMDBUS_CHECKPOINTS": "litestream"})
    while True:
        try:
            with urllib.request.urlopen(f"http://{ports['control']}/readyz", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.01)
    ready = time.monotonic() - started
    writer.terminate()
    writer.wait()
    shutil.rmtree(workdir)
    return {"size_mib": size_mib, "restore_s": round(restoring, 2), "start_s": round(ready, 2)}


def _wal(workdir: Path) -> int:
    wal = workdir / "data" / "commands.sqlite3-wal"
    return wal.stat().st_size if wal.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--rate", type=float, default=200.0, help="publishes a second")
    parser.add_argument(
        "--sizes", default="100", help="MiB of commands to restore, comma-separated"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",") if size]
    if args.kills < 0 or args.rate <= 0 or any(size < 1 for size in sizes):
        parser.error("--kills >= 0, --rate > 0 and every --sizes at least 1")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="cmdbus-replication-") as root:
        kills = [one_kill(Path(root) / f"kill{n}", args.rate, rng) for n in range(args.kills)]
        rto = [recovery_time(Path(root) / f"rto{size}", size) for size in sizes]
    result = {"rate": args.rate, "kills": kills, "rto": rto}
    if args.json:
        print(json.dumps(result))
        return
    lost = sorted(k["lost"] for k in kills)
    seconds = sorted(k["lost_s"] for k in kills)
    if kills:
        print(f"{len(kills)} kills at {args.rate:g} publishes/s: records lost per kill "
              f"p50 {lost[len(lost) // 2]}, max {lost[-1]}; seconds lost p50 "
              f"{seconds[len(seconds) // 2]}, max {seconds[-1]}")  # fmt: skip
    for row in rto:
        print(f"restore of {row['size_mib']} MiB: {row['restore_s']} s from the replica, "
              f"then {row['start_s']} s to ready")  # fmt: skip


if __name__ == "__main__":
    main()
