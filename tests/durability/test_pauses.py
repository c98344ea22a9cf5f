"""Pauses (SIGSTOP, as a GC pause, a stopped VM or a throttled container would make them):
a worker paused past its lease loses the record to another and its late ack is refused;
a writer paused past every client timeout and lease loses nothing acknowledged, honours
no lease twice, and its /livez fails while the pause lasts and says so after."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cmdbus_trio.client import ClientError
from cmdbus_trio.client.blocking import ClaimClient, IngestClient

from ..helpers import serving

pytestmark = pytest.mark.slow
LEASE_MS = 1000
RECORD = {"execution_id": 1, "payload": "{}"}

WORKER = """
import sys
from cmdbus_trio.client.blocking import ClaimClient
with ClaimClient(sys.argv[1]) as claim:
    delivery = claim.next("commands.>", wait=10, timeout=10)
    print(delivery.sort_key, flush=True)
    sys.stdin.readline()  # the test says when: after its pause
    print(claim.ack(delivery.sort_key, timeout=10), flush=True)
"""


def test_a_worker_paused_past_its_lease_loses_the_record_and_its_ack_is_refused(
    tmp_path: Path,
) -> None:
    with serving(tmp_path, CMDBUS_ACK_WAIT_MS=str(LEASE_MS)) as (_, ports):
        with IngestClient(ports["cmd_ingest"]) as ingest:
            key = ingest.publish(RECORD).sort_key
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, ports["cmd_claim"]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert worker.stdin is not None and worker.stdout is not None
        try:
            assert int(worker.stdout.readline()) == key
            worker.send_signal(signal.SIGSTOP)
            time.sleep(LEASE_MS / 1000 * 2.5)  # the lease ends while it cannot speak
            with ClaimClient(ports["cmd_claim"]) as other:
                again = other.next("commands.>", wait=5)
                assert again is not None and again.sort_key == key and again.redelivered
                assert other.ack(key)
            worker.send_signal(signal.SIGCONT)
            worker.stdin.write("ack\n")
            worker.stdin.flush()
            assert worker.stdout.readline().strip() == "False"  # its lease is over
            assert worker.wait(timeout=30) == 0
        finally:
            worker.kill()
            worker.wait()
        with ClaimClient(ports["cmd_claim"]) as check:
            assert check.lag().total == 0
            assert check.next("commands.>", wait=LEASE_MS / 1000 * 1.5) is None  # settled once


def livez(control: str) -> tuple[int, str]:
    """/livez's status and its body's status; (0, "timeout") when no answer came."""
    try:
        with urllib.request.urlopen(f"http://{control}/livez", timeout=0.5) as reply:
            return reply.status, json.loads(reply.read())["status"]
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["status"]
    except OSError:
        return 0, "timeout"


def test_a_writer_paused_past_every_timeout_loses_nothing_and_livez_shows_it(
    tmp_path: Path,
) -> None:
    settings = {
        "CMDBUS_ACK_WAIT_MS": str(LEASE_MS),
        "CMDBUS_LIVENESS_THRESHOLD_MS": "500",
        "CMDBUS_LIVENESS_WINDOW_MS": "3000",
    }
    acknowledged: list[int] = []
    probes: list[tuple[int, str]] = []
    with serving(tmp_path, **settings) as (writer, ports):
        stop = threading.Event()

        def publish() -> None:  # through the pause, each call timing out after 1 s
            with IngestClient(ports["cmd_ingest"], reconnect_for=0) as ingest:
                while not stop.is_set():
                    # A timeout is an unknown: in the writer's socket, maybe stored later.
                    with contextlib.suppress(ClientError):
                        acknowledged.append(ingest.publish(RECORD, timeout=1).sort_key)

        with ClaimClient(ports["cmd_claim"]) as first, ClaimClient(ports["cmd_claim"]) as second:
            publisher = threading.Thread(target=publish)
            publisher.start()
            while len(acknowledged) < 20:
                time.sleep(0.05)
            held = first.next("commands.>", wait=5)
            assert held is not None
            writer.send_signal(signal.SIGSTOP)
            paused_until = time.monotonic() + 3 * LEASE_MS / 1000
            while time.monotonic() < paused_until:  # a kubelet probing meanwhile
                probes.append(livez(ports["control"]))
                time.sleep(0.2)
            writer.send_signal(signal.SIGCONT)
            after_pause = livez(ports["control"])
            # Both ask at once: the lease is over by the monotonic clock; one of them
            # gets the record, never both.
            taken: list[int] = []
            claimer = threading.Thread(
                target=lambda: taken.extend(
                    d.sort_key for d in second.next_batch("commands.>", 1000, wait=2)
                )
            )
            claimer.start()
            acked_late = first.ack(held.sort_key, timeout=10)
            claimer.join()
            stop.set()
            publisher.join()
            assert acked_late != (held.sort_key in taken), (acked_late, taken)
            assert all(second.ack_many(taken))
            drained = set(taken)
            while batch := second.next_batch("commands.>", 1000, wait=LEASE_MS / 1000 * 1.5):
                drained.update(d.sort_key for d in batch)
                assert all(second.ack_many([d.sort_key for d in batch]))
            assert held.sort_key not in drained - set(taken)  # never delivered after its ack
        time.sleep(3.5)  # the liveness window after the stall
        recovered = livez(ports["control"])
    assert probes and all(status == 0 for status, _ in probes), probes
    assert after_pause == (503, "stalled"), after_pause
    assert recovered == (200, "ok"), recovered
    missing = set(acknowledged) - drained - {held.sort_key}
    assert not missing, f"acknowledged and not delivered: {sorted(missing)[:5]}"
