"""Which engine serves each model and where its loop runs: one AsyncLLMEngine over an
in-process core or an engine process, or a ReplicaSet of engine-process or Ray cores
(prefill/decode disaggregation included). `tessera serve` (launch.py) hands the router
`build_serving_engine` and `close_serving_engine`; the HTTP app never sees the topology,
only the engines the router gives it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

from tessera.errors import TesseraError
from tessera.profiles import PROFILE_SETTINGS
from tessera.server.served_model import ServedModel

if TYPE_CHECKING:
    from tessera.config import EngineConfig
    from tessera.engine.frontend.async_engine import AsyncLLMEngine
    from tessera.engine.frontend.protocols import CoreFactory, ServingEngine
    from tessera.engine.frontend.ray_core import RayPlacement
    from tessera.live_stats import LiveStats
    from tessera.metrics import MetricFamilies, PrometheusStatLogger
    from tessera.observability import StatLoggers, StatsConsumer
    from tessera.server.config import RaySettings, ServingSpec

logger = logging.getLogger("tessera.server")


def build_serving_engine(served: ServedModel, spec: ServingSpec, families: MetricFamilies) -> ServingEngine:
    """One model's engine, for any topology: an AsyncLLMEngine over an in-process or
    engine-process core, or a ReplicaSet of them over process or Ray cores (P/D included).
    Each engine gets the same wiring (`_start_engine`); the model's loggers are left on `served`
    for the app (429s, the dashboard) and `close_serving_engine`."""
    from tessera.engine.frontend.protocols import make_engine_core

    model = served.spec
    config = spec.engine_config(model)
    queue, wait = spec.queue_limit(model), spec.queue_wait(model)
    source = "model config" if model.max_num_queued_requests else "flag"
    if queue is None:
        queue, source = PROFILE_SETTINGS[config.profile].max_num_queued_requests, f"profile {config.profile}"
    logger.info("%s: queue of up to %d waiting requests%s (%s), then HTTP 429", served.name, queue,
                " per replica" if spec.replicated else "", source)
    if not spec.replicated:
        on_main_thread = spec.steps_on_main_thread
        loggers = _stat_loggers(spec, served.name, config, families)
        core = functools.partial(make_engine_core, engine_process=spec.engine_process or not on_main_thread,
                                 log_level=spec.log_level)
        engine, consumer = _start_engine(spec, config, core, loggers, loggers.all(), queue, wait,
                                         thread_name=f"tessera-stats-{served.name}", start_thread=not on_main_thread)
        served.metrics, served.live, served.stats_consumer = loggers.prometheus, loggers.live, consumer
        return engine

    from tessera.deploy.replicas import ReplicaSet
    from tessera.live_stats import LiveStats

    if config.num_threads is None:  # replicas must not fight over cores: each gets its share
        threads = spec.ray.num_cpus_per_replica if spec.ray is not None else (os.cpu_count() or 1) / spec.replica_count
        config = dataclasses.replace(config, num_threads=max(1, int(threads)))
    placement = _placement(spec.ray) if spec.ray is not None else None
    live = LiveStats(served.name)
    consumers: dict[int, StatsConsumer] = {}
    prometheus: dict[int, PrometheusStatLogger] = {}
    replica_set: Optional[ReplicaSet] = None

    def one(replica_id: int) -> AsyncLLMEngine:
        """A replica: its own core, stats thread and Prometheus logger (a `replica` label), all
        feeding the model's one LiveStats with the whole set's gauges (the dashboard)."""
        loggers = _stat_loggers(spec, served.name, config, families, replica=str(replica_id), live=live)
        sinks = [lg for lg in loggers.all() if lg is not live] + [_SetLive(live, lambda: replica_set)]
        core = functools.partial(make_engine_core, engine_process=True, ray=placement,
                                 name=f"{served.name}/{replica_id}", log_level=spec.log_level)
        engine, consumer = _start_engine(spec, config, core, loggers, sinks, queue, wait,
                                         thread_name=f"tessera-stats-{served.name}-{replica_id}")
        consumers[replica_id], prometheus[replica_id] = consumer, loggers.prometheus
        return engine

    def close_one(replica_id: int, engine: AsyncLLMEngine) -> None:
        consumer = consumers.pop(replica_id, None)
        if consumer is not None:
            consumer.stop()
        prometheus.pop(replica_id, None)

    def rejected(replica_id: int) -> None:
        if replica_id in prometheus:
            prometheus[replica_id].record_rejection()

    replica_set = ReplicaSet(one, spec.replicas, spec.router_policy, close=close_one, on_rejection=rejected,
                             pd=spec.pd)
    served.metrics, served.live = None, live  # 429s are counted by the set (on_rejection) and here
    return replica_set


def _stat_loggers(spec: ServingSpec, name: str, config: EngineConfig, families: MetricFamilies, *,
                  replica: Optional[str] = None, live: Optional[LiveStats] = None) -> StatLoggers:
    from tessera.observability import build_stat_loggers

    loggers = build_stat_loggers(name, max_model_len=config.max_model_len,
                                 max_num_batched_tokens=config.max_num_batched_tokens,
                                 otlp_traces_endpoint=spec.otlp_traces_endpoint, log_stats=spec.log_stats,
                                 families=families, replica=replica, live=live)
    if getattr(config, "enable_lora", False):  # vLLM exports its LoRA gauge only with LoRA enabled
        loggers.prometheus.enable_lora_info(config.max_loras)
    return loggers


def _start_engine(spec: ServingSpec, config: EngineConfig, core: CoreFactory, loggers: StatLoggers,
                  sinks: list, queue: int, wait: Optional[float], *, thread_name: str,
                  start_thread: bool = True) -> tuple[AsyncLLMEngine, StatsConsumer]:
    """An engine with the wiring every one gets: its stats on a thread of their own (metrics and
    traces are built there, off the engine loop), the queue bound and forecast admission, the
    watchdog, a warm-up, and the forecast on /metrics. Nothing is left running if it fails."""
    from tessera.engine.frontend.async_engine import AsyncLLMEngine
    from tessera.observability import StatsConsumer

    consumer = StatsConsumer(sinks, thread_name=thread_name)
    try:
        engine = AsyncLLMEngine(config, max_num_queued_requests=queue, stats_sink=consumer, start_thread=start_thread,
                                step_timeout=spec.engine_step_timeout, max_queue_wait=wait, core_factory=core)
        try:
            engine.warm_up()
        except BaseException:
            engine.shutdown()
            raise
    except BaseException:
        consumer.stop()
        raise
    loggers.prometheus.watch_predicted_wait(engine.predicted_wait)
    return engine, consumer


def close_serving_engine(served: ServedModel) -> None:
    """Stop what `build_serving_engine` started beside the engine (after the engine has shut down,
    so its last steps' stats still reached the loggers)."""
    if served.metrics is not None:
        served.metrics.watch_predicted_wait(lambda: None)
    if served.stats_consumer is not None:
        served.stats_consumer.stop()


class _SetLive:
    """Feeds a replica's step stats to the model's LiveStats with the whole set's scheduler
    gauges (running, waiting, KV use), so the dashboard does not flip between replicas."""

    def __init__(self, live, replica_set: Callable[[], Any]) -> None:
        self.live = live
        self.replica_set = replica_set

    def record(self, scheduler_stats, iteration_stats) -> None:
        replicas = self.replica_set()
        self.live.record(replicas.get_scheduler_stats() if replicas is not None else scheduler_stats,
                         iteration_stats)


def init_ray(ray_settings: RaySettings) -> None:
    try:
        import ray
    except ImportError:
        raise TesseraError("--ray needs Ray: pip install 'tessera[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=ray_settings.address, include_dashboard=False, log_to_driver=True,
                 logging_level=logging.WARNING)
    logger.info("Ray cluster: %s", ", ".join(f"{k} {v:g}" for k, v in sorted(ray.cluster_resources().items())
                                              if k in ("CPU", "GPU", "memory")))


def _placement(ray_settings: RaySettings) -> RayPlacement:
    """What each replica asks of Ray."""
    from tessera.engine.frontend.ray_core import RayPlacement

    return RayPlacement(num_cpus=ray_settings.num_cpus_per_replica, num_gpus=ray_settings.num_gpus_per_replica,
                        memory_bytes=ray_settings.memory_per_replica)
