"""The writer's spans, in one place (docs/tracing.md), as :mod:`cmdbus_trio.metrics` holds
its metrics.

Spans follow OpenTelemetry's messaging conventions: ``publish`` (ingest to durable ack),
``deliver`` (one per record a ``next`` hands out, linked to the context the record was
published with), ``ack`` and ``nack`` (settling), and the tier's ``append``,
``read_execution`` and ``scan``. Each says how long its request waited for the Gate
(``cmdbus.gate.wait_ms``), and a request that was shed or failed has an error status.

Only ``opentelemetry-api`` is imported here. Tracing is off until :func:`use` is given a
tracer provider (the writer does it at start when the ``OTEL_*`` variables ask for it:
:mod:`cmdbus_trio.tracing.setup`); while it is off each function below returns at its
first line, so the buses pay one comparison per request for having spans at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import trio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cmdbus_trio import __version__
from cmdbus_trio.admission import Shed
from cmdbus_trio.protocol import claim, tier
from cmdbus_trio.protocol.bus import Published, PublishRecord
from cmdbus_trio.protocol.trace import TraceContext

__all__ = [
    "MAX_LINKS",
    "SYSTEM",
    "begin",
    "enabled",
    "end",
    "use",
]

SYSTEM = "cmdbus"
"""``messaging.system``: this writer (the conventions name no well-known value for it)."""
MAX_LINKS = 32
"""Links one span carries at most (a batch of many contexts links the first ones)."""

_tracer: trace.Tracer | None = None
_propagator = TraceContextTextMapPropagator()


def use(provider: trace.TracerProvider | None) -> None:
    """Make spans with ``provider``'s tracer from now on; None turns tracing off."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer("cmdbus_trio", __version__)


def enabled() -> bool:
    return _tracer is not None


def begin(
    name: str,
    arrival: float,
    attributes: dict[str, str | int | bool],
    *,
    kind: SpanKind = SpanKind.SERVER,
    parent: TraceContext | None = None,
    links: Iterable[TraceContext | None] = (),
) -> Span | None:
    """A span that started at ``arrival`` (trio's clock, as requests are timed), a child
    of ``parent`` (the publisher's context) when given, linked to the other contexts;
    None while tracing is off."""
    if _tracer is None:
        return None
    started = time.time_ns() - int((trio.current_time() - arrival) * 1e9)
    linked = [
        Link(span_context)
        for span_context in _span_contexts(links)
        if span_context is not None and span_context.is_valid
    ]
    return _tracer.start_span(
        name,
        context=_context(parent),
        kind=kind,
        attributes={"messaging.system": SYSTEM, **attributes},
        links=linked,
        start_time=started,
    )


def end(
    span: Span | None,
    outcome: object = None,
    attributes: Mapping[str, str | int | bool] | None = None,
    *,
    waited: float | None = None,
) -> None:
    """End ``span`` (None: tracing was off when it began). ``outcome``: an exception gives
    the span an error status (``error.type``; a shed request its reason); ``waited``:
    seconds the request waited for the Gate."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if waited is not None:
        span.set_attribute("cmdbus.gate.wait_ms", round(waited * 1000, 3))
    if isinstance(outcome, Shed):
        span.set_attributes({"error.type": "busy", "cmdbus.shed.reason": outcome.reason.value})
    elif isinstance(outcome, BaseException):
        span.set_attribute("error.type", type(outcome).__name__)
    if isinstance(outcome, BaseException):
        span.set_status(Status(StatusCode.ERROR, str(outcome)))
    span.end()


def _context(trace_context: TraceContext | None) -> Context:
    """The publisher's span as a parent; without one an empty context (a root span: the
    loop's callbacks run in whatever context they were scheduled from)."""
    if trace_context is None:
        return Context()
    return _propagator.extract(trace_context.as_fields(), Context())


def _span_contexts(contexts: Iterable[TraceContext | None]) -> list[trace.SpanContext | None]:
    seen: dict[TraceContext, None] = {}
    for trace_context in contexts:
        if trace_context is not None and len(seen) < MAX_LINKS:
            seen.setdefault(trace_context)
    return [
        trace.get_current_span(_context(trace_context)).get_span_context() for trace_context in seen
    ]


# --- the spans of each op ------------------------------------------------------------------


def publishing(bus: str, records: Sequence[PublishRecord], arrival: float) -> Span | None:
    """A publish's span: the child of its records' context when they share one (a
    publisher's span), else linked to each."""
    if _tracer is None:
        return None
    contexts = {record.trace for record in records}
    parent = next(iter(contexts)) if len(contexts) == 1 else None
    attributes: dict[str, str | int | bool] = {
        "messaging.operation.name": "publish",
        "messaging.operation.type": "send",
    }
    if len(records) > 1:
        attributes["messaging.batch.message_count"] = len(records)
    links = () if parent is not None else (record.trace for record in records)
    return begin(f"publish {bus}", arrival, attributes, parent=parent, links=links)


def published(
    span: Span, commit_records: int, waited: float, outcome: Sequence[Published] | Exception
) -> None:
    """End a publish's span once its records are durable (or refused): where they went,
    the group commit's size, the Gate's wait."""
    attributes: dict[str, str | int | bool] = {"cmdbus.commit.records": commit_records}
    if not isinstance(outcome, Exception):
        subjects = {p.subject for p in outcome}
        if len(subjects) == 1:
            attributes["messaging.destination.name"] = subjects.pop()
        if len(outcome) == 1:
            attributes["messaging.message.id"] = str(outcome[0].sort_key)
            attributes["cmdbus.duplicate"] = outcome[0].duplicate
    end(span, outcome, attributes, waited=waited)


def delivered(
    face: str,
    group: str,
    handed: claim.Delivery,
    trace_context: TraceContext | None,
    arrival: float,
    waited: float,
) -> None:
    """A ``deliver`` span for one record a ``next`` hands out, from the moment it was
    handed to the request to its reply, linked to the context it was published with (the
    worker's own span is that context's child: the clients' ``context_of``)."""
    if _tracer is None:
        return
    attributes: dict[str, str | int | bool] = {
        "messaging.operation.name": "deliver",
        "messaging.operation.type": "receive",
        "messaging.destination.name": handed.subject,
        "messaging.message.id": str(handed.sort_key),
        "messaging.consumer.group.name": group,
        "messaging.message.delivery_attempt": handed.deliveries,
        "cmdbus.redelivered": handed.redelivered,
        "cmdbus.face": face,
    }
    span = begin(f"deliver {handed.subject}", arrival, attributes, links=(trace_context,))
    end(span, waited=waited)


def settling(
    operation: str, face: str, group: str, sort_keys: int, parent: TraceContext | None = None
) -> Span | None:
    """An ``ack`` or ``nack`` span (messaging: ``settle``), from now, a child of the
    settling worker's span when the request carried its context; the claim face answers
    at once for a nack, once the acks are durable for an ack."""
    if _tracer is None:
        return None
    attributes: dict[str, str | int | bool] = {
        "messaging.operation.name": operation,
        "messaging.operation.type": "settle",
        "messaging.consumer.group.name": group,
        "cmdbus.face": face,
    }
    if sort_keys > 1:
        attributes["messaging.batch.message_count"] = sort_keys
    return begin(f"{operation} {group}", trio.current_time(), attributes, parent=parent)


def settled(span: Span | None, outcome: Sequence[bool] | Exception) -> None:
    """End an ``ack`` or ``nack`` span: how many of its records this connection held."""
    if span is None:
        return
    held = {} if isinstance(outcome, Exception) else {"cmdbus.settled": sum(outcome)}
    end(span, outcome, held)


TierOp = tier.Append | tier.AppendBatch | tier.ReadExecution | tier.Scan | tier.DeleteExecution


def tier_op(request: TierOp, arrival: float) -> Span | None:
    """A tier request's span (``append``, ``append_batch``, ``read_execution``, ``scan``,
    ``delete_execution``), from its arrival; :func:`end` it with the Gate's wait."""
    if _tracer is None:
        return None
    attributes: dict[str, str | int | bool] = {
        "messaging.operation.name": request.op,
        "cmdbus.tier": request.tier,
    }
    execution_id = getattr(request, "execution_id", None)
    if execution_id is not None:
        attributes["cmdbus.execution_id"] = str(execution_id)
    if isinstance(request, tier.AppendBatch):
        attributes["messaging.batch.message_count"] = len(request.payloads)
    return begin(f"{request.op} {request.tier}", arrival, attributes)
