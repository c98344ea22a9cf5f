"""The data plane's share of each turn of the loop (``cmdbus_trio.loop.turns``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import trio
import trio.testing

from cmdbus_trio.config import Config
from cmdbus_trio.loop import turns
from cmdbus_trio.loop.turns import TurnBudget
from cmdbus_trio.protocol import encode_frame

from ..helpers import frame_client, get, metric_sum, running_writer

RECORD = {"execution_id": 1, "payload": "{}"}


def installed(share: float) -> TurnBudget:
    budget = TurnBudget(share)
    trio.lowlevel.add_instrument(budget)
    return budget


def spend(seconds: float) -> None:
    """Work on the loop for ``seconds`` of the real clock (a share is real time) and of
    this thread's CPU time (a control step is charged its CPU time): on a busy machine
    the thread may be preempted, and wall time alone then left a step short of CPU."""
    wall, cpu = time.perf_counter() + seconds, time.thread_time() + seconds
    while time.perf_counter() < wall or time.thread_time() < cpu:
        pass


async def spend_the_share_then_wait(budget: TurnBudget) -> None:
    await budget.wait()
    spend(budget.share * 2)
    await budget.wait()


async def test_a_unit_waits_for_the_next_turn_once_the_share_is_spent() -> None:
    budget = installed(0.002)
    await trio.lowlevel.checkpoint()  # a fresh turn
    began = budget.statistics().turns
    await budget.wait()
    assert budget.statistics().turns == began  # room: let through at once
    spend(0.003)
    assert not budget.has_room()
    with trio.fail_after(5):  # a loop asleep while it waits fails here, not hangs
        await budget.wait()
    assert budget.statistics().turns > began
    assert budget.statistics().deferred == 1


async def test_a_unit_runs_in_this_turn_while_the_share_has_room() -> None:
    budget = installed(60.0)
    await trio.lowlevel.checkpoint()
    began = budget.statistics().turns
    for _ in range(100):
        assert budget.has_room()
        await budget.wait()
    statistics = budget.statistics()
    assert (statistics.turns, statistics.deferred) == (began, 0)


async def test_busy_counts_the_loops_work_and_not_its_waits() -> None:
    budget = installed(60.0)
    await trio.lowlevel.checkpoint()
    before = budget.statistics().busy
    spend(0.05)
    await trio.sleep(0.5)  # the loop waits for the timer: idle, not busy
    busy = budget.statistics().busy - before
    assert 0.05 <= busy < 0.3, busy


async def test_the_first_unit_of_every_turn_is_let_through() -> None:
    """With no share at all, the data plane still does one unit a turn: never starved."""
    budget = installed(0.0)
    admitted: list[tuple[int, str]] = []

    async def worker(name: str) -> None:
        for _ in range(5):
            await budget.wait()
            admitted.append((budget.statistics().turns, name))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for name in "abc":
                nursery.start_soon(worker, name)
    assert sorted(name for _, name in admitted) == sorted("abc" * 5)
    turns_seen = [turn for turn, _ in admitted]
    assert len(set(turns_seen)) == len(turns_seen)  # one a turn (the first is let through)


async def test_deferred_units_do_not_wait_for_the_next_deadline() -> None:
    """A parked task is not ready: with nothing else ready, the loop would sleep until
    the next deadline (here 5 s away), so one waiter stays ready and keeps it turning."""
    budget = installed(0.001)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(spend_the_share_then_wait, budget)
    assert budget.statistics().deferred >= 3


async def test_a_cancelled_wait_leaves_the_next_waiters_turning() -> None:
    budget = installed(0.001)
    await budget.wait()
    spend(0.002)
    with trio.CancelScope() as scope:
        scope.cancel()
        await budget.wait()  # the waiter that keeps the loop turning
    assert scope.cancelled_caught
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(spend_the_share_then_wait, budget)


async def test_no_data_plane_unit_runs_while_a_control_task_is_ready() -> None:
    budget = installed(60.0)  # room for every unit in one turn, but for the control face
    admitted: list[int] = []
    control_ended: list[int] = []

    async def spin() -> None:
        for _ in range(60):
            await trio.lowlevel.checkpoint()
        control_ended.append(budget.statistics().turns)

    async def control(*, task_status: trio.TaskStatus[None]) -> None:
        budget.put_first(trio.lowlevel.current_task())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spin)  # spawned by a control task: the control face's too
            task_status.started()

    async def worker(units: int) -> None:
        for _ in range(units):
            await budget.wait()
            admitted.append(budget.statistics().turns)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(control)
            for _ in range(3):
                nursery.start_soon(worker, 5)
        assert len(admitted) == 15
        assert min(admitted) > control_ended[0]  # none while the control face ran
        assert len(set(admitted)) == 1  # then all in one turn, as the share allows
        assert budget.statistics().control_first > 0
        await trio.lowlevel.checkpoint()
        admitted.clear()
        await worker(50)
    assert len(set(admitted)) == 1  # with no control task: all in one


async def test_the_control_face_is_favoured_for_at_most_its_share_of_the_loop() -> None:
    """A control face that is always ready (a flood of probes) costs the data plane at
    most CONTROL_FIRST_SHARE of the loop's time, after a first burst."""
    now = [0.0]
    budget = TurnBudget(60.0, clock=lambda: now[0])
    trio.lowlevel.add_instrument(budget)
    room: list[bool] = []

    async def control() -> None:
        budget.put_first(trio.lowlevel.current_task())
        for _ in range(2000):
            now[0] += 0.01  # each turn lasts 10 ms of the budget's clock
            room.append(budget.has_room())
            await trio.lowlevel.checkpoint()

    async def worker() -> None:
        for _ in range(200):
            await budget.wait()
        worker_done.append(len(room))

    worker_done: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(control)
            nursery.start_soon(worker)
    # Not starved: the data plane runs in the turns the control face may not have.
    assert worker_done and worker_done[0] < 2000
    statistics = budget.statistics()
    assert statistics.busy >= 19.0
    assert statistics.control_first <= (
        turns.CONTROL_FIRST_SHARE * statistics.busy + turns.CONTROL_FIRST_BURST + 0.01
    )
    assert statistics.control_first >= 0.8 * turns.CONTROL_FIRST_SHARE * statistics.busy
    assert room[1:6] == [False] * 5  # favoured from its next turn, within the burst
    assert room.count(True) >= 0.7 * len(room)


async def test_a_turn_end_callback_runs_once_as_its_turn_ends() -> None:
    """Not before the turn's other ready tasks have run, and once only."""
    budget = turns.current()
    calls: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.lowlevel.checkpoint)  # ready in the next turn
        budget.at_turn_end(lambda: calls.append("end"))
        calls.append("this turn")
        await trio.sleep(0.01)  # a few turns later
    assert calls == ["this turn", "end"]


async def test_current_is_one_budget_per_run_and_counts_turns() -> None:
    budget = turns.current()
    assert turns.current() is budget
    assert budget.share == turns.DATA_PLANE_SHARE
    began = budget.statistics().turns
    for _ in range(3):
        await trio.lowlevel.checkpoint()
    assert budget.statistics().turns >= began + 3


async def test_a_writer_with_no_share_answers_every_pipelined_request(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every unit of data-plane work but a turn's first waits a turn, and a pipelined
    burst on several connections is still answered whole, with probes answered beside."""
    monkeypatch.setattr(turns, "DATA_PLANE_SHARE", 0.0)
    config = make_config(cmd_ingest_bind="127.0.0.1:0")
    answered: list[int] = []

    async def publisher(address: str, client_id: int) -> None:
        record = {"execution_id": client_id, "payload": json.dumps({"execution_pool": "p"})}
        requests = [{"id": i, "op": "publish", "record": record} for i in range(50)]
        async with frame_client(address) as client:
            await client.stream.send_all(
                b"".join(encode_frame(json.dumps(request).encode()) for request in requests)
            )
            for _ in requests:
                reply = await client.receive_json()
                assert "sort_key" in reply, reply
                answered.append(reply["id"])

    with trio.fail_after(60):
        async with running_writer(config) as (_, addresses):
            before = await get(addresses["control"], "/metrics")
            async with trio.open_nursery() as nursery:
                for client_id in range(4):
                    nursery.start_soon(publisher, addresses["cmd_ingest"], client_id)
                probe = await get(addresses["control"], "/healthz")
            assert probe.status == 200
            assert turns.current().statistics().deferred > 0
            await trio.sleep(0.3)  # heartbeats: the metric follows
            after = await get(addresses["control"], "/metrics")
    assert len(answered) == 200
    for name in (
        "cmdbus_loop_turns_deferred_total",
        "cmdbus_loop_busy_seconds_total",
        "cmdbus_loop_control_first_seconds_total",  # the probe's tasks are the control face's
    ):
        assert metric_sum(after.body.decode(), name) > metric_sum(before.body.decode(), name)


async def test_a_read_whose_wait_for_a_turn_outlives_the_timer_loses_nothing(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's timer may fire while it waits for room in the turn, bytes just read
    in hand: they are the protocol's already, and answered once the wait is over."""
    held = trio.Event()

    class HoldsTheFirstRead(TurnBudget):
        async def wait(self) -> None:
            if "Reader" in trio.lowlevel.current_task().name and not held.is_set():
                held.set()
                await trio.sleep_forever()  # until the reader's timer cancels it
            await super().wait()

    use_budget(HoldsTheFirstRead, monkeypatch)
    config = make_config(cmd_ingest_bind="127.0.0.1:0", read_timeout_ms=100, idle_timeout_ms=60_000)
    with trio.fail_after(30):
        async with (
            running_writer(config) as (_, addresses),
            frame_client(addresses["cmd_ingest"]) as client,
        ):
            reply = await client.request("publish", record=RECORD)
    assert held.is_set()
    assert "sort_key" in reply, reply


async def test_a_reply_made_in_a_task_of_its_own_waits_for_a_turn_with_room(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request answered by a task of its own (a read) writes its reply as a unit of the
    data plane: a commit that woke 64 such tasks (appends that had waited for a slot, as
    they did then) in one turn made that turn, and every probe's, long."""
    asked: list[str] = []

    class Recording(TurnBudget):
        async def wait(self) -> None:
            asked.append(trio.lowlevel.current_task().name)
            await super().wait()

    use_budget(Recording, monkeypatch)
    config = make_config(tier_bind="127.0.0.1:0")
    with trio.fail_after(30):
        async with (
            running_writer(config) as (_, addresses),
            frame_client(addresses["tier"]) as client,
        ):
            reply = await client.request("read_execution", execution_id="none")
    assert reply["ok"] and reply["exists"] is False
    assert any(name.endswith("Connection._v2") for name in asked), asked


def use_budget(kind: type[TurnBudget], monkeypatch: pytest.MonkeyPatch) -> None:
    """Have :func:`turns.current` give a ``kind`` of budget, made and installed as an
    instrument on first use (in the run)."""
    made: list[TurnBudget] = []

    def current() -> TurnBudget:
        if not made:
            made.append(kind(turns.DATA_PLANE_SHARE))
            trio.lowlevel.add_instrument(made[0])
        return made[0]

    monkeypatch.setattr(turns, "current", current)


# --- the control face's own share (issue 38) ------------------------------------------------


async def test_the_budget_times_every_step_of_a_control_task() -> None:
    budget = installed(60.0)

    async def control_work() -> None:
        budget.put_first(trio.lowlevel.current_task())  # counted from its next step on
        await trio.lowlevel.checkpoint()
        for _ in range(3):
            spend(0.01)
            await trio.lowlevel.checkpoint()

    async def data_work() -> None:
        for _ in range(3):
            spend(0.01)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(control_work)
        nursery.start_soon(data_work)
    control = budget.statistics().control
    assert 0.03 <= control < 0.055  # its three steps of work, not the data plane's


async def test_a_control_step_is_charged_its_cpu_time_not_its_wall_time() -> None:
    """A step off the CPU (the thread preempted, or waiting for the GIL: here, asleep)
    is not the control face's work: on a busy machine it paced probes as a flood."""
    budget = installed(60.0)

    async def control_work() -> None:
        budget.put_first(trio.lowlevel.current_task())
        await trio.lowlevel.checkpoint()
        for _ in range(3):
            time.sleep(0.02)  # noqa: ASYNC251 - a step held off the CPU, on purpose
            await trio.lowlevel.checkpoint()

    await control_work()
    assert budget.statistics().control < 0.01  # 60 ms of wall time, next to no CPU


class _Steps:
    """A budget stand-in whose control time the test sets."""

    def __init__(self) -> None:
        self.control_time = 0.0
        self._clock = trio.current_time


async def test_a_control_flood_waits_for_its_share_and_probes_go_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Once the control face has spent its burst, each request waits until the share
    refills what the last one cost; a probe is let through at once (within its
    overdraft), and a probe that has to wait goes before the scrapes waiting."""
    steps = _Steps()
    share = turns.ControlShare(steps)  # type: ignore[arg-type]
    admitted: list[tuple[str, float]] = []

    async def request(name: str, cost: float, first: bool = False) -> None:
        await share.admit(first=first)
        admitted.append((name, trio.current_time()))
        steps.control_time += cost

    start = trio.current_time()
    await request("burst", turns.CONTROL_BURST + 0.01)  # the burst, and 10 ms of debt
    assert not share.pacing and share.pressed
    async with trio.open_nursery() as nursery:
        for n in range(3):
            nursery.start_soon(request, f"scrape{n}", 0.01)
            await trio.testing.wait_all_tasks_blocked()
        assert share.pacing  # no turn favours the control face meanwhile
        await request("probe", 0.001, first=True)  # overdraft: at once
        assert admitted[-1] == ("probe", start)
        steps.control_time += turns.PROBE_OVERDRAFT  # probes spent their overdraft
        nursery.start_soon(request, "late probe", 0.001, True)
    names = [name for name, _ in admitted]
    assert names[:3] == ["burst", "probe", "scrape0"]
    assert names.index("late probe") < names.index("scrape2")  # ahead of those still waiting
    waits = [at - start for _, at in admitted]
    # Each request after the burst waits until the share has refilled the debt: the
    # 10 ms of the burst's debt and 10 ms of each scrape, at CONTROL_SHARE a second.
    assert waits[-1] >= (0.01 * 3 + turns.PROBE_OVERDRAFT) / turns.CONTROL_SHARE
    assert not share.pacing and share.waited > 0


async def test_a_cancelled_control_wait_lets_the_next_one_through(
    autojump_clock: trio.testing.MockClock,
) -> None:
    steps = _Steps()
    share = turns.ControlShare(steps)  # type: ignore[arg-type]
    steps.control_time = turns.CONTROL_BURST + 1.0  # a second of debt: every request waits
    done: list[str] = []
    scopes = {name: trio.CancelScope() for name in ("owner", "parked", "last")}

    async def request(name: str) -> None:
        with scopes[name]:
            await share.admit()
            done.append(name)

    async with trio.open_nursery() as nursery:
        for name in scopes:
            nursery.start_soon(request, name)
            await trio.testing.wait_all_tasks_blocked()
        scopes["parked"].cancel()  # while waiting its turn
        scopes["owner"].cancel()  # while waiting for the share
    assert done == ["last"]
    assert not share.pacing


async def test_a_flood_that_no_request_admitted_holds_the_probes_back_briefly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two seconds of control work that waited for no admission (a flood of connections
    accepted and closed) leave the share owing MAX_DEBT, not two seconds: a probe then
    waits half a second at most, where it used to wait twenty seconds."""
    steps = _Steps()
    share = turns.ControlShare(steps)  # type: ignore[arg-type]
    steps.control_time = turns.CONTROL_BURST + 2.0
    start = trio.current_time()
    await share.admit(first=True)
    waited = trio.current_time() - start
    assert 0 < waited <= turns.MAX_DEBT / turns.CONTROL_SHARE + 0.002
