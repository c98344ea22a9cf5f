"""Command bus throughput: cmdbus-trio against local Redis and NATS, in the same run.

    python benchmarks/bus.py --peer redis --peer nats      # about 5 minutes on 2 cores
    python benchmarks/bus.py --peer redis --quick          # about 40 s
    python benchmarks/bus.py --memory                      # writer RSS with a 1M backlog
    python benchmarks/bus.py --floor --peer redis          # adds the floor (see below)

Workloads (each --duration seconds): durable publish with 1 and 16 producers, one at a time
(unpipelined), 32 in flight (pipelined: 32 single-record requests) and 32 records per round
trip (batched: cmdbus-trio's publish_batch; Redis and NATS have no multi-record publish, so
for them this is their pipelined workload again); claim+ack cycles with 1 and 16 consumers
over a preloaded backlog, with ack latency.

--floor adds `floor_server.py`: the same protocol answered from memory by the least a trio
server can do per request (no disk, no admission, no metrics). It bounds what one trio loop
can reach on this machine with this protocol and these load generators.

The load generators are separate processes (4 at most), with each system's usual Python
client: our codec and redis-py on blocking sockets in threads; nats-py (asyncio only) in
tasks.

Durability: cmdbus-trio with synchronous=FULL (an fsync per group commit); Redis with
appendonly yes and appendfsync always; NATS JetStream (work-queue stream, file storage,
durable pull consumer, explicit acks) as Debian 12's nats-server 2.9 has it, which has no
per-message fsync setting: its durability is weaker than the other two.
"""

from __future__ import annotations

import argparse
import asyncio
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
SUBJECT = "commands.shared.shard.0"
WORKLOADS = [  # (mode, clients, style)
    ("publish", 1, "single"),
    ("publish", 16, "single"),
    ("publish", 16, "pipelined"),
    ("publish", 16, "batched"),
    ("claim+ack", 1, "single"),
    ("claim+ack", 16, "single"),
]


def body(n: int) -> dict[str, Any]:
    return {"execution_id": n, "payload": json.dumps({"n": n, "pad": "x" * 200})}


def subject_of(n: int) -> str:
    """One record in five in the system pool: the backlog has more than one subject."""
    return f"commands.{'system' if n % 5 == 0 else 'shared'}.shard.0"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int) -> None:
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


# --- servers -------------------------------------------------------------------------------


def start_cmdbus(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    ports_file = workdir / "ports.json"
    env = {**os.environ, "CMDBUS_PORTS_FILE": str(ports_file), "CMDBUS_LOG_LEVEL": "warning"}
    for face in ("TIER", "EVT_INGEST", "EVT_CLAIM", "EVT_SUBSCRIBE"):
        env[f"CMDBUS_{face}_BIND"] = ""
    for face in ("CONTROL", "CMD_INGEST", "CMD_CLAIM"):
        env[f"CMDBUS_{face}_BIND"] = "127.0.0.1:0"
    log = (workdir / "cmdbus.log").open("w")
    command = [sys.executable, "-m", "cmdbus_trio", "serve", "--data-dir", str(workdir / "data")]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while not ports_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"cmdbus-trio did not start: see {log.name}")
        time.sleep(0.05)
    return process, ports_file.read_text()


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    (workdir / "redis").mkdir()
    command = [
        *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
        *("--dir", str(workdir / "redis"), "--save", ""),
        *("--appendonly", "yes", "--appendfsync", "always"),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port)
    import redis

    redis.Redis(port=port).xgroup_create("commands", "workers", id="0", mkstream=True)
    return process, f"127.0.0.1:{port}"


def start_nats(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    if shutil.which("nats-server") is None:
        raise SystemExit("nats-server is not installed (Debian: apt-get install nats-server)")
    port = free_port()
    command = [
        "nats-server",
        "-js",
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
        "-sd",
        str(workdir / "nats"),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port)

    async def setup() -> None:
        import nats
        from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType

        connection = await nats.connect(f"nats://127.0.0.1:{port}")
        js = connection.jetstream()
        await js.add_stream(
            name="COMMANDS",
            subjects=["commands.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
        )
        config = ConsumerConfig(durable_name="workers", ack_policy=AckPolicy.EXPLICIT)
        await js.add_consumer("COMMANDS", config)
        await connection.close()

    asyncio.run(setup())
    return process, f"127.0.0.1:{port}"


def start_floor(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    ports_file = workdir / "ports.json"
    command = [sys.executable, str(HERE.parent / "floor_server.py"), str(ports_file)]
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 60
    while not ports_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the floor server did not start")
        time.sleep(0.05)
    return process, ports_file.read_text()


STARTERS = {
    "cmdbus-trio": start_cmdbus,
    "floor": start_floor,
    "redis": start_redis,
    "nats": start_nats,
}


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- clients (in the worker processes) ----------------------------------------------------


class CmdbusClient:
    def __init__(self, address: str) -> None:
        ports = json.loads(address)
        self.ingest = BlockingClient(ports["cmd_ingest"])
        self.claim = BlockingClient(ports["cmd_claim"])

    def publish(self, n: int, count: int, batched: bool) -> None:
        if batched:
            reply = self.ingest.call("publish_batch", records=[body(n) for _ in range(count)])
            assert len(reply["sort_keys"]) == count
            return
        frames = [self.ingest.request_frame("publish", record=body(n)) for _ in range(count)]
        self.ingest.send_raw(b"".join(frames))
        for _ in range(count):
            assert self.ingest.receive()["ok"]

    def claim_ack(self) -> float | None:
        delivery = self.claim.call("next", filter="commands.>", timeout_ms=1000)["delivery"]
        if delivery is None:
            return None
        start = time.perf_counter()
        assert self.claim.call("ack", sort_key=delivery["sort_key"])["acked"]
        return time.perf_counter() - start


class RedisClient:
    def __init__(self, address: str) -> None:
        import redis

        self.redis = redis.Redis(port=int(address.rsplit(":", 1)[1]))
        self.name = f"c{os.getpid()}-{threading.get_ident()}"

    def publish(self, n: int, count: int, batched: bool) -> None:
        del batched  # no multi-record XADD: a pipeline is Redis's way to batch
        pipe = self.redis.pipeline(transaction=False)
        for _ in range(count):
            pipe.xadd("commands", body(n))
        pipe.execute()

    def claim_ack(self) -> float | None:
        got = self.redis.xreadgroup("workers", self.name, {"commands": ">"}, count=1, block=1000)
        if not got:
            return None
        start = time.perf_counter()
        self.redis.xack("commands", "workers", got[0][1][0][0])
        return time.perf_counter() - start


def thread_worker(
    target: str, address: str, kind: str, clients: int, count: int, duration: float
) -> dict[str, Any]:
    """``kind``: publish (``count`` in flight), batched (``count`` records per request) or
    claim+ack."""
    ops = [0] * clients
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration

    def run(index: int) -> None:
        client: Any = RedisClient(address) if target == "redis" else CmdbusClient(address)
        n = index * 10_000_000
        while time.monotonic() < deadline:
            if kind != "claim+ack":
                client.publish(n, count, kind == "batched")
                ops[index] += count
                n += 1
            elif (latency := client.claim_ack()) is not None:
                ops[index] += 1
                with lock:
                    latencies.append(latency)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"ops": sum(ops), "latencies": latencies}


async def nats_worker(
    address: str, kind: str, clients: int, count: int, duration: float
) -> dict[str, Any]:
    import nats

    ops = [0] * clients
    latencies: list[float] = []
    deadline = time.monotonic() + duration

    async def run(index: int) -> None:
        connection = await nats.connect(f"nats://{address}")
        js = connection.jetstream()
        subscription = (
            None if kind != "claim+ack" else await js.pull_subscribe_bind("workers", "COMMANDS")
        )
        n = index * 10_000_000
        while time.monotonic() < deadline:
            if subscription is None:
                data = json.dumps(body(n)).encode()
                await asyncio.gather(*(js.publish(SUBJECT, data) for _ in range(count)))
                ops[index] += count
                n += 1
                continue
            try:
                messages = await subscription.fetch(1, timeout=1)
            except nats.errors.TimeoutError:
                continue
            start = time.perf_counter()
            await messages[0].ack_sync()
            latencies.append(time.perf_counter() - start)
            ops[index] += 1
        await connection.close()

    await asyncio.gather(*(run(i) for i in range(clients)))
    return {"ops": sum(ops), "latencies": latencies}


def run_workload(
    target: str, address: str, kind: str, clients: int, count: int, duration: float
) -> dict[str, Any]:
    processes = min(clients, 4)
    shares = [
        clients // processes + (1 if i < clients % processes else 0) for i in range(processes)
    ]
    command = [sys.executable, str(HERE), "--worker", target, address, kind]
    workers = [
        subprocess.Popen(
            [*command, str(share), str(count), str(duration)], stdout=subprocess.PIPE, text=True
        )
        for share in shares
    ]
    results = [json.loads(w.communicate(timeout=duration + 120)[0]) for w in workers]
    latencies = [x for r in results for x in r["latencies"]]
    return {"rate": sum(r["ops"] for r in results) / duration, "ack": percentiles(latencies)}


def preload(target: str, address: str, records: int) -> None:
    """Publish about ``records`` records (pipelined, 4 producers) for the claim workloads."""
    per_second = run_workload(target, address, "publish", 4, PIPELINE, 2.0)["rate"]
    remaining = max(0.0, (records - per_second * 2.0) / max(per_second, 1.0))
    if remaining:
        run_workload(target, address, "publish", 4, PIPELINE, remaining)


def measure_memory(backlog: int, workdir: Path) -> None:
    from cmdbus_trio.storage.buslog import BusEntry, BusLog

    log = BusLog.open(workdir / "data" / "commands.sqlite3", name="commands", synchronous="normal")
    for start in range(0, backlog, 50_000):
        end = min(backlog, start + 50_000)
        log.publish([BusEntry(subject_of(i), json.dumps(body(i))) for i in range(start, end)])
    log.close()
    started = time.monotonic()
    process, address = start_cmdbus(workdir)
    took = time.monotonic() - started
    time.sleep(1.5)  # let the lag sampler run
    status = Path(f"/proc/{process.pid}/status").read_text().splitlines()
    rss_kib = int(next(line.split()[1] for line in status if line.startswith("VmRSS")))
    import urllib.request

    control = json.loads(address)["control"]
    with urllib.request.urlopen(f"http://{control}/metrics", timeout=30) as response:
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
    parser.add_argument("--peer", choices=["redis", "nats"], action="append", default=[])
    parser.add_argument("--floor", action="store_true", help="also run floor_server.py")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--backlog", type=int, default=40_000, help="records preloaded for claims")
    parser.add_argument("--quick", action="store_true", help="3 s workloads, 10k backlog")
    parser.add_argument("--memory", type=int, nargs="?", const=1_000_000, help="only measure RSS")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.backlog = 3.0, 10_000
    workdir = Path(tempfile.mkdtemp(prefix="cmdbus-bus-"))
    print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    if args.memory:
        measure_memory(args.memory, workdir)
        return
    names = ["cmdbus-trio", *(["floor"] if args.floor else []), *dict.fromkeys(args.peer)]
    results: dict[str, dict[str, Any]] = {name: {} for name in names}
    for name in names:  # one server at a time: they share the machine's 2 cores and disk
        (workdir / name).mkdir()
        process, address = STARTERS[name](workdir / name)
        try:
            for mode, clients, style in WORKLOADS:
                if mode == "claim+ack" and clients == 1:
                    preload(name, address, args.backlog)
                key = f"{mode} x{clients}" + ("" if style == "single" else f" {style}")
                kind = {"single": mode, "pipelined": "publish"}.get(style, style)
                count = 1 if style == "single" else PIPELINE
                results[name][key] = run_workload(
                    name, address, kind, clients, count, args.duration
                )
        finally:
            stop(process)
    print(f"\n{args.duration:.0f} s per workload; ops/s (ack p50 / p99 ms for claim+ack)")
    peers = names[names.index("cmdbus-trio") + 1 + args.floor :]
    measured = ["cmdbus-trio", *(["floor"] if args.floor else [])]
    ratio_columns = [(m, p) for m in measured for p in peers]
    if args.floor:
        ratio_columns.insert(0, ("cmdbus-trio", "floor"))
    print(
        f"{'workload':<26}"
        + "".join(f"{n:>22}" for n in names)
        + "".join(f"{(m if m == 'floor' else 'ours') + ' / ' + p:>16}" for m, p in ratio_columns)
    )
    for key in results["cmdbus-trio"]:
        cells = []
        for name in names:
            r = results[name][key]
            ack = (
                f" ({r['ack']['p50']:.1f}/{r['ack']['p99']:.1f})" if key.startswith("claim") else ""
            )
            cells.append(f"{r['rate']:.0f}{ack}")
        ratios = [
            f"{results[m][key]['rate'] / results[p][key]['rate']:.2f}x" for m, p in ratio_columns
        ]
        print(
            f"{key:<26}" + "".join(f"{c:>22}" for c in cells) + "".join(f"{r:>16}" for r in ratios)
        )


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--worker":
        _, _, target, address, kind, clients, count, seconds = sys.argv
        if target == "nats":
            result = asyncio.run(
                nats_worker(address, kind, int(clients), int(count), float(seconds))
            )
        else:
            result = thread_worker(target, address, kind, int(clients), int(count), float(seconds))
        print(json.dumps(result))
    else:
        main()
