"""Backups of a data directory, their restore, and the offline check: synchronous, for
the command line (``cmdbus-trio backup | restore | check``), never the writer's loop.

A backup copies each store from one read snapshot with SQLite's online backup API, so a
writer serving the directory goes on meanwhile; every copy passes ``PRAGMA
integrity_check`` and its size and SHA-256 go into the manifest, written last (a target
without one is an unfinished backup). A restore checks the manifest and every file
before it writes anything, builds the stores inside the data directory and renames them
into place (never the directory itself: it may be a volume's mount point), and moves the
keys on (:func:`keys_after_restore`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import attrs

from ._sqlite import KEYED_TABLES
from .datadir import (
    KEY_FLOOR_NAME,
    LOCK_NAME,
    STORE_FILES,
    fsync_path,
    read_key_floor,
    write_key_floor,
)

FORMAT: Final = 1
"""The manifest's format: a restore refuses a newer one."""
MANIFEST: Final = "manifest.json"
MIN_KEY_JUMP: Final = 1 << 32
KEYS_A_SECOND: Final = 1_000_000
"""More records a second than one writer can take: with :data:`MIN_KEY_JUMP`, what a
restore moves every key counter on by, per second of the backup's age."""
REPLICA_KEY_JUMP: Final = 1 << 40
"""What a store restored from a Litestream replica moves its keys on by: the replica's
age against the lost writer is not known (its replication may have been broken a while
before the disk went), so a jump of 2**40, past what a writer taking 50,000 records a
second gives out in 250 days, and still below 2**53 (exact in JSON) after 8,000 of them."""
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
    stores = _stores_or_refuse(data_dir)
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
    sequences = _sequences(partial)
    fsync_path(partial)
    partial.rename(dest)
    fsync_path(dest.parent)
    size = dest.stat().st_size
    progress(dest.name, size, size)
    return StoreCopy(dest.name, size, _sha256(dest), sequences)


# --- restore ----------------------------------------------------------------------------


@attrs.frozen
class Restored:
    manifest: Manifest
    key_jump: int
    """What every key counter was moved on by (:func:`keys_after_restore`)."""
    moved_aside: Path | None
    """Where the data directory that was there went (``force``), or None."""


def keys_after_restore(backup_age: float) -> int:
    """How far a restored store's key counters move on: past any key the lost writer
    could have given out after the backup, so that a key a consumer or subscriber holds
    never names another record. ``2**32 + 10**6`` a second of the backup's age (a
    writer takes far fewer than a million records a second; a clock that went back
    counts as no age)."""
    return MIN_KEY_JUMP + math.ceil(max(0.0, backup_age) * KEYS_A_SECOND)


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


NOT_DATA: Final = frozenset({"lost+found", LOCK_NAME})
"""What a data directory may hold and still count as empty: a new ext4 volume's
``lost+found`` (the directory may be a mount point), and the writer's lock file."""
RESTORING: Final = ".restoring-"
REPLACED: Final = ".replaced-"


def restore(
    target: Path,
    data_dir: Path,
    *,
    shard: int,
    shard_count: int,
    force: bool = False,
    now: Callable[[], float] = time.time,
) -> Restored:
    """Restore the backup in ``target`` into ``data_dir``.

    ``data_dir`` must not exist or be empty (bar :data:`NOT_DATA`), and no writer may hold
    it: the restore holds the writer's lock itself, so none starts meanwhile. With
    ``force``, what is there is moved aside into ``<data_dir>/.replaced-<time>``, never
    deleted. Nothing is written before the backup is verified (:func:`verify`); the
    stores are built in ``<data_dir>/.restoring-<pid>``, their key counters moved on
    (:func:`keys_after_restore`) and checked (:func:`check`), then renamed into place.
    Only entries move, never ``data_dir`` itself, and all within it: it may be a mount
    point (a volume), where renaming it fails (EBUSY) and so does a rename to a place
    beside it on another file system (EXDEV).

    Error handling: :class:`BackupError`, with nothing changed."""
    if data_dir.exists() and not data_dir.is_dir():
        raise BackupError(f"{data_dir}: not a directory")
    old = _contents(data_dir)
    if old and not force:
        _refuse_if_held(data_dir)
        raise BackupError(
            f"{data_dir}: exists and is not empty; --force moves it aside (never deletes it)"
        )
    manifest = verify(target, shard=shard, shard_count=shard_count)
    jump = keys_after_restore(now() - manifest.created_at)
    created = not data_dir.exists()
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _holding(data_dir):
            if created:
                fsync_path(data_dir.parent)
            aside = _restore_into(target, manifest, jump, data_dir, old, now)
    except BaseException:
        if created:
            shutil.rmtree(data_dir, ignore_errors=True)
        raise
    return Restored(manifest, jump, aside)


def _restore_into(
    target: Path,
    manifest: Manifest,
    jump: int,
    data_dir: Path,
    old: list[Path],
    now: Callable[[], float],
) -> Path | None:
    for leftover in data_dir.glob(f"{RESTORING}*"):  # an earlier restore's, interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    staging = data_dir / f"{RESTORING}{os.getpid()}"
    staging.mkdir()
    try:
        for store in manifest.stores:
            shutil.copyfile(target / store.name, staging / store.name)
            _move_keys_on(staging / store.name, jump)
            fsync_path(staging / store.name)
        if problems := check(staging):
            raise BackupError(f"the restored {problems[0].store}: {problems[0].what}")
        write_key_floor(staging, key_floor(manifest) + jump)
        aside = None
        if old:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now()))
            aside = data_dir / f"{REPLACED}{stamp}"
            aside.mkdir()
            for entry in old:
                entry.rename(aside / entry.name)
            fsync_path(aside)
        # The floor first: stores in place without it would let a new table start at 1.
        for name in (KEY_FLOOR_NAME, *(store.name for store in manifest.stores)):
            (staging / name).rename(data_dir / name)
        staging.rmdir()
        fsync_path(data_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return aside


def _contents(data_dir: Path) -> list[Path]:
    """What ``data_dir`` holds that is data (all but :data:`NOT_DATA` and an interrupted
    restore's staging), sorted; none when it does not exist."""
    if not data_dir.is_dir():
        return []
    return sorted(
        entry
        for entry in data_dir.iterdir()
        if entry.name not in NOT_DATA and not entry.name.startswith(RESTORING)
    )


@contextlib.contextmanager
def _holding(data_dir: Path) -> Iterator[None]:
    """Hold ``data_dir``'s writer lock, as a writer would: no writer starts on a
    directory being restored.

    Error handling: :class:`BackupError` when a writer holds it."""
    fd = os.open(data_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _refuse_if_held(data_dir)
            raise BackupError(f"{data_dir}: a writer holds it; stop it first") from None
        yield
    finally:
        os.close(fd)


def after_replica_restore(data_dir: Path) -> int:
    """Move the key counters of the stores ``litestream restore`` put in ``data_dir``
    on by :data:`REPLICA_KEY_JUMP`, once they pass the check; returns the jump.

    Error handling: :class:`BackupError` when a writer holds ``data_dir``, it has no
    store, or one is not sound (nothing is changed then)."""
    _refuse_if_held(data_dir)
    stores = _stores_or_refuse(data_dir)
    if problems := check(data_dir):
        raise BackupError(f"{problems[0].store}: {problems[0].what}")
    floor = max([read_key_floor(data_dir), *_highest_keys(data_dir, stores)])
    write_key_floor(data_dir, floor + REPLICA_KEY_JUMP)
    for name in stores:
        _move_keys_on(data_dir / name, REPLICA_KEY_JUMP)
        fsync_path(data_dir / name)
    return REPLICA_KEY_JUMP


def key_floor(manifest: Manifest) -> int:
    """The highest key the backed-up writer could have given out in a table the backup
    does not hold, as of the backup: its own floor, or a key of any table it holds (each
    counter starts at the floor at least)."""
    counters = (seq for store in manifest.stores for seq in store.sequences.values())
    return max([manifest.key_floor, *counters])


def _highest_keys(data_dir: Path, stores: list[str]) -> Iterator[int]:
    for name in stores:
        yield from _sequences(data_dir / name).values()


def _move_keys_on(path: Path, jump: int) -> None:
    """Every key counter of the store past what the lost writer could have given out;
    a counter that never counted starts there too."""
    tables = [name for (name,) in _query(path, KEYED_TABLES)]
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as connection:
        connection.execute("BEGIN IMMEDIATE")
        for table in tables:
            seq = connection.execute(
                "SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)
            ).fetchone()
            if seq is None:
                connection.execute(
                    "INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", (table, jump)
                )
            else:
                connection.execute(
                    "UPDATE sqlite_sequence SET seq = ? WHERE name = ?", (seq[0] + jump, table)
                )
        connection.execute("COMMIT")


"""The tables whose keys are never reused: the bus log's ``records``, the tier's
``<tier>_records``."""


# --- check --------------------------------------------------------------------------------


def stores_in(data_dir: Path) -> list[str]:
    """The names of the stores ``data_dir`` holds, in :data:`STORE_FILES` order."""
    return [name for name in STORE_FILES if (data_dir / name).is_file()]


def _stores_or_refuse(data_dir: Path) -> list[str]:
    if not (stores := stores_in(data_dir)):
        raise BackupError(f"{data_dir}: no store in it ({', '.join(STORE_FILES)})")
    return stores


def _refuse_if_held(data_dir: Path) -> None:
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
    rows = [row[0] for row in _query(path, "PRAGMA integrity_check")]
    return [] if rows == ["ok"] else rows


def _counters_behind(path: Path) -> Iterator[str]:
    sequences = _sequences(path)
    for (table,) in _query(path, KEYED_TABLES):
        key = "sort_key" if table == "records" else "global_sequence"
        ((highest,),) = _query(path, f"SELECT max({key}) FROM {table}")
        if highest is not None and highest > sequences.get(table, 0):
            yield (
                f"{table}: the key counter is at {sequences.get(table, 0)} but a record has "
                f"{highest}: the next keys would name records already there"
            )


def _sequences(path: Path) -> dict[str, int]:
    return {name: int(seq) for name, seq in _query(path, "SELECT name, seq FROM sqlite_sequence")}


# --- files --------------------------------------------------------------------------------


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection (a writer serving the store goes on)."""
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        yield connection
    finally:
        connection.close()


def _query(path: Path, sql: str) -> list[Any]:
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
