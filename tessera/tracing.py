"""OpenTelemetry traces: one span per finished request, built from its timestamps.

The engine never touches OpenTelemetry: it records wall-clock timestamps in
`RequestMetrics`, and when a request finishes `RequestTracer.record()` (a
StatLogger, run on the stats consumer thread) replays them as a span that
starts at arrival and ends when the request finished, with one event per
milestone: queued, scheduled, first_token, preempted (once per preemption)
and finished. Spans go through a BatchSpanProcessor to an OTLP/HTTP collector,
to stdout ("console"), or to any SpanExporter handed in (tests use
InMemorySpanExporter).

Attributes follow the OpenTelemetry gen_ai semantic conventions where one
fits: gen_ai.request.model, gen_ai.response.id (the request id, also under
tessera.request.id), gen_ai.usage.input_tokens / output_tokens /
cache_read.input_tokens, gen_ai.response.finish_reasons, the sampling knobs
as gen_ai.request.*, and gen_ai.response.time_to_first_chunk; Tessera's own: the request's
priority, its preemptions, and the steps that computed its prompt with the tokens they computed
in all (tessera.prompt_steps, tessera.prompt_step_tokens: a first token that waited for other
requests' prompts shows it there).

Each tracer has its own TracerProvider; the global OpenTelemetry provider is
left alone.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind

from tessera.errors import TesseraError

if TYPE_CHECKING:
    from tessera.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats

SPAN_NAME = "llm_request"
CONSOLE = "console"


def to_ns(seconds: float) -> int:
    """time.time() seconds to the integer nanoseconds OpenTelemetry wants."""
    return round(seconds * 1_000_000_000)


def exporter_for_endpoint(endpoint: str) -> SpanExporter:
    """"console" prints spans as JSON; an http(s) URL sends them with OTLP over HTTP/protobuf.

    A URL without a path gets the standard /v1/traces, so http://collector:4318 works as is.
    """
    if endpoint.strip().lower() == CONSOLE:
        return ConsoleSpanExporter()
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TesseraError(f"--otlp-traces-endpoint must be an http(s) URL such as "
                           f"http://localhost:4318/v1/traces, or 'console'; got {endpoint!r}")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/traces")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=urlunsplit(parts))


class RequestTracer:
    """A StatLogger that turns each finished request into one span."""

    def __init__(self, model_name: str, exporter: SpanExporter, *, service_name: str = "tessera") -> None:
        self.model_name = model_name
        self._provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("tessera")

    @classmethod
    def from_endpoint(cls, endpoint: str, model_name: str, **kwargs: Any) -> RequestTracer:
        """Build from the --otlp-traces-endpoint value; raises TesseraError for a bad value."""
        return cls(model_name, exporter_for_endpoint(endpoint), **kwargs)

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        if iteration_stats is None:
            return
        for finished in iteration_stats.finished:
            self.trace_request(finished)

    def trace_request(self, f: FinishedRequestStats) -> None:
        m = f.metrics
        end = m.finished_time or m.last_token_time or m.arrival_time
        span = self._tracer.start_span(SPAN_NAME, kind=SpanKind.SERVER, start_time=to_ns(m.arrival_time),
                                       attributes=self._attributes(f))
        events: list[tuple[float, str, dict[str, Any]]] = [(m.arrival_time, "queued", {})]
        if m.first_scheduled_time is not None:
            events.append((m.first_scheduled_time, "scheduled", {}))
        if m.first_token_time is not None:
            events.append((m.first_token_time, "first_token", {}))
        for i, t in enumerate(m.preempted_times):
            events.append((t, "preempted", {"tessera.preemption.index": i}))
        events.append((end, "finished", {"gen_ai.response.finish_reasons": (f.finish_reason,)}))
        for t, name, attrs in sorted(events, key=lambda e: e[0]):  # stable: ties keep life order
            span.add_event(name, attrs, timestamp=to_ns(t))
        span.end(end_time=to_ns(end))

    def _attributes(self, f: FinishedRequestStats) -> dict[str, Any]:
        m, p = f.metrics, f.params
        attrs: dict[str, Any] = {
            "gen_ai.provider.name": "tessera",
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.response.id": f.request_id,
            "tessera.request.id": f.request_id,
            "gen_ai.usage.input_tokens": f.num_prompt_tokens,
            "gen_ai.usage.output_tokens": f.num_generation_tokens,
            "gen_ai.usage.cache_read.input_tokens": f.num_cached_tokens,
            "gen_ai.response.finish_reasons": (f.finish_reason,),
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.request.choice.count": p.n,
            "tessera.num_preemptions": len(m.preempted_times),
            "tessera.request.priority": p.priority,
            "tessera.prompt_steps": m.prompt_steps,
            "tessera.prompt_step_tokens": m.prompt_step_tokens,
        }
        if p.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = p.max_tokens
        if p.top_k > 0:
            attrs["gen_ai.request.top_k"] = p.top_k
        if p.seed is not None:
            attrs["gen_ai.request.seed"] = p.seed
        if p.presence_penalty:
            attrs["gen_ai.request.presence_penalty"] = p.presence_penalty
        if p.frequency_penalty:
            attrs["gen_ai.request.frequency_penalty"] = p.frequency_penalty
        if p.stop:
            attrs["gen_ai.request.stop_sequences"] = tuple(p.stop)
        if m.first_token_time is not None:
            attrs["gen_ai.response.time_to_first_chunk"] = max(0.0, m.first_token_time - m.arrival_time)
        return attrs

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export every span ended so far; True if that finished within the timeout."""
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()
