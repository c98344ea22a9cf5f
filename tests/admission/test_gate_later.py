"""``Gate.acquire_later``: a request that waits for its slot as a callback, no task."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from cmdbus_trio.admission import Gate, GateClosed, Shed, ShedReason, Slot

from .test_gate import held, make_gate

Outcomes = list["Slot | Shed | GateClosed"]


@asynccontextmanager
async def timers(gate: Gate) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(gate.run_timers)
        yield
        nursery.cancel_scope.cancel()


async def test_admitted_before_it_returns_when_a_slot_is_free(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate()
    outcomes: Outcomes = []
    gate.acquire_later("append", outcomes.append)  # no timers needed: it never waits
    [slot] = outcomes
    assert isinstance(slot, Slot) and gate.statistics().inflight == 1
    slot.release()
    assert gate.statistics().inflight == 0


async def test_a_waiting_callback_is_admitted_when_a_slot_frees(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(shed_after=5.0)
    outcomes: Outcomes = []
    async with timers(gate):
        first = gate.acquire_nowait("hold")
        gate.acquire_later("append", outcomes.append)
        assert outcomes == [] and gate.statistics().waiters == 1
        await trio.sleep(1)  # within shed_after
        first.release()
        [slot] = outcomes
        assert isinstance(slot, Slot) and slot.admitted_at - slot.arrival == 1
        statistics = gate.statistics()
        assert (statistics.inflight, statistics.waiters) == (1, 0)  # the slot passed on
        slot.release()
    assert gate.statistics().inflight == 0


async def test_tasks_and_callbacks_are_admitted_first_come_first_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(max_waiters=4, shed_after=60.0)
    admitted: list[str] = []

    def later(name: str) -> None:
        def then(slot: Slot | Shed | GateClosed) -> None:
            assert isinstance(slot, Slot)
            admitted.append(name)
            slot.release()

        gate.acquire_later("append", then)

    async def task(name: str) -> None:
        with await gate.acquire("delete"):
            admitted.append(name)

    async with timers(gate), trio.open_nursery() as nursery:
        slot = gate.acquire_nowait("hold")
        nursery.start_soon(task, "task 1")
        await trio.testing.wait_all_tasks_blocked()
        later("callback 2")
        nursery.start_soon(task, "task 3")
        await trio.testing.wait_all_tasks_blocked()
        later("callback 4")
        assert gate.statistics().waiters == 4
        slot.release()
    assert admitted == ["task 1", "callback 2", "task 3", "callback 4"]
    assert gate.statistics().inflight == 0


@pytest.mark.parametrize(
    ("budget", "reason"),
    [(None, ShedReason.QUEUE_TIMEOUT), (0.05, ShedReason.DEADLINE)],
)
async def test_a_callback_waiting_past_its_time_is_shed(
    autojump_clock: trio.testing.MockClock, budget: float | None, reason: ShedReason
) -> None:
    gate = make_gate(shed_after=0.1)
    outcomes: Outcomes = []
    async with timers(gate), held(gate):
        gate.acquire_later("append", outcomes.append, budget=budget)
        await trio.sleep(0.5)  # longer than shed_after and the budget
        [shed] = outcomes
        assert isinstance(shed, Shed) and shed.reason is reason
        statistics = gate.statistics()
        assert statistics.waiters == 0 and statistics.shed_total[reason.value] == 1


async def test_a_later_callback_with_an_earlier_time_is_shed_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The timers' sleep is brought forward by a callback whose time comes sooner."""
    gate = make_gate(max_waiters=2, shed_after=10.0)
    outcomes: list[str] = []
    async with timers(gate), held(gate):
        gate.acquire_later("append", lambda _: outcomes.append("patient"))
        await trio.sleep(1)
        gate.acquire_later("append", lambda _: outcomes.append("hasty"), budget=0.5)
        await trio.sleep(1)
        assert outcomes == ["hasty"]
        await trio.sleep(10)
        assert outcomes == ["hasty", "patient"]


async def test_a_full_queue_or_a_spent_budget_refuses_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(max_waiters=0)
    outcomes: Outcomes = []
    async with held(gate):
        gate.acquire_later("append", outcomes.append)
    gate.acquire_later("append", outcomes.append, budget=0)
    full, spent = outcomes
    assert isinstance(full, Shed) and full.reason is ShedReason.WAITERS_FULL
    assert isinstance(spent, Shed) and spent.reason is ShedReason.DEADLINE


async def test_close_refuses_waiting_and_new_callbacks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(shed_after=5.0)
    outcomes: Outcomes = []
    async with timers(gate), held(gate):
        gate.acquire_later("append", outcomes.append)
        gate.close()
        gate.acquire_later("append", outcomes.append)
        assert [type(each) for each in outcomes] == [GateClosed, GateClosed]
        assert gate.statistics().waiters == 0


async def test_waiting_without_the_timers_running_is_refused_as_a_bug(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate()
    async with held(gate):
        with pytest.raises(RuntimeError, match="run_timers"):
            gate.acquire_later("append", lambda _: None)
    assert gate.statistics().waiters == 0
