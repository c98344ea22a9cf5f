"""A sharded `next(wait)` is bounded by its wait whatever one writer does (a writer
paused with SIGSTOP answers nothing, though the kernel still accepts its connections),
and rides through when every writer is away, as a call to one writer does."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.client import ShardMap, blocking
from cmdbus_trio.client.trio import ShardedClaimClient

from ..helpers import serving
from .test_reconnect import same_ports

pytestmark = pytest.mark.slow

WAIT = 3.0
ACK_WAIT = {"CMDBUS_ACK_WAIT_MS": "2000"}
"""A lease given to an ask that gave up ends soon."""
SLACK = 1.5
"""Seconds past the wait a call may take: the least time a writer has to answer one ask
(0.5 s, as the last ask may start when the wait is spent), the local grace, a loaded CI."""


@contextmanager
def two_shards(tmp_path: Path) -> Iterator[tuple[list[Any], ShardMap]]:
    """Two writers, shard 0 and 1, each with one command; the claim shard map."""
    with ExitStack() as stack:
        writers = []
        for shard in (0, 1):
            env = {"CMDBUS_SHARD": str(shard), "CMDBUS_SHARD_COUNT": "2", **ACK_WAIT}
            (tmp_path / f"w{shard}").mkdir()
            writers.append(stack.enter_context(serving(tmp_path / f"w{shard}", **env)))
        claims = ShardMap.parse(",".join(f"{i}@{w[1]['cmd_claim']}" for i, w in enumerate(writers)))
        for shard, (_, ports) in enumerate(writers):
            execution = next(n for n in range(100) if claims.shard_for(n) == shard)
            with blocking.IngestClient(ports["cmd_ingest"]) as ingest:
                ingest.publish({"execution_id": execution, "payload": "{}"})
        yield writers, claims


@contextmanager
def paused(process: Any) -> Iterator[None]:
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


async def test_a_paused_writer_costs_a_sharded_next_no_more_than_its_wait(
    tmp_path: Path,
) -> None:
    """Shard 0's writer paused, before and after the clients connected to it: each
    `next(wait=3)` of the trio and the blocking client returns within about 3 s, with
    shard 1's record first, then None; shard 0 is not asked first again while it is
    silent."""
    with trio.fail_after(120), two_shards(tmp_path) as (writers, claims):
        async with ShardedClaimClient(claims) as connected:
            assert await connected.next("commands.none.>", wait=0) is None  # both connected
            with paused(writers[0][0]):
                started = time.monotonic()
                first = await connected.next("commands.>", wait=WAIT)
                assert first is not None and first.shard == 1
                assert await connected.ack(first)
                assert await connected.next("commands.>", wait=WAIT) is None
                assert time.monotonic() - started < 2 * (WAIT + SLACK)

                async with ShardedClaimClient(claims) as fresh:  # connects to a paused writer
                    started = time.monotonic()
                    assert await fresh.next("commands.>", wait=WAIT) is None
                    assert time.monotonic() - started < WAIT + SLACK

                def blocking_next() -> tuple[float, Any]:
                    with blocking.ShardedClaimClient(claims) as cluster:
                        started = time.monotonic()
                        claimed = cluster.next("commands.>", wait=WAIT)
                        return time.monotonic() - started, claimed

                took, claimed = await trio.to_thread.run_sync(blocking_next)
                assert claimed is None and took < WAIT + SLACK
            # Back, it answers the asks that gave up (and may lease its record to one of
            # them: that lease ends with the ack wait), then serves again.
            with trio.fail_after(10):
                again = await connected.next("commands.>", wait=5)
            assert again is not None and again.shard == 0


async def test_a_sharded_next_rides_through_when_every_writer_is_away(tmp_path: Path) -> None:
    """Both writers killed: a `next(wait=0.5)` does not return None at its wait but rides
    through the reconnect window, and returns the record of the writer that comes back."""
    with trio.fail_after(120), two_shards(tmp_path) as (writers, claims):
        for process, _ in writers:
            process.kill()
            process.wait()
        with ExitStack() as stack:

            async def restart_shard_1() -> None:
                await trio.sleep(1.5)
                env = {"CMDBUS_SHARD": "1", "CMDBUS_SHARD_COUNT": "2", **ACK_WAIT}
                stack.enter_context(serving(tmp_path / "w1", **env, **same_ports(writers[1][1])))

            async with ShardedClaimClient(claims) as cluster, trio.open_nursery() as nursery:
                nursery.start_soon(restart_shard_1)
                started = time.monotonic()
                claimed = await cluster.next("commands.>", wait=0.5)
                assert time.monotonic() - started > 1.0
                assert claimed is not None and claimed.shard == 1
