"""`cmdbus-trio diagnose`: its verdicts from scrapes alone, and the cases around the nine
states (test_diagnose_states.py): a stall remembered after it ends, a real I/O error, a
pipelined flood that is not a stall, a backlog being worked that is not stuck."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.client import Unavailable, blocking
from cmdbus_trio.commands._scrape import Scrape, quantile
from cmdbus_trio.commands.bench import http_get
from cmdbus_trio.commands.client import fetch
from cmdbus_trio.commands.diagnose import EXIT_CODES, SEVERITY, assess

from ..helpers import background, cli, serving


def diagnose(ports: dict[str, str], *args: str) -> tuple[int, list[dict[str, Any]]]:
    result = subprocess.run(
        cli("diagnose", f"http://{ports['control']}", "--interval", "2", *args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stderr == ""
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.e2e
def test_a_blocked_loop_is_stalled_not_saturated(tmp_path: Path) -> None:
    env = {"CMDBUS_DEBUG_HOOKS": "true", "CMDBUS_LIVENESS_THRESHOLD_MS": "500"}
    with serving(tmp_path, **env) as (_, ports):
        block = urllib.request.Request(
            f"http://{ports['control']}/debug/block-loop?seconds=3", method="POST"
        )
        with urllib.request.urlopen(block, timeout=10) as response:
            assert response.status == 202
        # While it is blocked, /healthz cannot answer.
        code, during = diagnose(ports, "--timeout", "1")
        assert code == EXIT_CODES["stalled"] and during[0]["verdict"] == "stalled", during
        assert "did not answer" in during[0]["summary"]
        time.sleep(2.5)
        # After it, the writer's heartbeat remembers the stall for the liveness window.
        code, after = diagnose(ports)
    assert code == EXIT_CODES["stalled"] and after[0]["verdict"] == "stalled", after
    assert any("heartbeat" in line or "stalled" in line for line in after[0]["evidence"])
    assert "saturated" not in [f["verdict"] for f in during + after]


@pytest.mark.e2e
def test_a_failed_write_is_poisoned(tmp_path: Path) -> None:
    with serving(tmp_path, file_size_limit=512 * 1024) as (_, ports):
        with blocking.TierClient.connect(ports["tier"]) as tier:
            for _ in range(1000):
                try:
                    tier.append("big", json.dumps("x" * 8000), timeout=10)
                except Unavailable:
                    break
            else:
                raise AssertionError("the file-size limit never failed a write")
        code, findings = diagnose(ports)
    assert code == EXIT_CODES["poisoned"] and findings[0]["verdict"] == "poisoned", findings
    assert "store tier" in findings[0]["summary"]
    assert any("poisoned_reason" in line for line in findings[0]["evidence"])


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 50.0, 0.2: 100.0, float("inf"): 100.0}
    assert quantile(buckets, 0.5) == 0.1
    assert abs((quantile(buckets, 0.75) or 0) - 0.15) < 1e-9
    assert quantile({float("inf"): 0.0}, 0.99) is None


def test_assess_from_scrapes_alone() -> None:
    before = Scrape('cmdbus_shed_total{face="tier",op="scan",reason="queue_timeout"} 1\n')
    after = Scrape('cmdbus_shed_total{face="tier",op="scan",reason="queue_timeout"} 31\n')
    findings = assess(({}, {}), before, after, 3.0)
    assert [f.verdict for f in findings] == ["saturated"]
    assert "scan shed 10.0/s (queue_timeout)" in findings[0].summary


def busy_loop_scrapes(busy: float, deferred: float) -> tuple[Scrape, Scrape]:
    before = "cmdbus_loop_busy_seconds_total 10\ncmdbus_loop_turns_deferred_total 5\n"
    after = (
        f"cmdbus_loop_busy_seconds_total {10 + busy}\n"
        f"cmdbus_loop_turns_deferred_total {5 + deferred}\n"
    )
    return Scrape(before), Scrape(after)


def test_a_loop_busy_with_client_work_is_saturated() -> None:
    """Busy over 75% of the interval with work waiting for turns: the writer's CPU, not a
    Gate, is the limit. Busy without deferrals is a loop blocked (a stall, found by its
    heartbeat), and a loop with room is healthy whatever it defers."""
    findings = assess(({}, {}), *busy_loop_scrapes(2.85, 4000), 3.0)
    assert [f.verdict for f in findings] == ["saturated"]
    assert findings[0].summary.startswith("event loop: busy 95% of the time")
    assert "cmdbus_loop_turns_deferred_total +4000 in 3.0 s" in findings[0].evidence
    for busy, deferred in ((2.85, 0), (2.1, 4000)):
        findings = assess(({}, {}), *busy_loop_scrapes(busy, deferred), 3.0)
        assert [f.verdict for f in findings] == ["healthy"], (busy, deferred)
    assert "loop busy 70%" in findings[0].evidence[0]


def test_a_flooded_control_face_is_named_and_kubelet_probes_are_not() -> None:
    """The control face goes first in the loop, for at most a quarter of it: a share of
    the interval at or above CONTROL_FLOODED names a flood of the control port."""
    before = Scrape("cmdbus_loop_control_first_seconds_total 1\n")
    flooded = Scrape("cmdbus_loop_control_first_seconds_total 1.6\n")  # 20% of 3 s
    findings = assess(({}, {}), before, flooded, 3.0)
    assert [f.verdict for f in findings] == ["control face flooded"]
    assert findings[0].summary.startswith("control face: its requests went first for 20%")
    assert findings[0].evidence[0] == "cmdbus_loop_control_first_seconds_total +0.60 in 3.0 s"
    for favoured in (1.003, 1.44):  # a kubelet's probes; just under the threshold (14%)
        after = Scrape(f"cmdbus_loop_control_first_seconds_total {favoured}\n")
        assert [f.verdict for f in assess(({}, {}), before, after, 3.0)] == ["healthy"]


def test_a_control_face_paced_for_its_share_is_flooded() -> None:
    """Once the control face has spent its share of the loop its requests wait: any wait
    in the interval names a flood, whatever the favoured share (it stops while paced)."""
    before = Scrape("cmdbus_control_paced_seconds_total 2\n")
    paced = Scrape("cmdbus_control_paced_seconds_total 2.9\n")
    findings = assess(({}, {}), before, paced, 3.0)
    assert [f.verdict for f in findings] == ["control face flooded"]
    assert findings[0].summary.startswith("control face: its requests waited 0.90 s")
    assert findings[0].evidence[1] == "cmdbus_control_paced_seconds_total +0.90 in 3.0 s"
    assert [f.verdict for f in assess(({}, {}), before, before, 3.0)] == ["healthy"]


def test_a_control_port_at_its_connection_cap_is_flooded() -> None:
    """A port that closed its quietest connections to let new ones in, in the interval:
    named, with the port; none closed is healthy."""
    crowded = "cmdbus_control_connections_crowded_out_total"
    before = Scrape(f'{crowded}{{port="control"}} 3\n{crowded}{{port="cmd_lag"}} 0\n')
    after = Scrape(f'{crowded}{{port="control"}} 40\n{crowded}{{port="cmd_lag"}} 0\n')
    findings = assess(({}, {}), before, after, 3.0)
    assert [f.verdict for f in findings] == ["control face flooded"]
    assert findings[0].summary.startswith(
        "control face: at its connection cap on port control (37 closed)"
    )
    assert f'{crowded}{{port="control"}} +37' in findings[0].evidence
    assert [f.verdict for f in assess(({}, {}), before, before, 3.0)] == ["healthy"]


FLOOD = """
import json, socket, struct, sys, threading, time
from cmdbus_trio.protocol import encode_frame

host, port = sys.argv[1].rsplit(":", 1)
until = time.monotonic() + float(sys.argv[2])
record = {"execution_id": 1, "payload": json.dumps({"execution_pool": "p"})}
batch = b"".join(
    encode_frame(json.dumps({"id": i, "op": "publish", "record": record}).encode())
    for i in range(64)
)

def frames(reader, n):
    for _ in range(n):
        (size,) = struct.unpack(">I", reader.read(4))
        reader.read(size)

def flood():
    with socket.create_connection((host, int(port))) as sock:
        reader = sock.makefile("rb")
        sock.sendall(encode_frame(b'{"hello": {"protocol": 2, "client": "flood"}}'))
        frames(reader, 1)
        while time.monotonic() < until:
            sock.sendall(batch)
            frames(reader, 64)

threads = [threading.Thread(target=flood) for _ in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


@pytest.mark.e2e
def test_a_pipelined_flood_fills_the_loop_and_is_not_a_stall(tmp_path: Path) -> None:
    """Sixteen connections, 64 publishes in flight each, from another process: beside
    the ingest face's queue, the loop itself is named full (87-88% busy here), and the
    writer is never taken for stalled."""
    with serving(tmp_path) as (_, ports):
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, ports["cmd_ingest"], "8"])
        try:
            time.sleep(1)
            code, findings = diagnose(ports)
        finally:
            assert flood.wait(timeout=60) == 0
    assert code == EXIT_CODES[findings[0]["verdict"]] and code > 2, findings
    verdicts = [(f["verdict"], f["summary"].split(":")[0]) for f in findings]
    assert ("saturated", "event loop") in verdicts, findings
    assert "stalled" not in [verdict for verdict, _ in verdicts]


def test_a_crashed_face_or_task_is_named() -> None:
    """A crashed face (and a crashed background task) has a verdict of its own, above
    "not ready": only a restart brings it back. (It used to be reported as "not ready".)"""
    reasons = ["face tier crashed", "task events.committer crashed", "store tier poisoned: x"]
    document = {"not_ready_reasons": reasons}
    empty = Scrape("")
    findings = assess((document, document), empty, empty, 3.0)
    assert [f.verdict for f in findings] == ["face crashed", "task crashed"]
    assert "face tier crashed" in findings[0].summary and "store" not in findings[0].summary
    assert "events.committer" in findings[1].summary
    starting = {"not_ready_reasons": ["starting: faces or stores not open yet"]}
    assert [f.verdict for f in assess((starting, starting), empty, empty, 3.0)] == ["not ready"]


@pytest.mark.e2e
def test_a_backlog_being_worked_is_not_stuck(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, ports):
        with blocking.IngestClient.connect(ports["cmd_ingest"]) as ingest:
            ingest.publish_batch([{"execution_id": n, "payload": "{}"} for n in range(400)])

        def work(stop: threading.Event) -> None:
            with blocking.ClaimClient.connect(ports["cmd_claim"]) as claim:
                while not stop.is_set():
                    delivery = claim.next("commands.>", wait=0.2)
                    if delivery is not None:
                        claim.ack(delivery.sort_key)
                        time.sleep(0.02)  # slower than the backlog: it stays

        time.sleep(1.2)
        with background(work):
            _, findings = diagnose(ports)
    assert "backlog stuck" not in [f["verdict"] for f in findings], findings


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",  # cut mid-body
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhello",  # fewer bytes than said
        b"HTTP/1.1 2",  # cut in the status line
    ],
)
def test_an_answer_cut_off_is_an_oserror_not_a_crash(answer: bytes) -> None:
    """A writer killed while it answered: `fetch` (health, diagnose) raises the OSError
    its callers turn into "no answer", not http.client's IncompleteRead."""
    with socket.create_server(("127.0.0.1", 0)) as server:

        def answer_and_close() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(answer)

        thread = threading.Thread(target=answer_and_close, daemon=True)
        thread.start()
        with pytest.raises(OSError):
            fetch(f"http://127.0.0.1:{server.getsockname()[1]}/healthz", timeout=10)
        thread.join(timeout=10)


async def test_a_probe_reset_mid_answer_is_an_oserror() -> None:
    """`bench`'s probe (a kubelet's new connection): a reset is an OSError, which the
    probe loop counts as a failed probe, not trio's BrokenResourceError, which ended it."""
    with socket.create_server(("127.0.0.1", 0)) as server:

        def reset_mid_answer() -> None:
            connection, _ = server.accept()
            connection.recv(65536)
            connection.sendall(b"HTTP/1.0 200 OK\r\n")
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            connection.close()  # with a zero linger: a reset, not a FIN

        thread = threading.Thread(target=reset_mid_answer, daemon=True)
        thread.start()
        with pytest.raises(OSError):
            await http_get(f"http://127.0.0.1:{server.getsockname()[1]}/healthz")
        thread.join(timeout=10)


def test_a_face_whose_waiters_stay_unanswered_is_stuck_and_a_busy_one_is_not() -> None:
    """Requests queued for a Gate slot (or for the face's bytes) at both scrapes, and
    nothing answered but sheds: stuck. The same waiters while some requests are
    answered: not stuck (saturated, if it sheds). Waiters at one scrape only: not stuck."""
    from cmdbus_trio.commands._verdicts import face_stuck

    count = "cmdbus_request_duration_seconds_count"

    def scrape(waiters: int, ok: int, busy: int, metric: str = "cmdbus_waiters") -> Scrape:
        return Scrape(
            f'{metric}{{face="tier"}} {waiters}\n'
            f'{count}{{face="tier",op="append",outcome="ok"}} {ok}\n'
            f'{count}{{face="tier",op="append",outcome="busy"}} {busy}\n'
        )

    stuck = face_stuck(scrape(5, 10, 0), scrape(7, 10, 30), 3.0)
    assert [finding.verdict for finding in stuck] == ["face stuck"]
    assert "face tier" in stuck[0].summary
    assert 'cmdbus_waiters{face="tier"} 5 -> 7' in stuck[0].evidence
    waiting_for_bytes = "cmdbus_pending_bytes_waiters"
    assert face_stuck(scrape(2, 10, 0, waiting_for_bytes), scrape(2, 10, 0, waiting_for_bytes), 3)
    assert face_stuck(scrape(5, 10, 0), scrape(7, 11, 30), 3.0) == []  # one answered
    assert face_stuck(scrape(0, 10, 0), scrape(7, 10, 0), 3.0) == []  # just arrived


def test_every_verdict_has_an_exit_code_of_its_own() -> None:
    """A script tells the verdicts apart by the status alone; 1 (diagnose failed), 2 (bad
    usage) and 130 (Ctrl-C) are no verdict's."""
    assert set(EXIT_CODES) == {"healthy", *SEVERITY}
    assert EXIT_CODES["healthy"] == 0
    assert len(set(EXIT_CODES.values())) == len(EXIT_CODES)
    assert not {1, 2, 130} & set(EXIT_CODES.values())


@pytest.mark.slow  # a port let go of, then used: one at a time (noxfile.IN_PARALLEL)
def test_an_unreachable_writer_exits_with_its_code(tmp_path: Path) -> None:
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    done = subprocess.run(
        cli("diagnose", "--url", f"127.0.0.1:{port}", "--interval", "0.1", "--json"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == EXIT_CODES["unreachable"], done.stderr
    assert json.loads(done.stdout.splitlines()[0])["verdict"] == "unreachable"
