"""OpenTelemetry's SDK, the worker's one importer of opentelemetry: a session's spans as
worker.session.spans builds them (ids, parents and times of their own, derived from the
session) become SDK ReadableSpans, handed to a BatchSpanProcessor per exporter: OTLP/HTTP
(`otlp`) or stdout (`console`). The exporter and the processor read the standard OTEL_*
variables themselves (endpoint, headers, timeout, OTEL_BSP_*), but for the schedule delay,
which the worker's settings give unless OTEL_BSP_SCHEDULE_DELAY does. Imported only when spans
are on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from worker.session.spans import SpanValue

log = logging.getLogger(__name__)

SCHEMA_URL = "https://opentelemetry.io/schemas/1.41.0"  # the GenAI conventions' version
_KINDS = {"internal": SpanKind.INTERNAL, "client": SpanKind.CLIENT}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)  # a span not sampled is dropped by the processor
_MS = 1_000_000  # ns


def _exporter(name: str) -> SpanExporter:
    return ConsoleSpanExporter() if name == "console" else OTLPSpanExporter()


def _version() -> str:
    try:
        return version("cchatq")
    except PackageNotFoundError:
        return "0"


class OtelSpans:
    """The SpanSink of a worker whose spans are on."""

    on = True

    def __init__(self, exporters: Sequence[str], service: str, delay_ms: int | None = None) -> None:
        """`delay_ms`: how long a span waits in its batch processor before it is sent (None:
        OTEL_BSP_SCHEDULE_DELAY, read by the SDK): what a SIGKILLed worker held is lost."""
        self.resource = Resource.create({"service.name": service})
        self.scope = InstrumentationScope("cchatq", _version(), SCHEMA_URL)
        self.processors = [
            BatchSpanProcessor(_exporter(name), schedule_delay_millis=delay_ms)
            for name in exporters
        ]

    def export(self, spans: Sequence[SpanValue]) -> None:
        for value in spans:
            span = self.readable(value)
            for processor in self.processors:
                processor.on_end(span)

    def readable(self, value: SpanValue) -> ReadableSpan:
        """A finished SDK span with the value's own ids, parent and times."""
        context = SpanContext(value.trace_id, value.span_id, False, _SAMPLED)
        parent = None
        if value.parent_id is not None:
            parent = SpanContext(value.trace_id, value.parent_id, False, _SAMPLED)
        status = Status(StatusCode.UNSET)
        if value.error is not None:
            status = Status(StatusCode.ERROR, value.error)
        events = [
            Event(e.name, dict(e.attributes), e.ts_ms * _MS) for e in value.events
        ]  # fmt: skip
        return ReadableSpan(
            name=value.name,
            context=context,
            parent=parent,
            resource=self.resource,
            attributes=dict(value.attributes),
            events=events,
            kind=_KINDS[value.kind],
            status=status,
            start_time=value.start_ms * _MS,
            end_time=value.end_ms * _MS,
            instrumentation_scope=self.scope,
        )

    def flush(self) -> None:
        """Send what the processors hold and stop them (the worker process is ending)."""
        for processor in self.processors:
            try:
                processor.force_flush()
                processor.shutdown()  # type: ignore[no-untyped-call]
            except Exception as exc:  # a collector away at shutdown: its spans are lost
                log.warning("spans not flushed: %s", type(exc).__name__)
