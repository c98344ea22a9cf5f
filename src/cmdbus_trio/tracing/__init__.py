"""The writer's traces (docs/tracing.md): the span catalogue (:mod:`.spans`: every span a
record's path through the writer makes, the API only) and the OpenTelemetry SDK set up
from the standard ``OTEL_*`` variables when the ``otel`` extra is installed
(:mod:`.setup`)."""
