from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial

import pytest
import trio
import trio.testing

from cmdbus_trio import metrics
from cmdbus_trio.app import StartupError, Writer
from cmdbus_trio.commands._addresses import write_ports_file
from cmdbus_trio.config import Config
from cmdbus_trio.faces import FaceContext

from .helpers import get, running_writer

finished_work: list[float] = []


async def sleeper_face(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """A test face: each connection sends seconds to sleep in a worker thread under a Gate
    slot (as a write: it always finishes) and gets ``done`` back."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            seconds = float(await stream.receive_some(100))
            with await ctx.gate.acquire("sleep") as slot:
                await slot.run_to_completion(time.sleep, seconds)
                finished_work.append(seconds)
            await stream.send_all(b"done")

    listeners = await trio.open_tcp_listeners(ctx.bind.port, host=ctx.bind.host)
    async with trio.open_nursery() as handlers, trio.open_nursery() as acceptor:
        await acceptor.start(
            partial(trio.serve_listeners, handle, listeners, handler_nursery=handlers)
        )
        host, port = listeners[0].socket.getsockname()[:2]
        task_status.started(f"{host}:{port}")
        await ctx.draining.wait()
        acceptor.cancel_scope.cancel()  # stop accepting; in-flight handlers go on


crash_now = trio.Event()


async def crashing_face(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    task_status.started("127.0.0.1:1")
    await crash_now.wait()
    raise RuntimeError("boom: a bug in a face")


async def failing_start_face(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    raise OSError(98, "Address already in use")


async def send_sleep(address: str, seconds: float) -> bytes:
    host, port = address.rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(str(seconds).encode())
        return await stream.receive_some(100)


async def wait_inflight(writer: Writer, face: str, count: int) -> None:
    while writer.health.gates[face].statistics().inflight != count:
        await trio.sleep(0.01)


async def test_drain_waits_for_inflight_work_and_reports_draining(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(tier_bind="127.0.0.1:0", shutdown_timeout_ms=10_000)
    finished_work.clear()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            writer = Writer(config, faces={"tier": sleeper_face})
            addresses = await nursery.start(writer.run)
            assert metrics.REGISTRY.get_sample_value("cmdbus_ready") == 1
            replies: list[bytes] = []

            async def client() -> None:
                replies.append(await send_sleep(addresses["tier"], 0.5))

            nursery.start_soon(client)
            await wait_inflight(writer, "tier", 1)
            writer.request_drain()
            await trio.sleep(0.05)
            readyz = await get(addresses["control"], "/readyz")
            assert readyz.status == 503
            assert readyz.json()["reasons"] == ["draining: shutting down"]
            assert metrics.REGISTRY.get_sample_value("cmdbus_ready") == 0
            assert finished_work == []  # still running; the writer has not stopped
    assert finished_work == [0.5]
    assert replies == [b"done"]


async def test_drain_budget_cancels_but_still_waits_for_threads(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tier_bind="127.0.0.1:0", shutdown_timeout_ms=100)
    finished_work.clear()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            writer = Writer(config, faces={"tier": sleeper_face})
            addresses = await nursery.start(writer.run)
            nursery.start_soon(send_sleep, addresses["tier"], 1.0)
            await wait_inflight(writer, "tier", 1)
            start = trio.current_time()
            writer.request_drain()
        # The budget ran out at 0.1 s, but a started write finishes before the writer stops.
        assert trio.current_time() - start >= 0.9
    assert finished_work == [1.0]
    assert "shutdown_budget_exhausted" in [record.getMessage() for record in caplog.records]


async def test_a_crashed_face_is_logged_counted_and_the_rest_keeps_serving(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(
        tier_bind="127.0.0.1:0", cmd_ingest_bind="127.0.0.1:0", liveness_window_ms=300
    )
    before = metrics.REGISTRY.get_sample_value("cmdbus_face_crashes_total", {"face": "tier"}) or 0
    with trio.fail_after(20):
        faces = {"tier": crashing_face, "cmd_ingest": sleeper_face}
        async with running_writer(config, faces) as (writer, addresses):
            crash_now.set()
            while writer.health.faces["tier"].value != "crashed":
                await trio.sleep(0.01)
            readyz = await get(addresses["control"], "/readyz")
            assert readyz.status == 503
            assert readyz.json()["reasons"] == ["face tier crashed"]
            assert await send_sleep(addresses["cmd_ingest"], 0.01) == b"done"
            # Crashed for longer than the liveness window: /livez fails too, so that
            # Kubernetes restarts the pod (nothing in the process restarts the face).
            while (livez := await get(addresses["control"], "/livez")).status == 200:
                await trio.sleep(0.05)
            assert livez.status == 503 and livez.json()["status"] == "face_crashed"
            assert livez.json()["reason"].startswith("face tier crashed")
    crashes = [r for r in caplog.records if r.getMessage() == "face_crashed"]
    assert len(crashes) == 1
    assert crashes[0].cmdbus_fields["error"] == "RuntimeError: boom: a bug in a face"  # type: ignore[attr-defined]
    assert crashes[0].exc_info is not None  # the JSON line carries the traceback
    after = metrics.REGISTRY.get_sample_value("cmdbus_face_crashes_total", {"face": "tier"})
    assert after == before + 1


async def test_a_face_that_cannot_start_is_a_startup_error(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(tier_bind="127.0.0.1:0")
    with (
        trio.fail_after(10),
        pytest.RaisesGroup(
            pytest.RaisesExc(
                StartupError, match="cannot start the tier face on 127.0.0.1:0: .*in use"
            ),
            flatten_subgroups=True,
        ),
    ):
        await Writer(config, faces={"tier": failing_start_face}).run()


async def test_ports_file_lists_every_enabled_face(
    make_config: Callable[..., Config], tmp_path: trio.Path
) -> None:
    ports_file = tmp_path / "run" / "ports.json"
    config = make_config(
        tier_bind="127.0.0.1:0", cmd_claim_bind="127.0.0.1:0", ports_file=ports_file
    )
    with trio.fail_after(10):
        faces = {"tier": sleeper_face, "cmd_claim": sleeper_face}
        async with running_writer(config, faces) as (_, addresses):
            written = json.loads(ports_file.read_text())
    assert written == addresses
    assert set(written) == {"control", "tier", "cmd_claim"}
    assert all(value.startswith("127.0.0.1:") for value in written.values())
    assert not [path for path in ports_file.parent.iterdir() if path != ports_file]


def test_ports_file_is_replaced_whole(tmp_path: trio.Path) -> None:
    path = tmp_path / "ports.json"
    path.write_text("old")
    write_ports_file(path, {"control": "127.0.0.1:1"})
    assert json.loads(path.read_text()) == {"control": "127.0.0.1:1"}
    assert [p.name for p in tmp_path.iterdir()] == ["ports.json"]


async def test_switch_interval_is_lowered_while_serving(
    make_config: Callable[..., Config],
) -> None:
    import sys

    before = sys.getswitchinterval()
    with trio.fail_after(10):
        async with running_writer(make_config(switch_interval_ms=0.5)):
            assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == before


async def test_the_collector_is_tuned_while_serving(make_config: Callable[..., Config]) -> None:
    """Young collections rarer and startup's objects frozen while serving; both given
    back when it ends."""
    import gc

    from cmdbus_trio.loop.interpreter import YOUNG_COLLECTION_THRESHOLD

    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with trio.fail_after(10):
        async with running_writer(make_config()):
            assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *before[1:])
            assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_crashed_face_fails_liveness_only_after_the_window() -> None:
    from cmdbus_trio.control.health import FaceState, Health
    from cmdbus_trio.loop.heartbeat import Heartbeat

    async def scenario() -> None:
        health = Health(Heartbeat(interval=0.1, threshold=0.5, window=2.0))
        health.faces["tier"] = FaceState.LISTENING
        health.face_crashed("tier")
        await trio.sleep(1.9)
        assert health.dead_faces() == []
        await trio.sleep(0.2)
        assert health.dead_faces() == ["face tier crashed 2.1 s ago"]

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_heartbeat_stall_detection() -> None:
    from cmdbus_trio.loop.heartbeat import Heartbeat

    clock = trio.testing.MockClock(autojump_threshold=0)

    async def scenario() -> None:
        beat = Heartbeat(interval=0.1, threshold=0.5, window=2.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(beat.run)
            await trio.sleep(1)
            assert not beat.statistics().stalled
            clock.jump(0.8)  # the loop "stalls": the heartbeat is overdue
            stats = beat.statistics()
            assert stats.stalled and "overdue" in (stats.reason or "")
            await trio.sleep(0.05)  # the heartbeat runs again: due at 1.1 s, it woke at 1.8 s
            stats = beat.statistics()
            assert stats.stalled and "stalled 0.700 s" in (stats.reason or "")
            assert stats.worst_recent_lag == pytest.approx(0.7)
            await trio.sleep(2.1)  # the window passes
            assert not beat.statistics().stalled
            nursery.cancel_scope.cancel()

    trio.run(scenario, clock=clock)
