"""A shard of two pods as deploy/k8s/overlays/ha runs it, on one machine: the members
agree through a ``kubernetes:`` Lease served over TLS by the fake API server (with a
pod's token and CA from a service-account directory), label their pods with their roles,
and a "Service" forwards each new connection to the pod labelled primary and Ready, as
the shard's client Service does. A publisher writes through the Service only.

- A rollout: members replaced one at a time as a StatefulSet does (highest ordinal
  first, each SIGTERMed, started again on its volume, and waited for until Ready), twice:
  every pause of the publisher is a hand-over, never a lease's expiry; nothing
  acknowledged is lost; a Ready standby is always one the lease names in sync.
- A dead node: the primary SIGKILLed and not restarted (its pod object stays, labelled
  primary): the standby takes over when the lease expires and relabels the dead pod, so
  the Service reaches the new primary at once; nothing acknowledged is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trustme
from harness.pair import Service

from cmdbus_trio.client import DeadlineExceeded
from cmdbus_trio.client.blocking import IngestClient
from cmdbus_trio.ha._kube_pods import ROLE_LABEL

from ..helpers import cli, environment
from .kube_api import FakeKubeAPI, serving
from .test_pair import claimed_keys, ha, until

pytestmark = pytest.mark.e2e

NAMESPACE = "cmdbus"
PODS = ("cmdbus-trio-0-0", "cmdbus-trio-0-1")
GRACE_S = 30  # terminationGracePeriodSeconds


def ready(ports: dict[str, str]) -> bool:
    try:
        with urllib.request.urlopen(f"http://{ports['control']}/readyz", timeout=2) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


class Shard:
    """The two pods of a shard: processes started, stopped and started again on their
    data dirs, the Lease and the pods' labels in the fake API server."""

    def __init__(self, root: Path, api: FakeKubeAPI, ca: trustme.CA, lease_ms: int) -> None:
        self.root = root
        self.api = api
        account = root / "serviceaccount"
        account.mkdir()
        (account / "token").write_text("pod-token\n")
        ca.cert_pem.write_to_path(str(account / "ca.crt"))
        host, port = api.url.removeprefix("https://").split(":")
        self.env = {
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": port,
            "CMDBUS_HA_LEASE": f"kubernetes:{NAMESPACE}/cmdbus-trio-0",
            "CMDBUS_HA_POD_LABELS": "true",
            "CMDBUS_HA_KUBE_SERVICE_ACCOUNT": str(account),
            "CMDBUS_HA_BIND": "127.0.0.1:0",
            "CMDBUS_HA_LEASE_MS": str(lease_ms),
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._ready_seen: tuple[float, str | None] = (0.0, None)
        for pod in PODS:
            api.add_pod(NAMESPACE, pod)

    def ports_file(self, pod: str) -> Path:
        return self.root / pod / "ports.json"

    def ports(self, pod: str) -> dict[str, str]:
        ports: dict[str, str] = json.loads(self.ports_file(pod).read_text())
        return ports

    def start(self, pod: str) -> None:
        home = self.root / pod
        home.mkdir(exist_ok=True)
        self.ports_file(pod).unlink(missing_ok=True)
        env = environment(home, CMDBUS_HA_NAME=pod, **self.env)
        with (home / "server.log").open("a") as log:
            self.processes[pod] = subprocess.Popen(
                cli("serve"), env=env, stdout=subprocess.DEVNULL, stderr=log
            )
        until(lambda: self.ports_file(pod).exists(), timeout=30)

    def stop(self, pod: str, sig: signal.Signals) -> int:
        process = self.processes.pop(pod)
        process.send_signal(sig)
        return process.wait(GRACE_S)

    def label(self, pod: str) -> str | None:
        return self.api.labels(NAMESPACE, pod).get(ROLE_LABEL)

    def endpoint(self) -> str | None:
        """The ports file of the Service's endpoint: the pod labelled primary and Ready
        (asked at most every 0.2 s, as a Service's endpoints lag the pods a little)."""
        seen_at, seen = self._ready_seen
        if time.monotonic() - seen_at < 0.2:
            return seen
        chosen = None
        for pod in self.processes:
            if self.label(pod) == "primary" and ready(self.ports(pod)):
                chosen = str(self.ports_file(pod))
        self._ready_seen = (time.monotonic(), chosen)
        return chosen

    def primary(self) -> str | None:
        for pod in self.processes:
            if ha(self.ports(pod))["role"] == "primary":
                return pod
        return None

    def cpu_while_idle(self, seconds: float) -> dict[str, float]:
        """Each member's CPU (cores) over ``seconds`` with no load."""

        def used(pod: str) -> float:
            fields = Path(f"/proc/{self.processes[pod].pid}/stat").read_text().split(")")[-1]
            utime, stime = fields.split()[11:13]
            return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")

        before = {pod: used(pod) for pod in self.processes}
        time.sleep(seconds)
        return {pod: (used(pod) - before[pod]) / seconds for pod in self.processes}

    def close(self) -> None:
        for process in self.processes.values():
            process.kill()
            process.wait()


@contextmanager
def shard(tmp_path: Path, lease_ms: int) -> Iterator[tuple[Shard, Service]]:
    ca = trustme.CA()
    with serving(FakeKubeAPI(token="pod-token"), ca) as api:
        pods = Shard(tmp_path, api, ca, lease_ms)
        service = Service(("cmd_ingest", "cmd_claim"), pods.endpoint)
        try:
            pods.start(PODS[0])
            until(lambda: pods.label(PODS[0]) == "primary")
            pods.start(PODS[1])
            until(lambda: ready(pods.ports(PODS[1])), timeout=30)
            for pod, busy in pods.cpu_while_idle(2.0).items():
                assert busy < 0.25, f"{pod} idle used {busy:.2f} of a core"  # (no spin)
            yield pods, service
        finally:
            service.close()
            pods.close()


class Publisher:
    """Publishes through the Service at about 100 records/s in a thread, as docs/ha.md
    tells a client to (a call timeout, and a call that timed out sent again with its
    msg_id); keeps every acknowledged sort key and the waits between acknowledgements."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.acked: set[int] = set()
        self.pauses: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> Publisher:
        self._thread.start()
        until(lambda: len(self.acked) >= 20)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert self.error is None, self.error

    def _run(self) -> None:
        try:
            with IngestClient(self.address) as ingest:
                last = time.monotonic()
                n = 0
                while not self._stop.is_set():
                    record = {"execution_id": n, "payload": json.dumps({"n": n})}
                    try:  # as docs/ha.md says: a timeout, then again with the same msg_id
                        answer = ingest.publish(record, msg_id=f"m{n}", timeout=2)
                    except DeadlineExceeded:
                        continue
                    self.acked.add(answer.sort_key)
                    now = time.monotonic()
                    self.pauses.append(now - last)
                    last, n = now, n + 1
                    time.sleep(0.01)
        except BaseException as exc:  # (reported by __exit__)
            self.error = exc


def test_a_rollout_of_both_pods_is_hand_overs_and_loses_nothing(tmp_path: Path) -> None:
    lease_ms = 10_000  # a pause shorter than this was a hand-over, not an expiry
    with shard(tmp_path, lease_ms) as (pods, service):
        assert ha(pods.ports(PODS[1]))["in_sync"]  # Ready: the lease names it in sync
        switchovers = 0
        with Publisher(service.addresses["cmd_ingest"]) as publisher:
            for _ in range(2):
                for pod in reversed(PODS):  # as a StatefulSet's rolling update does
                    was_primary = pods.primary() == pod
                    assert pods.stop(pod, signal.SIGTERM) == 0
                    pods.start(pod)
                    until(lambda pod=pod: ready(pods.ports(pod)), timeout=60)  # type: ignore[misc]
                    # Ready is "serving its role": a restarted member is the standby,
                    # in sync, before the rollout moves on to the other.
                    report = ha(pods.ports(pod))
                    assert report["role"] == "standby" and report["in_sync"], report
                    assert pods.label(pod) == "standby"
                    other = PODS[1 - PODS.index(pod)]
                    assert pods.label(other) == "primary" == ha(pods.ports(other))["role"]
                    switchovers += was_primary
                    time.sleep(0.5)
        assert switchovers >= 2
        print(f"rollout: longest pauses {sorted(publisher.pauses)[-4:]}")
        assert max(publisher.pauses) < lease_ms / 1000
        primary = pods.primary()
        assert primary is not None
        assert claimed_keys(pods.ports(primary)) >= publisher.acked


def test_a_dead_nodes_primary_is_replaced_and_its_pod_leaves_the_service(tmp_path: Path) -> None:
    lease_ms = 2000
    with shard(tmp_path, lease_ms) as (pods, service):
        with Publisher(service.addresses["cmd_ingest"]) as publisher:
            pods.stop(PODS[0], signal.SIGKILL)  # its node gone: the pod stays, labelled
            took = until(lambda: pods.label(PODS[0]) == "replaced", timeout=30)
            assert pods.label(PODS[1]) == "primary" == ha(pods.ports(PODS[1]))["role"]
            assert took >= lease_ms / 1000 * 0.8  # (the standby waited for the expiry)
            before = len(publisher.acked)
            until(lambda: len(publisher.acked) > before + 50)  # through the Service
            pods.start(PODS[0])  # the StatefulSet recreates it (the node is back)
            until(lambda: ready(pods.ports(PODS[0])), timeout=60)
            assert pods.label(PODS[0]) == "standby"
            assert ha(pods.ports(PODS[0]))["in_sync"]
        assert claimed_keys(pods.ports(PODS[1])) >= publisher.acked
