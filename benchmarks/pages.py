"""What a reader's page costs in its worker thread: cmdbus-trio's page assembly against
the per-record one it replaced, in the same run.

    python benchmarks/pages.py                 # 20,000 records of ~1.1 KB, 1,000 a reply

Both read the same execution through the same SQL (SQLite writes every record's reply
fragment, the page's fragments come back in one row); they differ in what Python does
with the row:

- ``per record`` (the design before, kept here as the baseline): split the row into one
  ``(key, fragment)`` pair per record, then walk the pairs to cut the reply by count and
  by bytes, then join them;
- ``cmdbus-trio``: ``protocol.paging.Fragments`` (the keys and the fragments' ends, computed
  in C) and ``protocol.tier.page``, which takes a prefix of each page's blob by bisecting.

Each is timed alone and beside a thread that holds the GIL in 1 ms slices half of the
time (a busy loop): every take of the GIL can then wait, so Python work per record costs
more than its own CPU. It prints thread CPU and wall time per reply.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cmdbus_trio.protocol import pages as paging
from cmdbus_trio.storage import _tier_pages
from cmdbus_trio.storage import tier as tier_store
from cmdbus_trio.storage.tier import NewRecord, TierStore

LIMIT = 1000
MAX_REPLY = 16 << 20


def per_record_pages(store: TierStore, after: int) -> Iterator[list[tuple[int, bytes]]]:
    """The rows of cmdbus-trio's own query, split as before: a pair per record."""
    table = "eventlog_records"
    columns = f"global_sequence, {_tier_pages.FRAGMENT_SQL} AS fragment"
    page = _tier_pages.BOUNDED_PAGE_SQL.format(
        columns=columns, table=table, condition="execution_id = ? AND"
    )
    sql = (
        "SELECT group_concat(global_sequence), group_concat(length(fragment)), "
        f"CAST(group_concat(fragment, '') AS BLOB) FROM ({page})"
    )
    with store._connection() as connection:
        while True:
            [(keys, lengths, fragments)] = connection.execute(
                sql, ("big", after, tier_store.PAGE_ROWS, tier_store.PAGE_BYTES)
            ).fetchall()
            if keys is None:
                return
            pairs = []
            start = 0
            for key, length in zip(keys.split(","), lengths.split(","), strict=True):
                end = start + int(length)
                pairs.append((int(key), fragments[start:end]))
                start = end
            yield pairs
            after = pairs[-1][0]


def per_record_reply(store: TierStore, after: int) -> bytes:
    head: dict[str, Any] = {"id": 1, "ok": True}
    overhead = paging.reply_size(head | {"returned": LIMIT}, 0, 0, {"next_after": 1 << 63})
    fragments: list[bytes] = []
    size = 0
    last = None
    more = False
    for pairs in per_record_pages(store, after):
        for key, fragment in pairs:
            if len(fragments) == LIMIT:
                more = True
                break
            grown = size + len(fragment) + (1 if fragments else 0)
            if overhead + grown > MAX_REPLY:
                more = True
                break
            fragments.append(fragment)
            size = grown
            last = key
        if more:
            break
    head["returned"] = len(fragments)
    return paging.with_records(head, fragments, {"next_after": last if more else None})


def cmdbus_reply(store: TierStore, after: int) -> bytes:
    pages = store.iter_execution_encoded("eventlog", "big", after=after)
    head: dict[str, Any] = {"id": 1, "ok": True}
    return paging.page(head, pages, limit=LIMIT, max_reply=MAX_REPLY, name="record", returned=True)


def timed(
    reply: Callable[[TierStore, int], bytes], store: TierStore, replies: int
) -> dict[str, float]:
    result: dict[str, float] = {}

    def work() -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        for n in range(replies):
            reply(store, n * LIMIT)
        result["cpu_ms"] = (time.thread_time() - cpu) / replies * 1000
        result["wall_ms"] = (time.perf_counter() - wall) / replies * 1000

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return result


def busy_loop(stop: threading.Event) -> None:
    """Hold the GIL for 1 ms, then sleep 1 ms (without it), until stopped."""
    while not stop.is_set():
        until = time.perf_counter() + 0.001
        while time.perf_counter() < until:
            pass
        time.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--payload-bytes", type=int, default=1100)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two")
    args = parser.parse_args()
    replies = args.records // LIMIT
    with tempfile.TemporaryDirectory(prefix="cmdbus-pages-") as workdir:
        store = TierStore.open(Path(workdir) / "tier.sqlite3", synchronous="normal")
        pad = "x" * args.payload_bytes
        store.append_batch(
            "eventlog",
            "big",
            [NewRecord(json.dumps({"i": i, "pad": pad}), "tx") for i in range(args.records)],
        )
        assert store.fragments_in_sqlite, "this SQLite cannot write the fragments"
        assert per_record_reply(store, 0) == cmdbus_reply(store, 0)  # the same bytes
        contenders: dict[str, Callable[[TierStore, int], bytes]] = {
            "per record": per_record_reply,
            "cmdbus-trio": cmdbus_reply,
        }
        print(f"{replies} replies of {LIMIT} records of ~{args.payload_bytes} bytes, per reply:")
        print(f"{'round':<7}{'beside':<10}{'target':<13}{'cpu ms':>8}{'wall ms':>9}")
        for round_ in range(1, args.rounds + 1):
            for beside in ("nothing", "busy loop"):
                stop = threading.Event()
                busy = threading.Thread(target=busy_loop, args=(stop,))
                if beside == "busy loop":
                    busy.start()
                try:
                    for name, reply in contenders.items():
                        figures = timed(reply, store, replies)
                        print(
                            f"{round_:<7}{beside:<10}{name:<13}"
                            f"{figures['cpu_ms']:>8.2f}{figures['wall_ms']:>9.2f}"
                        )
                finally:
                    stop.set()
                    if busy.is_alive():
                        busy.join()
        store.close()


if __name__ == "__main__":
    main()
