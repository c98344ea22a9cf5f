"""The power-cut shim itself, on a small program's files: what it keeps and drops is what
a power cut keeps and drops (each case has its twin), and a write around it is reported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from .harness import cut


def under_shim(shim: Path, tmp_path: Path, program: str) -> tuple[Path, list[str]]:
    """Run ``program`` (Python, ``data`` is the watched dir) under the shim, then cut."""
    data, image = tmp_path / "data", tmp_path / "image"
    data.mkdir(exist_ok=True)
    env = {**os.environ, "LD_PRELOAD": str(shim), "POWERCUT_DIR": str(data),
           "POWERCUT_IMAGE": str(image)}  # fmt: skip
    code = f"import os, mmap\ndata = {str(data)!r}\n" + textwrap.dedent(program)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    return data, cut(data, image)


def test_a_write_is_kept_only_once_synced(shim: Path, tmp_path: Path) -> None:
    data, bypassed = under_shim(
        shim,
        tmp_path,
        """
        synced = os.open(os.path.join(data, "synced"), os.O_CREAT | os.O_WRONLY)
        os.write(synced, b"kept")
        os.fsync(synced)
        os.write(synced, b" and lost")  # after the last fsync
        unsynced = os.open(os.path.join(data, "unsynced"), os.O_CREAT | os.O_WRONLY)
        os.write(unsynced, b"lost")
        folder = os.open(data, os.O_RDONLY)
        os.fsync(folder)  # both names are durable; only one file's content is
    """,
    )
    assert (data / "synced").read_bytes() == b"kept"
    assert (data / "unsynced").read_bytes() == b""
    assert bypassed == []


def test_a_new_name_needs_the_directory_synced(shim: Path, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "old").write_bytes(b"before")
    data, _ = under_shim(
        shim,
        tmp_path,
        """
        fd = os.open(os.path.join(data, "new"), os.O_CREAT | os.O_WRONLY)
        os.write(fd, b"after")
        os.fsync(fd)  # its content, not its name
        os.rename(os.path.join(data, "old"), os.path.join(data, "renamed"))
        os.pwrite(os.open(os.path.join(data, "renamed"), os.O_WRONLY), b"X", 0)
    """,
    )
    assert sorted(p.name for p in data.iterdir()) == ["old"]  # as the process found it
    assert (data / "old").read_bytes() == b"before"
    data, _ = under_shim(
        shim,
        tmp_path,
        """
        fd = os.open(os.path.join(data, "new"), os.O_CREAT | os.O_WRONLY)
        os.write(fd, b"after")
        os.fsync(fd)
        os.rename(os.path.join(data, "old"), os.path.join(data, "renamed"))
        os.fsync(os.open(data, os.O_RDONLY))
    """,
    )
    assert {p.name: p.read_bytes() for p in data.iterdir()} == {
        "new": b"after", "renamed": b"before"
    }  # fmt: skip


def test_a_truncation_is_kept_once_synced(shim: Path, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "file").write_bytes(b"0123456789")
    data, _ = under_shim(
        shim,
        tmp_path,
        """
        fd = os.open(os.path.join(data, "file"), os.O_WRONLY)
        os.ftruncate(fd, 4)
        os.pwrite(fd, b"ab", 6)  # a hole from 4 to 6
        os.fsync(fd)
    """,
    )
    assert (data / "file").read_bytes() == b"0123\0\0ab"


def test_a_shared_writable_mapping_is_reported(shim: Path, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "file").write_bytes(b"x" * 4096)
    (tmp_path / "data" / "db-shm").write_bytes(b"x" * 4096)
    _, bypassed = under_shim(
        shim,
        tmp_path,
        """
        with open(os.path.join(data, "db-shm"), "r+b") as f:  # SQLite's: not state
            mmap.mmap(f.fileno(), 4096)
        with open(os.path.join(data, "file"), "r+b") as f:
            mmap.mmap(f.fileno(), 4096)
    """,
    )
    assert len(bypassed) == 1 and bypassed[0].startswith("mmap ") and "file" in bypassed[0]
