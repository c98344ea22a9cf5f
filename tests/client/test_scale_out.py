"""Three sharded writers on loopback, a router, and a sharded claim client: publish
through the router, kill -9 one writer mid-run and restart it, then consume across the
cluster. Every acknowledged record is delivered at least once and acked exactly once;
per-shard lag metrics add up to the cluster's backlog. (`--scale-records`, default 6000
in CI; the full run is 30000.)"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.client import ClientError, ShardMap
from cmdbus_trio.client.blocking import Router, ShardedClaimClient

from ..helpers import serving

pytestmark = pytest.mark.slow
SHARDS = 3
CHUNK = 500


def lag_metrics(control: str) -> tuple[float, float]:
    """(sum of ehdb_feed_subject_lag, ehdb_feed_total_lag) of one writer."""
    with urllib.request.urlopen(f"http://{control}/metrics", timeout=10) as response:
        text = response.read().decode()
    subjects = total = 0.0
    for line in text.splitlines():
        if line.startswith("ehdb_feed_subject_lag{"):
            subjects += float(line.split()[-1])
        elif line.startswith("ehdb_feed_total_lag "):
            total = float(line.split()[-1])
    return subjects, total


def test_three_writers_one_killed_and_restarted(tmp_path: Path, scale_records: int) -> None:
    records = [
        {"execution_id": n, "payload": json.dumps({"id": n, "execution_pool": "shared"})}
        for n in range(scale_records)
    ]
    acknowledged: set[int] = set()
    unknown: set[int] = set()
    with ExitStack() as stack:
        writers: list[tuple[Any, dict[str, str]]] = []
        for shard in range(SHARDS):
            (tmp_path / f"w{shard}").mkdir()
            env = {"CMDBUS_SHARD": str(shard), "CMDBUS_SHARD_COUNT": str(SHARDS)}
            writers.append(stack.enter_context(serving(tmp_path / f"w{shard}", **env)))
        ingest = ShardMap.parse(
            ",".join(f"{i}@{w[1]['cmd_ingest']}" for i, w in enumerate(writers))
        )
        with Router(ingest) as router:
            for begin in range(0, len(records), CHUNK):
                if begin == len(records) // 2:  # kill -9 shard 1 mid-run
                    process, ports = writers[1]
                    process.send_signal(signal.SIGKILL)
                    process.wait()
                    try:
                        router.publish_batch(records[begin : begin + CHUNK], timeout=10)
                        raise AssertionError("a publish to the dead writer succeeded")
                    except ClientError as error:
                        assert error.shard is not None  # the router says which shard
                        unknown.update(range(begin, begin + CHUNK))
                    binds = [f"--{face.replace('_', '-')}-bind={ports[face]}" for face in ports]
                    restarted = stack.enter_context(
                        serving(tmp_path / "w1", *binds, CMDBUS_SHARD="1", CMDBUS_SHARD_COUNT="3")
                    )
                    writers[1] = restarted
                    continue
                chunk = records[begin : begin + CHUNK]
                router.publish_batch(chunk, timeout=30)  # reconnects to the restarted writer
                acknowledged.update(range(begin, begin + len(chunk)))
        assert len(acknowledged) >= scale_records - CHUNK
        # Per-shard lag adds up: each writer's subjects sum to its total, and the writers'
        # totals to the cluster's backlog (as the claim faces count it).
        claims = ShardMap.parse(",".join(f"{i}@{w[1]['cmd_claim']}" for i, w in enumerate(writers)))
        with ShardedClaimClient(claims) as cluster:
            backlog = sum(writer.lag().total for writer in cluster.writers)
        time.sleep(1.5)  # the lag sampler runs every second
        per_writer = [lag_metrics(w[1]["control"]) for w in writers]
        assert all(subjects == total for subjects, total in per_writer)
        assert sum(total for _, total in per_writer) == backlog >= len(acknowledged)
        # Consume across the cluster with four sharded claim clients.
        delivered: Counter[int] = Counter()
        acked: Counter[int] = Counter()
        lock = threading.Lock()
        failures: list[BaseException] = []

        def consume() -> None:
            try:
                with ShardedClaimClient(claims) as client:
                    while (got := client.next("commands.>", wait=1.0, timeout=10)) is not None:
                        record_id = json.loads(got.delivery.record["payload"])["id"]
                        ok = client.ack(got, timeout=10)
                        with lock:
                            delivered[record_id] += 1
                            acked[record_id] += 1 if ok else 0
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=consume) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        assert not failures, failures
    missing = sorted(n for n in acknowledged if delivered[n] == 0)
    acked_twice = sorted(n for n, count in acked.items() if count > 1)
    not_acked = sorted(n for n in acknowledged if acked[n] != 1)
    stray = sorted(set(delivered) - acknowledged - unknown)
    print(
        f"\nscale-out: {SHARDS} writers, {len(records)} records, {len(acknowledged)} "
        f"acknowledged, {len(unknown)} unknown (the killed writer's batch); delivered "
        f"{sum(delivered.values())}; missing {len(missing)}, acked twice {len(acked_twice)}"
    )
    assert not missing and not acked_twice and not not_acked and not stray
