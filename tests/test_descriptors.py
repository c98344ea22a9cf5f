"""Open files: a writer started with a container's soft limit of 1,024 raises it, keeps
its connection caps within what it has, and a flood of connections never takes the
probes, the stores or the other faces down."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.client import blocking
from cmdbus_trio.config import ConfigError, descriptors, load
from cmdbus_trio.logs import OncePerBurst
from cmdbus_trio.storage import StoreState, StoreUnavailable
from cmdbus_trio.storage.tier import PAGE_ROWS, NewRecord, TierStore

from .helpers import cli, environment, metric_sum, metrics_text

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def test_the_reserve_counts_each_user_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(descriptors, "cpu_quota", lambda: 2)
    config = load({"tier_max_inflight": "2"}, environ={})
    assert descriptors.store_pool_size(config, "tier") == 2 + 3
    assert descriptors.store_pool_size(config, "events") == 2 * 2 + 4
    # Each pool: a database and a WAL file per connection, one shared-memory file.
    stores = (2 * 5 + 1) + 2 * (2 * 8 + 1)
    control = descriptors.CONTROL_CONNECTIONS + 1  # its connections and its listener
    assert descriptors.reserved(config) == stores + control + descriptors.SPARE == 174
    lag_ports = load({"tier_max_inflight": "2", "cmd_lag_bind": "127.0.0.1:0"}, environ={})
    assert descriptors.reserved(lag_ports) == 174 + descriptors.LAG_PORT_CONNECTIONS + 1
    tier_only = load(
        {"tier_max_inflight": "2", "cmd_ingest_bind": "", "cmd_claim_bind": ""}, environ={}
    )
    assert descriptors.reserved(tier_only) == 174 - (2 * 8 + 1)


def test_the_caps_are_lowered_to_fit_the_limit(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(descriptors, "cpu_quota", lambda: 2)
    config = load({"tier_max_inflight": "2"}, environ={})  # six data faces, 1,024 each
    assert descriptors.fit(config, limit=100_000) is config
    fitted = descriptors.fit(config, limit=1024)
    assert fitted.max_connections == (1024 - 174) // 6 == 141
    assert "connection_caps_lowered" in caplog.text
    others = ("cmd_ingest", "cmd_claim", "evt_ingest", "evt_claim", "evt_subscribe")
    one_face = load({"tier_max_inflight": "2", **{f"{f}_bind": "" for f in others}}, environ={})
    assert descriptors.fit(one_face, limit=1024).max_connections == 1024 - (11 + 65 + 64)


def test_too_few_descriptors_is_a_clear_refusal() -> None:
    with pytest.raises(ConfigError, match=r"CMDBUS_MAX_CONNECTIONS.*open-files limit is 250"):
        descriptors.fit(load({}, environ={}), limit=250)


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
@pytest.mark.once
def test_the_soft_limit_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    with limited_writer(tmp_path, f"1024:{HARD}") as process:
        wait_for_ports(tmp_path, process)
        limits = Path(f"/proc/{process.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        assert line.split()[3:5] == [str(HARD), str(HARD)]
    raised = [x for x in log_lines(tmp_path) if x["event"] == "open_files_limit_raised"]
    assert raised and raised[0]["soft_before"] == 1024 and raised[0]["soft"] == HARD


@pytest.mark.once
def test_a_connection_flood_under_1024_files_never_takes_the_probes_down(tmp_path: Path) -> None:
    """Hard limit 1,024: the caps are lowered to fit (about 140 a face), so 1,200 idle
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
            cap = next(
                x["max_connections"]
                for x in log_lines(tmp_path)
                if x["event"] == "connection_caps_lowered"
            )
            assert 128 <= cap < 1024 // 6 and refused >= 1200 - cap
        finally:
            for sock in flood:
                sock.close()
    lines = log_lines(tmp_path)
    assert not [x for x in lines if x["level"] == "error"], [x["event"] for x in lines][-5:]
    assert not [x for x in lines if "EMFILE" in json.dumps(x)]


FLOOD = 1500


@contextmanager
def enough_descriptors_here(wanted: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the test process may open {hard} files, {wanted} wanted")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.once
def test_a_flood_of_control_connections_takes_no_descriptor_from_anyone(
    tmp_path: Path,
) -> None:
    """Hard limit 1,024: 1,500 connections to the control port and 500 to a lag port,
    held open. Each port keeps at most its cap (the quietest connections make room), so
    the data faces still accept, the stores still write, and the probes answer. Before,
    hypercorn took every connection until the process had no descriptor left."""
    with (
        enough_descriptors_here(2 * FLOOD + 256),
        limited_writer(tmp_path, "1024:1024", CMDBUS_CMD_LAG_BIND="127.0.0.1:0") as process,
    ):
        ports = wait_for_ports(tmp_path, process)
        flood: list[socket.socket] = []
        try:
            for address, count in ((ports["control"], FLOOD), (ports["cmd_lag"], FLOOD // 3)):
                host, port = address.rsplit(":", 1)
                for _ in range(count):
                    flood.append(socket.create_connection((host, int(port)), timeout=5))
            time.sleep(0.5)  # every one accepted (and the quietest closed)
            with urllib.request.urlopen(f"http://{ports['control']}/readyz", timeout=5) as reply:
                assert reply.status == 200
            with blocking.IngestClient.connect(ports["cmd_ingest"], connect_timeout=5) as ingest:
                assert ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key == 1
            with blocking.TierClient.connect(ports["tier"], connect_timeout=5) as tier:
                assert tier.append("e", "{}").global_sequence == 1
            open_files = len(os.listdir(f"/proc/{process.pid}/fd"))
            text = metrics_text(ports)
            crowded = "cmdbus_control_connections_crowded_out_total"
            assert metric_sum(text, f'{crowded}{{port="control"}}') >= FLOOD - 64
            assert metric_sum(text, f'{crowded}{{port="cmd_lag"}}') >= FLOOD // 3 - 16
        finally:
            for sock in flood:
                sock.close()
    assert open_files < 1024 - 128  # the data faces' share is still there
    lines = log_lines(tmp_path)
    assert not [x for x in lines if x["level"] == "error"], [x["event"] for x in lines][-5:]
    assert not [x for x in lines if "EMFILE" in json.dumps(x)]


def test_too_small_a_limit_refuses_to_start(tmp_path: Path) -> None:
    with limited_writer(tmp_path, "250:250") as process:
        assert process.wait(timeout=30) == 2
    assert "open-files limit is 250" in (tmp_path / "server.log").read_text()


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextmanager
def no_descriptor_left() -> Iterator[None]:
    """Every descriptor this process may open taken (the soft limit lowered to near what
    is open, then filled), as a flood of connections would take them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_descriptors() + 16, hard))
    try:
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_store_takes_every_descriptor_it_needs_when_it_opens(tmp_path: Path) -> None:
    """With no descriptor left, a store opened before serves as many calls at once as
    its pool, sorts past its cache (a temp file, unless in memory), pages a read left
    half-done beside appends, and is not poisoned. The pool used to grow on demand:
    the first call beyond its connections failed, and a failed journal poisoned it."""
    before = open_descriptors()
    store = TierStore.open(tmp_path / "tier.sqlite3", pool_size=4)
    try:
        assert store.connections == 4
        assert open_descriptors() - before == 2 * 4 + 1
        big = NewRecord(payload=json.dumps("x" * 4000), transaction_id="", event_id=None)
        store.append_batch("eventlog", "e", [big] * (2 * PAGE_ROWS))
        with no_descriptor_left():
            half_read = store.iter_execution("eventlog", "e")
            assert len(next(half_read)) == PAGE_ROWS  # and left there, as a slow client would

            def work(n: int) -> int:
                if n % 2:
                    store.append_batch("eventlog", f"e{n}", [big] * 50)
                with store._connection() as connection:  # a sort of ~8 MB: past the cache
                    rows = connection.execute(
                        "SELECT payload FROM eventlog_records ORDER BY random()"
                    ).fetchall()
                return len(rows)

            with ThreadPoolExecutor(8) as pool:
                # Every connection held here until a call has waited for one, so the
                # calls below contend for the pool whatever the machine's speed.
                with ExitStack() as held:
                    for _ in range(4):
                        held.enter_context(store._connection())
                    results = pool.map(work, range(16))
                    deadline = time.monotonic() + 10
                    while store.connection_waits == 0 and time.monotonic() < deadline:
                        time.sleep(0.001)
                assert min(results) >= 2 * PAGE_ROWS
            assert len(next(half_read)) == PAGE_ROWS
        assert store.poisoned_reason is None
        assert store.state is not StoreState.POISONED
        assert store.connections == 4
        assert store.connection_waits > 0  # 8 threads, 4 connections: some waited
    finally:
        store.close()


def test_a_call_waits_for_a_connection_and_a_close_ends_the_wait(tmp_path: Path) -> None:
    store = TierStore.open(tmp_path / "tier.sqlite3", pool_size=1)
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(store.execution_count("eventlog", "e"))
        except StoreUnavailable as exc:
            outcome.append(exc)

    with store._connection():
        waiter = threading.Thread(target=read)
        waiter.start()
        deadline = time.monotonic() + 10
        while store.connection_waits == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert outcome == []  # the pool's one connection is out: it waits
    waiter.join(timeout=10)
    assert outcome == [None]
    with store._connection():
        waiter = threading.Thread(target=read)
        waiter.start()
        while store.connection_waits < 2:
            time.sleep(0.01)
        store.close()  # a close wakes the waiters: the store is gone
        waiter.join(timeout=10)
    assert isinstance(outcome[-1], StoreUnavailable)
    with pytest.raises(ValueError, match="pool_size must be at least 1, got 0"):
        TierStore(tmp_path / "other.sqlite3", pool_size=0)
