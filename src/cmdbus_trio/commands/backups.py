"""``cmdbus-trio backup | restore | check``: a data directory copied while its writer
serves it, put back on a new volume, and checked offline (docs/operations.md).

Each prints for a human on a terminal and JSON lines otherwise (``--human`` /
``--json`` to choose); an error is one line on stderr, and nothing was changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from cmdbus_trio import __version__
from cmdbus_trio.config import ConfigError, load
from cmdbus_trio.storage import backups, restores
from cmdbus_trio.storage.backups import BackupError

from ._output import add_output_arguments, human_wanted

CHECK_EXIT = {"sound": 0, "unsound": 1, "usage": 2, "held": 3}
"""``check``'s exit codes: sound; a problem found (each printed); bad usage or no data
directory there; a writer holds it (not checked: stop it, or check a backup)."""


def _shard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shard", help="the writer's shard (default: CMDBUS_SHARD, as the writer reads it)"
    )
    parser.add_argument(
        "--shard-count", help="the cluster's shards (default: CMDBUS_SHARD_COUNT, else 1)"
    )


def _shard_of(args: argparse.Namespace) -> tuple[int, int]:
    """The shard as the writer's own settings say (flags, then CMDBUS_* variables)."""
    flags = {"shard": args.shard, "shard_count": args.shard_count}
    environ = {k: v for k, v in os.environ.items() if k in ("CMDBUS_SHARD", "CMDBUS_SHARD_COUNT")}
    config = load({k: v for k, v in flags.items() if v is not None}, environ=environ)
    return config.shard, config.shard_count


def _print(args: argparse.Namespace, document: dict[str, Any], text: str) -> None:
    print(text if human_wanted(args) else json.dumps(document, separators=(",", ":")), flush=True)


def _refused(command: str, message: str, code: int = 1) -> int:
    print(f"cmdbus-trio {command}: {message}", file=sys.stderr, flush=True)
    return code


class _Bar:
    """A progress bar on stderr for a human on a terminal: a store's copy, read from the
    size of its partial file while the copy runs."""

    def __init__(self, target: Path, shown: bool) -> None:
        self._target = target
        self._shown = shown and sys.stderr.isatty()
        self._store: tuple[str, int] | None = None
        self._done = threading.Event()

    def __call__(self, store: str, copied: int, total: int) -> None:
        self._store = (store, total)
        self._draw(copied)
        if copied and copied >= total and self._shown:
            print(file=sys.stderr)

    def watch(self) -> None:
        while not self._done.wait(0.2):
            if self._store is not None:
                partial = self._target / (self._store[0] + backups.PARTIAL)
                if partial.exists():
                    self._draw(partial.stat().st_size)

    def stop(self) -> None:
        self._done.set()

    def _draw(self, copied: int) -> None:
        if not self._shown or self._store is None:
            return
        store, total = self._store
        share = min(1.0, copied / total) if total else 1.0
        bar = "#" * int(share * 30)
        print(f"\r{store:<18} [{bar:<30}] {share:4.0%} {copied / 2**20:8.1f} MiB",
              end="", file=sys.stderr, flush=True)  # fmt: skip


class Backup:
    """Copy a data directory while its writer serves it: each store from one read
    snapshot (SQLite's online backup), checked with ``PRAGMA integrity_check``, and a
    manifest (format, writer version, shard, each store's size, SHA-256 and highest
    keys, the time) written last. TARGET must not exist or be empty. Exits 0 once every
    copy passed its check."""

    HELP = "copy a data directory while its writer serves it"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--data-dir", type=Path, required=True, help="the writer's")
        parser.add_argument("--to", type=Path, required=True, dest="target", metavar="TARGET")
        _shard_arguments(parser)
        add_output_arguments(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        try:
            shard, shard_count = _shard_of(args)
        except ConfigError as exc:
            return _refused("backup", str(exc), 2)
        bar = _Bar(args.target, human_wanted(args))
        watcher = threading.Thread(target=bar.watch, daemon=True)
        watcher.start()
        started = time.monotonic()
        try:
            manifest = backups.backup(
                args.data_dir,
                args.target,
                shard=shard,
                shard_count=shard_count,
                writer_version=__version__,
                progress=bar,
            )
        except (BackupError, OSError) as exc:
            return _refused("backup", str(exc))
        finally:
            bar.stop()
        seconds = time.monotonic() - started
        for store in manifest.stores:
            text = f"{store.name}: {store.bytes / 2**20:.1f} MiB, sha256 {store.sha256[:16]}…"
            _print(args, attrs.asdict(store), text)
        done = f"backup of shard {shard}/{shard_count} in {args.target} ({seconds:.1f} s)"
        _print(args, {"backup": str(args.target), "seconds": round(seconds, 3)}, done)
        return 0


class Restore:
    """Put a backup back as a data directory. Refuses one a writer holds, or one that is
    not empty (``--force`` moves it aside, never deletes it). Checks the manifest, the
    shard and every file's size and SHA-256 before it writes anything. The restored
    stores give out keys past any the lost writer could have given after the backup, so
    a key never names two records. With ``--after-litestream`` instead of ``--from``:
    the stores ``litestream restore`` just put in the data directory are checked and
    their keys moved on the same way."""

    HELP = "restore a backup as a data directory"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--from", type=Path, dest="source", metavar="TARGET")
        source.add_argument(
            "--after-litestream",
            action="store_true",
            help="the stores in --data-dir were just restored by `litestream restore`: "
            "check them and move their keys on",
        )
        parser.add_argument("--data-dir", type=Path, required=True)
        parser.add_argument(
            "--force", action="store_true", help="move a data directory that is there aside"
        )
        _shard_arguments(parser)
        add_output_arguments(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        if args.after_litestream:
            try:
                jump = restores.after_replica_restore(args.data_dir)
            except (BackupError, OSError) as exc:
                return _refused("restore", str(exc))
            text = f"{args.data_dir}: sound; new keys start {jump} past the replica's"
            _print(args, {"restored": str(args.data_dir), "key_jump": jump}, text)
            return 0
        try:
            shard, shard_count = _shard_of(args)
        except ConfigError as exc:
            return _refused("restore", str(exc), 2)
        try:
            restored = restores.restore(
                args.source, args.data_dir, shard=shard, shard_count=shard_count, force=args.force
            )
        except (BackupError, OSError) as exc:
            return _refused("restore", str(exc))
        manifest = restored.manifest
        age = time.time() - manifest.created_at
        document = {
            "restored": str(args.data_dir),
            "backup_taken_at": manifest.created_at,
            "key_jump": restored.key_jump,
            "moved_aside": None if restored.moved_aside is None else str(restored.moved_aside),
        }
        text = (
            f"restored {args.data_dir} from a backup taken {age:.0f} s ago; what was "
            f"acknowledged after it is lost; new keys start {restored.key_jump} past its own"
        )
        if restored.moved_aside is not None:
            text += f"; the old data directory is {restored.moved_aside}"
        _print(args, document, text)
        return 0


class Check:
    """Check a data directory offline: every store opens, passes ``PRAGMA
    integrity_check``, and no key counter is behind a key already given. Exit 0: sound;
    1: a problem found (each printed); 2: bad usage, or no store there; 3: a writer
    holds it (nothing checked)."""

    HELP = "check a data directory offline"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--data-dir", type=Path, required=True)
        add_output_arguments(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        data_dir: Path = args.data_dir
        if holder := backups.held_by(data_dir):
            message = f"{data_dir}: a writer holds it (pid {holder}); check it once stopped"
            return _refused("check", message, CHECK_EXIT["held"])
        if not backups.stores_in(data_dir):
            return _refused("check", f"{data_dir}: no store in it", CHECK_EXIT["usage"])
        problems = backups.check(data_dir)
        for problem in problems:
            _print(args, attrs.asdict(problem), f"{problem.store}: {problem.what}")
        if problems:
            return CHECK_EXIT["unsound"]
        _print(args, {"sound": str(data_dir)}, f"{data_dir}: sound")
        return CHECK_EXIT["sound"]
