"""The ``file:PATH`` lease store: members on one machine (a host, the tests).

``PATH`` is a directory; each version of the record is a file of its own, ``v`` and the
version number, never changed once written. A write of version ``n + 1`` writes a
temporary file, makes it durable, and links it to its name: ``link`` fails when the name
exists, so of two members writing on version ``n`` one wins, and the file appears whole
or not at all. Nothing is locked, so a member stopped at any instant (SIGSTOP, a pause)
holds nothing the other needs: a temporary file it leaves behind is never read.

Old versions are deleted as new ones are written (the newest :data:`KEPT` stay). A
member that names a version so old that the file after it is gone (it was paused
through :data:`KEPT` writes) could create that file again, and nobody would read it;
so a write checks that the version it names is there, and, once linked, that the
newest version is not more than :data:`KEPT` past its own (then its own may be such a
file: it removes it and reports the conflict). A member that wrote in time and was
then built upon by the other sees a newer version, but not that far past: its write
stands.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
from pathlib import Path

from cmdbus_trio.storage import refuses_loop_thread

from .lease import LeaseConflict, LeaseError, LeaseRecord, Versioned

KEPT = 16
"""Versions kept: enough that a member a few writes behind still conflicts on its own."""
_VERSION = re.compile(r"v(\d{20})")


class FileLeaseStore:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def describe(self) -> str:
        return f"file:{self.path}"

    @refuses_loop_thread
    def read(self) -> Versioned | None:
        for _ in range(KEPT):  # (each turn: a version written and one deleted meanwhile)
            newest = self._newest()
            if newest is None:
                return None
            try:
                raw = (self.path / _name(newest)).read_bytes()
                break
            except FileNotFoundError:  # deleted as old between the listing and the read
                continue
            except OSError as exc:
                raise LeaseError(f"cannot read the lease {self.describe()}: {exc}") from None
        else:
            raise LeaseError(f"the lease {self.describe()} changes faster than it can be read")
        try:
            record = LeaseRecord.from_json(json.loads(raw))
        except ValueError as exc:
            raise LeaseError(f"the lease {self.describe()} v{newest} is not JSON: {exc}") from None
        return Versioned(record, str(newest))

    @refuses_loop_thread
    def write(self, record: LeaseRecord, version: str | None) -> str:
        self._make_room()
        if version is None:
            if self._newest() is not None:
                raise LeaseConflict(f"the lease {self.describe()} exists already")
            number = 1
        else:
            number = int(version) + 1
            if not (self.path / _name(number - 1)).exists():
                raise LeaseConflict(f"the lease {self.describe()} moved past v{number - 1}")
        temporary = self.path / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            with open(temporary, "xb") as file:
                file.write(record.encode())
                file.flush()
                os.fsync(file.fileno())
            try:
                os.link(temporary, self.path / _name(number))
            except FileExistsError:
                raise LeaseConflict(
                    f"the lease {self.describe()} moved past v{number - 1}"
                ) from None
        except OSError as exc:
            raise LeaseError(f"cannot write the lease {self.describe()}: {exc}") from None
        finally:
            temporary.unlink(missing_ok=True)
        self._sync_directory()
        newest = self._newest()
        if newest is not None and newest > number + KEPT:  # named a version long gone
            (self.path / _name(number)).unlink(missing_ok=True)
            raise LeaseConflict(f"the lease {self.describe()} moved past v{number - 1}")
        self._forget_before(number - KEPT)
        return str(number)

    def _versions(self) -> list[int]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise LeaseError(f"cannot list the lease {self.describe()}: {exc}") from None
        return [int(found.group(1)) for name in names if (found := _VERSION.fullmatch(name))]

    def _newest(self) -> int | None:
        return max(self._versions(), default=None)

    def _make_room(self) -> None:
        try:
            self.path.mkdir(exist_ok=True)
        except OSError as exc:
            raise LeaseError(f"cannot create the lease {self.describe()}: {exc}") from None

    def _sync_directory(self) -> None:
        descriptor = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        except OSError as exc:  # some file systems cannot sync a directory
            if exc.errno not in (errno.EINVAL, errno.EBADF):
                raise LeaseError(f"cannot sync the lease {self.describe()}: {exc}") from None
        finally:
            os.close(descriptor)

    def _forget_before(self, number: int) -> None:
        for old in self._versions():
            if old < number:
                (self.path / _name(old)).unlink(missing_ok=True)
        for name in os.listdir(self.path):  # temporaries of members that stopped mid-write
            if name.startswith(".tmp-") and not _is_alive(name):
                (self.path / name).unlink(missing_ok=True)


def _name(number: int) -> str:
    return f"v{number:020d}"


def _is_alive(temporary: str) -> bool:
    """The process that named a temporary file runs still (its write may be under way)."""
    try:
        os.kill(int(temporary.split("-")[1]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
