"""The tier's group commit: many append requests in one transaction, each refused alone;
the committer that batches the tier face's appends; and a drain that flushes it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.config import Config
from cmdbus_trio.protocol import FieldError
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage import _tier_appends as appends_module
from cmdbus_trio.storage.tier import (
    Appending,
    AppendResult,
    NewRecord,
    TierStore,
    VersionConflict,
)
from cmdbus_trio.tier.committer import AppendTicket, TierCommitter

from ..helpers import Refusing, commit_lines, commit_together, frame_client, running_writer


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TierStore]:
    opened = TierStore.open(tmp_path / "tier.sqlite3")
    yield opened
    opened.close()


def commits_of(store: TierStore) -> list[int]:
    """Counts the store's transactions (one entry per COMMIT)."""
    seen: list[int] = []
    store.before_commit = lambda: seen.append(1)
    return seen


def appending(execution: str, *payloads: str, expected: int | None = None) -> Appending:
    records = [NewRecord(p, "tx", json.loads(p).get("event_id")) for p in payloads or ("{}",)]
    return Appending("eventlog", execution, records, expected)


def test_requests_append_in_one_transaction_each_refused_alone(store: TierStore) -> None:
    commits = commits_of(store)
    outcomes = store.append_many(
        [
            appending("a"),
            appending("a", expected=0),  # "a" has one record by now: refused
            appending("b", "{}", "{}"),
            Appending("nope", "c", [NewRecord("{}")]),  # an unknown tier: refused
            appending("a", expected=1),
        ]
    )
    assert commits == [1]
    assert isinstance(outcomes[1], VersionConflict) and outcomes[1].actual == 1
    assert isinstance(outcomes[3], ValueError)
    good = [o for o in outcomes if isinstance(o, list)]
    assert [[r.global_sequence for r in o] for o in good] == [[1], [2, 3], [4]]
    # log_record_count: the tier's count after each request, within the transaction.
    assert [o[-1].log_record_count for o in good] == [1, 3, 4]
    assert store.statistics().record_counts["eventlog"] == 4
    assert store.execution_count("eventlog", "a") == 2
    assert store.execution_count("eventlog", "b") == 2


def test_an_event_id_is_deduplicated_across_the_requests_of_a_transaction(
    store: TierStore,
) -> None:
    first, again, other = store.append_many(
        [
            appending("a", '{"event_id": 7}'),
            appending("a", '{"event_id": 7}', '{"event_id": 8}'),
            appending("b", '{"event_id": 7}'),  # another execution: its own record
        ]
    )
    assert isinstance(first, list) and isinstance(again, list) and isinstance(other, list)
    assert again[0] == AppendResult(first[0].global_sequence, 2, True)
    assert not again[1].deduplicated and not other[0].deduplicated
    assert store.execution_count("eventlog", "a") == 2
    assert store.statistics().record_counts["eventlog"] == 3


def test_a_request_that_breaks_the_transaction_fails_alone(
    store: TierStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure that is not the store's, met mid-way by one request (a bug its input
    alone meets): the transaction is retried a request at a time, so only it fails and
    nothing of it is kept."""
    real_insert = appends_module._insert

    def insert(connection: Any, request: Appending, record: NewRecord) -> tuple[int, bool]:
        if "poison" in record.payload:
            raise RuntimeError("a bug this record alone meets")
        return real_insert(connection, request, record)

    monkeypatch.setattr(appends_module, "_insert", insert)
    commits = commits_of(store)
    outcomes = store.append_many(
        [appending("a"), appending("b", "{}", '{"poison": 1}'), appending("c")]
    )
    assert isinstance(outcomes[1], RuntimeError)
    assert [o[0].global_sequence for o in outcomes if isinstance(o, list)] == [1, 2]
    assert len(commits) == 2  # the batch rolled back (it is never committed), then a, c
    assert store.execution_count("eventlog", "b") is None
    assert store.statistics().record_counts["eventlog"] == 2
    with pytest.raises(RuntimeError):  # alone, it is raised
        store.append_many([appending("b", '{"poison": 2}')])


def test_a_store_failure_fails_every_request(store: TierStore) -> None:
    store.close()
    with pytest.raises(StoreUnavailable):
        store.append_many([appending("a"), appending("b")])


# --- the committer ---------------------------------------------------------------------


def ticket(request: Appending | Exception, records: int = 1) -> AppendTicket:
    def make() -> Appending:
        if isinstance(request, Exception):
            raise request
        return request

    def reply(results: list[AppendResult]) -> bytes:
        threads.append(threading.get_ident())
        return json.dumps([r.global_sequence for r in results]).encode()

    return AppendTicket(make, reply, records=records)


threads: list[int] = []


@pytest.fixture
async def tier_store(tmp_path: Path) -> AsyncIterator[TierStore]:
    opened = await trio.to_thread.run_sync(TierStore.open, tmp_path / "tier.sqlite3")
    yield opened
    await trio.to_thread.run_sync(opened.close)


async def test_queued_appends_commit_together_in_order_each_failing_alone(
    tier_store: TierStore,
) -> None:
    threads.clear()
    commits = commits_of(tier_store)
    tickets = [
        ticket(appending("a")),
        ticket(FieldError("payload", "payload is not JSON")),  # refused as it is made
        ticket(appending("a", expected=5)),
        ticket(appending("b", "{}", "{}"), records=2),
    ]
    await commit_together(TierCommitter(tier_store), tickets)
    assert commits == [1]
    assert [tickets[0].replied, tickets[3].replied] == [b"[1]", b"[2, 3]"]
    assert isinstance(tickets[1].error, FieldError)
    assert isinstance(tickets[2].error, VersionConflict)
    # Replies are encoded in the commit thread, off the loop.
    assert threads and threading.get_ident() not in threads


async def test_a_failing_settle_callback_stops_no_other_ticket(
    tier_store: TierStore, caplog: pytest.LogCaptureFixture
) -> None:
    settled: list[AppendTicket] = []

    def broken(_: AppendTicket) -> None:
        raise RuntimeError("a bug")

    first, second = ticket(appending("a")), ticket(appending("b"))
    first.on_settled, second.on_settled = broken, settled.append
    await commit_together(TierCommitter(tier_store), [first, second])
    assert settled == [second]
    assert first.replied == b"[1]"  # committed: only its callback failed
    assert any("step_failed" in record.getMessage() for record in caplog.records)


async def test_a_transaction_takes_at_most_max_records(tier_store: TierStore) -> None:
    commits = commits_of(tier_store)
    tickets = [ticket(appending(f"e{n}", "{}", "{}"), records=2) for n in range(5)]
    tickets.append(ticket(appending("big", *["{}"] * 5), records=5))  # over: alone
    await commit_together(TierCommitter(tier_store, max_records=4), tickets)
    assert len(commits) == 4  # 2 + 2, 2 + 2, 2, 5
    assert all(each.error is None for each in tickets)


async def test_a_store_failure_reaches_every_ticket(tier_store: TierStore) -> None:
    await trio.to_thread.run_sync(tier_store.close)
    tickets = [ticket(appending("a")), ticket(appending("b"))]
    await commit_together(TierCommitter(tier_store), tickets)
    assert all(isinstance(each.error, StoreUnavailable) for each in tickets)


async def test_refused_appends_are_a_warning_a_burst_and_a_failed_store_an_error(
    tier_store: TierStore, caplog: pytest.LogCaptureFixture
) -> None:
    """As the buses' committers: refused while the cause lasts, one warning a burst
    (its cause is logged once where it is found); a store that failed, an error each."""
    refusing = TierCommitter(tier_store, max_records=1)
    refusing.wait_for(Refusing())
    await commit_together(refusing, [ticket(appending("a")), ticket(appending("b"))])
    why = {"store": "tier", "why": "no standby is in sync", "traceback": False}
    assert commit_lines(caplog) == [("WARNING", "commit_refused", why)]
    caplog.clear()
    await trio.to_thread.run_sync(tier_store.close)
    await commit_together(TierCommitter(tier_store, max_records=1), [ticket(appending("c"))] * 2)
    assert (
        commit_lines(caplog)
        == [("ERROR", "commit_failed", {"store": "tier", "traceback": True})] * 2
    )


def test_the_committer_checks_its_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_records must be >= 1, got 0"):
        TierCommitter(TierStore(tmp_path / "t.sqlite3"), max_records=0)


# --- through the face ------------------------------------------------------------------


@pytest.mark.parametrize("budget_ms", [10_000, 100])
async def test_a_drain_commits_every_queued_append(
    make_config: Callable[..., Config], budget_ms: int
) -> None:
    """Appends queued behind a slow commit when the drain begins are committed before
    the writer stops, and answered within the shutdown budget; past it (100 ms here,
    against 0.6 s of commits) they are committed all the same, though their
    connections may close before the reply."""
    config = make_config(tier_bind="127.0.0.1:0", shutdown_timeout_ms=budget_ms)
    replies: list[dict[str, Any] | None] = []
    with trio.fail_after(30):
        async with running_writer(config) as (writer, addresses):
            tier = writer._stores["tier"]
            tier.store.before_commit = lambda: time.sleep(0.3)  # a slow fsync
            gate = writer.health.gates["tier_writes"]

            async def append(n: int) -> None:
                async with frame_client(addresses["tier"]) as client:
                    try:
                        reply = await client.request("append", execution_id=f"d{n}", payload="{}")
                    except AssertionError:  # closed past the budget
                        reply = None
                    replies.append(reply)

            async with trio.open_nursery() as nursery:
                for n in range(6):
                    nursery.start_soon(append, n)
                while gate.statistics().inflight < 6:
                    await trio.sleep(0.01)
                writer.request_drain()
    answered = [reply for reply in replies if reply is not None]
    assert all(reply["ok"] for reply in answered)
    if budget_ms == 10_000:
        assert len(answered) == 6

    def stored() -> list[int | None]:  # read back from the file, after the writer stopped
        reopened = TierStore.open(tier.store.path)
        try:
            return [reopened.execution_count("eventlog", f"d{n}") for n in range(6)]
        finally:
            reopened.close()

    assert await trio.to_thread.run_sync(stored) == [1] * 6
