"""The command a member runs while primary (ha/while_primary.py), as real processes: it
runs until the member stops being primary, is stopped with SIGTERM (killed when it ignores
it past the grace), started again when it exits on its own (logged and counted), and
stopped when the member's task is cancelled."""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import pytest
import trio
from prometheus_client import generate_latest

from cmdbus_trio import metrics
from cmdbus_trio.ha import while_primary
from cmdbus_trio.storage.tier import NewRecord, TierStore

from ..helpers import metric_sum


def command(tmp_path: Path, *, ignore_term: bool = False, exit_after: float = 60.0) -> list[str]:
    """A process that appends its pid to tmp_path/pids, then sleeps ``exit_after``."""
    script = (
        "import os, signal, sys, time\n"
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
        + f"open({str(tmp_path / 'pids')!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        + f"time.sleep({exit_after})\n"
    )
    return [sys.executable, "-c", script]


def pids(tmp_path: Path) -> list[int]:
    path = tmp_path / "pids"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def run(command: list[str]) -> Callable[[trio.Event], Awaitable[None]]:
    return while_primary.WhilePrimary(command).run


async def started(tmp_path: Path, count: int = 1) -> list[int]:
    while len(pids(tmp_path)) < count:
        await trio.sleep(0.02)
    return pids(tmp_path)


async def test_it_runs_until_the_member_stops_being_primary_then_is_stopped(
    tmp_path: Path,
) -> None:
    until = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run(command(tmp_path)), until)
            [pid] = await started(tmp_path)
            await trio.sleep(0.3)
            assert alive(pid)
            until.set()
        assert not alive(pid)


async def test_one_that_ignores_sigterm_is_killed_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(while_primary, "STOP_GRACE_S", 0.5)
    until = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run(command(tmp_path, ignore_term=True)), until)
            [pid] = await started(tmp_path)
            await trio.sleep(0.3)  # (its handler set before it wrote its pid)
            took = trio.current_time()
            until.set()
        took = trio.current_time() - took
        assert not alive(pid)
        assert took >= 0.5  # it had the grace, and no more than it needed


async def test_one_that_exits_on_its_own_is_counted_and_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(while_primary, "RESTART_AFTER_S", 0.3)
    before = metric_sum(metrics_text(), "cmdbus_ha_while_primary_exits_total")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run(command(tmp_path, exit_after=0.1)), trio.Event())
            first = trio.current_time()
            await started(tmp_path, 3)
            assert trio.current_time() - first >= 2 * 0.3  # restarted after the wait, each time
            nursery.cancel_scope.cancel()
    exits = metric_sum(metrics_text(), "cmdbus_ha_while_primary_exits_total") - before
    assert exits >= 2
    assert not any(alive(pid) for pid in pids(tmp_path))


async def test_one_that_cannot_start_is_counted_and_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The program gone (or made not executable) after the writer started: the member
    goes on serving, and tries again."""
    monkeypatch.setattr(while_primary, "RESTART_AFTER_S", 0.2)
    before = metric_sum(metrics_text(), "cmdbus_ha_while_primary_exits_total")
    with trio.fail_after(20), trio.move_on_after(1.0):
        await run([str(tmp_path / "gone")])(trio.Event())
    exits = metric_sum(metrics_text(), "cmdbus_ha_while_primary_exits_total") - before
    assert 3 <= exits <= 6  # a try each 0.2 s, no faster


async def test_it_is_stopped_when_the_member_task_is_cancelled(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run(command(tmp_path)), trio.Event())
            [pid] = await started(tmp_path)
            nursery.cancel_scope.cancel()
        assert not alive(pid)


async def test_stop_stops_it_and_returns_once_it_exited(tmp_path: Path) -> None:
    """As the member calls it before its stores close: the command has exited when
    ``stop`` returns, and is not started again."""
    runner = while_primary.WhilePrimary(command(tmp_path))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.run, trio.Event())
            [pid] = await started(tmp_path)
            await runner.stop()
            assert not alive(pid)
        await runner.run(trio.Event())  # (returns at once)
    assert pids(tmp_path) == [pid]


async def test_stop_before_it_ran_returns_at_once_and_it_never_starts(tmp_path: Path) -> None:
    """The faces failed to start, say: the member's stores close without it."""
    runner = while_primary.WhilePrimary(command(tmp_path))
    with trio.fail_after(20):
        await runner.stop()
        await runner.run(trio.Event())
    await trio.sleep(0.2)
    assert pids(tmp_path) == []


def metrics_text() -> str:
    return generate_latest(metrics.REGISTRY).decode()


async def test_before_start_is_awaited_before_every_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(while_primary, "RESTART_AFTER_S", 0.1)
    seen: list[int] = []  # how many had started when it was awaited

    async def before_start() -> None:
        seen.append(len(pids(tmp_path)))

    restarting = while_primary.WhilePrimary(
        command(tmp_path, exit_after=0.1), before_start=before_start
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(restarting.run, trio.Event())
            await started(tmp_path, 3)
            nursery.cancel_scope.cancel()
    assert seen[:3] == [0, 1, 2]


@pytest.mark.parametrize("reader", [False, True])
async def test_truncate_wals_cuts_every_wal_back_or_says_which_it_could_not(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    reader: bool,
) -> None:
    """A reader on the WAL (a read transaction) for longer than every try: a warning
    names the store, and the other stores are cut back all the same."""
    monkeypatch.setattr(while_primary, "TRUNCATE_TRIES", 2)
    offload = trio.to_thread.run_sync
    stores = {
        name: await offload(partial(TierStore.open, tmp_path / f"{name}.sqlite3"))
        for name in ("tier", "other")
    }
    for store in stores.values():
        await offload(partial(store.append, "eventlog", "e", NewRecord(payload="{}")))
    held = sqlite3.connect(tmp_path / "tier.sqlite3", check_same_thread=False)
    try:
        if reader:
            held.execute("BEGIN")
            held.execute("SELECT count(*) FROM eventlog_records").fetchone()
        await while_primary.truncate_wals(stores, offload)
        wals = {name: (tmp_path / f"{name}.sqlite3-wal").stat().st_size for name in stores}
    finally:
        held.close()
        for store in stores.values():
            await offload(store.close)
    warned = [
        r.cmdbus_fields["store"] for r in caplog.records if r.getMessage() == "wal_not_truncated"
    ]
    if reader:
        assert warned == ["tier"] and wals["tier"] > 0 and wals["other"] == 0
    else:
        assert warned == [] and wals == {"tier": 0, "other": 0}
