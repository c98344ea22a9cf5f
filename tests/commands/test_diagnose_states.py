"""`cmdbus-trio diagnose` proved in eleven states: each injected into a real writer in a
subprocess as the fault itself would strike (a hook where nothing else can make it: a
blocked loop, a failing or slow disk, a crashed face; real clients for floods and
backlogs). Its verdict, in JSON and with ``--human`` (both run over the same window),
must name exactly that state and the face, store, port or pool it concerns, and nothing
else."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import attrs
import pytest

from cmdbus_trio.client import Busy, ClientError, Unavailable, blocking
from cmdbus_trio.commands.diagnose import EXIT_CODES

from ..helpers import background, cli, serving

pytestmark = pytest.mark.e2e

Ports = dict[str, str]


@attrs.frozen
class Look:
    code: int
    findings: list[dict[str, Any]]
    human: str


def look(ports: Ports, *args: str) -> Look:
    """Both outputs of one state, side by side over the same window."""
    command = cli("diagnose", f"http://{ports['control']}", "--interval", "2", *args)
    runs = [
        subprocess.Popen(command + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for extra in ([], ["--human"])
    ]
    (out, err), (human, human_err) = (run.communicate(timeout=60) for run in runs)
    assert err == human_err == "", (err, human_err)
    codes = {run.returncode for run in runs}
    assert len(codes) == 1, codes
    return Look(codes.pop(), [json.loads(line) for line in out.splitlines()], human)


def post(ports: Ports, path: str) -> None:
    request = urllib.request.Request(f"http://{ports['control']}{path}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 202


def publishing(ports: Ports, pool: str, pause: float) -> Callable[[threading.Event], None]:
    def publish(stop: threading.Event) -> None:
        with blocking.IngestClient.connect(ports["cmd_ingest"]) as ingest:
            n = 0
            while not stop.is_set():
                n += 1
                record = {"execution_id": n, "payload": json.dumps({"execution_pool": pool})}
                try:
                    ingest.publish(record, timeout=10)
                except ClientError:
                    return
                time.sleep(pause)

    return publish


# --- the eleven states: each sets its writer up, injects its fault, and looks -----------


def healthy(tmp_path: Path) -> Look:
    with serving(tmp_path) as (_, ports):
        return look(ports)


def stalled(tmp_path: Path) -> Look:
    env = {"CMDBUS_DEBUG_HOOKS": "true", "CMDBUS_LIVENESS_THRESHOLD_MS": "500"}
    with serving(tmp_path, **env) as (_, ports):
        post(ports, "/debug/block-loop?seconds=4")
        return look(ports, "--timeout", "1")


def poisoned(tmp_path: Path) -> Look:
    with serving(tmp_path, CMDBUS_DEBUG_HOOKS="true") as (_, ports):
        post(ports, "/debug/fail-writes?store=tier&error=eio")
        with blocking.TierClient.connect(ports["tier"]) as tier, suppress(Unavailable):
            tier.append("x", "{}", timeout=10)
        return look(ports)


def face_crashed(tmp_path: Path) -> Look:
    with serving(tmp_path, CMDBUS_DEBUG_HOOKS="true") as (_, ports):
        post(ports, "/debug/crash-face?face=evt_subscribe")
        time.sleep(0.5)
        return look(ports)


def face_stuck(tmp_path: Path) -> Look:
    """The face's byte budget held by work that does not finish: publishers queue for it
    and nothing is answered, while the loop and the probes are fine."""
    with serving(tmp_path, CMDBUS_DEBUG_HOOKS="true") as (_, ports):
        post(ports, "/debug/hold-bytes?face=cmd_ingest&seconds=5")
        with background(publishing(ports, "system", 0.01), threads=2):
            time.sleep(0.5)
            return look(ports)


def disk_slow(tmp_path: Path) -> Look:
    with serving(tmp_path, CMDBUS_DEBUG_HOOKS="true") as (_, ports):
        post(ports, "/debug/slow-commits?store=tier&seconds=0.4")

        def append(stop: threading.Event) -> None:  # a history: no backlog to grow
            with blocking.TierClient.connect(ports["tier"]) as tier:
                while not stop.is_set():
                    tier.append("slow", "{}", timeout=10)

        with background(append, threads=2):
            time.sleep(0.5)
            return look(ports)


def saturated(tmp_path: Path) -> Look:
    gate = {
        "CMDBUS_TIER_MAX_INFLIGHT": "1",
        "CMDBUS_TIER_MAX_PENDING_WRITES": "1",
        "CMDBUS_TIER_MAX_WAITERS": "0",
    }
    with serving(tmp_path, **gate) as (_, ports):
        # New connections: one just told `busy` has its next request wait for room (it
        # is held back in its socket), so persistent clients were shed too rarely.
        def flood(stop: threading.Event) -> None:
            while not stop.is_set():
                with blocking.TierClient.connect(ports["tier"]) as tier, suppress(Busy):
                    tier.append("flood", "{}")

        with background(flood, threads=6):
            return look(ports)


def control_face_flooded(tmp_path: Path) -> Look:
    """A client that opens control connections and never closes them: past the port's
    cap (64), each new one closes the quietest. The buses are untouched. (25 a second:
    diagnose's own connection must be read before 64 newer ones pass it, and the flood's
    accepts take the control face's share of the loop; at 50 a second a loaded 2-CPU
    machine did not read it in time, and diagnose saw its answer cut off.)"""
    with serving(tmp_path) as (_, ports):
        host, port = ports["control"].rsplit(":", 1)

        def hold(stop: threading.Event) -> None:
            with ExitStack() as held:
                while not stop.is_set():
                    held.enter_context(socket.create_connection((host, int(port)), timeout=5))
                    time.sleep(0.04)

        with background(hold):
            time.sleep(3.0)  # past the cap (75 connections) before the look
            return look(ports)


def backlog_growing(tmp_path: Path) -> Look:
    with serving(tmp_path) as (_, ports), background(publishing(ports, "system", 0.01)):
        time.sleep(1.2)  # the lag sampler has published a first value
        return look(ports)


def backlog_stuck(tmp_path: Path) -> Look:
    with serving(tmp_path) as (_, ports):
        records = [
            {"execution_id": n, "payload": json.dumps({"execution_pool": "reports"})}
            for n in range(800)
        ]
        with blocking.IngestClient.connect(ports["cmd_ingest"]) as ingest:
            ingest.publish_batch(records)
        time.sleep(1.2)
        return look(ports)


def no_checkpointer(tmp_path: Path) -> Look:
    """Litestream's checkpoints asked for and no Litestream: a tier history written
    (no backlog) takes its WAL past a 1 MiB ceiling, again and again, and the writer
    checkpoints it itself."""
    env = {
        "CMDBUS_CHECKPOINTS": "litestream",
        "CMDBUS_WAL_CEILING_BYTES": str(1 << 20),
        "CMDBUS_RETENTION_INTERVAL_MS": "200",
    }
    with serving(tmp_path, **env) as (_, ports):

        def append(stop: threading.Event) -> None:
            payload = json.dumps({"padding": "x" * 1000})
            with blocking.TierClient.connect(ports["tier"]) as tier:
                while not stop.is_set():
                    tier.append_batch("history", [payload] * 50, timeout=10)

        with background(append):
            return look(ports)


STATES: list[tuple[Callable[[Path], Look], str, str]] = [
    (healthy, "healthy", "no shedding, no stall"),
    (stalled, "stalled", "did not answer"),
    (poisoned, "poisoned", "store tier"),
    (face_crashed, "face crashed", "face evt_subscribe crashed"),
    (face_stuck, "face stuck", "face cmd_ingest"),
    (disk_slow, "disk slow", "store tier"),
    (saturated, "saturated", "face tier"),
    (control_face_flooded, "control face flooded", "connection cap on port control"),
    (backlog_growing, "backlog growing", "subject commands.system.shard.0 (pool system)"),
    (backlog_stuck, "backlog stuck", "subject commands.reports.shard.0 (pool reports)"),
    (no_checkpointer, "no checkpointer", "store tier"),
]


@pytest.mark.parametrize(
    ("inject", "verdict", "concerning"), STATES, ids=[verdict for _, verdict, _ in STATES]
)
def test_diagnose_names_exactly_the_state_injected(
    tmp_path: Path, inject: Callable[[Path], Look], verdict: str, concerning: str
) -> None:
    """(A state may be found twice, for two reasons: a face's Gate shedding and the loop
    itself busy are both `saturated`. Nothing else may be found.)"""
    seen = inject(tmp_path)
    assert {f["verdict"] for f in seen.findings} == {verdict}, seen.findings
    assert concerning in seen.findings[0]["summary"], seen.findings
    assert seen.code == EXIT_CODES[verdict]
    said = [line for line in seen.human.splitlines() if not line.startswith(" ")]
    assert said[0].startswith(f"{verdict.upper()}: ") and concerning in said[0], seen.human
    assert all(line.startswith(f"also {verdict.upper()}: ") for line in said[1:]), seen.human
