"""benchmarks/bus.py runs and measures: a short steady end-to-end run against the writer
and the floor prints, for each, the records delivered, their latency, the server's CPU
and the load generators' CPU, and the writer's /healthz latency beside it. (The figures
themselves are for docs/benchmarks.md, never asserted here.)"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmdbus_trio.protocol import FrameDecoder, encode_frame

pytestmark = pytest.mark.slow

BUS = Path(__file__).resolve().parents[2] / "benchmarks" / "bus.py"
FLOOR = BUS.parent / "floor_server.py"


def test_the_steady_workload_reports_rates_latency_and_cpu(tmp_path: Path) -> None:
    command = [sys.executable, str(BUS), "--floor", "--rate", "100", "--duration", "1"]
    done = subprocess.run(
        [*command, "--only", "steady"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("steady 100/s e2e") and not line.endswith("x")  # not a ratio
    ]
    rows = {line.split()[3]: line.split() for line in lines if " batch " not in line}
    assert set(rows) == {"cmdbus-trio", "floor", "floor+disk", "floor+strict"}
    # The consumers in batches (issue 41), on the floors too (they take `max` since 12-05).
    batched = {line.split()[5]: line.split()[5:] for line in lines if " batch 16 " in line}
    assert set(batched) == set(rows)
    for name, row in batched.items():
        assert float(row[1]) > 50, f"{name} delivered {row[1]}/s of 100/s in batches"
    for name, row in rows.items():
        delivered, latency, cores, us_per_op, generator_cores = row[4:9]
        assert float(delivered) > 50, f"{name} delivered {delivered}/s of 100/s"
        p50, p99 = map(float, latency.split("/"))
        assert 0 < p50 <= p99
        assert float(cores) > 0 and float(us_per_op) > 0 and float(generator_cores) > 0
    healthz = rows["cmdbus-trio"][9]
    assert all(float(ms) > 0 for ms in healthz.split("/"))
    # No control face, so no probe: one field fewer.
    assert {len(rows[name]) for name in ("floor", "floor+disk", "floor+strict")} == {9}
    # The latency above is to the delivery; to the ack's confirmation is said apart, and
    # comes later (a commit later) for each record.
    (acked_line,) = (line for line in done.stdout.splitlines() if "ack's confirmation" in line)
    acked = {
        part.split()[-2]: part.split()[-1]
        for part in acked_line.split(": ", 1)[1].split("; ")
        if " batch " not in part
    }
    assert set(acked) == set(rows)
    for name, latency in acked.items():
        acked_p50 = float(latency.split("/")[0])
        assert acked_p50 >= float(rows[name][5].split("/")[0]), (name, acked_line)


def test_rounds_report_medians_and_each_rounds_ratio(tmp_path: Path) -> None:
    """--rounds N runs everything N times (the servers' order reversed each round) and
    reports the median of each figure, and of the rounds' ratios beside each of them."""
    command = [sys.executable, str(BUS), "--floor", "--duration", "1", "--rounds", "2"]
    done = subprocess.run(
        [*command, "--only", "publish x16 batched"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "medians of 2 rounds" in done.stdout
    (ratio,) = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("publish x16 batched") and "(" in line
    ]
    cells = re.findall(r"([\d.]+)x \(([\d. ]+)\)", ratio)
    assert len(cells) == 3, ratio  # ours / each floor
    for median, rounds in cells:
        each = [float(x) for x in rounds.split()]
        assert len(each) == 2 and all(x > 0 for x in each)
        assert float(median) == pytest.approx(sum(each) / 2, abs=0.011)


class FloorConnection:
    """One blocking connection to a floor server, a request at a time."""

    def __init__(self, ports: Path) -> None:
        host, port = json.loads(ports.read_text())["cmd_ingest"].split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.decoder = FrameDecoder(1 << 20)
        assert self.ask({"protocol": 2, "hello": True})["ok"]

    def send(self, request: dict[str, object]) -> None:
        self.sock.sendall(encode_frame(json.dumps(request).encode()))

    def receive(self) -> dict[str, object]:
        while not isinstance(frame := self.decoder.next_frame(), bytes):
            self.decoder.receive_data(self.sock.recv(65536))
        reply: dict[str, object] = json.loads(frame)
        return reply

    def ask(self, request: dict[str, object]) -> dict[str, object]:
        self.send(request)
        return self.receive()


@contextlib.contextmanager
def floor_server(tmp_path: Path, *options: str) -> Iterator[tuple[Path, Path]]:
    """A durable floor_server.py (with ``options``): its ports file and database."""
    ports, database = tmp_path / "ports.json", tmp_path / "floor.sqlite3"
    command = [sys.executable, str(FLOOR), str(ports), "--durable", str(database), *options]
    server = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 30
        while not ports.exists():
            assert server.poll() is None and time.monotonic() < deadline, "no floor"
            time.sleep(0.05)
        yield ports, database
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("options", [(), ("--strict",)])
def test_the_durable_floor_replies_only_after_its_commit(
    tmp_path: Path, options: tuple[str, ...]
) -> None:
    """floor_server.py --durable: a publish's or an ack's reply means it is in the
    database (read here by another connection, as after a crash), batches included."""
    with floor_server(tmp_path, *options) as (ports, database):
        connection = FloorConnection(ports)
        with connection.sock:
            ask = connection.ask
            published = ask({"id": 1, "op": "publish", "record": {"n": 1}})
            stored = sqlite3.connect(database).execute("SELECT * FROM records").fetchall()
            assert stored == [(published["sort_key"], '{"n": 1}')]
            batch = ask({"id": 2, "op": "publish_batch", "records": [{"n": 2}, {"n": 3}]})
            assert len(sqlite3.connect(database).execute("SELECT * FROM records").fetchall()) == 3
            delivered = ask({"id": 3, "op": "next", "filter": "commands.>"})["delivery"]
            assert isinstance(delivered, dict) and delivered["sort_key"] == published["sort_key"]
            assert ask({"id": 4, "op": "ack", "sort_key": delivered["sort_key"]})["acked"]
            acks = sqlite3.connect(database).execute("SELECT * FROM acks").fetchall()
            assert acks == [(delivered["sort_key"],)] and batch["sort_keys"] == [2, 3]
            many = ask({"id": 5, "op": "next", "filter": "commands.>", "max": 5})["deliveries"]
            assert isinstance(many, list) and [d["sort_key"] for d in many] == [2, 3]
            assert ask({"id": 6, "op": "ack", "sort_keys": [2, 3]})["acked"]
            acks = sqlite3.connect(database).execute("SELECT * FROM acks").fetchall()
            assert sorted(acks) == [(1,), (2,), (3,)]


@pytest.mark.parametrize(
    ("options", "delivered_before_commit"), [((), True), (("--strict",), False)]
)
def test_the_strict_floor_delivers_a_record_only_once_it_is_on_disk(
    tmp_path: Path, options: tuple[str, ...], delivered_before_commit: bool
) -> None:
    """floor_server.py --durable --strict hands a record to a waiting `next` only after
    its commit, as the writer does; without --strict the floor hands it over at once.
    The test holds the database's write lock (well under the floor's 5 s busy timeout),
    so that no commit can end while it looks."""
    with floor_server(tmp_path, *options) as (ports, database):
        producer, consumer = FloorConnection(ports), FloorConnection(ports)
        with producer.sock, consumer.sock:
            consumer.send({"id": 1, "op": "next", "filter": "commands.>", "timeout_ms": 20_000})
            time.sleep(0.2)  # the next waits in the floor
            lock = sqlite3.connect(database, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            try:
                producer.send({"id": 1, "op": "publish", "record": {"n": 1}})
                consumer.sock.settimeout(1.0)
                try:
                    early: dict[str, object] | None = consumer.receive()
                except TimeoutError:
                    early = None
            finally:
                lock.execute("ROLLBACK")
            assert (early is not None) is delivered_before_commit, early
            consumer.sock.settimeout(10)
            delivery = (early or consumer.receive())["delivery"]
            published = producer.receive()
            assert isinstance(delivery, dict)
            assert delivery["sort_key"] == published["sort_key"] == 1
            stored = sqlite3.connect(database).execute("SELECT sort_key FROM records")
            assert stored.fetchall() == [(1,)]


def test_rounds_below_one_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BUS), "--rounds", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "--rounds must be at least 1, not 0" in done.stderr


def test_an_odd_number_of_rounds_against_a_baseline_is_pointed_out(tmp_path: Path) -> None:
    """The order of the servers is reversed each round: with an odd --rounds the tree
    runs first once more than its baseline, which costs it (docs/benchmarks.md)."""
    for rounds, said in (("3", True), ("2", False)):
        done = subprocess.run(
            [sys.executable, str(BUS), "--baseline", "HEAD", "--rounds", rounds, "--memory", "100"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        assert ("--rounds 3 is odd" in done.stderr) is said, done.stderr
