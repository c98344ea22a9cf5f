"""What the loop pays per use of the trio primitives a connection's hot path uses, on this
machine, in microseconds, against a bare checkpoint measured in the same run.

    python benchmarks/trio_costs.py            # about 10 seconds
    python benchmarks/trio_costs.py --uses 100 # a quick look that it runs

- ``checkpoint``: one task yields and is run again (the baseline: one pass of the loop);
- ``hand-over``: one task hands an item to another waiting on an unbuffered memory
  channel, and that task runs (a connection's reader handing a read's requests to its
  dispatcher);
- ``cancel scope with a deadline``: a scope with a deadline entered and left around a
  checkpoint (what a read with a timeout cost before the reader kept one scope for
  many reads);
- ``cancel scope, deadline moved``: the same with the deadline moved once inside;
- ``checkpoint, a scheduling hook``: a checkpoint with an instrument's ``task_scheduled``
  installed (as ``turns.TurnBudget`` follows the control face's tasks), and
  ``checkpoint, scheduling and step hooks``: with ``before_task_step`` too (what counting
  a control task exactly, to see it run, would add).

Each figure is the median of 5 repetitions of ``--uses`` uses (20,000), minus nothing:
compare each row with the checkpoint row to see what the primitive adds to a pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable

import trio

REPETITIONS = 5


async def checkpoint(uses: int) -> None:
    for _ in range(uses):
        await trio.lowlevel.checkpoint()


async def hand_over(uses: int) -> None:
    send, receive = trio.open_memory_channel[int](0)

    async def take() -> None:
        async for _ in receive:
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take)
        await trio.lowlevel.checkpoint()  # the taker waits before the first item
        async with send:
            for item in range(uses):
                await send.send(item)


async def scope_with_deadline(uses: int) -> None:
    for _ in range(uses):
        with trio.CancelScope(deadline=trio.current_time() + 30):
            await trio.lowlevel.checkpoint()


async def scope_with_deadline_moved(uses: int) -> None:
    for _ in range(uses):
        with trio.CancelScope() as scope:
            scope.deadline = trio.current_time() + 30
            await trio.lowlevel.checkpoint()


class _Scheduled(trio.abc.Instrument):
    def __init__(self) -> None:
        self.followed: set[trio.lowlevel.Task] = set()  # empty: the lookup is the cost
        self.ready = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task in self.followed:
            self.ready += 1


class _ScheduledAndStepped(_Scheduled):
    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task in self.followed:
            self.ready -= 1


def with_hooks(instrument: type[_Scheduled]) -> Callable[[int], Awaitable[None]]:
    async def case(uses: int) -> None:
        hooks = instrument()
        trio.lowlevel.add_instrument(hooks)
        try:
            await checkpoint(uses)
        finally:
            trio.lowlevel.remove_instrument(hooks)

    return case


CASES: dict[str, Callable[[int], Awaitable[None]]] = {
    "checkpoint": checkpoint,
    "hand-over": hand_over,
    "cancel scope with a deadline": scope_with_deadline,
    "cancel scope, deadline moved": scope_with_deadline_moved,
    "checkpoint, a scheduling hook": with_hooks(_Scheduled),
    "checkpoint, scheduling and step hooks": with_hooks(_ScheduledAndStepped),
}


async def measure(uses: int) -> dict[str, float]:
    """Microseconds per use, the median of the repetitions; the cases interleaved so that
    a change in the machine's speed shows in every row alike."""
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(REPETITIONS):
        for name, case in CASES.items():
            started = time.perf_counter()
            await case(uses)
            samples[name].append((time.perf_counter() - started) / uses * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uses", type=int, default=20_000, help="uses per repetition")
    uses = parser.parse_args().uses
    if uses < 1:
        parser.error("--uses must be at least 1")
    costs = trio.run(measure, uses)
    base = costs["checkpoint"]
    print(f"{'primitive':40} {'us per use':>10} {'x checkpoint':>13}")
    for name, cost in costs.items():
        print(f"{name:40} {cost:10.1f} {cost / base:12.2f}x")


if __name__ == "__main__":
    main()
