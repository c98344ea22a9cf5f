"""A store's WAL: its size and checkpoint count read from the file, the age of its last
full checkpoint, and the ceiling past which the writer checkpoints it whoever else
should (`CMDBUS_CHECKPOINTS=litestream` with no Litestream)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cmdbus_trio.client import blocking
from cmdbus_trio.commands._scrape import Scrape
from cmdbus_trio.commands._verdicts import NO_CHECKPOINT_AGE, no_checkpointer
from cmdbus_trio.storage import CheckpointWatch, WalState
from cmdbus_trio.storage.tier import NewRecord, TierStore

from ..helpers import metrics_text, server_log, serving

PAYLOAD = json.dumps({"padding": "x" * 1000})


def test_the_wal_is_read_from_its_file_and_a_checkpoint_moves_its_number(
    tmp_path: Path,
) -> None:
    store = TierStore.open(tmp_path / "tier.sqlite3", checkpoints="litestream")
    try:
        store.append_batch("eventlog", "e", [NewRecord(PAYLOAD)] * 200)
        grown = store.wal()
        assert grown.bytes > 200_000 and grown.checkpoints is not None
        assert not store.checkpoint_past(grown.bytes)  # at the ceiling: not past it
        assert store.checkpoint_past(1 << 16)
        assert store.wal() == WalState(0, None)  # truncated
        store.append_batch("eventlog", "e", [NewRecord(PAYLOAD)])
        again = store.wal()
        assert again.checkpoints is not None and again.checkpoints != grown.checkpoints
    finally:
        store.close()


def test_a_checkpoint_is_seen_when_the_number_moves_or_the_wal_shrinks() -> None:
    watch = CheckpointWatch(now=100.0)
    assert watch.seen("tier", WalState(4096, 7), 105.0) == 5.0  # since the watch began
    assert watch.seen("tier", WalState(9000, 7), 110.0) == 10.0  # grew: no checkpoint
    assert watch.seen("tier", WalState(9000, 8), 111.0) == 0.0  # its number moved
    assert watch.seen("tier", WalState(9000, 8), 115.0) == 4.0
    assert watch.seen("events", WalState(9000, 3), 115.0) == 15.0  # each store its own
    assert watch.seen("tier", WalState(0, None), 116.0) == 0.0  # truncated


def wal_scrape(wal: float, age: float, forced: float, ceiling: float = 1 << 20) -> Scrape:
    return Scrape(
        f'cmdbus_store_wal_bytes{{store="tier"}} {wal}\n'
        f'cmdbus_store_checkpoint_age_seconds{{store="tier"}} {age}\n'
        f'cmdbus_store_wal_ceiling_checkpoints_total{{store="tier"}} {forced}\n'
        f"cmdbus_store_wal_ceiling_bytes {ceiling}\n"
    )


def test_no_checkpointer_is_found_and_its_twins_are_not() -> None:
    """The writer checkpointed at its ceiling between the scrapes, or the WAL is past
    half the ceiling with no checkpoint for NO_CHECKPOINT_AGE: found. A large WAL
    checkpointed lately, or an old one that is small, is not."""
    quiet = wal_scrape(1000, 5, 0)
    forced = no_checkpointer(quiet, wal_scrape(1000, 0, 1), 3.0)
    assert [f.verdict for f in forced] == ["no checkpointer"]
    assert forced[0].summary.startswith("store tier: its WAL is not checkpointed")
    old = NO_CHECKPOINT_AGE
    assert no_checkpointer(quiet, wal_scrape(600_000, old, 0), 3.0) != []
    assert no_checkpointer(quiet, wal_scrape(600_000, old - 1, 0), 3.0) == []  # lately
    assert no_checkpointer(quiet, wal_scrape(400_000, old * 10, 0), 3.0) == []  # small
    assert no_checkpointer(quiet, quiet, 3.0) == []


def wal_comes_back_under(wal: Path, ceiling: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not wal.exists() or wal.stat().st_size <= ceiling:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.slow
def test_a_wal_nothing_checkpoints_is_bounded_by_the_ceiling(tmp_path: Path) -> None:
    """Litestream's checkpoints asked for and none running: 8,000 tier records of 1 KB
    (8 MB of WAL unchecked), a megabyte at a time, and after each the writer brings the
    WAL back under a 1 MiB ceiling within a few of its passes (every 100 ms), says why in
    its log and counts it, and the metrics show the WAL and its checkpoint age. (Each
    megabyte waits for that: how much is written within one pass depends on the
    machine, and once bounded a WAL file only shrinks when it is checkpointed.)"""
    ceiling = 1 << 20
    env = {
        "CMDBUS_CHECKPOINTS": "litestream",
        "CMDBUS_WAL_CEILING_BYTES": str(ceiling),
        "CMDBUS_RETENTION_INTERVAL_MS": "100",
    }
    wal = tmp_path / "data" / "tier.sqlite3-wal"
    with serving(tmp_path, **env) as (_, ports), blocking.TierClient(ports["tier"]) as tier:
        for megabyte in range(8):
            for _ in range(10):
                tier.append_batch("history", [PAYLOAD] * 100)
            assert wal_comes_back_under(wal, ceiling, within=10.0), (megabyte, wal.stat())
        text = metrics_text(ports)
    assert 'cmdbus_store_wal_ceiling_checkpoints_total{store="tier"}' in text
    forced = [line for line in text.splitlines() if line.startswith("cmdbus_store_wal_ceiling_c")]
    assert any(float(line.split()[-1]) >= 1 for line in forced if '"tier"' in line), forced
    assert 'cmdbus_store_checkpoint_age_seconds{store="tier"}' in text
    assert "wal_ceiling_checkpoint" in server_log(tmp_path)
