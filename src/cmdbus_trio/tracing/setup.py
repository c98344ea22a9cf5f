"""The OpenTelemetry SDK, set up from the standard ``OTEL_*`` variables when they ask for
traces (docs/tracing.md).

They ask when ``OTEL_TRACES_EXPORTER`` names ``otlp`` (or ``console``), or when an OTLP
endpoint is given (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``),
and ``OTEL_SDK_DISABLED`` is not ``true`` and the exporter is not ``none``. Everything else
(sampler, endpoint, headers, timeouts, batch sizes, resource) is the SDK's own reading of
its variables. The SDK and the OTLP exporter come with the ``otel`` extra
(``pip install 'cmdbus-trio[otel]'``): without it, a writer asked for traces says so in
its log and serves without them. Nothing here is imported by the buses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cmdbus_trio.logs import event

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

EXPORTERS = ("otlp", "console")
FLUSH_ON_EXIT_MS = 5000
"""How long the exit waits for the spans still queued to be exported."""


def asked(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters the variables ask for (none: tracing stays off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    named = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    named = [n for n in named if n]
    if "none" in named:
        return ()
    if named:
        return tuple(named)
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return ("otlp",) if any(environ.get(name) for name in endpoints) else ()


def from_environment(environ: Mapping[str, str]) -> TracerProvider | None:
    """A tracer provider exporting as the variables ask, or None (off). Each reason to
    stay off that an operator would not expect is said in the log (``tracing_off``)."""
    exporters = asked(environ)
    if not exporters:
        return None
    unknown = [name for name in exporters if name not in EXPORTERS]
    if unknown:
        why = f"OTEL_TRACES_EXPORTER names {', '.join(unknown)}; supported: {', '.join(EXPORTERS)}"
        event(log, logging.ERROR, "tracing_off", reason=why)
        return None
    protocol = environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    )
    if "otlp" in exporters and protocol.strip() not in ("", "http/protobuf"):
        why = f"OTLP protocol {protocol!r}: this writer exports http/protobuf only"
        event(log, logging.ERROR, "tracing_off", reason=why)
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        why = f"the otel extra is not installed (pip install 'cmdbus-trio[otel]'): {exc}"
        event(log, logging.ERROR, "tracing_off", reason=why)
        return None
    named = "OTEL_SERVICE_NAME" in environ or "service.name=" in environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    provider = TracerProvider(
        resource=Resource.create({} if named else {"service.name": "cmdbus-trio"})
    )
    for name in exporters:  # a bounded queue each, exported from the SDK's own thread
        exporter = OTLPSpanExporter() if name == "otlp" else ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    event(log, logging.INFO, "tracing_on", exporters=list(exporters))
    return provider


def shut_down(provider: TracerProvider | None, wait_ms: int = FLUSH_ON_EXIT_MS) -> None:
    """Export what is queued, then stop, taking at most ``wait_ms`` in all: a collector
    that accepts connections and never answers must not hold up the exit (the SDK's own
    waits are the exporter's timeout and retries, 10 s and more, and differ by version).
    The spans not exported by then are lost, and the log says so."""
    if provider is None:
        return

    def flush_and_stop() -> None:
        provider.force_flush(wait_ms)
        provider.shutdown()

    # A daemon thread: if it is still waiting on the collector, the process exits anyway.
    stopping = threading.Thread(target=flush_and_stop, name="tracing:exit", daemon=True)
    stopping.start()
    stopping.join(wait_ms / 1000)
    if stopping.is_alive():
        event(log, logging.WARNING, "tracing_flush_incomplete", waited_ms=wait_ms)
