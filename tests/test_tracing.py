"""Traces across the buses (issue 49, items 3-5): the writer's spans through the
OpenTelemetry SDK, in-process (the in-memory exporter) and from a writer subprocess over a
real OTLP HTTP exporter to a receiver here that decodes what arrives."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from cmdbus_trio.client import Busy
from cmdbus_trio.client.tracing import context_of, current_fields
from cmdbus_trio.client.trio import ClaimClient, IngestClient, TierClient
from cmdbus_trio.config import Config
from cmdbus_trio.tracing import setup as tracing_setup
from cmdbus_trio.tracing import spans

from .helpers import frame_client, running_writer, serving

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """The writer's spans (and the test's own, from the same provider), in memory; tracing
    is off again afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans.use(provider)
    try:
        yield exporter
    finally:
        spans.use(None)
        provider.shutdown()


def named(finished: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [span for span in finished if span.name.startswith(prefix)]


async def test_one_trace_from_the_publisher_through_the_writer_to_the_workers_ack(
    exported: InMemorySpanExporter, make_config: Callable[..., Config]
) -> None:
    """The publisher's span is the parent of the writer's ``publish`` span; the
    ``deliver`` span links to it; the worker's ``process`` span, started from the
    delivery with ``context_of``, is its child; the ``ack`` is in the worker's trace."""
    tracer = trace_provider_of(exported).get_tracer("tests")
    binds = {f"{face}_bind": "127.0.0.1:0" for face in ("cmd_ingest", "cmd_claim")}
    with trio.fail_after(30):
        async with (
            running_writer(make_config(**binds)) as (_, addresses),
            await IngestClient.connect(addresses["cmd_ingest"]) as ingest,
            await ClaimClient.connect(addresses["cmd_claim"]) as claim,
        ):
            with tracer.start_as_current_span("checkout", kind=SpanKind.PRODUCER) as publisher:
                published = await ingest.publish({"execution_id": 7, "payload": "{}"})
            untraced = await ingest.publish({"execution_id": 8, "payload": "{}"})
            delivery = await claim.next("commands.>", wait=5)
            assert delivery is not None and delivery.sort_key == published.sort_key
            with tracer.start_as_current_span(
                f"process {delivery.subject}", context=context_of(delivery), kind=SpanKind.CONSUMER
            ) as worker:
                assert await claim.ack(delivery.sort_key)
            plain = await claim.next("commands.>", wait=5)
            assert plain is not None and plain.sort_key == untraced.sort_key
            assert plain.traceparent is None and context_of(plain) == context_of(plain, None)
    finished = exported.get_finished_spans()
    trace_id = publisher.get_span_context().trace_id
    (publish, untraced_publish) = named(finished, "publish commands")
    assert (
        publish.parent is not None
        and publish.parent.span_id == publisher.get_span_context().span_id
    )
    assert publish.context.trace_id == trace_id and publish.kind is SpanKind.SERVER
    assert publish.attributes is not None
    assert publish.attributes["messaging.destination.name"] == "commands.shared.shard.0"
    assert publish.attributes["messaging.message.id"] == str(published.sort_key)
    assert publish.attributes["cmdbus.commit.records"] >= 1
    assert "cmdbus.gate.wait_ms" in publish.attributes
    assert untraced_publish.parent is None  # a root span: no context was sent
    deliver = named(finished, "deliver commands.shared.shard.0")
    assert [d.attributes["messaging.message.id"] for d in deliver if d.attributes] == [
        str(published.sort_key),
        str(untraced.sort_key),
    ]
    assert [link.context.trace_id for link in deliver[0].links] == [trace_id]
    assert list(deliver[1].links) == []
    assert (
        worker.parent is not None and worker.parent.span_id == publisher.get_span_context().span_id
    )
    (ack,) = named(finished, "ack commands")  # the worker's ack, in the worker's span
    assert ack.parent is not None and ack.parent.span_id == worker.get_span_context().span_id
    assert ack.context.trace_id == trace_id
    assert ack.attributes is not None and ack.attributes["cmdbus.settled"] == 1
    assert ack.status.status_code is StatusCode.UNSET


async def test_tier_spans_carry_the_gates_wait_and_a_shed(
    exported: InMemorySpanExporter, make_config: Callable[..., Config]
) -> None:
    """The read Gate has one place and no queue: while the test holds that place a
    ``scan`` is shed at once, and its span says so."""
    config = make_config(tier_bind="127.0.0.1:0", tier_max_inflight=1, tier_max_waiters=0)
    with trio.fail_after(30):
        async with (
            running_writer(config) as (writer, addresses),
            await TierClient.connect(addresses["tier"]) as tier,
        ):
            await tier.append(7, json.dumps({"event_id": "a"}))
            await tier.read_execution(7)
            await tier.scan()
            with await writer.health.gates["tier"].acquire("test"), pytest.raises(Busy):
                await tier.scan()
    finished = exported.get_finished_spans()
    assert [s.name for s in finished] == [
        "append eventlog",
        "read_execution eventlog",
        "scan eventlog",
        "scan eventlog",
    ]
    for span in finished[:3]:
        assert span.attributes is not None and span.attributes["cmdbus.gate.wait_ms"] >= 0
        assert span.status.status_code is StatusCode.UNSET
    assert finished[0].attributes is not None
    assert finished[0].attributes["cmdbus.execution_id"] == "7"
    shed = finished[3]
    assert shed.status.status_code is StatusCode.ERROR and shed.attributes is not None
    assert shed.attributes["error.type"] == "busy"
    assert shed.attributes["cmdbus.shed.reason"] == "waiters_full"
    assert "cmdbus.gate.wait_ms" not in shed.attributes  # never admitted


async def test_a_shed_request_has_an_error_status_naming_the_reason(
    exported: InMemorySpanExporter, make_config: Callable[..., Config]
) -> None:
    """An ingest Gate of one place with no queue: a burst of pipelined publishes sheds
    some (``busy``), and their spans say so."""
    config = make_config(cmd_ingest_bind="127.0.0.1:0", ingest_max_pending=1)
    with trio.fail_after(30):
        async with (
            running_writer(config) as (_, addresses),
            frame_client(addresses["cmd_ingest"]) as client,
        ):
            for n in range(50):
                record = {"execution_id": n, "payload": "{}"}
                await client.send(json.dumps({"id": n, "op": "publish", "record": record}).encode())
            replies = [await client.receive_json() for _ in range(50)]
    codes = {r["error"]["code"] for r in replies if not r["ok"]}
    assert codes == {"busy"}, replies
    shed = [
        s
        for s in named(exported.get_finished_spans(), "publish commands")
        if s.status.status_code is StatusCode.ERROR
    ]
    assert len(shed) == len([r for r in replies if not r["ok"]])
    assert all(s.attributes and s.attributes["error.type"] == "busy" for s in shed)
    assert all(s.attributes and s.attributes["cmdbus.shed.reason"] for s in shed)


def trace_provider_of(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def test_the_client_sends_the_current_span_and_nothing_without_one() -> None:
    assert current_fields() == {}
    provider = TracerProvider()
    with provider.get_tracer("tests").start_as_current_span("work") as span:
        fields = current_fields()
    context = span.get_span_context()
    flags = int(context.trace_flags)
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
    assert fields == {"traceparent": expected}
    provider.shutdown()


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, ()),
        ({"OTEL_SERVICE_NAME": "w"}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ("otlp", "console")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h"}, ()),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
    ],
)
def test_tracing_is_on_only_when_the_variables_ask(
    environ: dict[str, str], exporters: tuple[str, ...]
) -> None:
    assert tracing_setup.asked(environ) == exporters


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_TRACES_EXPORTER": "jaeger"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
    ],
)
def test_an_exporter_it_cannot_make_leaves_tracing_off_and_says_why(
    environ: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    assert tracing_setup.from_environment(environ) is None
    assert "tracing_off" in caplog.text


class _Stuck(SpanExporter):
    """A collector that never answers: each export waits until the test ends."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exports = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exports += 1
        self.release.wait(60)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def test_the_exit_waits_for_a_stuck_collector_no_longer_than_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The exit's flush is bounded (here 0.2 s): an export that never returns costs the
    exit that and no more, and the spans it held are said to be lost."""
    stuck = _Stuck()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(stuck, schedule_delay_millis=10))
    try:
        provider.get_tracer("tests").start_span("queued").end()
        started = time.monotonic()
        tracing_setup.shut_down(provider, wait_ms=200)
        took = time.monotonic() - started
        assert 0.2 <= took < 2.0, took
        assert "tracing_flush_incomplete" in caplog.text
        assert stuck.exports == 1  # the exporter was still in its export
    finally:
        stuck.release.set()


def test_the_exit_flushes_what_is_queued(caplog: pytest.LogCaptureFixture) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    provider.get_tracer("tests").start_span("queued").end()
    tracing_setup.shut_down(provider, wait_ms=5000)
    assert [span.name for span in exporter.get_finished_spans()] == ["queued"]
    assert "tracing_flush_incomplete" not in caplog.text


def test_without_tracing_nothing_beyond_the_api_is_imported() -> None:
    """A writer's modules, imported with no OTEL_* variable, load no SDK."""
    code = (
        "import sys, cmdbus_trio.cli, cmdbus_trio.app, cmdbus_trio.client.trio;"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]"
    assert not spans.enabled()


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: decodes each export request into the server's list."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.server.received.append((self.path, request))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.e2e
async def test_a_writer_exports_its_spans_over_otlp(tmp_path: Path) -> None:
    """A writer subprocess with the standard variables: its spans reach an OTLP HTTP
    receiver, in the publisher's trace, named by service."""
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    receiver.received = []  # type: ignore[attr-defined]
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "writer-under-test",
    }
    try:
        with trio.fail_after(60), serving(tmp_path, CMDBUS_TIER_BIND="", **otel) as (writer, ports):
            async with frame_client(ports["cmd_ingest"]) as ingest:
                reply = await ingest.request(
                    "publish", record={"execution_id": 1, "payload": "{}"}, traceparent=PARENT
                )
                assert reply["ok"], reply
            writer.terminate()  # the exit flushes what is queued
            assert await trio.to_thread.run_sync(lambda: writer.wait(timeout=30)) == 0
    finally:
        receiver.shutdown()
    received = receiver.received  # type: ignore[attr-defined]
    assert {path for path, _ in received} == {"/v1/traces"}
    exported_spans = [
        (resource.resource, span)
        for _, request in received
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    publish = [span for _, span in exported_spans if span.name == "publish commands"]
    assert [span.trace_id.hex() for span in publish] == [TRACE_ID]
    assert publish[0].parent_span_id.hex() == "00f067aa0ba902b7"
    (resource, _) = exported_spans[0]
    names = {a.key: a.value.string_value for a in resource.attributes}
    assert names["service.name"] == "writer-under-test"
