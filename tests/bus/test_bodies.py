"""The batched body reader: many deliveries' bodies per thread hop, the newest kept."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from cmdbus_trio.bus.bodies import BodyReader
from cmdbus_trio.metrics import REGISTRY
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage.buslog import MAX_READ_MANY, BusEntry, BusLog, StoredRecord

SUBJECT = "commands.shared.shard.0"


@pytest.fixture
def log(tmp_path: Path) -> Iterator[BusLog]:
    opened = BusLog.open(tmp_path / "commands.sqlite3")
    opened.publish([BusEntry(SUBJECT, f'{{"n":{n}}}') for n in range(1, 11)])
    yield opened
    opened.close()


@pytest.fixture
async def reader(log: BusLog) -> AsyncIterator[BodyReader]:
    async with trio.open_nursery() as nursery:
        bodies = BodyReader(log, max_batch=4)
        await nursery.start(bodies.run)
        yield bodies
        nursery.cancel_scope.cancel()


async def read_all(reader: BodyReader, keys: list[int]) -> dict[int, str]:
    got: dict[int, str] = {}

    async def one(key: int) -> None:
        got[key] = (await reader.read(key)).record

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(one, key)
    return got


async def test_asks_made_together_are_read_in_batches_of_at_most_max_batch(
    reader: BodyReader,
) -> None:
    got = await read_all(reader, [1, 2, 3, 4, 5, 6, 7, 2])
    assert got == {n: f'{{"n":{n}}}' for n in range(1, 8)}
    assert reader.batches == 2  # eight asks, batches of at most four


async def test_a_missing_record_is_a_lookup_error(reader: BodyReader) -> None:
    with trio.fail_after(10), pytest.raises(LookupError, match="no record with sort key 99"):
        await reader.read(99)


async def test_a_store_error_reaches_every_ask_of_the_batch(
    reader: BodyReader, log: BusLog
) -> None:
    await trio.to_thread.run_sync(log.close)
    errors: list[Exception] = []

    async def one(key: int) -> None:
        try:
            await reader.read(key)
        except StoreUnavailable as exc:
            errors.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for key in (1, 2, 3):
                nursery.start_soon(one, key)
    assert len(errors) == 3


async def test_a_cancelled_ask_leaves_the_others_alone(reader: BodyReader) -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await reader.read(1)
    assert await read_all(reader, [2, 3]) == {2: '{"n":2}', 3: '{"n":3}'}


@pytest.mark.parametrize("max_batch", [0, MAX_READ_MANY + 1])
def test_max_batch_is_checked(log: BusLog, max_batch: int) -> None:
    with pytest.raises(ValueError, match="max_batch must be in"):
        BodyReader(log, max_batch=max_batch)


def body_reads(source: str) -> float:
    value = REGISTRY.get_sample_value(
        "cmdbus_body_reads_total", {"store": "commands", "source": source}
    )
    return value or 0.0


def kept(sort_key: int, text: str = "{}") -> StoredRecord:
    return StoredRecord(sort_key, SUBJECT, text)


async def test_a_remembered_body_is_answered_without_a_read(reader: BodyReader) -> None:
    """Sort key 20 is not in the store: only the kept body can answer it."""
    memory, store = body_reads("memory"), body_reads("store")
    reader.remember([kept(20, '{"n":20}')])
    with trio.fail_after(10):
        assert (await reader.read(20)).record == '{"n":20}'
    assert reader.batches == 0
    assert body_reads("memory") == memory + 1
    assert await read_all(reader, [1]) == {1: '{"n":1}'}  # not kept: read from the store
    assert body_reads("store") == store + 1


async def test_kept_bodies_are_bounded_by_bytes_oldest_out_first(log: BusLog) -> None:
    entry = len('{"n":20}') + 200  # a body's text and its keeping
    bodies = BodyReader(log, recent_bytes=3 * entry)
    bodies.remember([kept(key, f'{{"n":{key}}}') for key in (20, 21, 22, 23, 24)])
    bodies.remember([kept(25, "x" * (3 * entry))])  # larger than the whole: not kept
    async with trio.open_nursery() as nursery:
        await nursery.start(bodies.run)
        for key in (20, 21, 25):
            with trio.fail_after(10), pytest.raises(LookupError):
                await bodies.read(key)  # dropped or never kept, and not in the store
        for key in (22, 23, 24):
            with trio.fail_after(10):
                assert (await bodies.read(key)).record == f'{{"n":{key}}}'
        nursery.cancel_scope.cancel()
    assert bodies.batches == 3  # only the three that were not kept went to the store


async def test_forget_through_drops_the_evicted_bodies(log: BusLog) -> None:
    bodies = BodyReader(log)
    bodies.remember([kept(key) for key in (20, 21, 22)])
    bodies.forget_through(21)
    async with trio.open_nursery() as nursery:
        await nursery.start(bodies.run)
        with trio.fail_after(10), pytest.raises(LookupError):
            await bodies.read(21)
        assert (await bodies.read(22)).sort_key == 22
        nursery.cancel_scope.cancel()


def test_recent_bytes_is_checked(log: BusLog) -> None:
    with pytest.raises(ValueError, match="recent_bytes must be >= 0, got -1"):
        BodyReader(log, recent_bytes=-1)


async def test_a_read_of_many_bodies_wakes_its_task_once(reader: BodyReader) -> None:
    """Kept and stored bodies, and a missing one, in order; the task that asked is woken
    once, when the last of its three batches is read. A wake-up per body cost a batched
    ``next`` a task step per record."""
    reader.remember([kept(20, '{"n":20}')])
    memory, store = body_reads("memory"), body_reads("store")
    me = trio.lowlevel.current_task()
    woken: list[trio.lowlevel.Task] = []

    class Wakes(trio.abc.Instrument):
        def task_scheduled(self, task: trio.lowlevel.Task) -> None:
            if task is me:
                woken.append(task)

    wakes = Wakes()
    trio.lowlevel.add_instrument(wakes)
    try:
        with trio.fail_after(10):
            got = await reader.read_many([1, 2, 20, 3, 4, 5, 99, 6, 7, 8, 9])
    finally:
        trio.lowlevel.remove_instrument(wakes)
    assert len(woken) == 1
    assert reader.batches == 3  # ten asks, batches of at most four
    records = [g.record if isinstance(g, StoredRecord) else type(g) for g in got]
    expected = [f'{{"n":{n}}}' for n in (1, 2, 20, 3, 4, 5)]
    assert records == [*expected, LookupError, *(f'{{"n":{n}}}' for n in (6, 7, 8, 9))]
    assert body_reads("memory") == memory + 1
    assert body_reads("store") == store + 10
