"""The writer's periodic measures of its stores and data dir (a background task)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import trio

from . import metrics
from .admission import run_in_thread
from .storage import CheckpointWatch, Store


async def measure_stores(
    stores: Mapping[str, Store],
    data_dir: Path,
    period: float,
    wal_ceiling: int,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Every store's bytes, WAL and checkpoint age (its WAL checkpointed past ``wal_ceiling``),
    the data dir's free and total bytes, every ``period`` (in a thread, never on the loop)."""
    limiter = trio.CapacityLimiter(1)
    checkpoints = CheckpointWatch(trio.current_time())
    metrics.STORE_WAL_CEILING.set(wal_ceiling)
    task_status.started()
    while True:
        for name, store in list(stores.items()):
            size = await run_in_thread(store.disk_bytes, limiter=limiter)
            metrics.STORE_BYTES.labels(store=name).set(size)
            wal = await run_in_thread(store.wal, limiter=limiter)
            metrics.STORE_WAL_BYTES.labels(store=name).set(wal.bytes)
            age = checkpoints.seen(name, wal, trio.current_time())
            metrics.STORE_CHECKPOINT_AGE.labels(store=name).set(age)
            if wal.bytes > wal_ceiling:  # (it logs why)
                await run_in_thread(store.checkpoint_past, wal_ceiling, age, limiter=limiter)
        volume = await run_in_thread(os.statvfs, data_dir, limiter=limiter)
        metrics.DATA_DIR_FREE.set(volume.f_bavail * volume.f_frsize)
        metrics.DATA_DIR_CAPACITY.set(volume.f_blocks * volume.f_frsize)
        await trio.sleep(period)
