"""The loop census: turns by what ended each wait, steps by task."""

from __future__ import annotations

import socket
import threading

import trio

from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.loop import census
from cmdbus_trio.loop.census import LoopCensus


async def test_a_sleep_that_runs_out_is_a_timer_turn_and_a_yield_a_ready_one() -> None:
    counted = LoopCensus()
    trio.lowlevel.add_instrument(counted)
    try:
        await trio.sleep(0.02)  # nothing else to do: the wait lasts its whole timeout
        before = dict(counted.turns)
        for _ in range(5):
            await trio.lowlevel.checkpoint()  # runnable: the loop does not wait
    finally:
        trio.lowlevel.remove_instrument(counted)
    assert before.get("timer", 0) >= 1
    assert counted.turns["ready"] - before.get("ready", 0) >= 5


async def test_bytes_arriving_before_the_timeout_are_a_woken_turn() -> None:
    counted = LoopCensus()
    left, right = socket.socketpair()  # bytes from another thread: no task is runnable
    with left, trio.socket.from_stdlib_socket(right) as receiving:
        sender = threading.Timer(0.02, left.send, (b"x",))
        trio.lowlevel.add_instrument(counted)
        try:
            sender.start()
            with trio.fail_after(5):
                await receiving.recv(1)  # with a timeout of 5 s pending
        finally:
            trio.lowlevel.remove_instrument(counted)
            sender.join()
    assert counted.turns["woken"] >= 1
    assert counted.turns["timer"] == 0


async def test_steps_are_counted_by_task_name() -> None:
    counted = LoopCensus()

    async def stepper() -> None:
        for _ in range(10):
            await trio.lowlevel.checkpoint()

    trio.lowlevel.add_instrument(counted)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stepper, name="stepper")
    finally:
        trio.lowlevel.remove_instrument(counted)
    report = counted.report()
    assert report["steps"]["stepper"] == 11  # its first step and one after each yield
    assert report["spawned"] == 1
    assert report["seconds"] > 0


async def test_swap_reports_the_window_since_the_last_call_and_stop_ends_it() -> None:
    assert census.swap(again=True) is None  # nothing counted before the first call
    for _ in range(3):
        await trio.lowlevel.checkpoint()
    first = census.swap(again=True)
    assert first is not None and sum(first["steps"].values()) >= 3
    second = census.swap(again=False)
    assert second is not None and second["seconds"] < first["seconds"] + 60
    assert census.swap(again=False) is None  # stopped: nothing counts


async def test_thread_hops_are_counted() -> None:
    counted = LoopCensus()
    limiter = trio.CapacityLimiter(1)
    for _ in range(3):
        await run_in_thread(int, limiter=limiter)
    assert counted.report()["thread_hops"] == 3
