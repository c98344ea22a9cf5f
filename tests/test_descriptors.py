"""Open files: a writer started with a container's soft limit of 1,024 raises it, keeps
its connection caps within what it has, and a flood of connections never takes the
probes, the stores or the other faces down."""

from __future__ import annotations

import json
import logging
import resource
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio import descriptors
from cmdbus_trio.client import blocking
from cmdbus_trio.config import ConfigError, load
from cmdbus_trio.logs import OncePerBurst

from .helpers import cli, environment, metric_sum, metrics_text

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def test_the_caps_are_lowered_to_fit_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    config = load({}, environ={})  # six data faces, 1,024 connections each
    assert descriptors.fit(config, limit=100_000) is config
    fitted = descriptors.fit(config, limit=1024)
    assert fitted.max_connections == (1024 - descriptors.RESERVED) // 6 == 128
    assert "connection_caps_lowered" in caplog.text
    others = ("cmd_ingest", "cmd_claim", "evt_ingest", "evt_claim", "evt_subscribe")
    one_face = load({f"{face}_bind": "" for face in others}, environ={})
    assert descriptors.fit(one_face, limit=1024).max_connections == 768


def test_too_few_descriptors_is_a_clear_refusal() -> None:
    with pytest.raises(ConfigError, match=r"CMDBUS_MAX_CONNECTIONS.*open-files limit is 300"):
        descriptors.fit(load({}, environ={}), limit=300)


def test_a_burst_of_failed_accepts_is_logged_once() -> None:
    now = [0.0]
    once = OncePerBurst(period=10, clock=lambda: now[0])
    records = [
        logging.LogRecord("trio", logging.ERROR, "", 0, "accept", None, None) for _ in range(4)
    ]
    assert [once.filter(r) for r in records[:3]] == [True, False, False]
    now[0] = 11
    assert once.filter(records[3]) and "2 more like it" in str(records[3].msg)


@contextmanager
def limited_writer(tmp_path: Path, nofile: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    """`cmdbus-trio serve` under `prlimit --nofile=<nofile>`, every face on port 0."""
    (tmp_path / "ports.json").unlink(missing_ok=True)
    with (tmp_path / "server.log").open("w") as log:
        process = subprocess.Popen(
            ["prlimit", f"--nofile={nofile}", *cli("serve")],
            env=environment(tmp_path, **env),
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_for_ports(tmp_path: Path, process: subprocess.Popen[str]) -> dict[str, str]:
    deadline = time.monotonic() + 30
    while not (tmp_path / "ports.json").exists():
        assert process.poll() is None, (tmp_path / "server.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ports: dict[str, str] = json.loads((tmp_path / "ports.json").read_text())
    return ports


def log_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines()]


@pytest.mark.skipif(HARD <= 1024, reason="the hard limit leaves nothing to raise")
def test_the_soft_limit_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    with limited_writer(tmp_path, f"1024:{HARD}") as process:
        wait_for_ports(tmp_path, process)
        limits = Path(f"/proc/{process.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        assert line.split()[3:5] == [str(HARD), str(HARD)]
    raised = [x for x in log_lines(tmp_path) if x["event"] == "open_files_limit_raised"]
    assert raised and raised[0]["soft_before"] == 1024 and raised[0]["soft"] == HARD


def test_a_connection_flood_under_1024_files_never_takes_the_probes_down(tmp_path: Path) -> None:
    """Hard limit 1,024: the caps are lowered to fit (128 a face), so 1,200 idle
    connections to the tier face are mostly refused at once (over_capacity); probes,
    scrapes, the stores and the other faces go on, and no accept ever fails."""
    with limited_writer(tmp_path, "1024:1024") as process:
        ports = wait_for_ports(tmp_path, process)
        host, port = ports["tier"].rsplit(":", 1)
        flood = []
        try:
            for _ in range(1200):
                flood.append(socket.create_connection((host, int(port)), timeout=5))
                if len(flood) % 200 == 0:
                    with urllib.request.urlopen(
                        f"http://{ports['control']}/healthz", timeout=5
                    ) as reply:
                        assert reply.status == 200
            time.sleep(0.5)
            with blocking.IngestClient.connect(ports["cmd_ingest"], connect_timeout=5) as ingest:
                assert ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key == 1
            with blocking.IngestClient.connect(ports["evt_ingest"], connect_timeout=5) as events:
                assert events.publish({"execution_id": 1, "payload": "{}"}).sort_key == 1
            text = metrics_text(ports)
            refused = metric_sum(text, 'cmdbus_connections_total{face="tier",outcome="over_cap')
            assert refused >= 1200 - 128
        finally:
            for sock in flood:
                sock.close()
    lines = log_lines(tmp_path)
    lowered = [x for x in lines if x["event"] == "connection_caps_lowered"]
    assert lowered and lowered[0]["max_connections"] == 128
    assert not [x for x in lines if x["level"] == "error"], [x["event"] for x in lines][-5:]
    assert not [x for x in lines if "EMFILE" in json.dumps(x)]


def test_too_small_a_limit_refuses_to_start(tmp_path: Path) -> None:
    with limited_writer(tmp_path, "300:300") as process:
        assert process.wait(timeout=30) == 2
    assert "open-files limit is 300" in (tmp_path / "server.log").read_text()
