"""The examples in examples/ run as users run them (subprocesses, default options)
against a writer that is stopped with SIGTERM and started again, then killed with
SIGKILL and started again, on the same ports, while they publish and work: every record
published is processed, no program sees an error, and no record is stored twice."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cmdbus_trio.client import blocking

from .helpers import serving

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
COUNT = 400


def start(name: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / name), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(program: subprocess.Popen[str], signalled: str | None = None) -> list[dict[str, int]]:
    """The program's JSON lines, once it exited 0 with nothing on stderr, or, stopped by
    ``signalled``, with its status (128 + the signal) and one line saying so."""
    out, err = program.communicate(timeout=60)
    if signalled is None:
        assert program.returncode == 0 and not err, err
    else:
        assert program.returncode == 128 + signal.Signals[signalled], (program.returncode, err)
        assert err.endswith(f": stopped by {signalled}\n") and err.count("\n") == 1, err
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.slow  # subprocesses through two writer restarts: see noxfile.SYSTEM_ONCE
def test_the_examples_ride_through_a_drain_and_a_kill(tmp_path: Path) -> None:
    with contextlib.ExitStack() as writers, contextlib.ExitStack() as programs:
        writer, ports = writers.enter_context(serving(tmp_path))
        same_ports = {f"CMDBUS_{face.upper()}_BIND": address for face, address in ports.items()}
        publish = ("--addr", ports["cmd_ingest"], "--count", str(COUNT), "--rate", "100")
        work = ("--addr", ports["cmd_claim"], "--filter", "commands.>")
        publisher = start("publisher.py", *publish)
        workers = [start("worker.py", *work), start("worker_blocking.py", *work)]
        for program in (publisher, *workers):
            programs.callback(program.kill)
        for how in (signal.SIGTERM, signal.SIGKILL):  # a rollout, then a crash
            time.sleep(1.0)
            writer.send_signal(how)
            writer.wait(timeout=30)
            writer, _ = writers.enter_context(serving(tmp_path, **same_ports))
        published = finish(publisher)
        assert [line["n"] for line in published] == list(range(COUNT))
        keys = {line["sort_key"] for line in published}
        assert len(keys) == COUNT  # no record stored twice: each its own sort key
        with blocking.ClaimClient(ports["cmd_claim"]) as claim:
            deadline = time.monotonic() + 60
            while claim.lag().total and time.monotonic() < deadline:
                time.sleep(0.2)  # until every record is acked
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        ran = [line for worker in workers for line in finish(worker, "SIGTERM")]
    processed = {line["sort_key"] for line in ran}
    assert processed == keys, (sorted(keys - processed)[:10], sorted(processed - keys)[:10])
    assert all(line["execution_id"] is not None for line in ran)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_the_examples_stop_at_once_while_the_writer_is_away(tmp_path: Path, how: str) -> None:
    """No writer at their addresses: each example waits for one (its reconnect window is
    a minute), and SIGTERM or Ctrl-C (SIGINT) stops it at once, with one line and the
    status of the signal, not a minute later with a traceback."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        away = f"127.0.0.1:{free.getsockname()[1]}"
    programs = [
        start("publisher.py", "--addr", away, "--count", "5"),
        start("worker.py", "--addr", away),
        start("worker_blocking.py", "--addr", away),
    ]
    try:
        time.sleep(1.5)  # started, and waiting for the writer
        for program in programs:
            program.send_signal(signal.Signals[how])
        for program in programs:
            assert finish(program, how) == []
    finally:
        for program in programs:
            program.kill()
