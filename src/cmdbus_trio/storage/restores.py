"""Restores of a data directory from a backup (``cmdbus-trio restore``) or after
``litestream restore`` (``--after-litestream``): synchronous, for the command line, never
the writer's loop. A restore checks the backup (:func:`.backups.verify`) before it writes
anything, builds the stores inside the data directory and renames them into place (never
the directory itself: it may be a volume's mount point), moves every key counter past
what the lost writer could have given out, and leaves a key floor for a store or table
the backup lacks (:func:`.datadir.read_key_floor`): no key ever names two records.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import attrs

from .backups import (
    BackupError,
    Manifest,
    check,
    counters,
    query,
    refuse_if_held,
    stores_or_refuse,
    verify,
)
from .datadir import LOCK_NAME, fsync_path
from .keys import KEY_FLOOR_NAME, KEYED_TABLES, read_key_floor, write_key_floor

MIN_KEY_JUMP: Final = 1 << 32
KEYS_A_SECOND: Final = 1_000_000
"""More records a second than one writer can take: with :data:`MIN_KEY_JUMP`, what a
restore moves every key counter on by, per second of the backup's age."""
REPLICA_KEY_JUMP: Final = 1 << 40
"""What a store restored from a Litestream replica moves its keys on by: the replica's
age against the lost writer is not known (its replication may have been broken a while
before the disk went), so a jump of 2**40, past what a writer taking 50,000 records a
second gives out in 250 days, and still below 2**53 (exact in JSON) after 8,000 of them."""


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
        refuse_if_held(data_dir)
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
            refuse_if_held(data_dir)
            raise BackupError(f"{data_dir}: a writer holds it; stop it first") from None
        yield
    finally:
        os.close(fd)


def after_replica_restore(data_dir: Path) -> int:
    """Move the key counters of the stores ``litestream restore`` put in ``data_dir``
    on by :data:`REPLICA_KEY_JUMP`, once they pass the check; returns the jump.

    Error handling: :class:`BackupError` when a writer holds ``data_dir``, it has no
    store, or one is not sound (nothing is changed then)."""
    refuse_if_held(data_dir)
    stores = stores_or_refuse(data_dir)
    if problems := check(data_dir):
        raise BackupError(f"{problems[0].store}: {problems[0].what}")
    return jump_keys(data_dir, stores)


def jump_keys(data_dir: Path, stores: list[str]) -> int:
    """Move every key counter of the ``stores`` (file names in ``data_dir``, none of them
    open) on by :data:`REPLICA_KEY_JUMP`, and the directory's key floor with them: what
    a copy that may lack the last records does before it serves (a restored replica, a
    standby taking over out of sync). Returns the jump."""
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
        yield from counters(data_dir / name).values()


def _move_keys_on(path: Path, jump: int) -> None:
    """Every key counter of the store past what the lost writer could have given out;
    a counter that never counted starts there too."""
    tables = [name for (name,) in query(path, KEYED_TABLES)]
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
