"""Backups of a data directory, their verification, and the offline check: synchronous,
for the command line (``cmdbus-trio backup | check``), never the writer's loop. Restores
are :mod:`.restores`.

A backup copies each store from one read snapshot with SQLite's online backup API, so a
writer serving the directory goes on meanwhile; every copy passes ``PRAGMA
integrity_check`` and its size and SHA-256 go into the manifest, written last (a target
without one is an unfinished backup). :func:`verify` checks a backup's manifest and every
file against it, before a restore writes anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import attrs

from .datadir import LOCK_NAME, STORE_FILES, fsync_path
from .keys import KEYED_TABLES, read_key_floor

FORMAT: Final = 1
"""The manifest's format: a restore refuses a newer one."""
MANIFEST: Final = "manifest.json"
HASH_CHUNK: Final = 1 << 20
PARTIAL: Final = ".partial"
"""A store's copy is ``<name>.partial`` until it is checked (a progress bar may watch
it grow)."""


class BackupError(Exception):
    """A backup, restore or check cannot go on; ``str()`` says why in one line, and
    nothing was changed."""


@attrs.frozen
class StoreCopy:
    """One store in a backup: its file's size and SHA-256, and the highest value each of
    its key counters (``sqlite_sequence``) had given out."""

    name: str
    bytes: int
    sha256: str
    sequences: dict[str, int]


@attrs.frozen
class Manifest:
    format: int
    writer_version: str
    created_at: float
    """Seconds since the epoch, when the snapshot was taken (the first store's)."""
    shard: int
    shard_count: int
    stores: tuple[StoreCopy, ...]
    key_floor: int = 0
    """The data directory's key floor when it was backed up (``keys.floor``; 0: none)."""

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), indent=2) + "\n"

    @classmethod
    def read(cls, target: Path) -> Manifest:
        path = target / MANIFEST
        try:
            value = json.loads(path.read_text())
            stores = tuple(StoreCopy(**store) for store in value.pop("stores"))
            return cls(**value, stores=stores)
        except FileNotFoundError:
            raise BackupError(f"{target}: no {MANIFEST}: not a backup, or one unfinished") from None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise BackupError(f"{path}: not a readable manifest ({exc})") from None


@attrs.frozen
class Problem:
    """What the check found wrong with one store (or the directory)."""

    store: str
    what: str


# --- backup ---------------------------------------------------------------------------


def backup(
    data_dir: Path,
    target: Path,
    *,
    shard: int,
    shard_count: int,
    writer_version: str,
    progress: Callable[[str, int, int], None] = lambda *_: None,
) -> Manifest:
    """Copy every store of ``data_dir`` into ``target`` (which must not exist, or be
    empty) and write its manifest; ``progress(store, copied, total)`` is told when each
    store's copy begins (0 of about ``total`` bytes) and ends.

    Error handling: :class:`BackupError` when ``data_dir`` holds no store, ``target``
    is not empty, or a copy fails its integrity check; the partial target is left for
    the operator to look at, with no manifest."""
    stores = stores_or_refuse(data_dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise BackupError(f"{target}: exists and is not empty; a backup goes to a new place")
    target.mkdir(parents=True, exist_ok=True)
    created_at = time.time()
    copies = [_copy(data_dir / name, target / name, progress) for name in stores]
    floor = read_key_floor(data_dir)
    manifest = Manifest(
        FORMAT, writer_version, created_at, shard, shard_count, tuple(copies), floor
    )
    _write_durably(target / MANIFEST, manifest.to_json())
    fsync_path(target.parent)  # the backup's own name, made by the mkdir above
    return manifest


def _copy(source: Path, dest: Path, progress: Callable[[str, int, int], None]) -> StoreCopy:
    partial = dest.with_name(dest.name + PARTIAL)
    progress(dest.name, 0, source.stat().st_size + _size(source.with_name(source.name + "-wal")))
    with _reading(source) as reader, contextlib.closing(sqlite3.connect(partial)) as writer:
        # All pages in one step: one read snapshot, whatever the writer does meanwhile
        # (a backup in steps starts again each time the source changes).
        reader.backup(writer, pages=-1)
        writer.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
    problems = integrity(partial)
    if problems:
        raise BackupError(f"{dest.name}: the copy fails its integrity check: {problems[0]}")
    sequences = counters(partial)
    fsync_path(partial)
    partial.rename(dest)
    fsync_path(dest.parent)
    size = dest.stat().st_size
    progress(dest.name, size, size)
    return StoreCopy(dest.name, size, _sha256(dest), sequences)


# --- restore ----------------------------------------------------------------------------


def verify(target: Path, *, shard: int | None = None, shard_count: int | None = None) -> Manifest:
    """The backup's manifest, once every file it names is there with its size and
    SHA-256, its format is one this version reads and (when given) its shard is ours.

    Error handling: :class:`BackupError` naming the first thing wrong."""
    manifest = Manifest.read(target)
    if manifest.format > FORMAT:
        raise BackupError(
            f"{target}: backup format {manifest.format} is newer than this version reads "
            f"({FORMAT}); restore it with cmdbus-trio {manifest.writer_version} or later"
        )
    if shard is not None and (manifest.shard, manifest.shard_count) != (shard, shard_count):
        raise BackupError(
            f"{target}: a backup of shard {manifest.shard} of {manifest.shard_count}, "
            f"not of shard {shard} of {shard_count}"
        )
    if not manifest.stores:
        raise BackupError(f"{target}: the manifest names no store")
    for store in manifest.stores:
        if store.name not in STORE_FILES:
            raise BackupError(f"{target}: the manifest names {store.name!r}, not a store")
        path = target / store.name
        if not path.is_file():
            raise BackupError(f"{target}: {store.name} is missing")
        if (size := path.stat().st_size) != store.bytes:
            raise BackupError(f"{path}: {size} bytes, the manifest says {store.bytes}")
        if _sha256(path) != store.sha256:
            raise BackupError(f"{path}: its SHA-256 is not the manifest's: altered or damaged")
    return manifest


# --- check --------------------------------------------------------------------------------


def stores_in(data_dir: Path) -> list[str]:
    """The names of the stores ``data_dir`` holds, in :data:`STORE_FILES` order."""
    return [name for name in STORE_FILES if (data_dir / name).is_file()]


def stores_or_refuse(data_dir: Path) -> list[str]:
    if not (stores := stores_in(data_dir)):
        raise BackupError(f"{data_dir}: no store in it ({', '.join(STORE_FILES)})")
    return stores


def refuse_if_held(data_dir: Path) -> None:
    if holder := held_by(data_dir):
        raise BackupError(f"{data_dir}: a writer holds it (pid {holder}); stop it first")


def held_by(data_dir: Path) -> str | None:
    """The pid of the writer holding ``data_dir`` (``"unknown"`` if it wrote none), or
    None when nobody holds it."""
    lock = data_dir / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return pid if pid.isdigit() else "unknown"
    finally:
        os.close(fd)
    return None


def check(data_dir: Path) -> list[Problem]:
    """What is wrong with the stores of ``data_dir``, offline (empty: sound): each one
    opens, passes ``PRAGMA integrity_check``, and no key counter is behind a key in its
    table (the next key would name a record already there)."""
    problems = []
    for name in STORE_FILES:
        path = data_dir / name
        if not path.exists():
            continue
        try:
            problems += [Problem(name, what) for what in integrity(path)]
            problems += [Problem(name, what) for what in _counters_behind(path)]
        except sqlite3.Error as exc:
            problems.append(Problem(name, f"cannot be read as a SQLite database: {exc}"))
    return problems


def integrity(path: Path) -> list[str]:
    """``PRAGMA integrity_check``'s findings (empty: ok)."""
    rows = [row[0] for row in query(path, "PRAGMA integrity_check")]
    return [] if rows == ["ok"] else rows


def _counters_behind(path: Path) -> Iterator[str]:
    sequences = counters(path)
    for (table,) in query(path, KEYED_TABLES):
        key = "sort_key" if table == "records" else "global_sequence"
        ((highest,),) = query(path, f"SELECT max({key}) FROM {table}")
        if highest is not None and highest > sequences.get(table, 0):
            yield (
                f"{table}: the key counter is at {sequences.get(table, 0)} but a record has "
                f"{highest}: the next keys would name records already there"
            )


def counters(path: Path) -> dict[str, int]:
    return {name: int(seq) for name, seq in query(path, "SELECT name, seq FROM sqlite_sequence")}


# --- files --------------------------------------------------------------------------------


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection (a writer serving the store goes on)."""
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        yield connection
    finally:
        connection.close()


def query(path: Path, sql: str) -> list[Any]:
    with _reading(path) as connection:
        return connection.execute(sql).fetchall()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _write_durably(path: Path, text: str) -> None:
    partial = path.with_name(path.name + PARTIAL)
    partial.write_text(text)
    fsync_path(partial)
    partial.rename(path)
    fsync_path(path.parent)
