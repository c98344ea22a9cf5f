from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from cmdbus_trio.config import Config

from ..helpers import frame_client, get, http_connection, metrics_text, running_writer, serving


async def test_probes_answer_when_serving(make_config: Callable[..., Config]) -> None:
    with trio.fail_after(10):
        async with running_writer(make_config()) as (_, addresses):
            control = addresses["control"]
            livez = await get(control, "/livez")
            assert (livez.status, livez.json()) == (200, {"status": "ok"})
            readyz = await get(control, "/readyz")
            assert (readyz.status, readyz.json()) == (200, {"status": "ready"})
            healthz = await get(control, "/healthz")
            assert healthz.status == 200
            summary = healthz.json()
            assert summary["status"] == "ok"
            assert summary["ready"] is True and summary["live"] is True
            assert summary["faces"]["control"] == {"state": "listening", "address": control}
            assert summary["loop"]["turn_ms"] >= 0
            assert healthz.headers["content-type"] == "application/json"


async def test_metrics_parse_and_carry_the_catalogue(make_config: Callable[..., Config]) -> None:
    with trio.fail_after(10):
        async with running_writer(make_config()) as (_, addresses):
            await trio.sleep(0.3)  # a few heartbeats
            response = await get(addresses["control"], "/metrics")
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {
        family.name: family for family in text_string_to_metric_families(response.body.decode())
    }
    for name in (
        "cmdbus_loop_lag_seconds",
        "cmdbus_loop_blocking_calls",
        "cmdbus_loop_turns_deferred",
        "cmdbus_loop_busy_seconds",
        "cmdbus_request_duration_seconds",
        "cmdbus_queue_wait_seconds",
        "cmdbus_service_seconds",
        "cmdbus_shed",
        "cmdbus_connections",
        "cmdbus_ready",
        "cmdbus_build_info",
        "process_resident_memory_bytes",
    ):
        assert name in families, name
    lag_count = next(
        sample.value
        for sample in families["cmdbus_loop_lag_seconds"].samples
        if sample.name == "cmdbus_loop_lag_seconds_count"
    )
    assert lag_count >= 1
    assert families["cmdbus_loop_lag_seconds"].documentation.startswith("How late")


async def test_livez_turns_503_with_a_reason_when_the_loop_is_blocked(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(liveness_threshold_ms=100, liveness_window_ms=500, debug_hooks="true")
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):
            control = addresses["control"]
            assert (await get(control, "/livez")).status == 200
            blocked = await get(control, "/debug/block-loop?seconds=0.4", method="POST")
            assert blocked.status == 202
            livez = await get(control, "/livez")  # served once the loop runs again
            assert livez.status == 503
            assert livez.json()["status"] == "stalled"
            assert "event loop stalled" in livez.json()["reason"]
            assert "threshold 0.100 s" in livez.json()["reason"]
            health = (await get(control, "/healthz")).json()
            assert health["live"] is False and health["status"] == "degraded"
            # Readiness is about serving, not about a past stall.
            assert (await get(control, "/readyz")).status == 200
            # Once the window has passed without a new stall, it is live again.
            while (await get(control, "/livez")).status != 200:
                await trio.sleep(0.05)


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "601", "x"])
async def test_block_hook_refuses_bad_durations(
    make_config: Callable[..., Config], seconds: str
) -> None:
    with trio.fail_after(10):
        async with running_writer(make_config(debug_hooks="true")) as (_, addresses):
            response = await get(
                addresses["control"], f"/debug/block-loop?seconds={seconds}", "POST"
            )
            assert response.status == 400
            assert "seconds must be" in response.json()["error"]


async def test_the_crash_hook_crashes_one_face_and_refuses_a_face_it_does_not_know(
    make_config: Callable[..., Config],
) -> None:
    config = make_config(debug_hooks="true", tier_bind="127.0.0.1:0", cmd_ingest_bind="127.0.0.1:0")
    with trio.fail_after(10):
        async with running_writer(config) as (_, addresses):
            control = addresses["control"]
            for face in ("", "nope", "control"):
                response = await get(control, f"/debug/crash-face?face={face}", "POST")
                assert response.status == 400
                assert "face must be one of ['cmd_ingest', 'tier']" in response.json()["error"]
            assert (await get(control, "/debug/crash-face?face=tier", "POST")).status == 202
            while (await get(control, "/readyz")).status != 503:
                await trio.sleep(0.02)
            assert "face tier crashed" in str((await get(control, "/readyz")).json())
            again = await get(control, "/debug/crash-face?face=tier", "POST")  # crashed: gone
            assert again.status == 400 and "['cmd_ingest']" in again.json()["error"]
            async with frame_client(addresses["cmd_ingest"]):  # the other face goes on
                pass


async def test_the_hold_bytes_hook_holds_a_face_and_refuses_what_it_cannot_hold(
    make_config: Callable[..., Config],
) -> None:
    """The face's publishes wait while its bytes are held, and are answered once they go
    back; a face it does not know, a bad duration and a budget in use are refused."""
    config = make_config(debug_hooks="true", cmd_ingest_bind="127.0.0.1:0", tier_bind="127.0.0.1:0")
    with trio.fail_after(20):
        async with running_writer(config) as (_, addresses):
            control = addresses["control"]
            for query in ("face=nope", "face=cmd_ingest&seconds=0", "face=tier&seconds=x"):
                response = await get(control, f"/debug/hold-bytes?{query}", "POST")
                assert response.status == 400
                assert "face must be one of ['cmd_ingest', 'tier']" in response.json()["error"]
            held = await get(control, "/debug/hold-bytes?face=cmd_ingest&seconds=1", "POST")
            assert held.status == 202
            again = await get(control, "/debug/hold-bytes?face=cmd_ingest&seconds=1", "POST")
            assert again.status == 409 and "in use" in again.json()["error"]
            async with frame_client(addresses["cmd_ingest"]) as client:
                started = trio.current_time()
                reply = await client.request("publish", record={"execution_id": 1, "payload": "{}"})
                assert reply["ok"] and trio.current_time() - started > 0.5  # it waited


async def test_block_hook_is_absent_unless_enabled(make_config: Callable[..., Config]) -> None:
    with trio.fail_after(10):
        async with running_writer(make_config()) as (_, addresses):
            response = await get(addresses["control"], "/debug/block-loop?seconds=5", "POST")
            assert response.status == 404


async def test_debug_hooks_need_the_token_when_one_is_set(
    make_config: Callable[..., Config],
) -> None:
    """The control port may listen on every interface (the image binds 0.0.0.0): with a
    token set, a hook without it was answered 202 once."""
    path = "/debug/block-loop?seconds=0.01"
    with trio.fail_after(10):
        async with running_writer(make_config(debug_hooks="true", auth_token="sesame")) as (
            _,
            addresses,
        ):
            for headers in ({}, {"authorization": "Bearer open"}, {"authorization": "sesame"}):
                async with http_connection(addresses["control"]) as connection:
                    refused = await connection.request("POST", path, headers)
                assert refused.status == 401, headers
                assert "Authorization: Bearer" in refused.json()["error"]
            async with http_connection(addresses["control"]) as connection:
                allowed = await connection.request("POST", path, {"authorization": "Bearer sesame"})
            assert allowed.status == 202


async def test_unknown_path_and_wrong_method(make_config: Callable[..., Config]) -> None:
    with trio.fail_after(10):
        async with running_writer(make_config()) as (_, addresses):
            control = addresses["control"]
            assert (await get(control, "/nope")).status == 404
            assert (await get(control, "/livez", "POST")).status == 405
            head = await get(control, "/readyz", "HEAD")
            assert (head.status, head.body) == (200, b"")


async def test_server_closes_after_connection_close(make_config: Callable[..., Config]) -> None:
    with trio.fail_after(10):
        async with (
            running_writer(make_config()) as (_, addresses),
            http_connection(addresses["control"]) as connection,
        ):
            response = await connection.request("GET", "/livez", {"connection": "close"})
            assert response.status == 200
            await connection.wait_closed_by_server()


async def test_server_closes_idle_keepalive_connections(
    make_config: Callable[..., Config],
) -> None:
    with trio.fail_after(10):
        async with (
            running_writer(make_config(control_keepalive_ms=200)) as (_, addresses),
            http_connection(addresses["control"]) as connection,
        ):
            for _ in range(3):  # keep-alive works...
                assert (await connection.request("GET", "/readyz")).status == 200
            await connection.wait_closed_by_server()  # ...until it idles out


async def test_probes_keep_answering_while_threads_are_busy(
    make_config: Callable[..., Config],
) -> None:
    """Threads doing GIL-releasing work (here: sleeping) do not delay the probes."""
    import time

    limiter = trio.CapacityLimiter(4)
    with trio.fail_after(20):
        async with running_writer(make_config()) as (_, addresses), trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(
                    lambda: trio.to_thread.run_sync(time.sleep, 1.0, limiter=limiter)
                )
            for _ in range(10):
                assert (await get(addresses["control"], "/healthz")).status == 200


def test_counters_exist_at_zero_from_the_start(tmp_path: Path) -> None:
    """A fresh writer's scrape already has the counters a dashboard sums, for every label
    set known at start: a `sum()` of them reads 0, not "no data". (Per-subject counters
    are not made up front: subjects come from clients, and each would be a series.)"""
    with serving(tmp_path) as (_, ports):
        text = metrics_text(ports)
        for sample in (
            'cmdbus_loop_blocking_calls_total{entry="BusLog.commit"} 0.0',
            'cmdbus_loop_blocking_calls_total{entry="TierStore.append"} 0.0',
            'cmdbus_shed_total{face="tier",op="read_execution",reason="waiters_full"} 0.0',
            'cmdbus_shed_total{face="cmd_ingest",op="publish",reason="queue_timeout"} 0.0',
            'cmdbus_shed_total{face="evt_claim",op="next",reason="deadline"} 0.0',
            'cmdbus_shed_total{face="evt_subscribe",op="subscribe",reason="waiters_full"} 0.0',
            'cmdbus_face_crashes_total{face="cmd_claim"} 0.0',
        ):
            assert sample in text.splitlines(), sample


def crowded_out(port: str) -> float:
    from cmdbus_trio.metrics import REGISTRY

    value = REGISTRY.get_sample_value(
        "cmdbus_control_connections_crowded_out_total", {"port": port}
    )
    return value or 0.0


async def test_a_port_at_its_cap_closes_the_connection_quiet_the_longest() -> None:
    """Cap 4: six connections that never speak, then a scraper, then a probe. Each one
    past the cap closes the one quiet the longest, so the probe and the scraper get in,
    the first four silent ones are closed, and the port never holds more than four."""
    from functools import partial

    from cmdbus_trio import control
    from cmdbus_trio.config import Bind
    from cmdbus_trio.metrics import REGISTRY

    def held() -> float:
        return REGISTRY.get_sample_value("cmdbus_control_connections", {"port": "cmd_lag"}) or 0

    async def until(condition: Callable[[], bool]) -> None:
        while not condition():
            await trio.sleep(0.01)

    stop = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            serve = partial(control.serve_lag_port, "cmd_lag", Bind("127.0.0.1", 0))
            address = await nursery.start(partial(serve, max_connections=4, shutdown=stop))
            host, port = address.rsplit(":", 1)
            before = crowded_out("cmd_lag")
            silent = []
            for n in range(6):
                silent.append(await trio.open_tcp_stream(host, int(port)))
                await until(lambda n=n: crowded_out("cmd_lag") - before == max(0, n - 3))
            async with http_connection(address) as scraper:
                assert (await scraper.request("GET", "/")).status == 200
                assert (await get(address, "/")).status == 200  # the probe
                assert (await scraper.request("GET", "/")).status == 200  # still open
                assert crowded_out("cmd_lag") - before == 4
                assert held() <= 4
                for closed in silent[:4]:
                    assert await closed.receive_some(1) == b""
                for stream in silent:
                    await stream.aclose()
            stop.set()


async def test_a_connection_reset_before_it_was_served_is_closed_and_forgotten() -> None:
    from cmdbus_trio.control.face import _Connections

    class Gone:
        closed = False

        class socket:  # the attribute a trio SocketStream has
            @staticmethod
            def getpeername() -> tuple[str, int]:
                raise OSError(107, "Transport endpoint is not connected")

        async def aclose(self) -> None:
            self.closed = True

    async def never(stream: object) -> None:
        raise AssertionError("served a connection that was gone")

    connections = _Connections("cmd_lag", 4)
    gone = Gone()
    await connections.handle(never, gone)  # type: ignore[arg-type]
    assert gone.closed
    with pytest.raises(ValueError, match="max_connections must be at least 1, got 0"):
        _Connections("cmd_lag", 0)


async def test_loop_census_hook_counts_windows_and_refuses_a_bad_stop(
    make_config: Callable[..., Config],
) -> None:
    with trio.fail_after(10):
        async with running_writer(make_config(debug_hooks="true")) as (_, addresses):
            control = addresses["control"]
            assert (await get(control, "/debug/loop-census", "POST")).json() == {"census": None}
            await trio.sleep(0.2)  # heartbeats: timer turns and steps
            window = (await get(control, "/debug/loop-census?stop=1", "POST")).json()["census"]
            assert window["seconds"] >= 0.2
            assert sum(window["turns"].values()) >= 1 and window["steps"]
            assert (await get(control, "/debug/loop-census?stop=1", "POST")).json() == {
                "census": None
            }
            refused = await get(control, "/debug/loop-census?stop=yes", "POST")
            assert refused.status == 400 and "stop must be 0 or 1" in refused.json()["error"]
            absent = await get(control, "/debug/loop-census")
            assert absent.status == 405
