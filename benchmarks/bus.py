"""Command bus throughput and cost: cmdbus-trio against local Redis and NATS, in the same run.

    python benchmarks/bus.py --floor --peer redis --peer nats --rate 1000   # about 9 minutes
    (--peer redis needs redis-server and the `redis` package; --peer nats, nats-server
    and `nats-py`: pip install redis nats-py)
    python benchmarks/bus.py --peer redis --quick          # about 1 minute
    python benchmarks/bus.py --only "publish x16"          # the workloads named so
    python benchmarks/bus.py --only 'claim+ack x16$'       # that one alone
    python benchmarks/bus.py --memory                      # writer RSS with a 1M backlog
    python benchmarks/bus.py --baseline REV --rounds 3     # A/B against REV, medians of 3
    python benchmarks/bus.py --traced                      # also the writer exporting spans

Workloads (each --duration seconds): durable publish with 1 and 16 producers, one at a time
(ack-each), 32 in flight (pipelined: 32 single-record requests) and 32 records per round
trip (batched: cmdbus-trio's publish_batch; Redis and NATS have no multi-record publish, so
for them this is their pipelined workload again); claim+ack cycles with 1 and 16 consumers
over a preloaded backlog, one record a request, and with 16 consumers in batches of 16 and
64 (cmdbus-trio: `next` with `max`, one `ack` of every sort key; Redis: `XREADGROUP COUNT
n`, one `XACK` of every id; NATS: a pull of n, `no_wait` first as nats-py's `fetch(n)`,
each ack confirmed; the floor servers as cmdbus-trio); and, on cmdbus-trio only, publish x16
again beside a scrape flood (32 keep-alive HTTP clients asking for /metrics, and the lag
port's, as fast as they are answered), against publish x16 alone. --rate R adds, first,
on an empty bus, the steady end-to-end workload: 16 producers publishing R records a
second between them (an open loop, each record stamped with its publish time), 16
consumers claiming and acking, and the latency of each record from its publish to its
delivery (the claim's reply in the consumer's hands) and, on a line of its own, to its
ack's confirmation (a second commit later); then the same with the consumers claiming
and acking in batches of up to 16.

For every workload and server: ops/s; latency p50/p99 (claim+ack: the next and the ack;
steady: publish to delivery); the server's CPU (utime + stime of its process, all
threads, over exactly the workload's window) in cores and in microseconds per operation;
the load generators' CPU in cores; and for cmdbus-trio the latency of /healthz, probed on
a new connection every 50 ms during the workload, as a kubelet would.

--floor adds `floor_server.py`: the same protocol answered from memory by the least a trio
server can do per request (no disk, no admission, no metrics). It bounds what one trio loop
can reach on this machine with this protocol and these load generators. "floor+disk" is the
same server committing each read's publishes and acks to SQLite (an fsync per group commit,
in one worker thread) before replying: the bound for a durable server on one trio loop.
It hands a record to `next` before the record is on disk, which a real server must not;
"floor+strict" hands it over only once it is on disk, as the writer does: the bound for a
server that keeps that promise.

The load generators (`_generators.py`) are the same for every server: worker processes (at
most 2 a side of the load) running asyncio, one connection per client, requests pipelined
as the workload says, and no client library (each cost more CPU than the server it
measured): our frames for cmdbus-trio and the floor, RESP for Redis, NATS's text protocol
(nats-py only sets the stream up). All start at the same instant, after connecting.

--traced adds the writer again with tracing on (docs/tracing.md): every span sampled
(OTEL_TRACES_SAMPLER=always_on) and exported over OTLP/HTTP to a sink in this process that
reads and discards each export; "cmdbus-trio" itself runs with tracing off, as it ships.

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
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _client import percentiles
from _generators import PAD_VARIABLE

HERE = Path(__file__).resolve()
PIPELINE = 32
WORKLOADS = [  # (mode, clients, style)
    ("publish", 1, "single"),
    ("publish", 16, "single"),
    ("publish", 16, "pipelined"),
    ("publish", 16, "batched"),
    ("claim+ack", 1, "single"),
    ("claim+ack", 16, "single"),
    ("claim+ack", 16, "batch 16"),
    ("claim+ack", 16, "batch 64"),
]
BATCHED_CONSUMERS = 16
"""Records a request at most for the steady workload's batched consumers."""


def body(n: int) -> dict[str, Any]:
    pad = "x" * int(os.environ.get(PAD_VARIABLE, "200"))
    return {"execution_id": n, "payload": json.dumps({"n": n, "pad": pad})}


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


def start_cmdbus(
    workdir: Path, source: Path | None = None, extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """The writer from this checkout, or from ``source`` (a tree with ``src/``), with
    ``extra`` in its environment."""
    ports_file = workdir / "ports.json"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "CMDBUS_PORTS_FILE": str(ports_file),
        "CMDBUS_LOG_LEVEL": "warning",
        **(extra or {}),
    }
    if source is not None:
        env["PYTHONPATH"] = str(source / "src")
    for face in ("TIER", "EVT_INGEST", "EVT_CLAIM", "EVT_SUBSCRIBE"):
        env[f"CMDBUS_{face}_BIND"] = ""
    for face in ("CONTROL", "CMD_INGEST", "CMD_CLAIM", "CMD_LAG"):
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


def start_floor(
    workdir: Path, durable: bool = False, strict: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    ports_file = workdir / "ports.json"
    command = [sys.executable, str(HERE.parent / "floor_server.py"), str(ports_file)]
    if durable:
        command += ["--durable", str(workdir / "floor.sqlite3")]
    if strict:
        command += ["--strict"]
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 60
    while not ports_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the floor server did not start")
        time.sleep(0.05)
    return process, ports_file.read_text()


FLOORS = ("floor", "floor+disk", "floor+strict")
STARTERS = {
    "cmdbus-trio": start_cmdbus,
    "floor": start_floor,
    "floor+disk": lambda workdir: start_floor(workdir, durable=True),
    "floor+strict": lambda workdir: start_floor(workdir, durable=True, strict=True),
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


# --- measuring a workload -------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PROBE_EVERY = 0.05
"""Seconds between two probes (``--probe-every``)."""


def probe(control: str, until: float, latencies: list[float]) -> None:
    """GET /healthz on a new connection every PROBE_EVERY until ``until``, as a kubelet
    does (every 10 s, not 50 ms: a probe has the loop's favour while it runs, so the
    default probing costs the data plane a few percent; docs/benchmarks.md)."""
    import http.client

    host, port = control.rsplit(":", 1)
    while time.monotonic() < until:
        started = time.monotonic()
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            connection.request("GET", "/healthz")
            connection.getresponse().read()
        finally:
            connection.close()
        latencies.append(time.monotonic() - started)
        time.sleep(max(0.0, PROBE_EVERY - (time.monotonic() - started)))


def generators(
    target: str, address: str, kind: str, clients: int, count: float, start_at: float, span: float
) -> list[subprocess.Popen[str]]:
    """Worker processes sharing ``clients`` (at most 2 processes a side of the load)."""
    processes = min(clients, 2)
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    command = [sys.executable, str(HERE.parent / "_generators.py"), target, address, kind]
    return [
        subprocess.Popen(
            [*command, str(share), str(count), str(start_at), str(span)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for share in shares
    ]


@attrs.frozen
class Server:
    name: str
    process: subprocess.Popen[bytes]
    address: str
    control: str | None = None
    """The control face (cmdbus-trio only): /healthz is probed during each workload."""
    scraped: str | None = None
    """Where the scrape flood asks (cmdbus-trio only): ``HOST:PORT/PATH``, comma-separated,
    the control face's /metrics and the command bus's lag port."""


def run_workload(
    server: Server, loads: list[tuple[str, int, float]], duration: float
) -> dict[str, Any]:
    """Run ``loads`` (kind, clients, count) together for ``duration`` seconds, all
    starting at the same instant; the server's CPU is sampled over exactly that window,
    and its /healthz probed throughout when it has a control face."""
    start_at = time.monotonic() + 2.0  # the workers have connected by then
    protocol = server.name.split("@")[0]  # a baseline writer speaks as the writer does

    def target(kind: str) -> tuple[str, str]:
        if kind == "scrape":
            assert server.scraped is not None, "only cmdbus-trio has a control face"
            return "http", server.scraped
        return protocol, server.address

    workers = [
        (index, w)
        for index, (kind, clients, count) in enumerate(loads)
        for w in generators(*target(kind), kind, clients, count, start_at, duration)
    ]
    probes: list[float] = []
    prober = None
    if server.control is not None:
        prober = threading.Thread(target=probe, args=(server.control, start_at + duration, probes))
    time.sleep(max(0.0, start_at - time.monotonic()))
    before = cpu_seconds(server.process.pid)
    if prober is not None:
        prober.start()
    time.sleep(max(0.0, start_at + duration - time.monotonic()))
    server_cpu = cpu_seconds(server.process.pid) - before
    if prober is not None:
        prober.join()
    results = [(i, json.loads(w.communicate(timeout=duration + 120)[0])) for i, w in workers]
    # The last load's operations count: with producers and consumers, the deliveries.
    ops = sum(r["ops"] for i, r in results if i == len(loads) - 1)
    scrapes = sum(r["ops"] for i, r in results if loads[i][0] == "scrape")
    return {
        "rate": ops / duration,
        "scrapes": scrapes / duration,
        "latency": percentiles([x for _, r in results for x in r["latencies"]]),
        "acked": percentiles(acked)
        if (acked := [x for _, r in results for x in r["acked"]])
        else None,
        "server_cores": server_cpu / duration,
        "server_us": server_cpu / max(ops, 1) * 1e6,
        "generator_cores": sum(r["cpu"] for _, r in results) / duration,
        "probe": percentiles(probes) if probes else None,
        "ran_dry": any(r.get("empty") for i, r in results if loads[i][0] == "claim+ack"),
        "per_claim": ops
        / max(1, sum(r.get("claims", 0) for i, r in results if i == len(loads) - 1)),
    }


def preload(server: Server, records: int) -> None:
    """Publish about ``records`` records (4 producers, 32 records a round trip: batched
    where the server has batches, else pipelined) for the claim workloads."""
    per_second = run_workload(server, [("batched", 4, PIPELINE)], 2.0)["rate"]
    remaining = max(0.0, (records - per_second * 2.0) / max(per_second, 1.0))
    if remaining:
        run_workload(server, [("batched", 4, PIPELINE)], remaining)


def drain(server: Server) -> None:
    """Claim and ack what an earlier workload left (in batches of 64), so that a steady
    workload starts on an empty bus."""
    for _ in range(60):  # 1 s each; a round that finds nothing ends it
        if not run_workload(server, [("claim+ack", 16, 64)], 1.0)["rate"]:
            return


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


def export_revision(revision: str, workdir: Path) -> Path:
    """This repository's tree at ``revision``, for a baseline writer in the same run."""
    tree = workdir / "baseline-tree"
    tree.mkdir()
    command = ["git", "-C", str(HERE.parent.parent), "archive", revision, "src"]
    archive = subprocess.run(command, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


TRACED = "cmdbus-trio@traced"
"""This checkout's writer exporting every span (``--traced``)."""


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that reads each export and answers 200, keeping nothing."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def span_sink() -> dict[str, str]:
    """Start the sink (a daemon thread of this process); the writer's OTEL_* variables."""
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.server_address[1]}",
        "OTEL_TRACES_SAMPLER": "always_on",
    }


def start(
    name: str, workdir: Path, baseline: Path | None, traced: dict[str, str] | None = None
) -> Server:
    if name == TRACED:
        process, address = start_cmdbus(workdir, extra=traced)
    elif name.startswith("cmdbus-trio@"):
        process, address = start_cmdbus(workdir, baseline)
    else:
        process, address = STARTERS[name](workdir)
    if not name.startswith("cmdbus-trio"):
        return Server(name, process, address)
    ports = json.loads(address)
    scraped = [f"{ports['control']}/metrics"] * 3 + [f"{ports['cmd_lag']}/"]
    return Server(name, process, address, ports["control"], ",".join(scraped))


def chosen(name: str, only: str | None) -> bool:
    """``--only``: workloads whose name starts with it, or exactly that one when it ends
    with ``$`` (``"claim+ack x16$"`` leaves out its batched forms)."""
    if only is None:
        return True
    return name == only[:-1] if only.endswith("$") else name.startswith(only)


def workloads(rate: float | None) -> list[tuple[str, list[tuple[str, int, float]]]]:
    """(name, loads) in the order they run: the steady one first, on an empty bus."""
    runs = []
    if rate:
        produce = ("produce", 16, rate / 16)
        runs.append((f"steady {rate:.0f}/s e2e", [produce, ("consume", 16, 1)]))
        batched = f"steady {rate:.0f}/s e2e batch {BATCHED_CONSUMERS}"
        runs.append((batched, [produce, ("consume", 16, BATCHED_CONSUMERS)]))
    for mode, clients, style in WORKLOADS:
        name = f"{mode} x{clients}" + ("" if style == "single" else f" {style}")
        if style.startswith("batch "):
            runs.append((name, [(mode, clients, int(style.split()[1]))]))
            continue
        kind = {"single": mode, "pipelined": "publish"}.get(style, style)
        runs.append((name, [(kind, clients, 1 if style == "single" else PIPELINE)]))
    # The scrape flood, on cmdbus-trio only: 32 keep-alive clients asking as fast as they
    # are answered, 24 for the control face's /metrics and 8 for the lag port's.
    runs.append((SCRAPE_FLOOD, [("scrape", 32, 1), ("publish", 16, 1)]))
    return runs


SCRAPE_FLOOD = "publish x16 +scrapes"
"""The workload run beside a scrape flood; compared with ``publish x16`` alone."""


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure of a workload's result, the median over the rounds."""

    def median_of(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: median_of([v[k] for v in values]) for k in values[0]}
        if isinstance(values[0], int | float):
            return statistics.median(values)
        return values[0]  # None: not probed

    return {key: median_of([run[key] for run in runs]) for key in runs[0]}


def report(names: list[str], rounds: list[dict[str, dict[str, Any]]], duration: float) -> None:
    """The table (with several rounds: each figure's median), then our ops/s against
    every other server's (with several rounds: the median of the rounds' ratios, and
    each round's)."""
    results = {
        name: {key: median_result([r[name][key] for r in rounds]) for key in rounds[0][name]}
        for name in names
    }
    medians = f", medians of {len(rounds)} rounds" if len(rounds) > 1 else ""
    print(
        f"\n{duration:.0f} s per workload{medians}. ops/s; latency p50/p99 ms (claim+ack: "
        "next and ack; steady: publish to delivery, the claim's reply in the consumer's "
        "hands); server CPU in cores and us per op; the load "
        "generators' CPU in cores; /healthz p50/p99/max ms during the workload. *: the "
        "claims ran out of backlog in the window (the figure is a lower bound)."
    )
    print(
        f"{'workload':<28}{'server':<18}{'ops/s':>9}{'latency':>15}{'cores':>7}{'us/op':>8}"
        f"{'gen':>6}{'healthz':>18}"
    )
    for key in results[names[0]]:
        for name in names:
            if key not in results[name]:
                continue  # not run on this server (the scrape flood)
            r = results[name][key]
            latency = r["latency"]
            lat = f"{latency['p50']:.1f}/{latency['p99']:.1f}" if key[0] in "cs" else ""
            probe = r["probe"]
            probed = f"{probe['p50']:.0f}/{probe['p99']:.0f}/{probe['max']:.0f}" if probe else ""
            dry = "*" if r.get("ran_dry") else " "
            print(
                f"{key:<28}{name:<18}{r['rate']:>8.0f}{dry}{lat:>15}{r['server_cores']:>7.2f}"
                f"{r['server_us']:>8.0f}{r['generator_cores']:>6.2f}{probed:>18}"
            )
    batched = [
        f"{key} {name} {results[name][key]['per_claim']:.1f}"
        for key in results[names[0]]
        if " batch " in key
        for name in names
        if key in results[name]
    ]
    if batched:
        print("records per claim request: " + "; ".join(batched))
    acked = [
        f"{key} {name} {r['acked']['p50']:.1f}/{r['acked']['p99']:.1f}"
        for key in results[names[0]]
        for name in names
        if (r := results[name].get(key)) is not None and r.get("acked")
    ]
    if acked:
        print("steady: publish to the ack's confirmation, p50/p99 ms: " + "; ".join(acked))
    for name in names:
        flood, alone = results[name].get(SCRAPE_FLOOD), results[name].get("publish x16")
        if flood is not None and alone is not None:
            print(
                f"{name}: beside {flood['scrapes']:.0f} scrapes/s, publish x16 at "
                f"{flood['rate'] / max(alone['rate'], 1e-9):.2f}x of its rate alone"
            )
    others = names[1:]
    if not others:
        return
    spread = 5 * len(rounds) + 2 if len(rounds) > 1 else 0  # " (0.77 0.72)": each round
    widths = [max(16, len(f"ours / {n}") + 2) + spread for n in others]
    print(
        f"\n{'ratios (ops/s)':<28}"
        + "".join(f"{'ours / ' + n:>{w}}" for n, w in zip(others, widths, strict=True))
    )
    for key in results[names[0]]:
        if not any(key in results[other] for other in others):
            continue  # ours alone (the scrape flood)
        cells = []
        for other, width in zip(others, widths, strict=True):
            if key not in results[other]:
                cells.append(f"{'':>{width}}")
                continue
            ratios = [r[names[0]][key]["rate"] / max(r[other][key]["rate"], 1e-9) for r in rounds]
            cell = f"{statistics.median(ratios):.2f}x"
            if len(rounds) > 1:
                cell += " (" + " ".join(f"{x:.2f}" for x in ratios) + ")"
            cells.append(f"{cell:>{width}}")
        print(f"{key:<28}" + "".join(cells))


def main() -> None:
    global PROBE_EVERY  # a command-line setting, read by the probe threads
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer", choices=["redis", "nats"], action="append", default=[])
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run floor_server.py: in memory, durable, durable and strict",
    )
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--backlog", type=int, default=40_000, help="records preloaded for claims")
    parser.add_argument("--rate", type=float, help="add the steady end-to-end workload (records/s)")
    parser.add_argument(
        "--only", help="run only the workloads whose name starts with this ('NAME$': that one)"
    )
    parser.add_argument("--quick", action="store_true", help="3 s workloads, 10k backlog")
    parser.add_argument(
        "--probe-every", type=float, default=0.05, help="seconds between /healthz probes"
    )
    parser.add_argument("--memory", type=int, nargs="?", const=1_000_000, help="only measure RSS")
    parser.add_argument(
        "--baseline", metavar="REV", help="also run the writer as git revision REV (A/B)"
    )
    parser.add_argument(
        "--traced", action="store_true", help="also the writer with every span exported"
    )
    parser.add_argument(
        "--pad-bytes",
        type=int,
        default=200,
        help="each record's padding, for every workload (default 200: records of ~250 bytes)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run everything this many times, the servers' order reversed each round; "
        "report medians (the machine drifts over the minutes one round takes)",
    )
    args = parser.parse_args()
    PROBE_EVERY = args.probe_every
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.baseline and args.rounds % 2:
        # Measured on 12-05: at 500/s the server that runs first costs 0.05-0.09 cores
        # more, so an odd --rounds leans the A/B against this tree.
        print(
            f"note: --rounds {args.rounds} is odd: this tree runs first in one round more "
            "than the baseline; an even --rounds gives the A/B no side",
            file=sys.stderr,
        )
    if args.quick:
        args.duration, args.backlog = 3.0, 10_000
    if args.pad_bytes < 0:
        parser.error(f"--pad-bytes must be >= 0, not {args.pad_bytes}")
    os.environ[PAD_VARIABLE] = str(args.pad_bytes)  # the generators' records (_generators.py)
    workdir = Path(tempfile.mkdtemp(prefix="cmdbus-bus-"))
    print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    if args.memory:
        measure_memory(args.memory, workdir)
        return
    baseline = export_revision(args.baseline, workdir) if args.baseline else None
    traced = span_sink() if args.traced else None
    names = [
        "cmdbus-trio",
        *([f"cmdbus-trio@{args.baseline}"] if args.baseline else []),
        *([TRACED] if args.traced else []),
        *(FLOORS if args.floor else []),
        *dict.fromkeys(args.peer),
    ]
    runs = [(k, loads) for k, loads in workloads(args.rate) if chosen(k, args.only)]
    rounds: list[dict[str, dict[str, Any]]] = []
    for round_number in range(args.rounds):
        results: dict[str, dict[str, Any]] = {name: {} for name in names}
        # One server at a time: they share the machine's 2 cores and disk. The order is
        # reversed each round, so that a drift of the machine favours nobody.
        for name in names if round_number % 2 == 0 else names[::-1]:
            where = workdir / f"{name}-{round_number}"
            where.mkdir()
            server = start(name, where, baseline, traced)
            try:
                for key, loads in runs:
                    if key == SCRAPE_FLOOD and server.scraped is None:
                        continue  # no control face
                    if key.startswith("claim+ack x1"):  # batches take more in a workload
                        preload(server, args.backlog * (8 if " batch " in key else 1))
                    if key.startswith("steady") and results[name]:
                        drain(server)  # what the workload before it left behind
                    results[name][key] = run_workload(server, loads, args.duration)
            finally:
                stop(server.process)
        rounds.append(results)
    report(names, rounds, args.duration)


if __name__ == "__main__":
    main()
