"""The incident at small scale: huge paged reads of one execution, appends, and probes.

    python benchmarks/stall.py                 # full run (about 3 minutes on 2 cores)
    python benchmarks/stall.py --quick         # smaller data, shorter phases

Preloads one execution of --events records (default 200,000 of ~1.1 KB: over 200 MB of
payload) plus many small executions, then for --duration seconds runs 8 x max_inflight
readers paging through the big execution, a few appenders, and a probe that measures
/healthz and the tier face's `health` every 50 ms and /metrics every 250 ms (each on a new
connection, as kubelet and Prometheus do). It does this against cmdbus-trio and against
benchmarks/baseline_inline.py (the seed's design: store work on the loop) in the same run,
and prints both; cmdbus-trio runs twice, with the tier's writes in their own lane (the
default) and sharing the readers' Gate (CMDBUS_TIER_WRITES=shared, as before the lane), so
the append figures (appends/s, p50 / p99 ms, shed) compare the two. Then it times
read_execution of a 100-event execution in a store of 10k vs 1M events.

With --split it instead measures what split roles (deploy/k8s/overlays/split) buy the
buses: the same tier stall, plus 4 publishers at a steady --publish-rate on the command
bus, against one writer serving both (target "together") and against two processes, the
buses in one and the tier in the other (target "split"). It prints the buses' /healthz
and publish latency during the stall, side by side.

The load generator runs in its own process, so the probe's numbers are the servers'.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _client import Client, http_get, open_loop, percentiles
from cmdbus_trio.config import cpu_quota
from cmdbus_trio.storage.tier import NewRecord, TierStore

HERE = Path(__file__).resolve().parent
NEXT_AFTER = re.compile(rb'"next_after":(null|\d+)\}$')
PROBE_TIMEOUT = 10.0


def preload(data_dir: Path, *, big_events: int, payload_bytes: int, small_executions: int) -> None:
    store = TierStore.open(data_dir / "tier.sqlite3", synchronous="normal")
    pad = "x" * payload_bytes
    batch: list[NewRecord] = []
    for i in range(big_events):
        batch.append(NewRecord(json.dumps({"event_id": i, "pad": pad}), "tx", str(i)))
        if len(batch) == 5000:
            store.append_batch("eventlog", "big", batch)
            batch = []
    if batch:
        store.append_batch("eventlog", "big", batch)
    for n in range(small_executions):
        store.append_batch(
            "eventlog", f"small-{n}", [NewRecord(json.dumps({"n": n, "i": i})) for i in range(10)]
        )
    store.close()


def add_execution(data_dir: Path, execution_id: str, events: int) -> None:
    store = TierStore.open(data_dir / "tier.sqlite3", synchronous="normal")
    store.append_batch(
        "eventlog", execution_id, [NewRecord(json.dumps({"i": i})) for i in range(events)]
    )
    store.close()


def fill(data_dir: Path, events: int) -> None:
    store = TierStore.open(data_dir / "tier.sqlite3", synchronous="normal")
    for start in range(0, events, 10_000):
        store.append_batch(
            "eventlog",
            f"fill-{start}",
            [NewRecord(json.dumps({"i": i})) for i in range(start, min(events, start + 10_000))],
        )
    store.close()


TARGETS = {
    "cmdbus-trio": {},
    "writes shared": {"CMDBUS_TIER_WRITES": "shared"},
    "baseline-inline": None,
}
"""Each target: cmdbus-trio with these settings, or (None) the inline baseline."""


BUS_FACES = ("CMD_INGEST", "CMD_CLAIM", "EVT_INGEST", "EVT_CLAIM", "EVT_SUBSCRIBE")


class Server:
    """One server process: ``kind`` names a target of :data:`TARGETS` (the tier face and
    the control face), or a cmdbus-trio writer serving ``faces`` with ``settings``."""

    def __init__(
        self,
        kind: str,
        data_dir: Path,
        workdir: Path,
        *,
        faces: tuple[str, ...] = ("TIER",),
        settings: dict[str, str] | None = None,
    ) -> None:
        self.ports_file = workdir / f"{kind.replace(' ', '-')}-ports.json"
        self.ports_file.unlink(missing_ok=True)
        if settings is None:
            settings = TARGETS.get(kind, {})
        if settings is not None:
            command = [sys.executable, "-m", "cmdbus_trio", "serve", "--data-dir", str(data_dir)]
            env = {
                **os.environ,
                "CMDBUS_PORTS_FILE": str(self.ports_file),
                "CMDBUS_LOG_LEVEL": "warning",
            }
            env.update({f"CMDBUS_{face}_BIND": "" for face in (*BUS_FACES, "TIER")})
            env.update({f"CMDBUS_{face}_BIND": "127.0.0.1:0" for face in ("CONTROL", *faces)})
            env.update(settings)
        else:
            command = [
                sys.executable,
                str(HERE / "baseline_inline.py"),
                "--data-dir",
                str(data_dir),
                "--ports-file",
                str(self.ports_file),
            ]
            env = dict(os.environ)
        self.log = (workdir / f"{kind.replace(' ', '-')}.log").open("w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while not self.ports_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{kind} did not start; see {self.log.name}")
            time.sleep(0.05)
        self.ports: dict[str, str] = json.loads(self.ports_file.read_text())

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


# --- the load generator (a separate process) ---------------------------------------------


PUBLISHERS = 4


async def load(
    tier: str,
    readers: int,
    appenders: int,
    duration: float,
    ingest: str | None = None,
    publish_rate: float = 0.0,
) -> dict[str, Any]:
    """The tier stall (paged readers and appenders on ``tier``); with ``ingest``, also
    :data:`PUBLISHERS` publishers on the command bus at ``publish_rate`` in all (open
    loop: one publish per tick, so both targets get the same offered load)."""
    stats: dict[str, Any] = {
        "pages": 0,
        "records_bytes": 0,
        "appends": 0,
        "reads_shed": 0,
        "appends_shed": 0,
        "publishes": 0,
        "errors": 0,
    }
    append_seconds: list[float] = []
    publish_seconds: list[float] = []
    deadline = trio.current_time() + duration

    async def publisher(n: int) -> None:
        assert ingest is not None
        client = await Client.connect(ingest)
        payload = json.dumps({"execution_pool": "shared", "step": "x" * 180})
        async for i in open_loop(n, PUBLISHERS, publish_rate, deadline):
            started = trio.current_time()
            record = {"execution_id": f"{n}-{i}", "payload": payload}
            reply = await client.call("publish", record=record)
            if reply.get("ok"):
                stats["publishes"] += 1
                publish_seconds.append(trio.current_time() - started)
            else:
                stats["errors"] += 1

    async def reader() -> None:
        client = await Client.connect(tier)
        after = 0
        while trio.current_time() < deadline:
            reply = await client.call_raw(
                "read_execution", execution_id="big", after=after, limit=1000
            )
            match = NEXT_AFTER.search(reply)
            if match is None:
                error = json.loads(reply)["error"]
                stats["reads_shed" if error["code"] == "busy" else "errors"] += 1
                await trio.sleep(error.get("retry_after_ms", 100) / 1000)
                continue
            stats["pages"] += 1
            stats["records_bytes"] += len(reply)
            after = 0 if match.group(1) == b"null" else int(match.group(1))

    async def appender(n: int) -> None:
        client = await Client.connect(tier)
        i = 0
        while trio.current_time() < deadline:
            started = trio.current_time()
            reply = await client.call(
                "append", execution_id=f"small-{n}", payload=json.dumps({"bench": i})
            )
            i += 1
            if reply.get("ok"):
                stats["appends"] += 1
                append_seconds.append(trio.current_time() - started)
            else:
                stats["appends_shed" if reply["error"]["code"] == "busy" else "errors"] += 1
                await trio.sleep(reply["error"].get("retry_after_ms", 100) / 1000)

    async with trio.open_nursery() as nursery:
        for _ in range(readers):
            nursery.start_soon(reader)
        for n in range(appenders):
            nursery.start_soon(appender, n)
        if ingest is not None:
            for n in range(PUBLISHERS):
                nursery.start_soon(publisher, n)
    stats["append_ms"] = percentiles(append_seconds)
    stats["publish_ms"] = percentiles(publish_seconds)
    return stats


# --- the probe (this process) ----------------------------------------------------------


async def probe(ports: dict[str, str], duration: float) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"healthz": [], "metrics": [], "tier health": []}
    timeouts = {name: 0 for name in samples}

    async def timed(name: str, call: Any) -> None:
        start = trio.current_time()
        with trio.move_on_after(PROBE_TIMEOUT) as scope:
            await call()
        if scope.cancelled_caught:
            timeouts[name] += 1
        samples[name].append(trio.current_time() - start)

    async def tier_health() -> None:
        client = await Client.connect(ports["tier"])
        try:
            await client.call("health")
        finally:
            await client.aclose()

    deadline = trio.current_time() + duration

    async def every(period: float, name: str, call: Any) -> None:
        while trio.current_time() < deadline:
            await timed(name, call)
            await trio.sleep(period)

    # One loop per endpoint: probes every 50 ms (about 400 samples in 20 s, enough for a
    # p99), scrapes every 250 ms (60 x Prometheus's usual rate, yet not so often that
    # the probe becomes the load it measures).
    async with trio.open_nursery() as nursery:
        nursery.start_soon(every, 0.05, "healthz", lambda: http_get(ports["control"], "/healthz"))
        nursery.start_soon(every, 0.25, "metrics", lambda: http_get(ports["control"], "/metrics"))
        nursery.start_soon(every, 0.05, "tier health", tier_health)
    return {
        name: {**percentiles(values), "n": len(values), "timeouts": timeouts[name]}
        for name, values in samples.items()
    }


def run_target(
    kind: str, data_dir: Path, workdir: Path, readers: int, duration: float
) -> dict[str, Any]:
    server = Server(kind, data_dir, workdir)
    try:
        return generate_and_probe(server.ports, server.ports, readers, duration)
    finally:
        server.stop()


def generate_and_probe(
    tier: dict[str, str],
    probed: dict[str, str],
    readers: int,
    duration: float,
    publish_rate: float = 0.0,
) -> dict[str, Any]:
    """Run the load generator against ``tier``'s tier face (and ``probed``'s command
    ingest face, when publishing) while this process probes ``probed``'s control face
    and ``tier``'s tier face."""
    command = [sys.executable, __file__, "--load-gen", tier["tier"], str(readers), "4"]
    command.append(str(duration))
    if publish_rate:
        command += [probed["cmd_ingest"], str(publish_rate)]
    generator = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    samples = trio.run(probe, probed | {"tier": tier["tier"]}, duration)
    out, _ = generator.communicate(timeout=duration + 120)
    return {"probe": samples, "load": json.loads(out)}


def run_split(data_dir: Path, workdir: Path, readers: int, duration: float, rate: float) -> None:
    """Target "together": one writer with the buses and the tier; target "split": the
    buses and the tier in two processes (the split overlay). The same stall and the same
    publishes against both; the buses' /healthz and publish latency printed side by side."""
    results = {}
    together = Server("together", data_dir, workdir, faces=("TIER", *BUS_FACES), settings={})
    try:
        results["together"] = generate_and_probe(
            together.ports, together.ports, readers, duration, rate
        )
    finally:
        together.stop()
    buses_dir = workdir / "buses-data"
    shutil.rmtree(buses_dir, ignore_errors=True)
    buses = Server("buses", buses_dir, workdir, faces=BUS_FACES, settings={})
    tier = Server("tier", data_dir, workdir, faces=("TIER",), settings={})
    try:
        results["split"] = generate_and_probe(tier.ports, buses.ports, readers, duration, rate)
    finally:
        tier.stop()
        buses.stop()
    print()
    print(
        f"{duration:.0f} s of {readers} paged readers of the big execution + 4 appenders on the "
        f"tier, and {rate:.0f} publishes/s on the command bus; p50 / p99 / max in ms"
    )
    print(
        f"{'target':<10}{'buses /healthz':>24}{'publish':>24}{'publishes/s':>13}"
        f"{'tier pages/s':>14}{'appends/s':>11}{'errors':>8}"
    )
    for kind, result in results.items():
        health, done = result["probe"]["healthz"], result["load"]
        cells = [
            f"{p['p50']:.1f} / {p['p99']:.1f} / {p['max']:.0f}"
            for p in (health, done["publish_ms"])
        ]
        if health["timeouts"]:
            cells[0] += f" ({health['timeouts']}t)"
        print(
            f"{kind:<10}{cells[0]:>24}{cells[1]:>24}{done['publishes'] / duration:>13.1f}"
            f"{done['pages'] / duration:>14.1f}{done['appends'] / duration:>11.1f}"
            f"{done['errors']:>8}"
        )
    joint, split = results["together"], results["split"]
    for name, key in (("buses /healthz", "healthz"), ("publish", None)):
        a = joint["probe"][key] if key else joint["load"]["publish_ms"]
        b = split["probe"][key] if key else split["load"]["publish_ms"]
        print(
            f"{name}: together / split = p50 {a['p50'] / b['p50']:.1f}x, "
            f"p99 {a['p99'] / b['p99']:.1f}x"
        )
    print(f"\nworkdir: {workdir}")


async def read_latency(tier: str, execution_id: str, count: int) -> dict[str, float]:
    client = await Client.connect(tier)
    samples = []
    for _ in range(count):
        start = trio.current_time()
        reply = await client.call_raw("read_execution", execution_id=execution_id)
        samples.append(trio.current_time() - start)
        assert b'"returned":100' in reply, reply[:200]
    await client.aclose()
    return percentiles(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--payload-bytes", type=int, default=1100)
    parser.add_argument("--small", type=int, default=2000, help="small executions to preload")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per target")
    parser.add_argument(
        "--scale-events",
        type=int,
        default=1_000_000,
        help="the large store of the read-scaling test",
    )
    parser.add_argument(
        "--quick", action="store_true", help="20k events, 5 s phases, 100k scale store"
    )
    parser.add_argument(
        "--split", action="store_true", help="the buses beside the tier stall, split or not"
    )
    parser.add_argument(
        "--publish-rate", type=float, default=200.0, help="--split: command publishes/s"
    )
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.events, args.small, args.duration, args.scale_events = 20_000, 200, 5.0, 100_000
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cmdbus-stall-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cpus = cpu_quota()
    readers = 8 * cpus
    python = sys.version.split()[0]
    print(f"machine: {os.cpu_count()} CPUs, quota {cpus}; max_inflight {cpus}; python {python}")
    data_dir = workdir / "data"
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    started = time.monotonic()
    preload(
        data_dir,
        big_events=args.events,
        payload_bytes=args.payload_bytes,
        small_executions=args.small,
    )
    size = (data_dir / "tier.sqlite3").stat().st_size
    took = time.monotonic() - started
    print(
        f"preloaded {args.events} events of {args.payload_bytes}+ bytes in one execution "
        f"and {args.small} small executions: {size / 2**20:.0f} MiB in {took:.0f} s"
    )

    if args.split:
        run_split(data_dir, workdir, readers, args.duration, args.publish_rate)
        return
    results = {
        kind: run_target(kind, data_dir, workdir, readers, args.duration) for kind in TARGETS
    }
    print()
    print(
        f"{args.duration:.0f} s of {readers} paged readers of the big execution + 4 appenders; "
        f"probe p50 / p99 / max in ms (timeouts at {PROBE_TIMEOUT:.0f} s)"
    )
    columns = ("/healthz", "/metrics", "tier health")
    print(f"{'target':<16}" + "".join(f"{c:>24}" for c in columns) + f"{'pages/s':>9}{'shed':>6}")
    for kind, result in results.items():
        cells = [
            f"{p['p50']:.1f} / {p['p99']:.1f} / {p['max']:.0f}"
            + (f" ({p['timeouts']}t)" if p["timeouts"] else "")
            for p in (result["probe"][name] for name in ("healthz", "metrics", "tier health"))
        ]
        done = result["load"]
        print(
            f"{kind:<16}"
            + "".join(f"{cell:>24}" for cell in cells)
            + f"{done['pages'] / args.duration:>9.1f}{done['reads_shed']:>6}"
        )
    print()
    print("the 4 appenders beside the readers: appends/s, latency of an admitted append")
    print(f"{'target':<16}{'appends/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'shed':>6}{'errors':>7}")
    for kind, result in results.items():
        done = result["load"]
        latency = done["append_ms"]
        print(
            f"{kind:<16}{done['appends'] / args.duration:>10.1f}{latency['p50']:>9.1f}"
            f"{latency['p99']:>9.1f}{done['appends_shed']:>6}{done['errors']:>7}"
        )
    lane, shared = results["cmdbus-trio"]["load"], results["writes shared"]["load"]
    print(
        f"lane / shared: appends/s {lane['appends'] / max(1, shared['appends']):.1f}x, "
        f"read pages/s {lane['pages'] / max(1, shared['pages']):.2f}x"
    )
    ours, theirs = results["cmdbus-trio"]["probe"], results["baseline-inline"]["probe"]
    for name in ("healthz", "metrics", "tier health"):
        print(
            f"p99 {name}: baseline / cmdbus-trio = {theirs[name]['p99'] / ours[name]['p99']:.1f}x"
        )

    print()
    print(
        "read_execution of a 100-event execution (200 sequential reads, cmdbus-trio, no other load)"
    )
    scale = {}
    for events in (10_000, args.scale_events):
        store_dir = workdir / f"scale-{events}"
        shutil.rmtree(store_dir, ignore_errors=True)
        store_dir.mkdir()
        fill(store_dir, events - 100)
        add_execution(store_dir, "hundred", 100)
        server = Server("cmdbus-trio", store_dir, workdir)
        try:
            scale[events] = trio.run(read_latency, server.ports["tier"], "hundred", 200)
        finally:
            server.stop()
        p50, p99 = scale[events]["p50"], scale[events]["p99"]
        print(f"store of {events:>9,} events: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    small, large = scale[10_000], scale[args.scale_events]
    p50_ratio, p99_ratio = large["p50"] / small["p50"], large["p99"] / small["p99"]
    print(f"ratio {args.scale_events:,} / 10,000: p50 {p50_ratio:.2f}, p99 {p99_ratio:.2f}")
    print(f"\nworkdir: {workdir}")


if __name__ == "__main__":
    if len(sys.argv) in (6, 8) and sys.argv[1] == "--load-gen":
        tier_address, readers_arg, appenders_arg, duration_arg = sys.argv[2:6]
        ingest, rate = (sys.argv[6], float(sys.argv[7])) if len(sys.argv) == 8 else (None, 0.0)
        print(
            json.dumps(
                trio.run(
                    load,
                    tier_address,
                    int(readers_arg),
                    int(appenders_arg),
                    float(duration_arg),
                    ingest,
                    rate,
                )
            )
        )
    else:
        main()
