"""A failing disk in the middle of a commit, from the kernel's side (the shim fails every
fsync with EIO, or every write that grows a file with ENOSPC, once armed), then a power
cut: the store is poisoned as documented (publishes answer `unavailable`, /readyz names
it), and after the disk is healthy again and the writer restarted on what the disk kept,
everything acknowledged is there."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cmdbus_trio.client import Unavailable
from cmdbus_trio.client.blocking import IngestClient
from cmdbus_trio.storage.buslog import BusLog

from ..helpers import serving
from .harness import cut

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fault", ["eio-fsync", "enospc-write"])
def test_a_disk_failing_mid_commit_then_a_power_cut_loses_nothing_acknowledged(
    tmp_path: Path, fault: str, shim: Path
) -> None:
    data, image = tmp_path / "data", tmp_path / "image"
    data.mkdir()
    shimmed = {
        "LD_PRELOAD": str(shim), "POWERCUT_DIR": str(data),
        "POWERCUT_IMAGE": str(image), "POWERCUT_FAULT": fault,
    }  # fmt: skip
    acknowledged: dict[str, int] = {}
    refused: list[str] = []
    with serving(tmp_path, **shimmed) as (writer, ports):

        def publish() -> None:
            with IngestClient(ports["cmd_ingest"], reconnect_for=0) as ingest:
                for n in range(1_000_000):
                    record = {"execution_id": n, "payload": json.dumps({"id": n})}
                    try:
                        acknowledged[str(n)] = ingest.publish(record, timeout=10).sort_key
                    except Unavailable as error:
                        refused.append(str(error))
                        return

        publisher = threading.Thread(target=publish)
        publisher.start()
        time.sleep(0.5)
        (image / "arm").touch()  # the disk fails from now on
        publisher.join(timeout=30)
        assert refused and "commands store is poisoned" in refused[0], refused
        try:
            urllib.request.urlopen(f"http://{ports['control']}/readyz", timeout=5)
            raise AssertionError("/readyz answered 200 with a poisoned store")
        except urllib.error.HTTPError as error:
            reasons = json.loads(error.read())["reasons"]
            assert any("store commands poisoned" in r for r in reasons), reasons
        (image / "arm").unlink()  # space is back, the disk healthy
        writer.send_signal(signal.SIGKILL)  # and the power goes as well
        writer.wait()
    cut(data, image)
    with serving(tmp_path) as (writer, ports):
        with IngestClient(ports["cmd_ingest"]) as ingest:
            fresh = ingest.publish({"execution_id": 0, "payload": json.dumps({"id": "new"})})
        assert fresh.sort_key > max(acknowledged.values())  # no acknowledged key given again
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=30) == 0
    log = BusLog.open(data / "commands.sqlite3")
    try:
        stored = {key: json.loads(json.loads(r.record)["payload"])["id"]
                  for key in acknowledged.values() if (r := log.read(key)) is not None}  # fmt: skip
    finally:
        log.close()
    lost = [n for n, key in acknowledged.items() if stored.get(key) != int(n)]
    assert len(acknowledged) > 10 and not lost, lost[:5]
