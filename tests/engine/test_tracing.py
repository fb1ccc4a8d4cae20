"""One span per finished request, checked with InMemorySpanExporter and a local OTLP/HTTP receiver."""
from __future__ import annotations

import gzip
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tessera.engine.outputs import RequestMetrics
from tessera.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from tessera.errors import TesseraError
from tessera.observability import StatsConsumer
from tessera.sampling_params import SamplingParams
from tessera.tracing import RequestTracer, exporter_for_endpoint, to_ns

MODEL = "tiny-test"
T0 = 1_700_000_000.0


def preempted_request() -> FinishedRequestStats:
    m = RequestMetrics(arrival_time=T0, first_scheduled_time=T0 + 0.5, first_token_time=T0 + 0.75,
                       last_token_time=T0 + 3.0, finished_time=T0 + 3.25, preempted_times=[T0 + 1.0, T0 + 2.0],
                       prompt_steps=2, prompt_step_tokens=300)
    return FinishedRequestStats("req-a", "length", num_prompt_tokens=12, num_generation_tokens=20,
                                num_cached_tokens=8, metrics=m,
                                params=SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, top_k=40, seed=3,
                                                      stop=["\n\n"], priority=3))


def aborted_while_waiting() -> FinishedRequestStats:
    m = RequestMetrics(arrival_time=T0 + 1.0, finished_time=T0 + 1.5)
    return FinishedRequestStats("req-b", "abort", num_prompt_tokens=5, num_generation_tokens=0,
                                num_cached_tokens=0, metrics=m, params=SamplingParams())


def traced(finished_per_step: list[list[FinishedRequestStats]]):
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(MODEL, exporter)
    consumer = StatsConsumer([tracer])
    for step, finished in enumerate(finished_per_step):
        consumer.put(SchedulerStats(), IterationStats(timestamp=T0 + step, finished=finished))
    consumer.put(SchedulerStats(), None)  # a step with nothing finished
    consumer.stop()  # drains, then flushes and shuts the tracer down
    return exporter.get_finished_spans()


def test_span_tree_one_root_span_per_request_with_its_life_as_events():
    spans = traced([[], [preempted_request()], [aborted_while_waiting()]])
    assert [s.name for s in spans] == ["llm_request", "llm_request"]
    assert all(s.parent is None for s in spans)  # each request is the root of its own trace
    assert len({s.context.trace_id for s in spans}) == 2
    assert all(s.resource.attributes["service.name"] == "tessera" for s in spans)
    a, b = spans

    assert a.kind == SpanKind.SERVER
    assert (a.start_time, a.end_time) == (to_ns(T0), to_ns(T0 + 3.25))
    assert [(e.name, e.timestamp) for e in a.events] == [
        ("queued", to_ns(T0)), ("scheduled", to_ns(T0 + 0.5)), ("first_token", to_ns(T0 + 0.75)),
        ("preempted", to_ns(T0 + 1.0)), ("preempted", to_ns(T0 + 2.0)), ("finished", to_ns(T0 + 3.25))]
    assert [e.attributes.get("tessera.preemption.index") for e in a.events if e.name == "preempted"] == [0, 1]
    assert a.events[-1].attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert dict(a.attributes) == {
        "gen_ai.provider.name": "tessera",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "gen_ai.response.id": "req-a",
        "tessera.request.id": "req-a",
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 20,
        "gen_ai.usage.cache_read.input_tokens": 8,
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 40,
        "gen_ai.request.seed": 3,
        "gen_ai.request.max_tokens": 20,
        "gen_ai.request.choice.count": 1,
        "gen_ai.request.stop_sequences": ("\n\n",),
        "gen_ai.response.time_to_first_chunk": 0.75,
        "tessera.num_preemptions": 2,
        "tessera.request.priority": 3,
        "tessera.prompt_steps": 2,
        "tessera.prompt_step_tokens": 300,
    }

    # aborted before it was ever scheduled: only the events that happened
    assert (b.start_time, b.end_time) == (to_ns(T0 + 1.0), to_ns(T0 + 1.5))
    assert [e.name for e in b.events] == ["queued", "finished"]
    assert b.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert b.attributes["gen_ai.usage.output_tokens"] == 0
    assert "gen_ai.response.time_to_first_chunk" not in b.attributes


def test_exporter_for_endpoint():
    assert isinstance(exporter_for_endpoint("console"), ConsoleSpanExporter)
    e = exporter_for_endpoint("http://collector:4318")
    assert isinstance(e, OTLPSpanExporter) and e._endpoint == "http://collector:4318/v1/traces"
    assert exporter_for_endpoint("https://c.example/custom/path")._endpoint == "https://c.example/custom/path"
    for bad in ("collector:4318", "grpc://collector:4317", "", "http://"):
        with pytest.raises(TesseraError, match="otlp-traces-endpoint"):
            exporter_for_endpoint(bad)


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]]

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        encoding = self.headers.get("Content-Encoding")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        self.server.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_reach_an_otlp_http_collector(monkeypatch):
    for var in ("no_proxy", "NO_PROXY"):  # a proxy configured for the outside world must not catch this
        monkeypatch.setenv(var, "127.0.0.1")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tracer = RequestTracer.from_endpoint(f"http://127.0.0.1:{server.server_port}", MODEL)
        tracer.record(SchedulerStats(), IterationStats(timestamp=T0, finished=[preempted_request()]))
        assert tracer.flush(timeout_s=20)
        tracer.shutdown()
    finally:
        server.shutdown()
    assert [path for path, _ in server.received] == ["/v1/traces"]
    request = ExportTraceServiceRequest.FromString(server.received[0][1])
    [span] = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert span.name == "llm_request"
    assert span.start_time_unix_nano == to_ns(T0) and span.end_time_unix_nano == to_ns(T0 + 3.25)
    assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "preempted", "preempted",
                                             "finished"]
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["gen_ai.response.id"].string_value == "req-a"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 20
