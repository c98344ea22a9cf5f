"""Background tasks are supervised like faces: a committer, body reader, claim timers,
lag sampler, consumer groups, retention, store-size sampler or shed watcher that dies is
logged, counted, named by /readyz, fails /livez after the liveness window, and the control
face keeps answering."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

from cmdbus_trio import app, metrics
from cmdbus_trio.admission import Gate
from cmdbus_trio.bus.bodies import BodyReader
from cmdbus_trio.bus.claims import Claims
from cmdbus_trio.bus.committer import GroupCommitter
from cmdbus_trio.bus.groups import ConsumerGroups
from cmdbus_trio.config import DATA_FACE_NAMES, Config
from cmdbus_trio.tier.committer import TierCommitter

from .helpers import get, running_writer


async def crash(
    *_: Any, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED, **__: Any
) -> None:
    task_status.started()
    await trio.sleep(0.05)
    raise RuntimeError("injected")


TARGETS: dict[str, tuple[Any, str, list[str]]] = {
    "committer": (GroupCommitter, "run", ["commands.committer", "events.committer"]),
    "bodies": (BodyReader, "run", ["commands.bodies", "events.bodies"]),
    "claim timers": (Claims, "run_timers", ["commands.groups", "events.groups"]),
    "lag sampler": (ConsumerGroups, "_sample_lag", ["commands.groups", "events.groups"]),
    "groups": (ConsumerGroups, "run", ["commands.groups", "events.groups"]),
    "retention": (app, "run_retention", ["commands.retention", "events.retention"]),
    "tier retention": (app, "run_tier_retention", ["tier.retention"]),
    "tier committer": (TierCommitter, "run", ["tier.committer"]),
    "store sizes": (app, "measure_stores", ["store_sizes"]),
    "gate timers": (
        Gate,
        "run_timers",
        [f"{gate}.timers" for gate in (*DATA_FACE_NAMES, "tier_writes")],
    ),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
async def test_a_crashed_background_task_is_seen_and_contained(
    make_config: Callable[..., Config],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    target: str,
) -> None:
    owner, attribute, tasks = TARGETS[target]
    monkeypatch.setattr(owner, attribute, crash)
    before = {t: _crashes(t) for t in tasks}
    binds = {f"{face}_bind": "127.0.0.1:0" for face in DATA_FACE_NAMES}
    config = make_config(liveness_window_ms=1500, tier_eventlog_retention_ms=3_600_000, **binds)
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):
            await trio.sleep(0.2)
            readyz = await get(addresses["control"], "/readyz")
            assert readyz.status == 503
            for task in tasks:
                assert f"task {task} crashed" in readyz.json()["reasons"]
                assert _crashes(task) == before[task] + 1
            assert (await get(addresses["control"], "/healthz")).status == 200
            assert (await get(addresses["control"], "/livez")).status == 200  # within window
            await trio.sleep(1.6)  # past the window, counted from the crash
            livez = await get(addresses["control"], "/livez")
            assert livez.status == 503 and livez.json()["status"] == "task_crashed"
            assert (await get(addresses["control"], "/metrics")).status == 200
    logged = [r for r in caplog.records if r.getMessage() == "task_crashed"]
    assert len(logged) == len(tasks)


def _crashes(task: str) -> float:
    value = metrics.REGISTRY.get_sample_value("cmdbus_task_crashes_total", {"task": task})
    return value or 0.0
