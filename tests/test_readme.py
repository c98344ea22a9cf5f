"""The README's commands work as a new user pastes them, from a fresh shell. They use the
default ports; here every face listens on port 0 and the commands find the writer
through its ports file (CMDBUS_PORTS_FILE), so the block itself runs unchanged."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import environment

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def block(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"^## {re.escape(heading)}\n+```sh\n(.*?)^```", text, re.S | re.M)
    assert match, heading
    return match.group(1)


def test_the_session_block_works_pasted_whole(tmp_path: Path) -> None:
    """It failed pasted as is: the first publish ran before the writer listened
    (ConnectionRefusedError), and `claim --max 1` without `--timeout` could wait for ever."""
    session = block("A session")
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
