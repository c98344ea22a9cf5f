"""The README's commands work as a new user pastes them, from a fresh shell. They use the
default ports; here every face listens on port 0 and the commands find the writer
through its ports file (CMDBUS_PORTS_FILE), so the block itself runs unchanged."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .helpers import environment

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def block(heading: str | None) -> str:
    """The first ``sh`` block under ``heading`` (None: the README's first block)."""
    text = (ROOT / "README.md").read_text()
    under = "" if heading is None else rf"^## {re.escape(heading)}\n.*?"
    match = re.search(rf"{under}^```sh\n(.*?)^```", text, re.S | re.M)
    assert match, heading
    return match.group(1)


def test_the_first_command_installs_and_starts_the_writer_in_a_fresh_venv(
    tmp_path: Path,
) -> None:
    """As written, in a copy of the checkout: a virtual environment, the install, the
    writer on ./cmdbus-data, until it is ready; then Ctrl-C (SIGINT) stops it with 0."""
    first, second = block(None).splitlines()
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install .")
    assert "nox -s tests" in second and "python3 -m venv" in second
    checkout = tmp_path / "checkout"
    tracked = (
        subprocess.run(  # what a checkout would hold, this tree's files not yet committed too
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            (checkout / name).write_bytes((ROOT / name).read_bytes())
    env = environment(tmp_path)
    del env["CMDBUS_DATA_DIR"]  # the command's own --data-dir
    env.pop("VIRTUAL_ENV", None)
    shell = subprocess.Popen(
        ["bash", "-c", first], cwd=checkout, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600  # the install downloads the dependencies
        while not (tmp_path / "ports.json").exists():
            assert shell.poll() is None, shell.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "not started in 10 minutes"
            time.sleep(0.5)
        control = json.loads((tmp_path / "ports.json").read_text())["control"]
        with urllib.request.urlopen(f"http://{control}/readyz", timeout=10) as reply:
            assert reply.status == 200
        assert (checkout / "cmdbus-data" / "commands.sqlite3").exists()
        assert (checkout / ".venv" / "bin" / "cmdbus-trio").exists()
        os.killpg(shell.pid, signal.SIGINT)  # Ctrl-C in the terminal
        assert shell.wait(timeout=60) == 0
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()


def test_the_session_block_works_pasted_whole(tmp_path: Path) -> None:
    """It failed pasted as is: the first publish ran before the writer listened
    (ConnectionRefusedError), and `claim --max 1` without `--timeout` could wait for ever."""
    session = block("Quick start")
    assert "cmdbus-trio serve" in session.splitlines()[0] and "&" in session.splitlines()[0]
    env = environment(tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    script = f"set -e\n{session}\nkill %1\nwait\n"
    shell = subprocess.Popen(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = shell.communicate(timeout=120)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    assert shell.returncode == 0, err[-3000:]
    assert out.count('"sort_key":1,"subject":"commands.shared.shard.0"') == 2  # published, claimed
    assert "step.done" in out  # appended and read back
    assert "HEALTHY" in out
    assert (tmp_path / "cmdbus-data" / "commands.sqlite3").exists()
