"""Prometheus metrics for GET /metrics, named like vLLM's under the `tessera:` prefix.

`PrometheusStatLogger` is a StatLogger: the stats consumer thread (see
tessera/observability.py) calls `record()` with the plain counts and timestamps
the engine loop collected, and this class turns them into gauges, counters and
histograms, off the engine's hot loop. Every instance owns its own
`CollectorRegistry`, so two servers (or two tests) in one process never share
a counter.

Finish reasons follow vLLM: `request_success_total` carries the label values
stop, length and abort (vLLM's FinishReason enum has exactly these three and
pre-creates all of them), so an aborted request is counted there under
finished_reason="abort" *and* in `request_aborts_total`. Dashboards that want
real successes filter `finished_reason=~"stop|length"`. Aborted requests are also
observed in the per-request histograms, so `request_prompt_tokens_sum` and
`request_generation_tokens_sum` add up with the finished requests of every kind.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from tessera.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats

PREFIX = "tessera:"
FINISH_REASONS = ("stop", "length", "abort")
UNKNOWN_MAX_MODEL_LEN = 100_000

# Buckets span a GPU's milliseconds and a small CPU's seconds alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Grammar compilation and per-step mask work: microseconds when cached, up to seconds for a big schema.
GRAMMAR_BUCKETS = (1e-5, 1e-4, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0,
                           2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                           960.0, 1920.0, 7680.0)


def buckets_1_2_5(maximum: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `maximum` (token-count buckets, as vLLM builds them)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return out
            out.append(value)
        exponent += 1


def buckets_pow2(maximum: int) -> list[int]:
    """1, 2, 4, ... up to `maximum`, plus `maximum` itself (per-step token budgets)."""
    out = [1]
    while out[-1] * 2 <= maximum:
        out.append(out[-1] * 2)
    if out[-1] != maximum and maximum > 1:
        out.append(maximum)
    return out


class MetricFamilies:
    """The metric families of one /metrics endpoint, shared by the loggers of every model it
    serves (each logger fills its own `model_name` label). A family is created by the first
    logger that asks for it, so a histogram's buckets are those of the first model."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._families: dict[str, object] = {}
        self._lock = threading.Lock()

    def render(self) -> tuple[bytes, str]:
        """The body and Content-Type for a GET /metrics response (classic Prometheus text format)."""
        return generate_latest(_WithoutCreated(self.registry)), CONTENT_TYPE_PLAIN_0_0_4

    def get(self, cls, name: str, doc: str, labelnames: list[str], **kwargs):
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = cls(name, doc, labelnames, registry=self.registry, **kwargs)
            return family

    def record_http_request(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        """One HTTP request answered, by route (`/v1/responses/{response_id}`, not each id), so the
        chat, completions, Responses and Messages APIs' traffic and errors can be told apart."""
        self.get(Counter, PREFIX + "http_requests", "HTTP requests answered, by endpoint, method and status.",
                 ["endpoint", "method", "status"]).labels(endpoint, method, str(status)).inc()
        self.get(Histogram, PREFIX + "http_request_duration_seconds", "Histogram of the time to answer an HTTP "
                 "request (a stream: to its last event), by endpoint.", ["endpoint", "method"],
                 buckets=REQUEST_LATENCY_BUCKETS).labels(endpoint, method).observe(seconds)


class PrometheusStatLogger:
    """Engine stats as Prometheus metrics, labelled by `model_name` (and `replica` when a model
    runs as several replicas: every logger of one registry must then have one)."""

    def __init__(self, model_name: str, *, max_model_len: Optional[int] = None, max_num_batched_tokens: int = 512,
                 registry: Optional[CollectorRegistry] = None, families: Optional[MetricFamilies] = None,
                 replica: Optional[str] = None) -> None:
        """`max_model_len` tops the token-count buckets; None (not resolved yet) means 100k tokens.
        Loggers of several models share one `families` (one registry, one /metrics)."""
        self.model_name = model_name
        token_buckets = buckets_1_2_5(max_model_len or UNKNOWN_MAX_MODEL_LEN)
        self.families = families if families is not None else MetricFamilies(registry)
        self.registry = self.families.registry
        self._labels = ["model_name"] + ([] if replica is None else ["replica"])
        self._label_values = (model_name,) + (() if replica is None else (replica,))
        self._scheduler_metrics()
        self._request_metrics()
        self._latency_histograms(token_buckets, max_num_batched_tokens)
        self._spec_decode_metrics()
        self._lora_info: Optional[Gauge] = None  # created by enable_lora_info
        self._max_loras = 0
        self._lora_labels: Optional[tuple[str, ...]] = None  # the series set last

    def _gauge(self, name: str, doc: str) -> Gauge:
        return self.families.get(Gauge, PREFIX + name, doc, self._labels).labels(*self._label_values)

    def _counter(self, name: str, doc: str) -> Counter:
        return self.families.get(Counter, PREFIX + name, doc, self._labels).labels(*self._label_values)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return self.families.get(Histogram, PREFIX + name, doc, self._labels,
                                 buckets=buckets).labels(*self._label_values)

    def _labelled(self, kind: type, name: str, doc: str, label: str):
        """A family with one more label than the model's (finish reason, endpoint, ...)."""
        return self.families.get(kind, PREFIX + name, doc, self._labels + [label])

    def _scheduler_metrics(self) -> None:
        """What the scheduler and the KV cache are doing (vLLM's names)."""
        gauge, counter, values = self._gauge, self._counter, self._label_values
        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Number of requests swapped out to host memory.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_state_slots_used = gauge(
            "num_state_slots_used", "Per-request state slots held (models with recurrent layers; 0 otherwise).")
        # Per priority class (the request's `priority`; a class gone from the queue reads 0).
        self._by_priority = (
            self._labelled(Gauge, "num_requests_running_by_priority",
                           "Number of requests in model execution batches, by priority.", "priority"),
            self._labelled(Gauge, "num_requests_waiting_by_priority",
                           "Number of requests waiting to be processed, by priority.", "priority"))
        self._priorities_seen: set[int] = set()
        # Created on the first stats from a GPU engine, so a CPU server exports no zero-valued GPU series.
        self.gpu_memory: Optional[tuple[Gauge, Gauge]] = None

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._request_success = self._labelled(Counter, "request_success",
                                               "Count of finished requests by finish reason.", "finished_reason")
        self.request_success = {r: self._request_success.labels(*values, r) for r in FINISH_REASONS}
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions by the scheduler.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in tokens (prompt tokens looked up).")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens (prompt tokens reused).")
        self.external_prefix_cache_hits = counter(
            "external_prefix_cache_hits", "Prefix cache hits in the disk tier (--kv-offload-dir), in tokens loaded "
            "instead of recomputed (prefix_cache_hits counts both tiers).")
        self._kv_offload_bytes = self._labelled(Counter, "kv_offload_bytes", "Bytes moved to and from the disk tier.",
                                                "direction")
        self.kv_offload_bytes_read = self._kv_offload_bytes.labels(*values, "read")
        self.kv_offload_bytes_written = self._kv_offload_bytes.labels(*values, "write")
        self.kv_offload_saved_seconds = counter(
            "kv_offload_saved_seconds", "Prefill time the disk tier's loads saved: the step-cost model's prediction "
            "for the loaded tokens less the time loading them took.")
        self.admission_rejections = counter(
            "admission_rejections", "Requests refused at admission (HTTP 429): the waiting queue was full, or "
                                    "the forecast wait for the prompt was past the request's deadline.")
        self.predicted_queue_wait = gauge(
            "predicted_queue_wait_seconds", "Forecast (step-cost model) of how long a request arriving now "
                                            "would wait for its prompt to be computed, in seconds.")

    def _request_metrics(self) -> None:
        """Requests by outcome and kind: constrained output, aborts, API endpoints."""
        counter, histogram = self._counter, self._histogram
        self._structured_requests = self._labelled(
            Counter, "structured_output_requests", "Finished sequences whose output was constrained, by "
            "kind (json, json_object, regex, choice, grammar, structural_tag: tool calls).", "kind")
        self.grammar_compile_time = histogram(
            "grammar_compile_seconds", "Histogram of the time to compile a request's output constraint (cached "
            "grammars take microseconds), in seconds.", GRAMMAR_BUCKETS)
        self.structured_mask_time = histogram(
            "structured_output_mask_seconds", "Histogram of the time per engine step spent computing and applying "
            "grammar token masks (steps with constrained requests), in seconds.", GRAMMAR_BUCKETS)
        self.request_aborts = counter("request_aborts", "Requests aborted before finishing (client gone or cancelled).")
        self._endpoint_requests = self._labelled(
            Counter, "endpoint_requests", "API requests answered, by endpoint (embeddings: /v1/embeddings, "
            "/api/embed, /api/embeddings).", "endpoint")
        self._endpoint_prompt_tokens = self._labelled(
            Counter, "endpoint_prompt_tokens", "Input tokens of the API requests answered, by endpoint.", "endpoint")

    def _latency_histograms(self, token_buckets: list, max_num_batched_tokens: int) -> None:
        """Per-request latencies and sizes, and per-step time and tokens (vLLM's names)."""
        histogram = self._histogram
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of each request's mean time per output token after the first, in seconds.",
            TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Histogram of time spent waiting before first scheduled, in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "Histogram of time from first scheduled to first token, in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Histogram of time from first token to last token, in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed per request.", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed per request.",
            token_buckets)
        self.step_time = histogram(
            "step_time_seconds", "Histogram of engine step time (schedule to outputs), in seconds.",
            TOKEN_LATENCY_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of the number of tokens per engine step.",
            buckets_pow2(max_num_batched_tokens))

    def _spec_decode_metrics(self) -> None:
        """Speculative decoding: runs verified, tokens proposed and accepted (vLLM's names)."""
        counter, histogram = self._counter, self._histogram
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Runs of proposed tokens verified (speculative decoding).")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Proposed tokens verified by the target model.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted.")
        self._spec_accepted_per_pos = self._labelled(
            Counter, "spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens by position in their run (0 = first proposal).", "position")
        self.spec_decode_request_acceptance_rate = histogram(
            "spec_decode_request_acceptance_rate",
            "Per finished request that verified proposals: accepted / proposed tokens.",
            [0.1 * i for i in range(1, 11)])

    def enable_lora_info(self, max_loras: int) -> None:
        """Export vLLM's LoRA gauge (`lora_requests_info`) for a model served with LoRA adapters:
        one series whose labels name the adapters running and waiting (comma-joined) and
        `max_lora`, valued at the time of its last update, as vLLM sets it."""
        self._max_loras = max_loras
        self._lora_info = self.families.get(
            Gauge, PREFIX + "lora_requests_info", "Running stats on LoRA requests: the adapters of the running "
            "and waiting requests (comma-joined names) and max_lora; the value is the time of the update.",
            self._labels + ["running_lora_adapters", "waiting_lora_adapters", "max_lora"])

    def _record_lora(self, scheduler_stats: SchedulerStats) -> None:
        """The LoRA gauge from the requests per adapter (SchedulerStats.lora_running / lora_waiting);
        only the current label set is kept, so adapters coming and going add no stale series."""
        assert self._lora_info is not None
        running = ",".join(sorted(getattr(scheduler_stats, "lora_running", None) or {}))
        waiting = ",".join(sorted(getattr(scheduler_stats, "lora_waiting", None) or {}))
        labels = (*self._label_values, running, waiting, str(self._max_loras))
        if self._lora_labels is not None and self._lora_labels != labels:
            try:
                self._lora_info.remove(*self._lora_labels)
            except KeyError:
                pass
        self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    # -- StatLogger ---------------------------------------------------------------------------

    def _record_priorities(self, classes: tuple[tuple[int, int, int], ...]) -> None:
        now = {p: (running, waiting) for p, running, waiting in classes}
        for p in self._priorities_seen | set(now):
            running, waiting = now.get(p, (0, 0))
            self._by_priority[0].labels(*self._label_values, str(p)).set(running)
            self._by_priority[1].labels(*self._label_values, str(p)).set(waiting)
        self._priorities_seen |= set(now)

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        """Called on the stats consumer thread; either argument may be None (nothing new of that kind)."""
        if scheduler_stats is not None:
            self.num_requests_running.set(scheduler_stats.num_running)
            self.num_requests_waiting.set(scheduler_stats.num_waiting)
            self.num_requests_swapped.set(scheduler_stats.num_swapped)
            self.kv_cache_usage_perc.set(scheduler_stats.kv_cache_usage)
            self.num_state_slots_used.set(scheduler_stats.num_state_slots_used)
            if self._lora_info is not None:
                self._record_lora(scheduler_stats)
            self._record_priorities(scheduler_stats.requests_by_priority)
            if scheduler_stats.gpu_memory_total_bytes:
                if self.gpu_memory is None:
                    self.gpu_memory = (
                        self._gauge("gpu_memory_allocated_bytes", "GPU memory the engine's PyTorch allocator "
                                    "holds (weights, KV cache, the step's activations; summed over a model's "
                                    "replicas), in bytes."),
                        self._gauge("gpu_memory_total_bytes", "The GPU's memory, in bytes."))
                self.gpu_memory[0].set(scheduler_stats.gpu_memory_allocated_bytes)
                self.gpu_memory[1].set(scheduler_stats.gpu_memory_total_bytes)
        if iteration_stats is None:
            return
        it = iteration_stats
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        self.num_preemptions.inc(it.num_preemptions)
        self.prefix_cache_queries.inc(it.prefix_cache_queries)
        self.prefix_cache_hits.inc(it.prefix_cache_hits)
        self.external_prefix_cache_hits.inc(it.external_prefix_cache_hits)
        self.kv_offload_bytes_read.inc(it.kv_offload_bytes_read)
        self.kv_offload_bytes_written.inc(it.kv_offload_bytes_written)
        self.kv_offload_saved_seconds.inc(max(0.0, it.kv_offload_saved_seconds))
        self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        if it.step_time > 0:
            self.step_time.observe(it.step_time)
        if it.structured_mask_time is not None:
            self.structured_mask_time.observe(it.structured_mask_time)
        for proposed, accepted in it.spec_results:
            self.spec_decode_num_drafts.inc()
            self.spec_decode_num_draft_tokens.inc(proposed)
            self.spec_decode_num_accepted_tokens.inc(accepted)
            for pos in range(accepted):
                self._spec_accepted_per_pos.labels(*self._label_values, str(pos)).inc()
        for ttft in it.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in it.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in it.finished:
            self._record_finished(finished)

    def _record_finished(self, f: FinishedRequestStats) -> None:
        reason = f.finish_reason
        success = self.request_success.get(reason)
        if success is None:  # a reason vLLM does not have; still counted, under its own label
            success = self._request_success.labels(*self._label_values, reason)
        success.inc()
        if reason == "abort":
            self.request_aborts.inc()
        self.request_prompt_tokens.observe(f.num_prompt_tokens)
        self.request_generation_tokens.observe(f.num_generation_tokens)

        m = f.metrics
        if m.finished_time is not None:
            self.e2e_request_latency.observe(max(0.0, m.finished_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.request_prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = max(0.0, m.last_token_time - m.first_token_time)
            self.request_decode_time.observe(decode)
            if f.num_generation_tokens > 1:
                self.request_time_per_output_token.observe(decode / (f.num_generation_tokens - 1))
        if m.spec_draft_tokens:
            self.spec_decode_request_acceptance_rate.observe(m.spec_accepted_tokens / m.spec_draft_tokens)
        structured = f.params.structured_outputs
        if structured is not None:
            self._structured_requests.labels(*self._label_values, structured.kind).inc()
            if m.grammar_compile_time is not None:
                self.grammar_compile_time.observe(m.grammar_compile_time)

    # -- events that happen outside an engine step ---------------------------------------------

    def record_rejection(self) -> None:
        """A request refused at admission (queue full, HTTP 429); thread-safe, call from anywhere."""
        self.admission_rejections.inc()

    def record_endpoint(self, endpoint: str, prompt_tokens: int) -> None:
        """One API request answered on `endpoint`, with its input tokens; thread-safe."""
        self._endpoint_requests.labels(*self._label_values, endpoint).inc()
        self._endpoint_prompt_tokens.labels(*self._label_values, endpoint).inc(prompt_tokens)

    def watch_predicted_wait(self, forecast: Callable[[], Optional[float]]) -> None:
        """Read the predicted queue wait from `forecast` at each scrape (it is not a step event)."""
        self.predicted_queue_wait.set_function(lambda: forecast() or 0.0)

    # -- exposition ----------------------------------------------------------------------------

    def record_http_request(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        self.families.record_http_request(endpoint, method, status, seconds)

    def render(self) -> tuple[bytes, str]:
        """The body and Content-Type for a GET /metrics response (classic Prometheus text format)."""
        return self.families.render()


class _WithoutCreated:
    """The registry minus the `*_created` timestamp series prometheus_client adds to counters and
    histograms (vLLM drops them too); filtered here because the library's switch is process-global."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield family
