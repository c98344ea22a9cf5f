"""Creating a consumer group on a live bus: every record reaches the new group exactly once,
whatever is committed while its history loads, and a creation holds up nobody else."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cmdbus_trio.bus.claims import Claims
from cmdbus_trio.bus.committer import GroupCommitter, Ticket
from cmdbus_trio.bus.groups import ConsumerGroups
from cmdbus_trio.protocol.bus import BusKind, SubjectRule
from cmdbus_trio.storage.buslog import BusLog

from ..helpers import publish_ticket


def step_ticket(n: int) -> Ticket:
    return publish_ticket(f'{{"event_type": "step.{n % 3}"}}', n)


class RacingLog(BusLog):
    """A bus log whose history reads let a record be committed right before each page of
    the tail's history is queried, right after its last (empty) page was, and while a
    group's acks are read: the moments a group's load can race with the committer."""

    committer: GroupCommitter
    racing = False

    def subjects_between(self, *args: Any, **kwargs: Any) -> list[tuple[int, str]]:
        if not self.racing:
            return super().subjects_between(*args, **kwargs)
        trio.from_thread.run(self._commit_one)
        page = super().subjects_between(*args, **kwargs)
        if not page:
            trio.from_thread.run(self._commit_one)
        return page

    def group_state(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[tuple[int, int]]]:
        if self.racing:
            trio.from_thread.run(self._commit_one)
        return super().group_state(*args, **kwargs)

    async def _commit_one(self) -> None:
        ticket = step_ticket(self.last_sort_key)
        self.committer.enqueue(ticket)
        await ticket.wait()  # settled: the committer's listeners have been called


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[RacingLog]:
    opened = await trio.to_thread.run_sync(RacingLog.open, tmp_path / "events.sqlite3")
    yield opened
    await trio.to_thread.run_sync(opened.close)


def drain(claims: Claims) -> list[int]:
    owner = object()
    taken: list[int] = []
    while (delivery := claims.next_nowait(("events", ">"), owner)) is not None:
        taken.append(delivery.sort_key)
    return taken


async def test_records_committed_around_every_history_page_reach_the_new_group(
    log: RacingLog,
) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    log.committer = committer
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            for n in range(50):
                await _publish(committer, n)
            # Made after the history: the new group's tail is read back from the store.
            groups = ConsumerGroups(
                log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(1)
            )
            log.racing = True
            beginning = await groups.get("from-beginning", "beginning")
            tail = await groups.get("from-tail", "tail")
            log.racing = False
            nursery.cancel_scope.cancel()
    everything = list(range(1, log.last_sort_key + 1))
    assert log.last_sort_key >= 54  # records were committed around both loads
    assert drain(beginning) == everything  # each once, in order
    tail_start = (await trio.to_thread.run_sync(log.groups))["from-tail"]
    assert drain(tail) == everything[tail_start:]


async def _publish(committer: GroupCommitter, n: int) -> None:
    ticket = step_ticket(n)
    committer.enqueue(ticket)
    await ticket.wait()


@pytest.mark.parametrize("round_", range(3))  # a race: three tries to meet it
async def test_groups_created_while_publishers_run_get_every_record(
    log: RacingLog, round_: int
) -> None:
    """The operator's scenario: a backlog, six publishers running, fifteen groups created
    one after another (and some at once) from the beginning."""
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    groups = ConsumerGroups(
        log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(1)
    )
    created: list[Claims] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            tickets = [step_ticket(n) for n in range(3000)]
            for ticket in tickets:
                committer.enqueue(ticket)
            await tickets[-1].wait()
            await nursery.start(groups.run)
            stop = trio.Event()
            async with trio.open_nursery() as publishers:
                for p in range(6):
                    publishers.start_soon(_publish_until, committer, stop, p)
                for n in range(15):
                    if n % 5 == 4:  # a few at once: creations go on side by side
                        async with trio.open_nursery() as together:
                            for name in (f"g{n}a", f"g{n}b"):
                                together.start_soon(_create, groups, name, created)
                    else:
                        await _create(groups, f"g{n}", created)
                    await trio.sleep(random.uniform(0, 0.01))
                stop.set()
            nursery.cancel_scope.cancel()
    everything = list(range(1, log.last_sort_key + 1))
    assert len(created) == 18
    for claims in created:
        got = drain(claims)
        missing = sorted(set(everything) - set(got))
        assert not missing, f"group {claims.group} never got {missing[:20]}"
        assert got == everything, f"group {claims.group}: duplicates or out of order"


async def _publish_until(committer: GroupCommitter, stop: trio.Event, seed: int) -> None:
    n = seed
    while not stop.is_set():
        await _publish(committer, n)
        n += 6


async def _create(groups: ConsumerGroups, name: str, created: list[Claims]) -> None:
    created.append(await groups.get(name, "beginning"))


async def test_a_slow_history_load_holds_up_no_other_group(tmp_path: Path) -> None:
    """One group's history load is held in its thread; another group is created and the
    existing one answers meanwhile."""

    class SlowLog(BusLog):
        held = trio.Event()
        release = False

        def group_state(
            self, consumer: str, *args: Any, **kwargs: Any
        ) -> tuple[list[int], list[tuple[int, int]]]:
            if consumer == "slow":
                trio.from_thread.run_sync(self.held.set)
                while not self.release:
                    trio.from_thread.check_cancelled()
                    trio.from_thread.run(trio.sleep, 0.01)
            return super().group_state(consumer, *args, **kwargs)

    log = await trio.to_thread.run_sync(SlowLog.open, tmp_path / "events.sqlite3")
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    groups = ConsumerGroups(
        log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(4)
    )
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(committer.run)
                await nursery.start(groups.run)
                first = await groups.get("first", "beginning")
                slow: list[Claims] = []
                nursery.start_soon(_create, groups, "slow", slow)
                await SlowLog.held.wait()
                other = await groups.get("other", "beginning")  # not behind "slow"
                assert await groups.get("first") is first
                assert "slow" not in groups.claims and other is groups.claims["other"]
                SlowLog.release = True
                waited = await groups.get("slow")  # waits for the creation under way
                assert waited is groups.claims["slow"]
                await trio.testing.wait_all_tasks_blocked()
                assert slow == [waited]
                nursery.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(log.close)


async def test_a_creation_whose_requester_left_still_completes(log: RacingLog) -> None:
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    log.committer = committer
    groups = ConsumerGroups(
        log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(1)
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(committer.run)
            await nursery.start(groups.run)
            await _publish(committer, 1)
            with trio.move_on_after(0):  # the requester is gone before the load ends
                await groups.get("orphan", "beginning")
            claims = await groups.get("orphan")  # without `from`: it exists
            await _publish(committer, 2)
            nursery.cancel_scope.cancel()
    assert drain(claims) == [1, 2]
    assert committer.listeners == [groups.tail]  # the one feed, shared by every group


async def test_a_group_recreated_after_its_deleter_left_is_not_dropped(log: RacingLog) -> None:
    """The deleter leaves before its drop is committed; a creation of the same name waits
    for the drop, so the new group is not deleted by it afterwards."""
    committer = GroupCommitter(log, SubjectRule(BusKind.EVENTS))
    log.committer = committer
    groups = ConsumerGroups(
        log, committer, ack_wait=30, max_deliver=0, limiter=trio.CapacityLimiter(1)
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(groups.run)
            await groups.get("again", "beginning")
            with trio.move_on_after(0):  # gone while the drop waits for the committer
                assert await groups.delete("again")
            recreated: list[Claims] = []
            nursery.start_soon(_create, groups, "again", recreated)
            await trio.testing.wait_all_tasks_blocked()
            assert not recreated  # waits for the drop, which waits for the committer
            await nursery.start(committer.run)
            await _publish(committer, 1)
            while not recreated:  # its history loads in a thread
                await trio.sleep(0.01)
            assert recreated == [groups.claims["again"]]
            nursery.cancel_scope.cancel()
    assert "again" in await trio.to_thread.run_sync(log.groups)
    assert drain(recreated[0]) == [1]
