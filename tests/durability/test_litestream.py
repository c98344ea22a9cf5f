"""The writer under Litestream (the real binary, the `litestream` extra) replicating every
store to a file target and to S3 (moto's server on loopback), with
CMDBUS_CHECKPOINTS=litestream: publishes, acks and appends,
then the writer and Litestream killed, the data directory deleted, each store restored
from its replica, and a writer started on what came back: everything acknowledged
before the last replicated transaction is there, keys move on past any the lost writer
could have given (`cmdbus-trio restore --after-litestream`), and the writer serves."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.deployment import free_ports

from cmdbus_trio.client import blocking
from cmdbus_trio.storage.datadir import STORE_FILES
from cmdbus_trio.storage.restores import REPLICA_KEY_JUMP

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
