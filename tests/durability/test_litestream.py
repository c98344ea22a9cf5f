"""The writer under Litestream (the real binary, the `litestream` extra) replicating every
store to a file target and to S3 (moto's server on loopback), with
CMDBUS_CHECKPOINTS=litestream: publishes, acks and appends,
then the writer and Litestream killed, the data directory deleted, each store restored
from its replica, and a writer started on what came back: everything acknowledged
before the last replicated transaction is there, keys move on past any the lost writer
could have given (`cmdbus-trio restore --after-litestream`), and the writer serves."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import trio
from harness.deployment import free_ports

from cmdbus_trio.client import blocking
from cmdbus_trio.ha import while_primary
from cmdbus_trio.storage.datadir import STORE_FILES
from cmdbus_trio.storage.restores import REPLICA_KEY_JUMP
from cmdbus_trio.storage.tier import NewRecord, TierStore

from ..helpers import serving

pytestmark = pytest.mark.slow
LITESTREAM = shutil.which("litestream") or str(Path(sys.executable).parent / "litestream")


@contextlib.contextmanager
def s3_on_loopback() -> Iterator[str]:
    """moto's S3 server on a free loopback port, with a bucket; its endpoint."""
    import boto3

    [port] = free_ports(1)
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
                client.create_bucket(Bucket="cmdbus")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield endpoint
    finally:
        server.kill()
        server.wait()


def config(data: Path, replica: Path, endpoint: str | None) -> str:
    def target(name: str) -> str:
        store = name.removesuffix(".sqlite3")
        if endpoint is None:
            return f"      type: file\n      path: {replica / store}\n"
        query = f"endpoint={endpoint}&region=us-east-1&force-path-style=true"
        return f"      url: s3://cmdbus/{store}?{query}\n"

    return "dbs:\n" + "".join(
        f"  - path: {data / name}\n    replica:\n{target(name)}" for name in STORE_FILES
    )


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str | None]:
    """Where Litestream replicates: a directory, or S3 (moto's server on loopback)."""
    if request.param == "file":
        yield None
        return
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
        monkeypatch.setenv(name, value)
        monkeypatch.setenv(name.replace("AWS_", "LITESTREAM_"), value)
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)  # a machine's: the SDK refuses it here
    with s3_on_loopback() as endpoint:
        yield endpoint


def test_a_writer_restored_from_its_litestream_replica_has_what_it_acknowledged(
    tmp_path: Path, target: str | None
) -> None:
    data, replica = tmp_path / "data", tmp_path / "replica"
    settings = {"CMDBUS_DATA_DIR": str(data), "CMDBUS_CHECKPOINTS": "litestream"}
    (tmp_path / "litestream.yml").write_text(config(data, replica, target))
    command = [LITESTREAM, "replicate", "-config", str(tmp_path / "litestream.yml")]
    with serving(tmp_path, **settings) as (writer, ports):
        litestream = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            with blocking.IngestClient(ports["cmd_ingest"]) as ingest:
                keys = [ingest.publish({"execution_id": n, "payload": "{}"}).sort_key
                        for n in range(200)]  # fmt: skip
            with blocking.ClaimClient(ports["cmd_claim"]) as claim:
                taken = claim.next_batch("commands.>", 50, wait=5)
                assert all(claim.ack_many([d.sort_key for d in taken]))
            with blocking.TierClient(ports["tier"]) as tier:
                for n in range(10):
                    tier.append("exec-1", f'{{"event_id": "e{n}"}}')
            time.sleep(3)  # Litestream syncs every second
        finally:
            litestream.send_signal(signal.SIGKILL)
            litestream.wait()
        writer.send_signal(signal.SIGKILL)  # the node is gone, and its disk with it
        writer.wait()
    shutil.rmtree(data)
    for name in STORE_FILES:
        restore = [LITESTREAM, "restore", "-config", str(tmp_path / "litestream.yml")]
        done = subprocess.run([*restore, str(data / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    # The replica is behind the lost writer: keys move on past any it could have given.
    after = [sys.executable, "-m", "cmdbus_trio", "restore", "--after-litestream", "--json"]
    done = subprocess.run([*after, "--data-dir", str(data)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f'"key_jump":{REPLICA_KEY_JUMP}' in done.stdout
    (tmp_path / "again").mkdir()
    with serving(tmp_path / "again", **settings) as (_, ports):
        with blocking.ClaimClient(ports["cmd_claim"]) as claim:
            assert claim.lag().total == len(keys) - len(taken)
        with blocking.TierClient(ports["tier"]) as tier:
            assert tier.read_execution("exec-1").record_count == 10
        with blocking.IngestClient(ports["cmd_ingest"]) as ingest:
            fresh = ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key
            assert fresh >= keys[-1] + REPLICA_KEY_JUMP


def ltx_positions(replica: Path) -> list[tuple[int, int]]:
    """The WAL position (salt1, end offset) each L0 LTX file of ``replica`` copied to."""
    positions = []
    for path in sorted((replica / "ltx" / "0").glob("*.ltx")):
        header = path.read_bytes()[:72]
        offset, size, salt1 = struct.unpack(">qqI", header[48:68])
        positions.append((salt1, offset + size))
    return positions


def wal_end(path: Path) -> tuple[int, int]:
    """A WAL's salt1 and where its last commit ends (a restarted WAL keeps the file's
    size: the frames past that are an earlier generation's)."""
    wal = path.with_name(path.name + "-wal").read_bytes()
    page_size, salt1, salt2 = struct.unpack(">I4xII", wal[8:24])
    end, at = 32, 32
    while at + 24 + page_size <= len(wal):
        committed, frame_salts = struct.unpack(">4xI8s", wal[at : at + 16])
        if frame_salts != struct.pack(">II", salt1, salt2):
            break
        at += 24 + page_size
        end = at if committed else end
    return salt1, end


@pytest.mark.parametrize("truncated", [True, False])
def test_litestream_started_again_after_a_kill_copies_what_it_never_read(
    tmp_path: Path, truncated: bool
) -> None:
    """A member killed with its Litestream, whose WAL is then checkpointed by something
    else and started again by the next write (the next term, on the same member): before
    it starts Litestream again the member cuts every WAL back to nothing
    (``while_primary.truncate_wals``), and Litestream's first sync copies the whole store;
    the replica, restored, has every record. Without that (the negative control)
    Litestream 0.5.17 carried on from the new WAL's first frame, and the replica lacked
    the pages of the frames it never read: a corrupt database."""
    path, replica = tmp_path / "tier.sqlite3", tmp_path / "replica"
    (tmp_path / "litestream.yml").write_text(
        f"dbs:\n  - path: {path}\n    replica: {{type: file, path: {replica}}}\n"
    )
    command = [LITESTREAM, "replicate", "-config", str(tmp_path / "litestream.yml")]
    store = TierStore.open(path, checkpoints="litestream")
    record = NewRecord(payload=json.dumps("x" * 100), transaction_id="", event_id=None)

    def append(executions: Iterable[str]) -> None:
        for execution in executions:
            store.append_batch("eventlog", execution + "-" * 400, [record])

    def until(check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, "Litestream did not sync"
            time.sleep(0.05)

    try:
        litestream = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        append(f"e{n:04d}0" for n in range(50))
        until(lambda: wal_end(path) in ltx_positions(replica))  # it read the WAL to its end
        until(lambda: any((replica / "ltx" / "9").glob("*.ltx")))  # and made its snapshot
        litestream.send_signal(signal.SIGSTOP)  # (so that it reads nothing more)
        append(f"e{n * 2:04d}5" for n in range(20))  # between: older pages
        litestream.send_signal(signal.SIGKILL)  # the member killed with it
        litestream.wait()
        with contextlib.closing(sqlite3.connect(path)) as other:  # a checkpoint it did not run
            assert other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[0] == 0
        salt = wal_end(path)[0]
        append(["z-next-term"])  # the WAL starts again from its top, over frames not read
        assert wal_end(path)[0] == salt + 1
        if truncated:
            trio.run(while_primary.truncate_wals, {"tier": store}, trio.to_thread.run_sync)
        litestream = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        copied = len(ltx_positions(replica))
        append(f"z{n:03d}" for n in range(20))
        until(lambda: len(ltx_positions(replica)) > copied)
        litestream.send_signal(signal.SIGTERM)  # (its last sync as it exits)
        assert litestream.wait(timeout=30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            litestream.kill()
        store.close()
    restored = tmp_path / "restored.sqlite3"
    done = subprocess.run([LITESTREAM, "restore", "-o", str(restored), f"file://{replica}"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    with contextlib.closing(sqlite3.connect(restored)) as copy:
        whole = copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = copy.execute("SELECT count(*) FROM eventlog_records").fetchone()[0]
    if truncated:
        assert whole and rows == 50 + 20 + 1 + 20
    else:  # the negative control (if this fails, Litestream no longer needs the truncation)
        assert not whole, rows
