"""Start `cmdbus-trio serve` as a child process on loopback port 0 (for `cmdbus-trio bench
--spawn` and the benchmarks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cmdbus_trio.config import DATA_FACE_NAMES, FACE_NAMES

START_TIMEOUT = 60.0


class SpawnError(RuntimeError):
    """The writer exited or wrote no ports file in time; the message names its log."""


def spawn_writer(
    workdir: Path,
    faces: tuple[str, ...] = DATA_FACE_NAMES,
    *,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """A writer on ``workdir`` (data dir, ports file, log) with the control face and
    ``faces`` on 127.0.0.1:0 and the other faces off, ``CMDBUS_*`` from this process's
    environment ignored, ``env`` added; returns the process and its ports file once every
    face listens.

    Error handling: raises :class:`SpawnError` (the child is killed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ports_file = workdir / "ports.json"
    ports_file.unlink(missing_ok=True)  # an earlier writer's: this one writes its own
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CMDBUS_")}
    environment.update(
        CMDBUS_DATA_DIR=str(workdir / "data"),
        CMDBUS_PORTS_FILE=str(ports_file),
        CMDBUS_LOG_LEVEL="warning",
        **{
            f"CMDBUS_{face.upper()}_BIND": "127.0.0.1:0" if face in ("control", *faces) else ""
            for face in FACE_NAMES
        },
    )
    environment.update(env or {})  # a face's bind too: a restart on the same ports
    log_path = workdir / "writer.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cmdbus_trio", "serve"],
            env=environment,
            stdout=log,
            stderr=log,
            preexec_fn=preexec_fn,
        )
    deadline = time.monotonic() + START_TIMEOUT
    while not ports_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise SpawnError(f"the writer did not start; see {log_path}")
        time.sleep(0.05)
    ports: dict[str, str] = json.loads(ports_file.read_text())
    return process, ports
