"""Command bus throughput: cmdbus-trio against a local Redis (Streams), in the same run.

    python benchmarks/bus.py --peer redis          # about 2 minutes on 2 cores
    python benchmarks/bus.py --peer redis --quick  # about 40 s
    python benchmarks/bus.py --memory              # RSS of a writer holding a 1M backlog

Workloads (each --duration seconds): durable publish with 1 and 16 producers, one at a time
(unpipelined) and 32 in flight (pipelined); claim+ack cycles with 1 and 16 consumers over a
preloaded backlog, with ack latency. Durability is equal: cmdbus-trio with synchronous=FULL
(fsync per commit), Redis with appendonly yes and appendfsync always. The load generators
are separate processes (4 at most), each running its clients in threads on blocking
sockets, with each system's usual Python client (our codec; redis-py).

NATS JetStream (`--peer nats`) is not here yet: see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _client import BlockingClient, percentiles

HERE = Path(__file__).resolve()
PIPELINE = 32
WORKLOADS = [
    ("publish", 1, False),
    ("publish", 16, False),
    ("publish", 16, True),
    ("claim+ack", 1, False),
    ("claim+ack", 16, False),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- servers -------------------------------------------------------------------------------


def start_cmdbus(workdir: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    ports_file = workdir / "ports.json"
    env = {**os.environ, "CMDBUS_PORTS_FILE": str(ports_file), "CMDBUS_LOG_LEVEL": "warning"}
    env.update(
        {f"CMDBUS_{f}_BIND": "" for f in ("TIER", "EVT_INGEST", "EVT_CLAIM", "EVT_SUBSCRIBE")}
    )
    env.update({f"CMDBUS_{f}_BIND": "127.0.0.1:0" for f in ("CONTROL", "CMD_INGEST", "CMD_CLAIM")})
    log = (workdir / "cmdbus.log").open("w")
    command = [sys.executable, "-m", "cmdbus_trio", "serve", "--data-dir", str(workdir / "data")]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while not ports_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"cmdbus-trio did not start: see {log.name}")
        time.sleep(0.05)
    return process, json.loads(ports_file.read_text())


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    data = workdir / "redis"
    data.mkdir()
    command = [
        *("redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)),
        *("--appendonly", "yes", "--appendfsync", "always", "--save", ""),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return process, f"127.0.0.1:{port}"


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- clients (in the worker processes) ----------------------------------------------------


class CmdbusClient:
    def __init__(self, ports: dict[str, str]) -> None:
        self.ingest = BlockingClient(ports["cmd_ingest"])
        self.claim = BlockingClient(ports["cmd_claim"])

    def publish(self, n: int, pipelined: bool) -> int:
        record = {"execution_id": n, "payload": json.dumps({"n": n, "pad": "x" * 200})}
        if not pipelined:
            assert self.ingest.call("publish", record=record)["ok"]
            return 1
        self.ingest.send_raw(
            b"".join(self.ingest.request_frame("publish", record=record) for _ in range(PIPELINE))
        )
        for _ in range(PIPELINE):
            assert self.ingest.receive()["ok"]
        return PIPELINE

    def claim_ack(self) -> float | None:
        delivery = self.claim.call("next", filter="commands.>", timeout_ms=1000)["delivery"]
        if delivery is None:
            return None
        start = time.perf_counter()
        assert self.claim.call("ack", sort_key=delivery["sort_key"])["acked"]
        return time.perf_counter() - start


class RedisClient:
    STREAM, GROUP = "commands", "workers"

    def __init__(self, address: str) -> None:
        import redis

        self.redis = redis.Redis(port=int(address.rsplit(":", 1)[1]))
        self.name = f"c{os.getpid()}-{threading.get_ident()}"

    def publish(self, n: int, pipelined: bool) -> int:
        fields = {"execution_id": n, "payload": json.dumps({"n": n, "pad": "x" * 200})}
        if not pipelined:
            self.redis.xadd(self.STREAM, fields)
            return 1
        pipe = self.redis.pipeline(transaction=False)
        for _ in range(PIPELINE):
            pipe.xadd(self.STREAM, fields)
        pipe.execute()
        return PIPELINE

    def claim_ack(self) -> float | None:
        got = self.redis.xreadgroup(self.GROUP, self.name, {self.STREAM: ">"}, count=1, block=1000)
        if not got:
            return None
        message_id = got[0][1][0][0]
        start = time.perf_counter()
        self.redis.xack(self.STREAM, self.GROUP, message_id)
        return time.perf_counter() - start


def worker(
    target: str, address: str, mode: str, clients: int, pipelined: bool, duration: float
) -> dict[str, Any]:
    ops = [0] * clients
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration

    def run(index: int) -> None:
        client: Any = (
            CmdbusClient(json.loads(address)) if target == "cmdbus-trio" else RedisClient(address)
        )
        n = index * 10_000_000
        while time.monotonic() < deadline:
            if mode == "publish":
                ops[index] += client.publish(n, pipelined)
                n += 1
            else:
                latency = client.claim_ack()
                if latency is not None:
                    ops[index] += 1
                    with lock:
                        latencies.append(latency)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"ops": sum(ops), "latencies": latencies}


def run_workload(
    target: str, address: str, mode: str, clients: int, pipelined: bool, duration: float
) -> dict[str, Any]:
    processes = min(clients, 4)
    shares = [
        clients // processes + (1 if i < clients % processes else 0) for i in range(processes)
    ]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE),
                "--worker",
                target,
                address,
                mode,
                str(share),
                str(int(pipelined)),
                str(duration),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for share in shares
    ]
    results = [json.loads(w.communicate(timeout=duration + 120)[0]) for w in workers]
    latencies = [x for r in results for x in r["latencies"]]
    return {"rate": sum(r["ops"] for r in results) / duration, "ack": percentiles(latencies)}


def preload(target: str, address: str, count: int) -> None:
    client: Any = (
        CmdbusClient(json.loads(address)) if target == "cmdbus-trio" else RedisClient(address)
    )
    if target == "redis":
        client.redis.xgroup_create(RedisClient.STREAM, RedisClient.GROUP, id="0", mkstream=True)
    published = 0
    while published < count:
        published += client.publish(published, True)


def measure_memory(backlog: int, workdir: Path) -> None:
    from cmdbus_trio.storage.buslog import BusEntry, BusLog

    log = BusLog.open(workdir / "data" / "commands.sqlite3", name="commands", synchronous="normal")
    for start in range(0, backlog, 50_000):
        log.publish([
            BusEntry(f"commands.{'system' if i % 5 == 0 else 'shared'}.shard.0",
                     json.dumps({"execution_id": i, "payload": json.dumps({"n": i})}))
            for i in range(start, min(backlog, start + 50_000))
        ])  # fmt: skip
    log.close()
    started = time.monotonic()
    process, ports = start_cmdbus(workdir)
    took = time.monotonic() - started
    time.sleep(1.5)  # let the lag sampler run
    status = Path(f"/proc/{process.pid}/status").read_text().splitlines()
    rss_kib = int(next(line.split()[1] for line in status if line.startswith("VmRSS")))
    import urllib.request

    with urllib.request.urlopen(f"http://{ports['control']}/metrics", timeout=30) as response:
        scrape = response.read().decode().splitlines()
    lag = next(line.split()[-1] for line in scrape if line.startswith("ehdb_feed_total_lag "))
    stop(process)
    print(
        f"backlog of {backlog:,} records (ehdb_feed_total_lag {float(lag):,.0f}): "
        f"writer RSS {rss_kib / 1024:.0f} MiB, {took:.1f} s to start and reload"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer", choices=["redis"], action="append", default=[])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument(
        "--backlog", type=int, default=40_000, help="records preloaded before the claim workloads"
    )
    parser.add_argument("--quick", action="store_true", help="3 s workloads, 10k backlog")
    parser.add_argument(
        "--memory", type=int, nargs="?", const=1_000_000, help="only measure RSS with this backlog"
    )
    args = parser.parse_args()
    if args.quick:
        args.duration, args.backlog = 3.0, 10_000
    workdir = Path(tempfile.mkdtemp(prefix="cmdbus-bus-"))
    print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    if args.memory:
        measure_memory(args.memory, workdir)
        return
    targets: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    process, ports = start_cmdbus(workdir)
    targets["cmdbus-trio"] = (process, json.dumps(ports))
    if "redis" in args.peer:
        targets["redis"] = start_redis(workdir)
    results: dict[str, dict[str, Any]] = {name: {} for name in targets}
    try:
        for name, (_, address) in targets.items():
            for mode, clients, pipelined in WORKLOADS:
                if mode == "claim+ack" and clients == 1:
                    preload(name, address, args.backlog)
                key = f"{mode} x{clients}" + (" pipelined" if pipelined else "")
                results[name][key] = run_workload(
                    name, address, mode, clients, pipelined, args.duration
                )
    finally:
        for process, _ in targets.values():
            stop(process)
    names = list(targets)
    print(f"\n{args.duration:.0f} s per workload; ops/s (ack p50 / p99 ms for claim+ack)")
    print(
        f"{'workload':<28}"
        + "".join(f"{n:>26}" for n in names)
        + ("   cmdbus / redis" if "redis" in names else "")
    )
    for key in results["cmdbus-trio"]:
        cells = []
        for name in names:
            r = results[name][key]
            cell = f"{r['rate']:.0f}"
            if key.startswith("claim"):
                cell += f" ({r['ack']['p50']:.1f} / {r['ack']['p99']:.1f})"
            cells.append(cell)
        ratio = (
            f"   {results['cmdbus-trio'][key]['rate'] / results['redis'][key]['rate']:.2f}x"
            if "redis" in names
            else ""
        )
        print(f"{key:<28}" + "".join(f"{c:>26}" for c in cells) + ratio)


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--worker":
        _, _, target_name, target_address, mode_name, count, piped, seconds = sys.argv
        print(
            json.dumps(
                worker(
                    target_name, target_address, mode_name, int(count), piped == "1", float(seconds)
                )
            )
        )
    else:
        main()
