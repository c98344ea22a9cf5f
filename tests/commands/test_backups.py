"""`cmdbus-trio backup | restore | check`, run as an operator runs them: a backup of a
writer that keeps serving under load, restored on a new data directory that a writer
then serves, with keys that never name two records; and every refusal, each changing
nothing."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.client import blocking
from cmdbus_trio.storage.restores import MIN_KEY_JUMP

from ..helpers import cli, serving

pytestmark = pytest.mark.e2e


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=120)


def lines(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def refused(done: subprocess.CompletedProcess[str], message: str, code: int = 1) -> None:
    assert done.returncode == code and done.stdout == "", (done.returncode, done.stdout)
    assert message in done.stderr, done.stderr


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` and its bytes: what "changes nothing" is held to."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_a_backup_of_a_serving_writer_restores_and_serves(tmp_path: Path) -> None:
    data = tmp_path / "data"
    target = tmp_path / "backup"
    acknowledged: list[int] = []
    with serving(tmp_path, CMDBUS_DATA_DIR=str(data)) as (writer, ports):
        with blocking.TierClient(ports["tier"]) as tier:
            tier.append("exec-1", json.dumps({"event_id": "e1"}))
        stop = threading.Event()

        def publish() -> None:  # the writer serves while the backup runs
            with blocking.IngestClient(ports["cmd_ingest"]) as ingest:
                while not stop.is_set():
                    record = {"execution_id": 1, "payload": "{}"}
                    acknowledged.append(ingest.publish(record).sort_key)

        publisher = threading.Thread(target=publish)
        publisher.start()
        time.sleep(0.5)
        before_backup = len(acknowledged)
        done = run("backup", "--data-dir", str(data), "--to", str(target), "--json")
        stop.set()
        publisher.join()
        rows = lines(done)
        assert [row.get("name") for row in rows[:3]] == [
            "commands.sqlite3", "events.sqlite3", "tier.sqlite3"
        ]  # fmt: skip
        in_backup = rows[0]["sequences"]["records"]
        assert acknowledged[before_backup - 1] <= in_backup <= acknowledged[-1]
        assert len(acknowledged) > before_backup  # it kept serving meanwhile
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=30) == 0
    manifest = json.loads((target / "manifest.json").read_text())
    assert (manifest["format"], manifest["shard"], manifest["shard_count"]) == (1, 0, 1)
    restored = tmp_path / "restored"
    done = lines(run("restore", "--from", str(target), "--data-dir", str(restored), "--json"))
    assert done[0]["key_jump"] >= MIN_KEY_JUMP
    assert lines(run("check", "--data-dir", str(restored), "--json")) == [{"sound": str(restored)}]
    (tmp_path / "again").mkdir()
    with serving(tmp_path / "again", CMDBUS_DATA_DIR=str(restored)) as (_, ports):
        with blocking.ClaimClient(ports["cmd_claim"]) as claim:
            assert claim.lag().total == in_backup  # every record up to the backup, no more
        with blocking.IngestClient(ports["cmd_ingest"]) as ingest:
            fresh = ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key
        assert fresh > acknowledged[-1] and fresh >= in_backup + MIN_KEY_JUMP
        with blocking.TierClient(ports["tier"]) as tier:
            page = tier.read_execution("exec-1")
            assert [json.loads(r.payload)["event_id"] for r in page.records] == ["e1"]
            later = tier.append("exec-1", json.dumps({"event_id": "e2"}))
            assert later.global_sequence > MIN_KEY_JUMP  # tier sequences moved on too


@pytest.fixture
def a_backup(tmp_path: Path) -> tuple[Path, Path]:
    """A stopped writer's data directory and a backup of it."""
    data, target = tmp_path / "data", tmp_path / "backup"
    with serving(tmp_path, CMDBUS_DATA_DIR=str(data)) as (writer, ports):
        with blocking.IngestClient(ports["cmd_ingest"]) as ingest:
            ingest.publish({"execution_id": 1, "payload": "{}"})
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=30) == 0
    lines(run("backup", "--data-dir", str(data), "--to", str(target), "--json"))
    return data, target


def test_a_backup_refuses_a_target_that_is_not_empty(a_backup: tuple[Path, Path]) -> None:
    data, target = a_backup
    before = snapshot(target)
    refused(run("backup", "--data-dir", str(data), "--to", str(target)), "is not empty")
    assert snapshot(target) == before
    refused(run("backup", "--data-dir", str(target.parent / "nowhere"), "--to", "x"), "no store")


def damage(target: Path, how: str) -> str:
    """Damage the backup ``how``; the message a restore must refuse it with."""
    store = target / "commands.sqlite3"
    manifest_path = target / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if how == "truncated":
        store.write_bytes(store.read_bytes()[:4096])
        return "the manifest says"
    if how == "altered":
        data = bytearray(store.read_bytes())
        data[-100] ^= 0xFF
        store.write_bytes(bytes(data))
        return "altered or damaged"
    if how == "newer format":
        manifest_path.write_text(json.dumps({**manifest, "format": 99}))
        return "newer than this version reads"
    if how == "another shard":
        manifest_path.write_text(json.dumps({**manifest, "shard": 1, "shard_count": 2}))
        return "a backup of shard 1 of 2"
    if how == "no manifest":
        manifest_path.unlink()
        return "not a backup, or one unfinished"
    if how == "missing store":
        (target / "tier.sqlite3").unlink()
        return "tier.sqlite3 is missing"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    ["truncated", "altered", "newer format", "another shard", "no manifest", "missing store"],
)
def test_a_restore_refuses_a_bad_backup_and_changes_nothing(
    a_backup: tuple[Path, Path], how: str
) -> None:
    _, target = a_backup
    message = damage(target, how)
    fresh = target.parent / "fresh"
    refused(run("restore", "--from", str(target), "--data-dir", str(fresh)), message)
    assert not fresh.exists() and not list(target.parent.glob(".fresh.restoring-*"))


def test_a_restore_refuses_a_data_dir_in_use_or_not_empty(
    tmp_path: Path, a_backup: tuple[Path, Path]
) -> None:
    data, target = a_backup
    before = snapshot(data)
    refused(run("restore", "--from", str(target), "--data-dir", str(data)), "--force moves it")
    with serving(tmp_path, CMDBUS_DATA_DIR=str(data)):
        done = run("restore", "--from", str(target), "--data-dir", str(data), "--force")
        refused(done, "a writer holds it")
        refused(run("check", "--data-dir", str(data)), "a writer holds it", code=3)
    before = snapshot(data)
    del before["writer.lock"]  # the lock stays: the restore holds it meanwhile
    moved = lines(run("restore", "--from", str(target), "--data-dir", str(data), "--force"))
    aside = Path(moved[0]["moved_aside"])
    assert snapshot(aside) == before  # moved, never deleted
    assert lines(run("check", "--data-dir", str(data)))[0] == {"sound": str(data)}


def test_after_litestream_refuses_a_dir_in_use_or_without_stores(
    tmp_path: Path, a_backup: tuple[Path, Path]
) -> None:
    data, _ = a_backup
    after = ("restore", "--after-litestream", "--data-dir")
    refused(run(*after, str(tmp_path / "empty")), "no store in it")
    with serving(tmp_path, CMDBUS_DATA_DIR=str(data)):
        refused(run(*after, str(data)), "a writer holds it")
    assert lines(run(*after, str(data), "--json"))[0]["key_jump"] == 1 << 40
    refused(run("restore", "--data-dir", str(data)), "one of the arguments", code=2)


def test_check_finds_a_damaged_store_and_a_counter_behind(a_backup: tuple[Path, Path]) -> None:
    data, _ = a_backup
    assert lines(run("check", "--data-dir", str(data))) == [{"sound": str(data)}]
    with sqlite3.connect(data / "commands.sqlite3") as connection:  # a counter set back
        connection.execute("UPDATE sqlite_sequence SET seq = 0 WHERE name = 'records'")
    done = run("check", "--data-dir", str(data), "--json")
    assert done.returncode == 1
    assert "the next keys would name records already there" in done.stdout
    tier = data / "tier.sqlite3"
    damaged = bytearray(tier.read_bytes())
    damaged[100:4096] = b"\xff" * (4096 - 100)  # the first page past the header
    tier.write_bytes(bytes(damaged))
    done = run("check", "--data-dir", str(data), "--human")
    assert done.returncode == 1 and "tier.sqlite3:" in done.stdout, done.stdout
    refused(run("check", "--data-dir", str(data.parent / "empty")), "no store in it", code=2)


@pytest.fixture
def a_volume(tmp_path: Path) -> Iterator[Path]:
    """A mount point, as a Kubernetes volume or a new disk is: a tmpfs the test mounts,
    with a new ext4's `lost+found` in it; skipped where mounting is not allowed."""
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(volume)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        (volume / "lost+found").mkdir()
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)


def test_a_restore_onto_a_mount_point(
    tmp_path: Path, a_backup: tuple[Path, Path], a_volume: Path
) -> None:
    """Onto a new volume (empty but for `lost+found`), then with --force onto the same
    volume that a writer has since served: the directory itself is never renamed (a
    mount point cannot be: EBUSY), what was there is moved aside inside it, and a writer
    serves the restored stores."""
    _, target = a_backup
    done = lines(run("restore", "--from", str(target), "--data-dir", str(a_volume), "--json"))
    assert done[0]["moved_aside"] is None
    assert (a_volume / "lost+found").is_dir()  # left where it was
    assert lines(run("check", "--data-dir", str(a_volume)))[0] == {"sound": str(a_volume)}
    with serving(tmp_path, CMDBUS_DATA_DIR=str(a_volume)) as (writer, ports):
        with blocking.IngestClient(ports["cmd_ingest"]) as ingest:
            assert ingest.publish({"execution_id": 2, "payload": "{}"}).sort_key > MIN_KEY_JUMP
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=30) == 0
    before = {
        name: data
        for name, data in snapshot(a_volume).items()
        if not name.startswith(("lost+found", "writer.lock"))
    }
    again = "restore", "--from", str(target), "--data-dir", str(a_volume), "--force", "--json"
    aside = Path(lines(run(*again))[0]["moved_aside"])
    assert aside.parent == a_volume and aside.name.startswith(".replaced-")
    assert snapshot(aside) == before  # moved, never deleted
    assert lines(run("check", "--data-dir", str(a_volume)))[0] == {"sound": str(a_volume)}
    assert not list(a_volume.glob(".restoring-*"))


def test_a_store_the_backup_lacks_starts_past_every_key_the_lost_writer_gave(
    tmp_path: Path, a_backup: tuple[Path, Path]
) -> None:
    """The backup holds the command store only (the tier store was made after it): on
    the restored writer the tier's sequences start past the jump too, as do the keys of
    the stores it holds, and a second restore from a backup of the restored writer moves
    them on again from there, though that backup lacks the tier store as well."""
    data, _ = a_backup
    for name in ("events.sqlite3", "tier.sqlite3"):
        for suffix in ("", "-wal", "-shm"):
            (data / f"{name}{suffix}").unlink(missing_ok=True)
    partial = tmp_path / "partial-backup"
    lines(run("backup", "--data-dir", str(data), "--to", str(partial), "--json"))
    restored = tmp_path / "restored"
    lines(run("restore", "--from", str(partial), "--data-dir", str(restored), "--json"))
    with serving(tmp_path, CMDBUS_DATA_DIR=str(restored)) as (writer, ports):
        with blocking.TierClient(ports["tier"]) as tier:
            first = tier.append("exec-1", "{}").global_sequence
        with blocking.IngestClient(ports["evt_ingest"]) as ingest:
            event = ingest.publish({"execution_id": 1, "payload": '{"event_type": "e"}'})
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=30) == 0
    assert first > MIN_KEY_JUMP and event.sort_key > MIN_KEY_JUMP
    for suffix in ("", "-wal", "-shm"):  # again a backup without the tier store
        (restored / f"tier.sqlite3{suffix}").unlink(missing_ok=True)
    again = tmp_path / "again"
    lines(run("backup", "--data-dir", str(restored), "--to", str(again), "--json"))
    twice = tmp_path / "twice"
    lines(run("restore", "--from", str(again), "--data-dir", str(twice), "--json"))
    with (
        serving(tmp_path, CMDBUS_DATA_DIR=str(twice)) as (_, ports),
        blocking.TierClient(ports["tier"]) as tier,
    ):
        assert tier.append("exec-2", "{}").global_sequence >= first + MIN_KEY_JUMP
