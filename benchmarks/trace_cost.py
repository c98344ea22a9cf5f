"""What tracing adds to a record, in microseconds, with tracing off and on.

    python benchmarks/trace_cost.py

A record's path through the writer calls the span catalogue (``cmdbus_trio.tracing.spans``) at
each op: ``publishing`` and ``published`` for its publish, ``delivered`` for its
delivery, ``settling`` and ``settled`` for its ack. This times those calls as the writer
makes them (same arguments, on a trio loop), and the decoding of a publish request with
and without trace context, best of 5 rounds of 20,000:

- off: no tracer provider, as the writer runs unless ``OTEL_*`` asks (each call returns
  at its first line);
- on: the SDK's tracer, every span sampled, handed to a batch processor whose exporter
  drops them (the cost of making spans, not of sending them: ``bus.py --traced`` measures
  the whole writer exporting over OTLP).

Set beside a record's ~1,200 µs of writer CPU at 500/s (docs/benchmarks.md, "What a
record costs"), it says what share of a record tracing takes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from cmdbus_trio.protocol import bus, claim
from cmdbus_trio.protocol.bus import Published
from cmdbus_trio.protocol.trace import TraceContext
from cmdbus_trio.tracing import spans

ROUNDS = 5
REPEAT = 20_000
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
RECORD = {"execution_id": 12345, "payload": json.dumps({"step": "x" * 180})}


class _Drop(SpanExporter):
    def export(self, batch: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def best(work: Callable[[], object]) -> float:
    """Microseconds per call, the best of :data:`ROUNDS`."""
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        for _ in range(REPEAT):
            work()
        times.append((time.perf_counter() - started) / REPEAT * 1e6)
    return min(times)


def a_record(trace: TraceContext | None) -> Callable[[], None]:
    """The span calls one record makes on its way: publish, deliver, ack."""
    decoded = bus.decode_op("publish", {"record": RECORD})
    assert isinstance(decoded, bus.Publish)
    record = bus.PublishRecord(decoded.record.execution_id, decoded.record.payload, None, trace)
    placed = [Published(41, "commands.shared.shard.0", False)]
    handed = claim.Delivery(41, "commands.shared.shard.0", False, 1)

    def calls() -> None:
        now = trio.current_time()
        span = spans.publishing("commands", [record], now)
        if span is not None:
            spans.published(span, 16, 0.0001, placed)
        spans.delivered("cmd_claim", "commands", handed, trace, now, 0.0001)
        settling = spans.settling("ack", "cmd_claim", "commands", 1, trace)
        spans.settled(settling, [True])

    return calls


async def measure() -> dict[str, float]:
    traced = TraceContext(PARENT)
    plain_request = {"record": RECORD}
    traced_request = {"record": RECORD, "traceparent": PARENT, "tracestate": "vendor=opaque"}
    figures = {
        "decode publish": best(lambda: bus.decode_op("publish", plain_request)),
        "decode publish, with trace context": best(
            lambda: bus.decode_op("publish", traced_request)
        ),
    }
    spans.use(None)
    figures["spans off: a record"] = best(a_record(None))
    figures["spans off: a record with trace context"] = best(a_record(traced))
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Drop(), max_queue_size=1 << 16))
    spans.use(provider)
    try:
        figures["spans on: a record"] = best(a_record(None))
        figures["spans on: a record with trace context"] = best(a_record(traced))
    finally:
        spans.use(None)
        provider.shutdown()
    return figures


def main() -> None:
    print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    print(f"{'what':<42} {'µs':>8}")
    for name, micros in trio.run(measure).items():
        print(f"{name:<42} {micros:>8.2f}")


if __name__ == "__main__":
    main()
