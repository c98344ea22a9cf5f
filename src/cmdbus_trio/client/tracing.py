"""Trace context for the clients' users (docs/clients.md, "Tracing").

The clients' ``publish`` and ``publish_batch`` send the current OpenTelemetry span's
context with each record when the application has one (:func:`current_fields`): the
writer stores it, and every v2 delivery of the record carries it back. A worker continues
the publisher's trace from a delivery with :func:`context_of`::

    with tracer.start_as_current_span(
        f"process {delivery.subject}", context=context_of(delivery), kind=SpanKind.CONSUMER
    ):
        run(delivery.record)

Only ``opentelemetry-api`` is used: without an SDK set up, there is no current span and
nothing is sent.
"""

from __future__ import annotations

from typing import Protocol

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


class Traced(Protocol):
    """What a delivery (claimed or pushed by a subscription) says of its trace context."""

    @property
    def traceparent(self) -> str | None: ...

    @property
    def tracestate(self) -> str | None: ...


def current_fields() -> dict[str, str]:
    """The current span's context as a publish carries it (``traceparent`` and, when
    there is one, ``tracestate``), or ``{}`` when no span is recording or valid."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def context_of(delivery: Traced, context: Context | None = None) -> Context:
    """``context`` (default: the current one) with the publisher's span as the parent, so
    a span started in it is a child of the span that published the record; ``context``
    unchanged when the record was published without trace context."""
    carrier = {"traceparent": delivery.traceparent or "", "tracestate": delivery.tracestate or ""}
    return _PROPAGATOR.extract({k: v for k, v in carrier.items() if v}, context)
