"""A NoETL-shaped deployment on this machine, for the system tests and
``benchmarks/workload.py``: the real ``cmdbus-trio serve`` with every timer compressed,
and the actors of :mod:`actors` as separate processes over real sockets, probed from
outside the way a kubelet and Prometheus do. :func:`run` runs one scenario and gathers
what every process saw; :func:`violations` checks it against the writer's guarantees;
:func:`figures` sums it up for sizing a writer."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

ACTORS = Path(__file__).with_name("actors.py")
FACES = ("control", "cmd_ingest", "cmd_claim", "evt_ingest", "evt_claim", "evt_subscribe", "tier")
DEFAULT_GROUPS = ("noetl_materializer", "noetl_result_materializer", "noetl_state_materializer")
LATE_GROUPS = ("late_audit", "late_search")
ABANDONED_GROUP = "abandoned"
ACK_WAIT = 2.0
TIMERS = {
    # Every timer far below the idle gaps of the run (GAP), so one minute holds many of each.
    "CMDBUS_ACK_WAIT_MS": str(int(ACK_WAIT * 1000)),
    "CMDBUS_DEFAULT_BUDGET_MS": "1000",
    "CMDBUS_IDLE_TIMEOUT_MS": "1000",
    "CMDBUS_READ_TIMEOUT_MS": "1000",
    "CMDBUS_DEDUP_WINDOW_MS": "5000",
    "CMDBUS_CONTROL_KEEPALIVE_MS": "500",
    "CMDBUS_SHUTDOWN_TIMEOUT_MS": "5000",
    "CMDBUS_MAX_DELIVER": "8",
    "CMDBUS_SUBSCRIBER_BUFFER": "2000",
    # Acked commands deleted a second after their ack, retention passes twice a second:
    # the store deletes under the load (and across the writer's restarts) while workers
    # still claim and ack. Events keep the default window: the late groups replay them all.
    "CMDBUS_CMD_KEEP_ACKED_MS": "1000",
    "CMDBUS_RETENTION_INTERVAL_MS": "500",
}
GAP = 2.5
"""Seconds of silence between a server's bursts: longer than every timer above."""
SCRAPE_EVERY = 15
"""The probing thread scrapes /metrics every this many rounds (about 3 s): a Prometheus
with a short interval, beside the kubelet's probes. The control face may use a tenth of
the loop before requests wait (loop/turns.py); on a pair's primary a scrape costs 12 ms
of it on a 2-CPU machine, a probe or an /ha 2-3 ms. Every second, this thread's probes
(ten), a scrape (every second at the end of a run) and the pair's /ha (four) used 55 ms
of the 100 there, and on a machine 1.6 times slower the scrape that came with a burst of
/ha was paced: a load twenty times a kubelet's and a Prometheus's, not theirs."""


@attrs.define
class Probe:
    at: float
    path: str
    status: int | None  # None: no answer
    seconds: float


@attrs.define
class Outcome:
    """Everything a run saw."""

    root: Path
    faults: bool
    lines: list[dict[str, Any]]
    probes: list[Probe]
    rss: list[tuple[float, int]]  # (time, bytes) of the writer
    restarts: list[tuple[float, float]]  # (killed or drained at, serving again at)
    killed: set[str]  # actors SIGKILLed
    started: float
    quiet: float  # when everything had been consumed
    metrics: str
    writer_exit: int | None
    writer_log: str
    tier: dict[str, list[str]]  # execution -> its event_ids, read at the end
    drained: list[int | None] = attrs.field(factory=list)  # each rollout's exit code

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["kind"] == kind]


def free_ports(count: int) -> list[int]:
    """Free ports below the kernel's ephemeral range, kept by the writer across its
    restarts: clients must find it again where it was, as behind a Kubernetes Service.
    Not a port 0 hands out: between a restart's unbind and bind, any client's connection
    could take that one as its own local port (a member failed to start so, "address
    already in use")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng, ports = random.Random(), set[int]()
    while len(ports) < count:
        port = rng.randrange(min(10_000, low // 2), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.add(port)
    return sorted(ports)


class Deployment:
    def __init__(self, root: Path, *, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.logs = root / "actors"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.ports_file = root / "ports.json"
        ports = dict(zip(FACES, free_ports(len(FACES)), strict=True))
        self.addresses = {face: f"127.0.0.1:{port}" for face, port in ports.items()}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CMDBUS_")}
        self.env.update(TIMERS)
        self.env.update({f"CMDBUS_{face.upper()}_BIND": a for face, a in self.addresses.items()})
        self.env.update(
            CMDBUS_DATA_DIR=str(root / "data"),
            CMDBUS_PORTS_FILE=str(self.ports_file),
            **(env or {}),
        )
        (root / "addresses.json").write_text(json.dumps(self.addresses))
        self.writer: subprocess.Popen[bytes] | None = None
        self.actors: dict[str, subprocess.Popen[bytes]] = {}
        self.actor_commands: dict[str, list[str]] = {}
        self.probes: list[Probe] = []
        self.rss: list[tuple[float, int]] = []
        self._probing = threading.Event()

    # --- the writer -----------------------------------------------------------------------

    def start_writer(self) -> float:
        """Start ``cmdbus-trio serve``; returns when it listens (its ports file)."""
        self.ports_file.unlink(missing_ok=True)
        with (self.root / "writer.log").open("ab") as log:
            self.writer = subprocess.Popen(
                [sys.executable, "-m", "cmdbus_trio", "serve"],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 30
        while not self.ports_file.exists():
            if self.writer.poll() is not None or time.monotonic() > deadline:
                self.writer.kill()  # (a writer that never listened must not outlive the run)
                self.writer.wait()
                raise AssertionError(f"the writer did not start:\n{self.writer_log()[-3000:]}")
            time.sleep(0.02)
        return time.time()

    def kill_writer(self) -> float:
        assert self.writer is not None
        self.writer.kill()
        self.writer.wait()
        return time.time()

    def stop_writer(self) -> int | None:
        """SIGTERM: the writer drains and exits (0 expected)."""
        assert self.writer is not None
        self.writer.send_signal(signal.SIGTERM)
        try:
            return self.writer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.writer.kill()
            self.writer.wait()
            return None

    def stop(self) -> int | None:
        """The end of a run: the writer stopped as :meth:`stop_writer` does."""
        return self.stop_writer()

    def writer_log(self) -> str:
        return (self.root / "writer.log").read_text(errors="replace")

    def controls(self) -> list[str]:
        """Every control face the probes ask."""
        return [self.addresses["control"]]

    def control(self) -> str:
        """The control face whose /metrics says how the run went."""
        return self.addresses["control"]

    # --- actors ---------------------------------------------------------------------------

    def start_actor(self, role: str, name: str, **options: Any) -> None:
        command = [
            sys.executable,
            str(ACTORS),
            role,
            "--ports",
            str(self.root / "addresses.json"),
            "--out",
            str(self.logs / f"{name}.jsonl"),
            "--name",
            name,
            "--ack-wait",
            str(ACK_WAIT),
            "--watch",
            str(self.logs),
        ]
        for option, value in options.items():
            command += [f"--{option.replace('_', '-')}", str(value)]
        self.actor_commands[name] = command
        with (self.root / "actors.log").open("ab") as log:
            self.actors[name] = subprocess.Popen(
                command, env=self.env, stdout=subprocess.DEVNULL, stderr=log
            )

    def kill_actor(self, name: str) -> None:
        process = self.actors.pop(name)
        process.kill()
        process.wait()

    def stop_actors(self) -> None:
        # An actor that failed before the run's end crashed: what it would have done is
        # missing from the run, and no checker would see that (some end on their own, 0).
        crashed = {name: p.returncode for name, p in self.actors.items() if p.poll()}
        for process in self.actors.values():
            process.send_signal(signal.SIGINT)
        for name, process in self.actors.items():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGUSR1)  # its stacks, into actors.log
                time.sleep(1)
                process.kill()
                process.wait()
                raise AssertionError(
                    f"actor {name} did not stop on SIGINT (its stacks: {self.root}/actors.log)"
                ) from None
        if crashed:
            raise AssertionError(
                f"actors failed before the run ended: {crashed} ({self.root}/actors.log)"
            )

    def lines(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in sorted(self.logs.glob("*.jsonl")):
            for text in path.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line cut by a SIGKILL
                    out.append(json.loads(text))
        out.sort(key=lambda line: line["t"])
        return out

    def last_kind(self, name: str) -> str | None:
        path = self.logs / f"{name}.jsonl"
        if not path.exists():
            return None
        text = path.read_text().strip().splitlines()
        return json.loads(text[-1])["kind"] if text else None

    # --- probes, from outside -------------------------------------------------------------

    @contextmanager
    def probing(self, period: float = 0.2) -> Iterator[None]:
        """Probe /readyz and /healthz and sample the writer's RSS every ``period``;
        scrape /metrics every :data:`SCRAPE_EVERY` periods."""
        self._probing.set()
        thread = threading.Thread(target=self._probe, args=(period,), daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._probing.clear()
            thread.join()

    def _probe(self, period: float) -> None:
        rounds = 0
        while self._probing.is_set():
            rounds += 1
            scrape = ("/metrics",) if rounds % SCRAPE_EVERY == 0 else ()  # a Prometheus
            for control, path in itertools.product(
                self.controls(), ("/readyz", "/healthz", *scrape)
            ):
                started = time.monotonic()
                try:
                    url = f"http://{control}{path}"
                    with urllib.request.urlopen(url, timeout=2) as response:
                        status: int | None = response.status
                        response.read()
                except urllib.error.HTTPError as error:
                    status = error.code
                except (OSError, http.client.HTTPException):  # IncompleteRead: killed mid-answer
                    status = None
                self.probes.append(Probe(time.time(), path, status, time.monotonic() - started))
            if self.writer is not None and self.writer.poll() is None:
                self.rss.append((time.time(), _rss(self.writer.pid)))
            time.sleep(period)

    def metrics(self) -> str:
        url = f"http://{self.control()}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def metric(text: str, prefix: str) -> list[float]:
    """The values of the samples whose line starts with ``prefix``."""
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]


# --- one run ------------------------------------------------------------------------------


def run(
    root: Path,
    *,
    faults: bool = False,
    bursts: int = 8,
    burst: int = 16,
    seed: int = 1,
    workers: int = 1,
    env: dict[str, str] | None = None,
    pair: bool = False,
    litestream: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> Outcome:
    """Run the deployment: two servers (trio and blocking clients) publishing ``bursts``
    bursts of ``burst`` commands each with idle gaps of :data:`GAP`; ``workers`` workers
    of each kind per pool in v1 (NoETL's dialect) and v2 (trio and blocking clients; the
    trio workers take half their claims in batches and ack each batch in one request), two
    of them SIGKILLed
    mid-command and replaced; the three default event groups, two more created
    mid-run from the beginning and one created and abandoned mid-run, then deleted; a
    push subscriber that resumes from its cursor once; a reader of finished executions.
    With ``faults``, the writer is SIGKILLed and restarted
    twice as well. ``pair``: a primary and its standby (harness/pair.py), whose faults are
    the primary's; ``litestream``: with Litestream in the primary (harness/pair.py).
    Returns once every command and event has been consumed."""
    rng = random.Random(seed)
    if pair:
        from harness.pair import PairDeployment

        deployment: Deployment = PairDeployment(root, env=env, litestream=litestream)
    else:
        deployment = Deployment(root, env=env)
    started = deployment.start_writer()
    restarts: list[tuple[float, float]] = []
    drained: list[int | None] = []  # each rollout's drain: the writer's exit code
    killed: set[str] = set()
    try:
        with deployment.probing():
            for server, client in (("server-a", "trio"), ("server-b", "blocking")):
                deployment.start_actor(
                    "server",
                    server,
                    client=client,
                    executions=bursts * burst,
                    burst=burst,
                    gap=GAP,
                    seed=rng.randrange(1 << 30),
                )
            kinds = [("shared", "v1"), ("shared", "trio"), ("shared", "blocking")]
            kinds += [("system", "v1"), ("system", "trio")]
            workers = {
                f"worker-{pool}-{dialect}" + (f".{n}" if n else ""): (pool, dialect)
                for n in range(workers)
                for pool, dialect in kinds
            }
            for name, (pool, dialect) in workers.items():
                deployment.start_actor(
                    "worker", name, pool=pool, dialect=dialect, seed=rng.randrange(1 << 30)
                )
            deployment.start_actor(
                "materializer", "groups-default", groups=",".join(DEFAULT_GROUPS)
            )
            deployment.start_actor(
                "materializer", "groups-late", groups=",".join(LATE_GROUPS), create_after=GAP * 3
            )
            deployment.start_actor(
                "abandoner",
                "group-abandoned",
                groups=ABANDONED_GROUP,
                create_after=GAP * 2,
                gap=GAP,
            )
            deployment.start_actor("subscriber", "subscriber", reconnect_after=bursts * burst // 2)
            deployment.start_actor("reader", "reader")
            run_for = bursts * (GAP + 0.5)
            chaos = sorted(
                [(run_for * 0.3, "worker"), (run_for * 0.6, "worker")]
                + ([(run_for * 0.4, "writer"), (run_for * 0.75, "writer")] if faults else [])
                + ([(run_for * 0.2, "rollout"), (run_for * 0.55, "rollout")] if faults else [])
            )
            log(f"running: {bursts} bursts of {burst} commands from each of two servers")
            for at, what in chaos:
                time.sleep(max(0.0, started + at - time.time()))
                if what == "writer":
                    down = deployment.kill_writer()
                    restarts.append((down, deployment.start_writer()))
                    log(f"{down - started:.1f} s: writer SIGKILLed and restarted")
                elif what == "rollout":  # as a StatefulSet's rollout: drain, then start
                    down = time.time()
                    drained.append(deployment.stop_writer())
                    restarts.append((down, deployment.start_writer()))
                    log(f"{down - started:.1f} s: writer drained (SIGTERM) and restarted")
                else:
                    killed.add(_kill_a_worker_mid_command(deployment, rng, workers))
                    log(f"{time.time() - started:.1f} s: a worker SIGKILLed mid-command")
            _wait_for_servers(deployment, timeout=run_for + 120)
            log(f"{time.time() - started:.1f} s: the servers are done; draining")
            quiet = _wait_until_consumed(deployment)
        metrics = deployment.metrics()
        tier = _read_tier(deployment)
    finally:
        try:
            deployment.stop_actors()
        finally:
            writer_exit = deployment.stop()
    return Outcome(
        root=root,
        faults=faults,
        lines=deployment.lines(),
        probes=deployment.probes,
        rss=deployment.rss,
        restarts=restarts,
        drained=drained,
        killed=killed,
        started=started,
        quiet=quiet,
        metrics=metrics,
        writer_exit=writer_exit,
        writer_log=deployment.writer_log(),
        tier=tier,
    )


def _kill_a_worker_mid_command(
    deployment: Deployment, rng: random.Random, workers: dict[str, tuple[str, str]]
) -> str:
    """SIGKILL a worker while it runs a command (its last word is a claim), and start a
    replacement of the same kind."""
    names = [name for name in deployment.actors if name.startswith("worker-")]
    deadline = time.monotonic() + 5
    while True:
        busy = [
            name
            for name in names
            if deployment.last_kind(name) in ("claimed", "extending", "extended")
        ]
        if busy or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    victim = rng.choice(busy or names)
    deployment.kill_actor(victim)
    base = victim.split("+")[0]
    pool, dialect = workers[base]
    deployment.start_actor(
        "worker", f"{base}+{len(deployment.actor_commands)}", pool=pool, dialect=dialect
    )
    return victim


def _wait_for_servers(deployment: Deployment, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    for name in ("server-a", "server-b"):
        process = deployment.actors[name]
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert process.returncode == 0, f"{name} exited {process.returncode}"
        del deployment.actors[name]


def _wait_until_consumed(deployment: Deployment, timeout: float = 60) -> float:
    """Until the command backlog, every group's backlog, and the subscriber are at the
    last event, twice in a row (the lag gauges are sampled every second)."""
    deadline = time.monotonic() + timeout
    calm = 0
    while calm < 2:
        if time.monotonic() > deadline:
            raise AssertionError("the deployment did not consume everything in time")
        time.sleep(1.0)
        try:
            text = deployment.metrics()
        except OSError:
            calm = 0
            continue
        lags = metric(text, "ehdb_feed_total_lag ") + metric(text, "ehdb_events_group_lag{")
        lines = deployment.lines()
        published = [x["sort_key"] for x in lines if x["kind"] == "event_published"]
        pushed = [k for x in lines if x["kind"] == "pushed" for k in x["keys"]]
        groups = {x["group"] for x in lines if x["kind"] == "event"}
        consumed = (
            published
            and pushed
            and max(pushed) >= max(published)
            and groups >= {*DEFAULT_GROUPS, *LATE_GROUPS}
        )
        calm = calm + 1 if consumed and lags and not any(lags) else 0
    return time.time()


def _read_tier(deployment: Deployment) -> dict[str, list[str]]:
    from cmdbus_trio.client import blocking

    executions = sorted({x["execution_id"] for x in deployment.lines() if x["kind"] == "published"})
    out: dict[str, list[str]] = {}
    with blocking.TierClient(deployment.addresses["tier"]) as tier:
        for execution_id in executions:
            out[execution_id] = [
                json.loads(r.payload)["event_id"] for r in tier.read_all(execution_id)
            ]
    return out


def _ack_lost_with_the_writer(
    outcome: Outcome,
    claim: dict[str, Any],
    events_of: dict[str, dict[int, list[dict[str, Any]]]],
) -> bool:
    """The last holder sent its ack and the writer was killed before the reply: the ack
    was durable, since the record was never delivered again (an ack that was not durable
    redelivers after the restart, and that claim would be last). The worker saw either
    the lost connection (``transient``) or, when its client retried the ack against the
    restarted writer, ``acked: false``: the record was already acked."""
    after = [x for x in events_of[claim["actor"]][claim["sort_key"]] if x["t"] >= claim["t"]]
    kinds = [x["kind"] for x in after]
    if "acking" not in kinds:
        return False
    acking = after[kinds.index("acking")]
    answers = after[kinds.index("acking") + 1 :]
    if any(x["kind"] == "transient" for x in answers):
        return True
    return any(
        x["kind"] == "acked"
        and not x["ok"]
        and any(acking["t"] <= killed <= x["t"] for killed, _ in outcome.restarts)
        for x in answers
    )


# --- what a run must show -----------------------------------------------------------------


def violations(outcome: Outcome) -> list[str]:
    """Every guarantee the run broke, each in a sentence; empty when none."""
    out: list[str] = []
    lines = outcome.lines
    published = outcome.kind("published")
    command_keys = {x["sort_key"] for x in published}
    execution_of = {x["sort_key"]: x["execution_id"] for x in published}

    # Sort keys are never reused: one msg_id per sort key, and a retried msg_id is a
    # duplicate of the first.
    msg_of: dict[int, str] = {}
    for x in published + outcome.kind("republished"):
        if msg_of.setdefault(x["sort_key"], x["msg_id"]) != x["msg_id"]:
            out.append(f"sort key {x['sort_key']} was given to two msg_ids")
    first_key = {x["msg_id"]: x["sort_key"] for x in published}
    for x in outcome.kind("republished"):
        if not (x["duplicate"] and x["sort_key"] == first_key[x["msg_id"]]):
            out.append(f"a retried msg_id {x['msg_id']} was not a duplicate: {x}")

    # Every v2 delivery of a command carries the trace context it was published with, also
    # after the writer was killed and restarted (it is stored with the record).
    traced_as = {x["sort_key"]: x.get("traceparent") for x in published}
    for x in outcome.kind("claimed"):
        if "traceparent" in x and x["traceparent"] != traced_as.get(x["sort_key"]):
            out.append(
                f"command {x['sort_key']} was delivered to {x['actor']} with trace context "
                f"{x['traceparent']}, published with {traced_as.get(x['sort_key'])}"
            )

    # Every command claimed, acked once, redelivered only for a reason, never dead.
    claims: dict[int, list[dict[str, Any]]] = defaultdict(list)
    events_of: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for x in lines:
        if x.get("sort_key") is not None and x["kind"] in (
            "claimed",
            "nacking",
            "nacked",
            "extending",
            "extended",
            "acking",
            "acked",
            "transient",
        ):
            events_of[x["actor"]][x["sort_key"]].append(x)
            if x["kind"] == "claimed":
                claims[x["sort_key"]].append(x)
    for sort_key in sorted(command_keys):
        history = claims.get(sort_key, [])
        if not history:
            out.append(f"command {sort_key} ({execution_of[sort_key]}) was never delivered")
            continue
        if history[0]["redelivered"] and not outcome.restarts:
            out.append(f"command {sort_key}: its first delivery said redelivered")
        for previous, claim in itertools.pairwise(history):
            if not _redelivery_explained(outcome, previous, claim, events_of):
                out.append(
                    f"command {sort_key} was redelivered to {claim['actor']} at "
                    f"{claim['t'] - outcome.started:.2f} s without a cause (previous holder "
                    f"{previous['actor']} neither died, nor nacked, nor let its lease lapse); "
                    + _story(outcome, sort_key)
                )
        acks = [x for x in outcome.kind("acked") if x["sort_key"] == sort_key and x["ok"]]
        if (
            not acks
            and history[-1]["actor"] not in outcome.killed
            and not _ack_lost_with_the_writer(outcome, history[-1], events_of)
        ):
            out.append(f"command {sort_key}: no worker acked it")
        v2_acks = [x for x in acks if x["dialect"] == "v2"]
        if len(v2_acks) > 1:
            out.append(f"command {sort_key} was acked {len(v2_acks)} times")
        for ack in v2_acks:
            later = [c for c in history if c["t"] > ack["t"]]
            if later:
                out.append(f"command {sort_key} was delivered again after its ack: {later[0]}")
    if sum(metric(outcome.metrics, "cmdbus_dead_total{")):
        out.append("commands went to the dead letters")
    deleted = 'cmdbus_retention_deleted_total{kind="records",store="commands"}'
    if not sum(metric(outcome.metrics, deleted)):  # counted since the last start
        out.append("retention deleted no acked command")

    # Every group saw every event; the subscriber saw each once, in order, no gap.
    last_event = max(
        [x["sort_key"] for x in outcome.kind("event_published")]
        + [x["sort_key"] for x in outcome.kind("event")],
        default=0,
    )
    every_event = set(range(1, last_event + 1))
    for group in (*DEFAULT_GROUPS, *LATE_GROUPS):
        seen = {x["sort_key"] for x in outcome.kind("event") if x["group"] == group}
        if missing := sorted(every_event - seen):
            out.append(f"group {group} never got events {missing[:20]} ({len(missing)} in all)")
    pushed = [k for x in outcome.kind("pushed") for k in x["keys"]]
    if pushed != sorted(every_event):
        gaps = sorted(every_event - set(pushed))[:20]
        doubles = sorted(k for k in set(pushed) if pushed.count(k) > 1)[:20]
        out.append(
            f"the subscriber's stream is not 1..{last_event}: missing {gaps}, twice {doubles}"
        )
    if not outcome.kind("resume"):
        out.append("the subscriber never resumed from its cursor")
    if not outcome.kind("group_deleted"):
        out.append("the abandoned group was never deleted")
    if f'group="{ABANDONED_GROUP}"' in outcome.metrics:
        out.append("the deleted group still has metric series")

    # Every execution's history complete and in order; the reader's pages agree.
    for execution_id, event_ids in sorted(outcome.tier.items()):
        expected = [f"{execution_id}-{kind}" for kind in ("started", "done")]
        if event_ids != expected:
            out.append(f"execution {execution_id}: tier history {event_ids}, expected {expected}")
    for x in outcome.kind("read"):
        if x["sequences"] != sorted(x["sequences"]) or x["event_ids"] != outcome.tier.get(
            x["execution_id"]
        ):
            out.append(f"the reader paged {x['execution_id']} as {x['event_ids']}")
    if not outcome.kind("read"):
        out.append("the reader read nothing")

    # The writer: lag 0, nothing blocked its loop, its probes went first, no shed, the
    # control face neither crowded nor paced, no error logged, exit 0.
    text = outcome.metrics
    if any(metric(text, "ehdb_feed_total_lag ") + metric(text, "ehdb_events_group_lag{")):
        out.append("lag is not back to 0")
    if sum(metric(text, "cmdbus_loop_blocking_calls_total")):
        out.append("the writer's cmdbus_loop_blocking_calls_total is not 0")
    if not sum(metric(text, "cmdbus_loop_control_first_seconds_total")):
        out.append("the probes never went first: cmdbus_loop_control_first_seconds_total is 0")
    if shed := sum(metric(text, "cmdbus_shed_total{")):
        out.append(f"{shed:.0f} requests were shed at this nominal load")
    if crowded := sum(metric(text, "cmdbus_control_connections_crowded_out_total{")):
        out.append(f"{crowded:.0f} probe or scrape connections were crowded out")
    if paced := sum(metric(text, "cmdbus_control_paced_seconds_total")):
        out.append(f"a kubelet and a Prometheus were paced as a flood would be ({paced:.3f} s)")
    errors = [line for line in outcome.writer_log.splitlines() if '"level": "error"' in line]
    if errors:
        out.append(f"the writer logged {len(errors)} error lines, first: {errors[0][:500]}")
    if outcome.writer_exit != 0:
        out.append(f"the writer exited {outcome.writer_exit} after SIGTERM")
    if any(code != 0 for code in outcome.drained):
        out.append(f"a rollout's drain exited {outcome.drained}")

    # The clients rode through every restart: no error a restart causes reached an actor
    # on the Python clients (v1 workers speak raw sockets; an append without
    # expected_version may have been stored, so its lost connection is the caller's).
    for x in outcome.kind("transient"):
        python_client = "-v1" not in x["actor"]  # worker-<pool>-v1, its replacements too
        lost_append = x.get("what") == "append" and x["error"] == "ConnectionLost"
        if python_client and not lost_append and x["error"] != "Busy":
            out.append(f"{x['actor']} saw {x['error']} ({x.get('what')}): a restart reached it")

    # Probes answered throughout (outside the writer's own restarts).
    for probe in outcome.probes:
        down = any(killed - 0.5 <= probe.at <= back + 0.5 for killed, back in outcome.restarts)
        if not down and probe.status != 200:
            out.append(
                f"{probe.path} answered {probe.status} at {probe.at - outcome.started:.2f} s"
            )
    if not outcome.restarts:
        out += _rss_growth(outcome)
    return out


def _story(outcome: Outcome, sort_key: int) -> str:
    """What everyone saw of a command, and every lease the writer released, for a
    failure's report: enough to tell a writer's fault from a client's."""
    seen = [
        f"{x['t'] - outcome.started:.3f} {x['actor']} {x['kind']}"
        + "".join(f" {k}={x[k]}" for k in ("ok", "redelivered", "what", "error") if k in x)
        for x in outcome.lines
        if x.get("sort_key") == sort_key and not x["kind"].startswith(("event", "pushed"))
    ]
    released = [
        line for line in outcome.writer_log.splitlines() if '"event": "leases_released"' in line
    ]
    return f"its story: {seen}; leases released by the writer: {released[:10]}"


def _redelivery_explained(
    outcome: Outcome,
    previous: dict[str, Any],
    claim: dict[str, Any],
    events_of: dict[str, dict[int, list[dict[str, Any]]]],
) -> bool:
    """Each process notes a fact when it sees it, so the holder's word can come later than
    the redelivery it caused: a nack is noted as ``nacking`` before it is sent (the
    writer redelivers at once, and the next worker may note its claim before the holder
    notes the reply), an extension as ``extending``, the lower bound of its new lease."""
    holder, sort_key = previous["actor"], previous["sort_key"]
    history = events_of[holder][sort_key]
    mine = [x for x in history if previous["t"] <= x["t"] <= claim["t"]]
    if holder in outcome.killed or any(x["kind"] in ("nacking", "transient") for x in mine):
        return True
    if any(previous["t"] <= back and killed <= claim["t"] for killed, back in outcome.restarts):
        return True  # the writer restarted in between: leases are not kept over a restart
    extended = [
        asked["t"]
        for asked, answer in itertools.pairwise(history)
        if (asked["kind"], answer["kind"]) == ("extending", "extended") and answer["ok"]
        if previous["t"] <= asked["t"] <= claim["t"]
    ]
    last_sign_of_life = max([previous["t"], *extended])
    return claim["t"] - last_sign_of_life >= ACK_WAIT * 0.9  # the lease lapsed


def _rss_growth(outcome: Outcome) -> list[str]:
    """The writer's RSS after warm-up (the first third of the run) stays within 20 MiB."""
    warm = outcome.started + (outcome.quiet - outcome.started) / 3
    after = [rss for at, rss in outcome.rss if at >= warm]
    if len(after) < 5:
        return ["too few RSS samples"]
    growth = max(after) - after[0]
    if growth > 20 << 20:
        return [f"the writer's RSS grew by {growth / 2**20:.1f} MiB after warm-up"]
    return []


def figures(outcome: Outcome) -> dict[str, Any]:
    """What a user sizes a writer by: goodput, latencies, redeliveries, sheds, probes, RSS."""
    published = {x["sort_key"]: x["t"] for x in outcome.kind("published")}
    first_claim: dict[int, float] = {}
    for x in outcome.kind("claimed"):
        first_claim.setdefault(x["sort_key"], x["t"])
    acked = {x["sort_key"]: x["t"] for x in outcome.kind("acked") if x["ok"]}
    claims = {x["sort_key"]: x["t"] for x in outcome.kind("claimed")}  # the last claim
    to_claim = [first_claim[k] - t for k, t in published.items() if k in first_claim]
    to_ack = [acked[k] - claims[k] for k in acked if k in claims and acked[k] >= claims[k]]
    probes = [p.seconds for p in outcome.probes if p.status == 200 and p.path != "/metrics"]
    span = outcome.quiet - outcome.started
    return {
        "seconds": round(span, 1),
        "commands": len(published),
        "events": len({x["sort_key"] for x in outcome.kind("event_published")}),
        "goodput_commands_per_s": round(len(acked) / span, 1),
        "publish_to_claim_ms": _percentiles(to_claim),
        "claim_to_ack_ms": _percentiles(to_ack),
        "redeliveries": sum(metric(outcome.metrics, "cmdbus_redeliveries_total{")),
        "leases_released": sum(metric(outcome.metrics, "cmdbus_leases_released_total{")),
        "shed": sum(metric(outcome.metrics, "cmdbus_shed_total{")),
        "probe_ms": _percentiles(probes),
        "probes_failed": sum(1 for p in outcome.probes if p.status != 200),
        "control_cpu_s": sum(metric(outcome.metrics, "cmdbus_loop_control_seconds_total")),
        # The writer's whole CPU (all threads), from its start (its last, with faults) to
        # the end: what the deployment's load cost it, for CPU a command.
        "writer_cpu_s": sum(metric(outcome.metrics, "process_cpu_seconds_total")),
        "rss_mib": {
            "min": round(min((r for _, r in outcome.rss), default=0) / 2**20, 1),
            "max": round(max((r for _, r in outcome.rss), default=0) / 2**20, 1),
        },
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50": float("nan"), "p99": float("nan")}
    cuts = statistics.quantiles(values, n=100)
    return {"p50": round(cuts[49] * 1000, 1), "p99": round(cuts[98] * 1000, 1)}
