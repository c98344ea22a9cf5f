from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from cmdbus_trio import metrics
from cmdbus_trio.admission import (
    DeadlineExceeded,
    Gate,
    GateClosed,
    Shed,
    ShedReason,
)
from cmdbus_trio.config import cpu_quota, load
from cmdbus_trio.faces.gates import CLAIM_MAX_READS, gate_for


def make_gate(face: str = "test", **overrides: float) -> Gate:
    settings = {"max_inflight": 1, "max_waiters": 1, "shed_after": 1.0, "default_budget": 10.0}
    settings.update(overrides)
    threads = settings.get("max_threads")
    return Gate(
        face,
        max_inflight=int(settings["max_inflight"]),
        max_waiters=int(settings["max_waiters"]),
        shed_after=settings["shed_after"],
        default_budget=settings["default_budget"],
        max_threads=None if threads is None else int(threads),
    )


def sample(name: str, labels: dict[str, str]) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def hold(gate: Gate, release: trio.Event, *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    with await gate.acquire("hold"):
        task_status.started()
        await release.wait()


@asynccontextmanager
async def held(gate: Gate) -> AsyncIterator[None]:
    """One of the gate's slots is taken for the duration of the block."""
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, gate, release)
        yield
        release.set()


async def test_admitted_at_once_when_a_slot_is_free(autojump_clock: trio.testing.MockClock) -> None:
    gate = make_gate("free")
    with await gate.acquire("read") as slot:
        assert gate.statistics().inflight == 1
        assert slot.admitted_at == slot.arrival
    stats = gate.statistics()
    assert (stats.inflight, stats.admitted_total) == (0, 1)
    assert sample("cmdbus_queue_wait_seconds_count", {"face": "free", "op": "read"}) == 1
    assert sample("cmdbus_service_seconds_count", {"face": "free", "op": "read"}) == 1


async def test_waiters_full_sheds_at_once(autojump_clock: trio.testing.MockClock) -> None:
    gate = make_gate("wf", max_waiters=0)
    async with held(gate):
        start = trio.current_time()
        with pytest.raises(Shed) as info:
            await gate.acquire("read")
        assert trio.current_time() == start
        assert info.value.reason is ShedReason.WAITERS_FULL
        assert info.value.retry_after_ms == 1000
    assert gate.statistics().shed_total["waiters_full"] == 1
    labels = {"face": "wf", "op": "read", "reason": "waiters_full"}
    assert sample("cmdbus_shed_total", labels) == 1


async def test_queue_timeout_after_shed_after(autojump_clock: trio.testing.MockClock) -> None:
    gate = make_gate("qt", shed_after=0.5)
    async with held(gate):
        start = trio.current_time()
        with pytest.raises(Shed) as info:
            await gate.acquire("read")
        assert trio.current_time() - start == pytest.approx(0.5)
        assert info.value.reason is ShedReason.QUEUE_TIMEOUT
    assert gate.statistics().shed_total == {"waiters_full": 0, "queue_timeout": 1, "deadline": 0}


async def test_budget_shorter_than_shed_after_sheds_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate("dl", shed_after=1.0)
    async with held(gate):
        start = trio.current_time()
        with pytest.raises(Shed) as info:
            await gate.acquire("read", budget=0.2)
        assert trio.current_time() - start == pytest.approx(0.2)
        assert info.value.reason is ShedReason.DEADLINE
        assert info.value.retry_after_ms == 0


async def test_spent_budget_sheds_deadline_even_with_a_free_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate("spent")
    await trio.sleep(1)
    with pytest.raises(Shed) as info:
        await gate.acquire("read", budget=0.5, arrival=trio.current_time() - 0.6)
    assert info.value.reason is ShedReason.DEADLINE
    assert gate.statistics().inflight == 0


async def test_waiter_is_admitted_when_a_slot_frees(autojump_clock: trio.testing.MockClock) -> None:
    gate = make_gate("wait", shed_after=5.0)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, gate, release)

        async def free_later() -> None:
            await trio.sleep(2)
            release.set()

        nursery.start_soon(free_later)
        arrival = trio.current_time()
        with await gate.acquire("read") as slot:
            assert slot.admitted_at - arrival == pytest.approx(2)
    assert gate.statistics().admitted_total == 2


async def test_arrival_counts_toward_queue_wait(autojump_clock: trio.testing.MockClock) -> None:
    gate = make_gate("arrival")
    arrival = trio.current_time()
    await trio.sleep(0.3)  # e.g. time spent reading the frame
    with await gate.acquire("read", arrival=arrival) as slot:
        assert slot.admitted_at - slot.arrival == pytest.approx(0.3)
        assert slot.deadline == pytest.approx(arrival + 10.0)
    assert sample("cmdbus_queue_wait_seconds_sum", {"face": "arrival", "op": "read"}) == (
        pytest.approx(0.3)
    )


async def test_acquire_nowait(autojump_clock: trio.testing.MockClock) -> None:
    gate = make_gate("nowait", max_waiters=5)
    slot = gate.acquire_nowait("read")
    with pytest.raises(Shed) as info:
        gate.acquire_nowait("read")
    assert info.value.reason is ShedReason.WAITERS_FULL
    slot.release()
    gate.acquire_nowait("read").release()
    with pytest.raises(Shed) as info:
        gate.acquire_nowait("read", budget=0)
    assert info.value.reason is ShedReason.DEADLINE


async def test_cancelled_waiter_holds_and_counts_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate("cancel", shed_after=5.0)
    async with held(gate):
        with trio.move_on_after(1):
            await gate.acquire("read")
        stats = gate.statistics()
        assert (stats.waiters, stats.inflight, stats.admitted_total) == (0, 1, 1)
        assert sum(stats.shed_total.values()) == 0


async def test_slot_is_held_until_a_cancelled_requests_thread_returns() -> None:
    """A cancelled request's task ends only once its thread has returned, holding its
    slot until then: the drain, which waits for every request task, never closes a store
    under a running thread."""
    gate = make_gate("slot")
    thread_started = threading.Event()
    let_thread_finish = threading.Event()
    observed: list[str] = []

    def work() -> str:
        thread_started.set()
        let_thread_finish.wait(timeout=10)
        observed.append("thread returned")
        return "done"

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            request_scope = trio.CancelScope()
            request_ended = trio.Event()

            async def cancellable_request() -> None:
                with request_scope, await gate.acquire("write") as slot:
                    await slot.run_cancellable(work)
                observed.append(f"request ended, {gate.statistics().inflight} held")
                request_ended.set()

            nursery.start_soon(cancellable_request)
            await trio.to_thread.run_sync(thread_started.wait)
            request_scope.cancel()
            gate.close()
            await trio.sleep(0.05)
            # The client is gone, but the thread still runs: the slot must still be held.
            assert gate.statistics().inflight == 1
            assert not request_ended.is_set()
            let_thread_finish.set()
            await request_ended.wait()
            assert observed == ["thread returned", "request ended, 0 held"]


async def test_read_work_stops_at_the_budget_within_one_page() -> None:
    gate = make_gate("pages", default_budget=0.2)
    pages: list[int] = []

    def read_pages() -> None:
        for page in range(10_000):
            trio.from_thread.check_cancelled()
            pages.append(page)
            threading.Event().wait(0.01)  # a page of work

    with (
        trio.fail_after(10),
        await gate.acquire("read") as slot,
        pytest.raises(DeadlineExceeded),
    ):
        await slot.run_cancellable(read_pages)
    assert 0 < len(pages) < 10_000
    assert gate.statistics().inflight == 0


async def test_write_work_finishes_even_when_cancelled() -> None:
    gate = make_gate("writes")
    finished = []

    def write() -> None:
        threading.Event().wait(0.1)
        finished.append(True)

    with trio.fail_after(10):
        with trio.move_on_after(0.01), await gate.acquire("append") as slot:
            await slot.run_to_completion(write)
        assert finished == [True]
        assert gate.statistics().inflight == 0


async def test_one_thread_per_lease() -> None:
    gate = make_gate("one", max_inflight=2)
    with await gate.acquire("read") as slot:
        started = threading.Event()
        stop = threading.Event()

        def slow() -> None:
            started.set()
            stop.wait(10)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slot.run_cancellable, slow)
            await trio.to_thread.run_sync(started.wait)
            with pytest.raises(RuntimeError, match="one thread per request"):
                await slot.run_cancellable(slow)
            stop.set()
    with pytest.raises(RuntimeError, match="released"):
        await slot.run_to_completion(slow)
    with pytest.raises(RuntimeError, match="twice"):
        slot.release()


async def test_close_wakes_waiters_and_refuses_new_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate("close", shed_after=5.0)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, gate, release)
        outcome: list[str] = []

        async def waiter() -> None:
            try:
                await gate.acquire("read")
            except GateClosed:
                outcome.append("closed")

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.statistics().waiters == 1
        gate.close()
        await trio.testing.wait_all_tasks_blocked()
        assert outcome == ["closed"]
        with pytest.raises(GateClosed):
            await gate.acquire("read")
        with pytest.raises(GateClosed):
            gate.acquire_nowait("read")
        assert gate.statistics().closed
        release.set()
    assert gate.statistics().inflight == 0  # the nursery waited for the holder


async def test_statistics_and_gauges_match(autojump_clock: trio.testing.MockClock) -> None:
    gate = make_gate("stats", max_inflight=2, max_waiters=3, shed_after=0.5)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, gate, release)
        await nursery.start(hold, gate, release)

        async def try_acquire() -> None:
            try:
                with await gate.acquire("read"):
                    pass
            except Shed:
                pass

        for _ in range(5):
            nursery.start_soon(try_acquire)
        await trio.testing.wait_all_tasks_blocked()
        stats = gate.statistics()
        assert (stats.capacity, stats.inflight, stats.waiters, stats.max_waiters) == (2, 2, 3, 3)
        assert stats.shed_total["waiters_full"] == 2
        assert sample("cmdbus_inflight", {"face": "stats"}) == 2
        assert sample("cmdbus_waiters", {"face": "stats"}) == 3
        assert sample("cmdbus_capacity", {"face": "stats"}) == 2
        await trio.sleep(1)
        stats = gate.statistics()
        assert stats.waiters == 0
        assert stats.shed_total == {"waiters_full": 2, "queue_timeout": 3, "deadline": 0}
        release.set()
    assert gate.statistics().admitted_total == 2


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("max_inflight", 0),
        ("max_waiters", -1),
        ("shed_after", 0),
        ("default_budget", -1),
        ("max_threads", 0),
        ("max_threads", 2),  # more than max_inflight (1)
    ],
)
def test_gate_parameters_are_checked(setting: str, value: float) -> None:
    with pytest.raises(ValueError, match=setting):
        make_gate(**{setting: value})


async def test_shed_bursts_log_start_and_end(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    gate = make_gate("burst", max_waiters=0)
    caplog.set_level("WARNING", logger="cmdbus_trio.admission")
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.run_timers)
        await nursery.start(hold, gate, release)
        for _ in range(50):
            with pytest.raises(Shed):
                await gate.acquire("read")
        await trio.sleep(3)
        events = [record.getMessage() for record in caplog.records]
        assert events == ["shed_burst_started", "shed_burst_ended"]
        assert caplog.records[1].cmdbus_fields["shed"] == {"waiters_full": 50}  # type: ignore[attr-defined]
        release.set()
        nursery.cancel_scope.cancel()


async def test_intake_is_full_when_every_slot_and_place_is_taken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(max_inflight=1, max_waiters=1)
    assert not gate.intake_full and gate.room == 2
    gate.take_in()
    assert not gate.intake_full and gate.room == 1
    gate.take_in()
    assert gate.intake_full and gate.room == 0
    assert gate.statistics().intake == 2
    gate.take_in()  # a request that does not wait for room (a lone one is shed at once)
    assert gate.room == 0
    gate.taken_out()
    gate.taken_out()
    assert not gate.intake_full
    assert gate.statistics().intake == 1


async def test_wait_for_room_wakes_one_connection_per_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(max_inflight=1, max_waiters=0)
    gate.take_in()
    woken: list[int] = []

    async def connection(n: int) -> None:
        await gate.wait_for_room()
        gate.take_in()  # it takes the place it was woken for
        woken.append(n)

    async with trio.open_nursery() as nursery:
        for n in range(3):
            nursery.start_soon(connection, n)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []
        gate.taken_out()  # one place: one connection goes on, the others keep waiting
        await trio.testing.wait_all_tasks_blocked()
        assert len(woken) == 1
        gate.taken_out()
        await trio.testing.wait_all_tasks_blocked()
        assert len(woken) == 2
        gate.close()  # draining: nobody waits any longer
    assert sorted(woken) == [0, 1, 2]


async def test_wait_for_room_returns_at_once_with_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(max_inflight=2, max_waiters=0)
    gate.take_in()
    with trio.fail_after(0.001):
        await gate.wait_for_room()


async def test_can_admit_now_only_when_open_with_a_free_slot_and_nobody_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(max_inflight=1, max_waiters=1)
    assert gate.can_admit_now
    slot = gate.acquire_nowait("op")
    assert not gate.can_admit_now  # no free slot
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.acquire, "op")
        await trio.testing.wait_all_tasks_blocked()
        slot.release()  # the slot goes to the waiter, not to a newcomer
        assert not gate.can_admit_now
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    closed = make_gate()
    closed.close()
    assert not closed.can_admit_now


async def test_max_threads_bounds_the_leases_running_a_thread_at_once() -> None:
    gate = make_gate(max_inflight=3, max_waiters=0, max_threads=1)
    running = 0
    most = 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1

    async def request() -> None:
        with gate.acquire_nowait("op") as slot:
            await slot.run_to_completion(work)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(request)
    assert most == 1 and gate.max_threads == 1
    assert gate.statistics().admitted_total == 3  # all admitted; the threads took turns


def test_the_claim_faces_admit_many_reads_but_run_threads_within_the_quota() -> None:
    config = load({}, environ={})
    for face in ("cmd_claim", "evt_claim"):
        gate = gate_for(face, config)
        assert gate.max_inflight == CLAIM_MAX_READS and gate.max_threads == cpu_quota()
    subscribe = gate_for("evt_subscribe", config)
    assert subscribe.max_inflight == subscribe.max_threads == cpu_quota()


async def test_when_free_is_called_once_when_a_slot_is_free_for_nobody_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = make_gate(max_waiters=1)
    called: list[str] = []

    def callback() -> None:
        called.append("free")

    first = gate.acquire_nowait("op")
    gate.when_free(callback)
    gate.when_free(callback)  # already waiting: not added again
    async with trio.open_nursery() as nursery:
        second: list[object] = []

        async def queued() -> None:
            second.append(await gate.acquire("op"))

        nursery.start_soon(queued)
        await trio.testing.wait_all_tasks_blocked()
        first.release()  # the slot passes to the queued request: not free
        await trio.testing.wait_all_tasks_blocked()
        assert called == [] and len(second) == 1
    second[0].release()  # type: ignore[attr-defined]
    assert called == ["free"]
    gate.acquire_nowait("op").release()
    assert called == ["free"]  # once only
