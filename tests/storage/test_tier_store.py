from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmdbus_trio.protocol.tier import record_fragment
from cmdbus_trio.storage import StoreState, StoreUnavailable
from cmdbus_trio.storage import tier as tier_module
from cmdbus_trio.storage._tier_pages import sqlite_writes_fragments
from cmdbus_trio.storage.tier import (
    PAGE_ROWS,
    TIERS,
    NewRecord,
    TierStore,
    VersionConflict,
)

from ..helpers import watch_the_write_lock


@pytest.fixture
def store(tmp_path: Path) -> TierStore:
    opened = TierStore.open(tmp_path / "tier.sqlite3")
    yield opened  # type: ignore[misc]
    opened.close()


def rec(payload: str = '{"a": 1}', event_id: str | None = None, tx: str = "") -> NewRecord:
    return NewRecord(payload=payload, transaction_id=tx, event_id=event_id)


def read_all(store: TierStore, tier: str, execution_id: str, after: int = 0) -> list[int]:
    return [
        r.global_sequence
        for page in store.iter_execution(tier, execution_id, after=after)
        for r in page
    ]


def test_open_uses_wal(store: TierStore) -> None:
    mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


@pytest.mark.parametrize("tier", TIERS)
def test_append_and_read_back_in_each_tier(store: TierStore, tier: str) -> None:
    first = store.append(tier, "e1", rec('{"n": 1}', tx="t1"))
    second = store.append(tier, "e1", rec('{"n": "é"}'))
    assert (first.global_sequence, first.log_record_count, first.deduplicated) == (1, 1, False)
    assert (second.global_sequence, second.log_record_count) == (2, 2)
    records = [r for page in store.iter_execution(tier, "e1") for r in page]
    assert [(r.global_sequence, r.execution_id, r.transaction_id, r.payload) for r in records] == [
        (1, "e1", "t1", '{"n": 1}'),
        (2, "e1", "", '{"n": "é"}'),
    ]
    assert records[1].byte_len == len('{"n": "é"}'.encode())
    assert store.execution_count(tier, "e1") == 2
    assert store.execution_count(tier, "nope") is None


def test_sequences_are_per_tier(store: TierStore) -> None:
    assert store.append("eventlog", "e", rec()).global_sequence == 1
    assert store.append("catalog", "e", rec()).global_sequence == 1
    assert store.append("eventlog", "f", rec()).global_sequence == 2
    assert store.append("eventlog", "f", rec()).log_record_count == 3
    assert store.statistics().record_counts == {"eventlog": 3, "projection": 0, "catalog": 1}


def test_dedup_by_event_id_per_execution_and_tier(store: TierStore) -> None:
    first = store.append("eventlog", "e", rec('{"event_id": 7}', event_id="7"))
    again = store.append("eventlog", "e", rec('{"event_id": 7, "x": 1}', event_id="7"))
    assert again == type(again)(first.global_sequence, 1, True)
    assert not store.append("eventlog", "other", rec(event_id="7")).deduplicated
    assert not store.append("projection", "e", rec(event_id="7")).deduplicated
    assert read_all(store, "eventlog", "e") == [1]


def test_batch_dedups_within_itself(store: TierStore) -> None:
    results = store.append_batch("eventlog", "e", [rec(event_id='"a"'), rec(event_id='"a"'), rec()])
    assert [(r.global_sequence, r.deduplicated) for r in results] == [
        (1, False),
        (1, True),
        (2, False),
    ]
    assert all(r.log_record_count == 2 for r in results)
    assert store.execution_count("eventlog", "e") == 2


def test_batch_is_all_or_nothing(store: TierStore) -> None:
    store.append("eventlog", "e", rec())

    def fail() -> None:
        raise RuntimeError("crash before commit")

    store.before_commit = fail
    with pytest.raises(RuntimeError):
        store.append_batch("eventlog", "e", [rec(), rec(), rec()])
    store.before_commit = None
    assert read_all(store, "eventlog", "e") == [1]
    assert store.state is StoreState.OK  # not an I/O failure: not poisoned
    assert store.append("eventlog", "e", rec()).log_record_count == 2


def test_expected_version(store: TierStore) -> None:
    store.append("eventlog", "e", rec(), expected_version=0)
    store.append("eventlog", "e", rec(), expected_version=1)
    with pytest.raises(VersionConflict) as info:
        store.append("eventlog", "e", rec(), expected_version=1)
    assert (info.value.expected, info.value.actual) == (1, 2)
    assert store.execution_count("eventlog", "e") == 2


def test_sequences_survive_reopen_and_are_never_reused(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite3"
    store = TierStore.open(path)
    store.append_batch("eventlog", "e", [rec(), rec(), rec()])
    store.close()
    store = TierStore.open(path)
    assert store.append("eventlog", "e", rec()).global_sequence == 4
    assert store.statistics().record_counts["eventlog"] == 4
    # Even if the newest rows vanished (they never do by our hand), AUTOINCREMENT
    # never hands their numbers out again.
    raw = sqlite3.connect(path)
    raw.execute("DELETE FROM eventlog_records WHERE global_sequence = 4")
    raw.commit()
    raw.close()
    assert store.append("eventlog", "e", rec()).global_sequence == 5
    store.close()


def test_paging_visits_every_record_once(store: TierStore) -> None:
    count = PAGE_ROWS * 2 + 17
    store.append_batch("eventlog", "big", [rec(f'{{"i": {i}}}') for i in range(count)])
    store.append("eventlog", "small", rec())
    pages = list(store.iter_execution("eventlog", "big"))
    assert [len(page) for page in pages] == [PAGE_ROWS, PAGE_ROWS, 17]
    assert read_all(store, "eventlog", "big") == list(range(1, count + 1))
    assert read_all(store, "eventlog", "big", after=count - 3) == [count - 2, count - 1, count]
    scanned = [
        r.global_sequence for page in store.iter_scan("eventlog", after=count - 1) for r in page
    ]
    assert scanned == [count, count + 1]


def test_concurrent_appends_from_threads(store: TierStore) -> None:
    def append(i: int) -> int:
        return store.append("eventlog", f"e{i % 5}", rec()).global_sequence

    with ThreadPoolExecutor(8) as pool:
        sequences = list(pool.map(append, range(400)))
    assert sorted(sequences) == list(range(1, 401))
    assert sum(store.execution_count("eventlog", f"e{i}") or 0 for i in range(5)) == 400


def test_injected_io_error_poisons_writes_but_not_reads(store: TierStore) -> None:
    store.append("eventlog", "e", rec())

    def io_error() -> None:
        error = sqlite3.OperationalError("disk I/O error")
        error.sqlite_errorcode = 10  # type: ignore[attr-defined]
        raise error

    store.before_commit = io_error
    with pytest.raises(StoreUnavailable, match="poisoned: OperationalError: disk I/O error"):
        store.append("eventlog", "e", rec())
    store.before_commit = None
    assert store.state is StoreState.POISONED
    with pytest.raises(StoreUnavailable, match="poisoned"):
        store.append("catalog", "e", rec())
    assert read_all(store, "eventlog", "e") == [1]


def test_contended_when_a_writer_waits_past_the_threshold(tmp_path: Path) -> None:
    now = [0.0]
    store = TierStore.open(tmp_path / "t.sqlite3", contention_threshold=0.5, clock=lambda: now[0])
    assert store.state is StoreState.OK
    store._write_lock.acquire()
    waiting = threading.Thread(target=store.append, args=("eventlog", "e", rec()))
    waiting.start()
    now[0] = 1.0  # the waiting writer will have waited 1 s
    store._write_lock.release()
    waiting.join()
    assert store.state is StoreState.CONTENDED
    assert store.statistics().write_lock_waits_over_threshold == 1
    now[0] = 20.0
    assert store.state is StoreState.OK
    store.close()


def test_contended_while_a_writer_is_still_waiting(tmp_path: Path) -> None:
    """A writer stuck behind the lock shows as contended while it waits, not only once
    it got the lock."""
    now = [0.0]
    store = TierStore.open(tmp_path / "t.sqlite3", contention_threshold=0.5, clock=lambda: now[0])
    store._write_lock.acquire()
    waiting = threading.Thread(target=store.append, args=("eventlog", "e", rec()))
    waiting.start()
    while not store._asking:
        time.sleep(0.001)
    assert store.state is StoreState.OK  # waited 0 s so far
    now[0] = 0.4
    assert store.state is StoreState.OK  # below the threshold
    now[0] = 1.0  # still waiting, past the threshold
    assert store.state is StoreState.CONTENDED
    store._write_lock.release()
    waiting.join()
    assert store.state is StoreState.CONTENDED  # remembered for contention_memory
    now[0] = 20.0
    assert store.state is StoreState.OK
    assert read_all(store, "eventlog", "e") == [1]
    store.close()


def test_closed_store_refuses(store: TierStore) -> None:
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.append("eventlog", "e", rec())


def test_unknown_tier(store: TierStore) -> None:
    with pytest.raises(ValueError, match="unknown tier 'nope'"):
        store.append("nope", "e", rec())


def test_synchronous_setting_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        TierStore(tmp_path / "x", synchronous="off")


def test_a_real_write_failure_poisons_the_store(tmp_path: Path) -> None:
    """A file-size limit makes the kernel refuse writes (EFBIG), as a full disk would."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pathlib import Path
        from cmdbus_trio.storage import StoreUnavailable
        from cmdbus_trio.storage.tier import NewRecord, TierStore
        store = TierStore.open(Path({str(tmp_path / "t.sqlite3")!r}))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
        acked = 0
        try:
            for i in range(1000):
                store.append("eventlog", "e", NewRecord('"' + "x" * 4000 + '"'))
                acked += 1
        except StoreUnavailable as exc:
            print("unavailable", acked, store.state.value, exc)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    word, acked, state, *_ = result.stdout.split()
    assert (word, state) == ("unavailable", "poisoned")
    # Nothing acknowledged is lost: a clean reopen has every acknowledged record.
    store = TierStore.open(tmp_path / "t.sqlite3")
    assert store.execution_count("eventlog", "e") == int(acked) > 0
    store.close()


def test_connections_are_the_pool_however_many_threads_came_and_went(store: TierStore) -> None:
    """trio retires idle worker threads and starts new ones; each new thread must not
    leave a connection (a file descriptor) behind: the pool opened with the store is
    all there is."""
    for i in range(50):
        thread = threading.Thread(
            target=lambda i=i: (
                store.append("eventlog", "e", rec()),
                [page for page in store.iter_execution("eventlog", "e")],
            )
        )
        thread.start()
        thread.join()
    assert store.statistics().connections == store.pool_size


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)))  # stored text never has one
_EXECUTIONS = itertools.count()


@pytest.mark.parametrize("in_sqlite", [True, False])
@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=4), name=_TEXT)
def test_encoded_pages_are_the_records_reply_fragments(
    store: TierStore, in_sqlite: bool, records: list[tuple[str, str]], name: str
) -> None:
    """SQLite's fragments (or the Python fallback's) are byte for byte those of
    record_fragment, for any text in any field."""
    store.fragments_in_sqlite = in_sqlite
    execution_id = f"{name}-{next(_EXECUTIONS)}"
    store.append_batch("eventlog", execution_id, [rec(p, tx=tx) for p, tx in records])
    expected = [
        (r.global_sequence, record_fragment(*attrs.astuple(r)))
        for page in store.iter_execution("eventlog", execution_id)
        for r in page
    ]
    encoded = store.iter_execution_encoded("eventlog", execution_id)
    assert [pair for page in encoded for pair in page] == expected
    after = expected[0][0] - 1
    scanned = [pair for page in store.iter_scan_encoded("eventlog", after=after) for pair in page]
    assert scanned[: len(expected)] == expected


def test_fragments_are_made_in_sqlite_only_where_it_escapes_as_we_do(store: TierStore) -> None:
    assert store.fragments_in_sqlite  # this SQLite: every CI Python links one like it
    connection = sqlite3.connect(":memory:")
    assert sqlite_writes_fragments(connection)

    def upper_hex_json_object(*pairs: object) -> str:  # \u001F where we write \u001f
        return json.dumps(dict(zip(pairs[::2], pairs[1::2], strict=True))).upper()

    connection.create_function("json_object", -1, upper_hex_json_object)
    assert not sqlite_writes_fragments(connection)
    connection.create_function("json_object", -1, None)  # as if built without JSON
    assert not sqlite_writes_fragments(connection)


@pytest.mark.parametrize("in_sqlite", [True, False])
def test_encoded_pages_hold_every_record_in_order_across_pages(
    store: TierStore, in_sqlite: bool
) -> None:
    store.fragments_in_sqlite = in_sqlite
    total = 2 * PAGE_ROWS + 5
    records = [rec(json.dumps({"n": "é\n" * (n % 7)}), tx=f"t{n}") for n in range(total)]
    store.append_batch("eventlog", "long", records)
    store.append("eventlog", "other", rec())  # between, skipped by the execution's reads
    store.append("eventlog", "long", rec('{"last": true}'))
    expected = [
        (r.global_sequence, record_fragment(*attrs.astuple(r)))
        for page in store.iter_execution("eventlog", "long")
        for r in page
    ]
    pages = list(store.iter_execution_encoded("eventlog", "long"))
    assert [len(page) for page in pages] == [PAGE_ROWS, PAGE_ROWS, 6]
    assert [pair for page in pages for pair in page] == expected
    middle = expected[PAGE_ROWS - 3][0]
    resumed = store.iter_execution_encoded("eventlog", "long", after=middle)
    assert [pair for page in resumed for pair in page] == expected[PAGE_ROWS - 2 :]
    scanned = [pair for page in store.iter_scan_encoded("eventlog") for pair in page]
    assert len(scanned) == total + 2


@pytest.mark.parametrize("in_sqlite", [True, False])
def test_an_encoded_page_holds_about_page_bytes_and_at_least_one_record(
    store: TierStore, in_sqlite: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records may be up to a request's size each: a page of PAGE_ROWS of them is not read
    at once. A page ends with the record that reaches PAGE_BYTES; a bigger one is alone."""
    store.fragments_in_sqlite = in_sqlite
    monkeypatch.setattr(tier_module, "PAGE_BYTES", 1000)
    sizes = [300, 300, 300, 300, 2500, 10, 10]
    store.append_batch("eventlog", "e", [rec(json.dumps("x" * (size - 2))) for size in sizes])
    pages = list(store.iter_execution_encoded("eventlog", "e"))
    assert [len(page) for page in pages] == [4, 1, 2]
    assert [key for page in pages for key, _ in page] == list(range(1, 8))


def test_delete_execution_deletes_its_records_only_in_bounded_transactions(
    store: TierStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier_module, "DELETE_BATCH", 7)  # several transactions
    store.append_batch("eventlog", "gone", [rec(f'{{"n": {n}}}') for n in range(20)])
    kept = store.append("eventlog", "kept", rec())
    store.append("projection", "gone", rec())  # another tier: untouched
    commits: list[int] = []
    store.before_commit = lambda: commits.append(1)
    assert store.delete_execution("eventlog", "gone") == 20
    assert len(commits) == 4  # 7 + 7 + 6, then one that finds nothing
    commits.clear()
    assert store.execution_count("eventlog", "gone") is None
    assert store.statistics().record_counts["eventlog"] == 1
    assert read_all(store, "eventlog", "kept") == [kept.global_sequence]
    assert store.execution_count("projection", "gone") == 1
    assert store.delete_execution("eventlog", "gone") == 0
    assert store.delete_execution("eventlog", "kept") == 1  # the newest sequence, 21
    again = store.append("eventlog", "gone", rec())
    assert again.global_sequence == 22 and again.log_record_count == 1  # never reused
    store.before_commit = None


def test_delete_execution_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite3"
    store = TierStore.open(path)
    store.append_batch("catalog", "x", [rec(), rec()])
    assert store.delete_execution("catalog", "x") == 2
    store.close()
    store = TierStore.open(path)
    assert store.execution_count("catalog", "x") is None
    assert store.statistics().record_counts["catalog"] == 0
    assert store.append("catalog", "x", rec()).global_sequence == 3
    store.close()


def test_counts_change_before_the_next_writer_takes_the_lock(store: TierStore) -> None:
    """An append in the committer's thread and a delete in retention's both read and
    change the tier's counts: each change is made under the write lock."""
    held = watch_the_write_lock(store)
    store.append_batch("eventlog", "e", [NewRecord("{}"), NewRecord("{}")])
    assert store.delete_execution("eventlog", "e") == 2
    assert held and all(held)
    assert store.statistics().record_counts["eventlog"] == 0
