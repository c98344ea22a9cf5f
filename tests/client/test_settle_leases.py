"""A settle names the lease it settles: one trio `ClaimClient` shared by two tasks, task A
holding a record whose lease ended (a writer restarted, or the lease expired) while task B
now holds the same record on the same connection. A's late (or resent) `ack` or `nack`
answers False and leaves B's lease alone; B's own settle answers True. A sort key alone
still names whatever lease the connection holds (the twin: why the token is needed)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.client.trio import ClaimClient, IngestClient

from ..helpers import serving
from .test_reconnect import restart_in_background, stop

pytestmark = pytest.mark.slow  # writers restarted in subprocesses: see noxfile.SYSTEM_ONCE

RECORD = {"execution_id": 1, "payload": "{}"}
FILTER = "commands.>"


async def _nobody_else_gets_it(ports: dict[str, str]) -> None:
    async with ClaimClient(ports["cmd_claim"]) as other:
        assert await other.next(FILTER, wait=0.5) is None


@pytest.mark.parametrize("settle", ["ack", "nack"])
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_a_settle_after_a_restart_leaves_another_tasks_lease_alone(
    tmp_path: Path, how: signal.Signals, settle: str
) -> None:
    with trio.fail_after(60), serving(tmp_path) as (process, ports):
        async with IngestClient(ports["cmd_ingest"]) as ingest:
            published = (await ingest.publish(RECORD)).sort_key
        started: list[Any] = []
        try:
            async with ClaimClient(ports["cmd_claim"]) as claim:
                task_a = await claim.next(FILTER, wait=5)
                assert task_a is not None and task_a.sort_key == published
                thread, started = restart_in_background(tmp_path, process, ports, how, 0.0)
                await trio.to_thread.run_sync(thread.join)
                task_b = await claim.next(FILTER, wait=5)  # rides through the restart
                assert task_b is not None and task_b.sort_key == published
                assert task_b.lease != task_a.lease
                settled_late = getattr(claim, settle)
                assert await settled_late(task_a) is False  # A's lease went with the old writer
                await _nobody_else_gets_it(ports)  # B's lease stands (a nack would free it)
                assert await claim.ack(task_b) is True
                assert await claim.ack(task_b) is False  # settled already
        finally:
            stop(started)


async def test_a_late_settle_after_the_lease_expired_leaves_the_new_one_alone(
    tmp_path: Path,
) -> None:
    """No restart: A's lease lapses (ack wait 1 s, A idles 1.5 s) and the record goes to
    B on the same connection. A's late ack, nack and extend answer False, B's lease
    stands, and the batch forms (`ack_many`) do the same per delivery."""
    with trio.fail_after(60), serving(tmp_path, CMDBUS_ACK_WAIT_MS="1000") as (_, ports):
        async with IngestClient(ports["cmd_ingest"]) as ingest:
            await ingest.publish_batch([RECORD, RECORD])
        async with ClaimClient(ports["cmd_claim"]) as claim:
            task_a = await claim.next_batch(FILTER, 2, wait=5)
            assert len(task_a) == 2
            await trio.sleep(1.5)  # past the ack wait: both leases lapse
            task_b = await claim.next_batch(FILTER, 2, wait=5)
            assert [d.sort_key for d in task_b] == [d.sort_key for d in task_a]
            assert await claim.extend(task_a[0]) is False
            assert await claim.nack(task_a[0]) is False
            assert await claim.ack_many(task_a) == [False, False]
            await _nobody_else_gets_it(ports)
            assert await claim.extend_many(task_b) == [True, True]
            # The twin: a sort key alone settles whatever lease the connection holds.
            assert await claim.ack(task_b[0].sort_key) is True
            assert await claim.ack_many([task_b[1]]) == [True]
