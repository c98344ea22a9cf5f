"""The data directory: made usable, checked, and held by one writer at a time.

Two writers on one directory each delivered only what was published through them, and
their lag figures disagreed; a directory the writer could not write (a volume mounted
without ``fsGroup``) ended in a long traceback that never named it. :func:`claim` turns
both into one line naming the directory, before any store opens.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import Final

LOCK_NAME: Final = "writer.lock"
SETTING: Final = "invalid setting CMDBUS_DATA_DIR (--data-dir)"
"""How the command line introduces the error, as it does any bad setting's."""
STORE_FILES: Final = ("commands.sqlite3", "events.sqlite3", "tier.sqlite3")


class DataDirError(Exception):
    """The data directory cannot be used; ``str()`` names it and says why, in one line."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{str(path)!r}: {why}")
        self.path = path


class DataDirLock:
    """The lock one writer holds on its data directory for as long as it runs (the
    kernel lets go of it when the process ends, however it ends)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def claim(path: Path) -> DataDirLock:
    """Create ``path`` if needed, check that this process can write it and the stores in
    it, and lock it (``flock`` on ``writer.lock``, which then holds this pid).

    Error handling: :class:`DataDirError` naming the directory and the reason: it cannot
    be created, read or written (with the uid, and the usual cause on Kubernetes), the
    volume is full or read-only, a store file in it is not this user's to write, or
    another writer holds it (with that writer's pid).
    """
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if created:  # its name in its parent is durable before anything is answered
            fsync_path(path.parent)
    except OSError as exc:
        raise DataDirError(path, f"cannot create it: {exc.strerror}") from None
    if not path.is_dir():
        raise DataDirError(path, "not a directory")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise DataDirError(path, _not_writable())
    for name in STORE_FILES:
        store = path / name
        if store.exists() and not os.access(store, os.R_OK | os.W_OK):
            raise DataDirError(path, f"{name} is not readable and writable by uid {os.getuid()}")
    lock_path = path / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise DataDirError(path, _cannot_write(exc)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        raise DataDirError(
            path,
            f"in use by another writer (pid {holder}); one writer per data directory",
        ) from None
    try:  # the holder's pid, for the next one to name; also proves the volume takes writes
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        fsync_path(path)
    except OSError as exc:
        os.close(fd)
        raise DataDirError(path, _cannot_write(exc)) from None
    return DataDirLock(path, fd)


def fsync_path(path: Path) -> None:
    """``fsync`` the file or directory ``path``. Of a directory: the names created or
    renamed in it are then on disk (a file's own fsync does not make its name durable;
    the writer does not rely on SQLite's syncing the directory when it creates a WAL to
    cover its other files)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_pid(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return str(int(os.pread(fd, 32, 0).decode().strip()))
    return "unknown"


def _not_writable() -> str:
    return (
        f"not readable and writable by uid {os.getuid()} "
        "(on Kubernetes: set the pod's securityContext.fsGroup)"
    )


def _cannot_write(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return _not_writable()
    if exc.errno == errno.EROFS:
        return "the volume is read-only"
    if exc.errno == errno.ENOSPC:
        return "the volume is full"
    return f"cannot write in it: {exc.strerror}"
