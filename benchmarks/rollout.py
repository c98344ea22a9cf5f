"""What a writer's restart costs the programs that use it, measured.

    python benchmarks/rollout.py                       # 200 records/s, 2 drains + 2 kills
    python benchmarks/rollout.py --rate 500 --restarts 3 --json

The example publisher (examples/publisher.py) publishes at --rate records a second and
the two example workers (examples/worker.py, examples/worker_blocking.py) run them, all
with the clients' defaults, while the writer is restarted --restarts times each way, on
the same ports: SIGTERM (a rollout: it drains), then started again; SIGKILL (a crash),
then started again. Printed, for each kind of restart:

- the time from the signal until the new writer's /readyz answers 200;
- the longest gap between two publishes answered, and between two commands run, around
  the restarts (what the programs saw as a pause);

and for the whole run: the records published and run, errors that reached a program
(anything on its stderr: the goal is 0), and records stored twice (the goal is 0: a
publish sent again after a lost connection is answered with its first sort key).
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from cmdbus_trio.commands.spawn import spawn_writer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SETTLE = 3.0
"""Seconds of steady running before the first restart, between two, and after the last."""


class Program:
    """An example as a subprocess; each line it prints is kept with when it came."""

    def __init__(self, name: str, *args: str) -> None:
        command = [sys.executable, str(EXAMPLES / name), *args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), json.loads(line)))

    def stop(self) -> str:
        """SIGTERM, then its stderr once it exited (a program that hangs is killed),
        but for the one line a program stopped by it says."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, err = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
            err += "\n(did not stop on SIGTERM)"
        self._reader.join(timeout=5)
        return "\n".join(line for line in err.splitlines() if not line.endswith(STOPPED))


STOPPED = ": stopped by SIGTERM"
"""What an example says on stderr when SIGTERM stops it."""


def ready(control: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{control}/readyz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"the writer at {control} was not ready in {timeout:g} s")


def longest_gap(times: list[float], windows: list[tuple[float, float]]) -> float:
    """The longest pause between two consecutive ``times`` that overlaps one of
    ``windows`` (a restart: from its signal until the writer is ready again)."""
    gaps = [
        b - a
        for a, b in itertools.pairwise(times)
        if any(a <= back and b >= down for down, back in windows)
    ]
    return max(gaps, default=0.0)


def measure(rate: float, restarts: int, workdir: Path) -> dict[str, Any]:
    process, ports = spawn_writer(workdir, ("cmd_ingest", "cmd_claim"))
    same_ports = {
        f"CMDBUS_{face.upper()}_BIND": ports[face]
        for face in ("control", "cmd_ingest", "cmd_claim")
    }
    count = int(rate * SETTLE * (2 * restarts + 2))
    publisher = Program(
        "publisher.py", "--addr", ports["cmd_ingest"], "--count", str(count), "--rate", str(rate)
    )
    work = ("--addr", ports["cmd_claim"], "--filter", "commands.>")
    workers = [Program("worker.py", *work), Program("worker_blocking.py", *work)]
    when: dict[str, list[tuple[float, float]]] = {"SIGTERM": [], "SIGKILL": []}
    to_ready: dict[str, list[float]] = {"SIGTERM": [], "SIGKILL": []}
    try:
        for how in [signal.SIGTERM, signal.SIGKILL] * restarts:
            time.sleep(SETTLE)
            signalled = time.monotonic()
            process.send_signal(how)
            process.wait(timeout=60)
            process, _ = spawn_writer(workdir, ("cmd_ingest", "cmd_claim"), env=same_ports)
            ready(ports["control"])
            when[how.name].append((signalled, time.monotonic()))
            to_ready[how.name].append(time.monotonic() - signalled)
        publisher.process.wait(timeout=count / rate + 120)
        published = [line for _, line in publisher.lines]
        keys = {line["sort_key"] for line in published}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until every published record has run
            ran = {line["sort_key"] for worker in workers for _, line in worker.lines}
            if keys <= ran:
                break
            time.sleep(0.2)
        errors = [err for program in (publisher, *workers) if (err := program.stop().strip())]
    finally:
        for program in (publisher, *workers):
            program.process.kill()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    publish_times = [at for at, _ in publisher.lines]
    run_times = sorted(at for worker in workers for at, _ in worker.lines)
    ran = {line["sort_key"] for worker in workers for _, line in worker.lines}
    return {
        "rate": rate,
        "published": len(published),
        "ran": len(ran & keys),
        "never_ran": len(keys - ran),
        "stored_twice": len(published) - len(keys) + len(ran - keys),
        "errors": errors,
        **{
            how: {
                "to_ready_s": [round(s, 2) for s in to_ready[how]],
                "longest_publish_gap_s": round(longest_gap(publish_times, when[how]), 2),
                "longest_run_gap_s": round(longest_gap(run_times, when[how]), 2),
            }
            for how in ("SIGTERM", "SIGKILL")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="records a second")
    parser.add_argument("--restarts", type=int, default=2, help="restarts of each kind")
    parser.add_argument("--json", action="store_true", help="one JSON object, not a table")
    args = parser.parse_args()
    if args.rate <= 0 or args.restarts < 1:
        parser.error("--rate must be > 0 and --restarts at least 1")
    with tempfile.TemporaryDirectory(prefix="cmdbus-rollout-") as workdir:
        result = measure(args.rate, args.restarts, Path(workdir))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['published']} records published at {args.rate:g}/s, {result['ran']} run")
    print(f"{'restart':<10}{'to ready (s)':<24}{'publish gap (s)':<18}{'run gap (s)':<14}")
    for how in ("SIGTERM", "SIGKILL"):
        row = result[how]
        ready_s = ", ".join(f"{s:.2f}" for s in row["to_ready_s"])
        print(
            f"{how:<10}{ready_s:<24}{row['longest_publish_gap_s']:<18.2f}"
            f"{row['longest_run_gap_s']:<14.2f}"
        )
    print(f"errors that reached a program: {len(result['errors'])}")
    print(f"records stored twice: {result['stored_twice']}; never run: {result['never_ran']}")
    for error in result["errors"]:
        print(error, file=sys.stderr)


if __name__ == "__main__":
    main()
