"""The tier's retention: history is kept for ever by default; a tier with
``CMDBUS_TIER_<TIER>_RETENTION_MS`` set deletes the history of an execution nothing was
appended to for that long, in bounded steps paced as the buses' are."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.config import Config
from cmdbus_trio.loop.paced import in_steps
from cmdbus_trio.storage import VACUUM_PAGES, StoreUnavailable
from cmdbus_trio.storage.tier import TierStore

IDLE_EXECUTIONS_PER_STEP = 100
"""Executions one tier retention step deletes at most."""


async def run_tier_retention(
    store: TierStore,
    windows: Mapping[str, float],
    interval: float,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Delete, every ``interval`` seconds, the history of executions nothing was appended
    to for their tier's window (``windows``: tier -> seconds), up to
    :data:`IDLE_EXECUTIONS_PER_STEP` per tier a step, resting as the
    buses' retention does.

    Cancellation and error handling: as
    :func:`cmdbus_trio.bus.retention.run_retention`."""
    limiter = trio.CapacityLimiter(1)

    async def step() -> bool:
        more = False
        for tier, window in windows.items():
            idle = await run_in_thread(
                store.idle_executions, tier, window, IDLE_EXECUTIONS_PER_STEP, limiter=limiter
            )
            for execution_id in idle:  # one appended to meanwhile is skipped
                delete = partial(store.delete_execution, tier, execution_id, idle_for=window)
                deleted = await run_in_thread(delete, limiter=limiter)
                metrics.RETAINED.labels(store="tier", kind="records").inc(deleted)
            more = more or len(idle) == IDLE_EXECUTIONS_PER_STEP
        await run_in_thread(store.vacuum_step, VACUUM_PAGES, limiter=limiter)
        return more

    task_status.started()
    await in_steps(step, interval, over=StoreUnavailable)


def tier_windows(config: Config) -> dict[str, float]:
    """Seconds each tier keeps an idle execution's history, for the tiers that do not keep
    it for ever."""
    windows = {
        "eventlog": config.tier_eventlog_retention_ms,
        "projection": config.tier_projection_retention_ms,
        "catalog": config.tier_catalog_retention_ms,
    }
    return {tier: ms / 1000 for tier, ms in windows.items() if ms}
