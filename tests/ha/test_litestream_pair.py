"""A pair with Litestream (docs/ha.md, "With Litestream"): each member runs `litestream
replicate` while it is primary (CMDBUS_HA_WHILE_PRIMARY), both to one replica. Only the
primary's runs, through switchovers both ways and a killed primary; the replica, restored
after both members are lost, has every record acknowledged before its last sync."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from harness.pair import LITESTREAM, litestream_config, litestream_pids

from cmdbus_trio.client.blocking import ClaimClient, IngestClient
from cmdbus_trio.storage.datadir import STORE_FILES

from ..helpers import cli, serving
from .test_pair import ha, member, until

pytestmark = pytest.mark.e2e


def running(tmp_path: Path) -> list[str]:
    """Whose `litestream replicate` runs: the members named by their configurations."""
    return sorted(litestream_pids(tmp_path).values())


def publish(ports: dict[str, str], count: int, start: int) -> set[int]:
    with IngestClient(ports["cmd_ingest"]) as ingest:
        return {ingest.publish({"execution_id": n, "payload": "{}"}).sort_key
                for n in range(start, start + count)}  # fmt: skip


def switch_over(ports: dict[str, str]) -> None:
    done = subprocess.run(cli("ha", "switchover", "--url", ports["control"]),
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_only_the_primary_runs_litestream_and_its_replica_has_what_was_acknowledged(
    tmp_path: Path,
) -> None:
    lease = tmp_path / "lease"
    settings = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        configuration = tmp_path / name / "litestream.yml"
        configuration.write_text(litestream_config(tmp_path / name / "data", tmp_path))
        settings[name] = {
            "CMDBUS_CHECKPOINTS": "litestream",
            "CMDBUS_HA_WHILE_PRIMARY": f"{LITESTREAM} replicate -config {configuration}",
        }
    acked: set[int] = set()
    with ExitStack() as stack:
        stack.callback(lambda: [os.kill(p, signal.SIGKILL) for p in litestream_pids(tmp_path)])
        a, a_ports = stack.enter_context(member(tmp_path, "a", lease, **settings["a"]))
        until(lambda: ha(a_ports)["role"] == "primary")
        b, b_ports = stack.enter_context(member(tmp_path, "b", lease, **settings["b"]))
        until(lambda: ha(a_ports)["in_sync"] and ha(b_ports)["role"] == "standby")
        until(lambda: running(tmp_path) == ["a"])
        acked |= publish(a_ports, 100, 0)
        switch_over(a_ports)
        until(lambda: ha(b_ports)["role"] == "primary")
        until(lambda: running(tmp_path) == ["b"])
        acked |= publish(b_ports, 100, 100)
        until(lambda: ha(a_ports)["in_sync"])
        switch_over(b_ports)
        until(lambda: ha(a_ports)["role"] == "primary")
        until(lambda: running(tmp_path) == ["a"])
        acked |= publish(a_ports, 100, 200)
        until(lambda: ha(b_ports)["in_sync"])
        a.send_signal(signal.SIGKILL)  # its Litestream outlives it: as a node lost whole,
        a.wait()
        [os.kill(pid, signal.SIGKILL) for pid, name in litestream_pids(tmp_path).items()
         if name == "a"]  # fmt: skip
        until(lambda: ha(b_ports)["role"] == "primary")
        until(lambda: running(tmp_path) == ["b"])
        acked |= publish(b_ports, 100, 300)
        time.sleep(3)  # Litestream syncs every second
        b.send_signal(signal.SIGKILL)  # and the other node, with both disks
        b.wait()
    assert running(tmp_path) == []
    restored = tmp_path / "restored"
    for name in STORE_FILES:
        command = [LITESTREAM, "restore", "-config", str(tmp_path / "b" / "litestream.yml"),
                   "-o", str(restored / name), str(tmp_path / "b" / "data" / name)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    after = [sys.executable, "-m", "cmdbus_trio", "restore", "--after-litestream", "--json"]
    done = subprocess.run([*after, "--data-dir", str(restored)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (tmp_path / "again").mkdir()
    with serving(tmp_path / "again", CMDBUS_DATA_DIR=str(restored)) as (_, ports):
        keys: set[int] = set()
        with ClaimClient(ports["cmd_claim"]) as claim:
            while batch := claim.next_batch("commands.>", 1000, wait=0.5):
                keys |= {delivery.sort_key for delivery in batch}
    assert keys == acked, json.dumps(sorted(acked - keys)[:10])


def test_the_last_member_stopped_leaves_its_replica_every_acknowledged_record(
    tmp_path: Path,
) -> None:
    """The shard's last member (its standby lost) stopped by SIGTERM, within Litestream's
    sync interval of its last publish: its Litestream is stopped after the drain and
    before the stores close, so its last sync read the whole WAL (the last close folds it
    into the database and deletes it). The replica restores every record acknowledged."""
    (tmp_path / "a").mkdir()
    configuration = tmp_path / "a" / "litestream.yml"
    configuration.write_text(litestream_config(tmp_path / "a" / "data", tmp_path))
    settings = {
        "CMDBUS_CHECKPOINTS": "litestream",
        "CMDBUS_HA_WHILE_PRIMARY": f"{LITESTREAM} replicate -config {configuration}",
    }
    with ExitStack() as stack:
        stack.callback(lambda: [os.kill(p, signal.SIGKILL) for p in litestream_pids(tmp_path)])
        a, a_ports = stack.enter_context(member(tmp_path, "a", tmp_path / "lease", **settings))
        until(lambda: ha(a_ports)["role"] == "primary")
        until(lambda: running(tmp_path) == ["a"])
        time.sleep(1.5)  # (its first sync: the replica exists)
        acked = publish(a_ports, 200, 0)
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=30) == 0
        assert running(tmp_path) == []
    restored = tmp_path / "restored.sqlite3"
    command = [LITESTREAM, "restore", "-config", str(configuration), "-o", str(restored),
               str(tmp_path / "a" / "data" / "commands.sqlite3")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with contextlib.closing(sqlite3.connect(restored)) as database:
        kept = {key for (key,) in database.execute("SELECT sort_key FROM records")}
    assert kept == acked, f"{len(acked - kept)} of {len(acked)} missing"


WAL_AT_SIGTERM = """
import json, os, signal, sys, time
wal, out = sys.argv[1], sys.argv[2]
def stop(*_):  # as Litestream's last sync: it reads the WAL, which must still be there
    with open(out, "w") as f:
        json.dump(os.path.getsize(wal) if os.path.exists(wal) else None, f)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(1)
"""


def test_the_command_is_stopped_before_the_stores_close_so_their_wal_is_there(
    tmp_path: Path,
) -> None:
    """What the test above needs, made certain: a command standing in for Litestream
    looks at the commands store's WAL as it is stopped. The member drains, stops it, and
    only then closes the stores, whose last close folds the WAL into the database and
    deletes it: the command saw the WAL whole (its writes, no checkpoint by the writer
    with ``CMDBUS_CHECKPOINTS=litestream``)."""
    seen = tmp_path / "wal-at-sigterm.json"
    wal = tmp_path / "a" / "data" / "commands.sqlite3-wal"
    script = tmp_path / "stand-in.py"
    script.write_text(WAL_AT_SIGTERM)
    settings = {
        "CMDBUS_CHECKPOINTS": "litestream",
        "CMDBUS_HA_WHILE_PRIMARY": f"{sys.executable} {script} {wal} {seen}",
    }
    with member(tmp_path, "a", tmp_path / "lease", **settings) as (a, a_ports):
        until(lambda: ha(a_ports)["role"] == "primary")
        publish(a_ports, 50, 0)
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=30) == 0
    assert not wal.exists()  # (the last close deleted it)
    wal_bytes = json.loads(seen.read_text())
    assert wal_bytes is not None and wal_bytes > 4096, wal_bytes  # (frames, not a header)
