"""Counts and timestamps the engine loop records; consumers turn them into metrics.

The loop only fills these plain objects. Histograms, traces and log lines are
built on another thread (see tessera.metrics), so observability never slows a step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from tessera.engine.outputs import RequestMetrics
from tessera.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoadSnapshot:
    """The scheduler's queue in plain numbers, for forecasting a newcomer's wait off the engine thread."""

    queued_prefill_tokens: int = 0  # prompt tokens still to compute, waiting and running
    num_waiting: int = 0
    num_decoding: int = 0
    num_prefilling: int = 0  # running requests with prompt tokens still to compute
    mean_context: int = 0  # of the decoding requests
    free_seq_slots: int = 0
    remaining_output_tokens: tuple[int, ...] = ()  # of running requests, ascending (max_tokens bounds)
    # (priority, waiting requests, their prompt tokens still to compute) per class, ascending.
    waiting_by_priority: tuple[tuple[int, int, int], ...] = ()
    # The best class served so far (priority policy): steps given way for lower classes are bounded.
    best_priority_seen: Optional[int] = None

    def ahead_of(self, priority: int) -> "LoadSnapshot":
        """The queue as a newcomer of `priority` meets it under the priority policy: the waiting
        requests of a lower class (a larger number) are not ahead of it."""
        behind = [(n, t) for p, n, t in self.waiting_by_priority if p > priority]
        if not behind:
            return self
        return dataclasses.replace(self, num_waiting=self.num_waiting - sum(n for n, _ in behind),
                                   queued_prefill_tokens=self.queued_prefill_tokens - sum(t for _, t in behind),
                                   waiting_by_priority=tuple(c for c in self.waiting_by_priority if c[0] <= priority))

    def waiting_ahead_of(self, priority: int) -> int:
        """Waiting requests of `priority` or a higher class."""
        return sum(n for p, n, _ in self.waiting_by_priority if p <= priority)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0  # share of blocks held by requests, 0..1
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    # Models with recurrent layers (0 otherwise): per-request state slots, and those requests hold.
    num_state_slots_total: int = 0
    num_state_slots_used: int = 0
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found
    num_preemptions: int = 0  # cumulative
    # On a GPU (0 elsewhere): bytes PyTorch has allocated there (weights, KV cache, activations
    # of the step in flight), and the device's memory.
    gpu_memory_allocated_bytes: int = 0
    gpu_memory_total_bytes: int = 0
    # Requests per LoRA adapter (vLLM's lora_requests_info), running and waiting.
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    # (priority, running, waiting) per priority class present, ascending.
    requests_by_priority: tuple[tuple[int, int, int], ...] = ()


@dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    params: SamplingParams


@dataclass
class IterationStats:
    timestamp: float
    num_prompt_tokens: int = 0  # prompt tokens computed this step (incl. recompute)
    num_generation_tokens: int = 0  # tokens sampled this step
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # The disk tier: tokens loaded instead of recomputed, bytes read and written, and the prefill
    # time those loads saved (the step-cost model's prediction for them, less the load time).
    external_prefix_cache_hits: int = 0
    kv_offload_bytes_read: int = 0
    kv_offload_bytes_written: int = 0
    kv_offload_saved_seconds: float = 0.0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec_results: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted) per request
    step_time: float = 0.0  # seconds from schedule to outputs
    structured_mask_time: Optional[float] = None  # seconds computing and applying grammar masks, if any
