"""The writer under Litestream (the real binary, the `litestream` extra) replicating every
store to a file target, with CMDBUS_CHECKPOINTS=litestream: publishes, acks and appends,
then the writer and Litestream killed, the data directory deleted, each store restored
from its replica, and a writer started on what came back: everything acknowledged
before the last replicated transaction is there, keys move on past any the lost writer
could have given (`cmdbus-trio restore --after-litestream`), and the writer serves."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cmdbus_trio.client import blocking
from cmdbus_trio.storage.backups import REPLICA_KEY_JUMP
from cmdbus_trio.storage.datadir import STORE_FILES

from ..helpers import serving

pytestmark = pytest.mark.slow
LITESTREAM = shutil.which("litestream") or str(Path(sys.executable).parent / "litestream")


def config(data: Path, replica: Path) -> str:
    return "dbs:\n" + "".join(
        f"  - path: {data / name}\n    replica:\n      type: file\n"
        f"      path: {replica / name.removesuffix('.sqlite3')}\n"
        for name in STORE_FILES
    )


def test_a_writer_restored_from_its_litestream_replica_has_what_it_acknowledged(
    tmp_path: Path,
) -> None:
    data, replica = tmp_path / "data", tmp_path / "replica"
    settings = {"CMDBUS_DATA_DIR": str(data), "CMDBUS_CHECKPOINTS": "litestream"}
    (tmp_path / "litestream.yml").write_text(config(data, replica))
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
