"""The scheduler's queues in plain numbers: the stats published each step, and the load snapshot
with the forecast read from it of how long a newcomer waits for its prompt (`WaitForecast`)."""
from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Optional

from tessera.config import EngineConfig
from tessera.engine.core.chunk_sizing import give_way_bound, prompts_outnumber_decodes
from tessera.engine.core.cost_model import StepCostPredictor, StepShape, max_fitting
from tessera.engine.core.kv_cache_manager import KVCacheManager
from tessera.engine.core.request import Request, RequestStatus
from tessera.engine.stats import LoadSnapshot, SchedulerStats


def scheduler_stats(running: list[Request], waiting: Collection[Request], kv: KVCacheManager,
                    num_preemptions: int) -> SchedulerStats:
    swapped = sum(1 for r in waiting if r.status == RequestStatus.SWAPPED)
    return SchedulerStats(
        num_running=len(running),
        num_waiting=len(waiting) - swapped,
        num_swapped=swapped,
        kv_cache_usage=kv.usage(),
        num_blocks_total=kv.num_blocks,
        num_blocks_free=kv.num_free_blocks,
        num_state_slots_total=kv.state.num_slots if kv.state is not None else 0,
        num_state_slots_used=kv.state.num_used if kv.state is not None else 0,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=num_preemptions,
        lora_running=_count_adapters(running),
        lora_waiting=_count_adapters(waiting),
        requests_by_priority=_by_priority(running, waiting),
    )


def _by_priority(running: Iterable[Request], waiting: Iterable[Request]) -> tuple[tuple[int, int, int], ...]:
    """(priority, running, waiting) per priority class present, ascending."""
    counts: dict[int, list[int]] = {}
    for r in running:
        counts.setdefault(r.priority, [0, 0])[0] += 1
    for r in waiting:
        counts.setdefault(r.priority, [0, 0])[1] += 1
    return tuple((p, c[0], c[1]) for p, c in sorted(counts.items()))


def _count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_name is not None:
            counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
    return counts


def load_snapshot(running: list[Request], waiting: Collection[Request], max_num_seqs: int,
                  best_priority_seen: Optional[int] = None) -> LoadSnapshot:
    """Plain numbers describing the queue, published each step for `WaitForecast.predict`."""
    queued = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
    queued += sum(r.num_tokens - r.num_computed_tokens for r in running
                  if r.num_tokens - r.num_computed_tokens > 1)
    decoding = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
    context = sum(r.num_tokens for r in decoding) // len(decoding) if decoding else 0
    remaining = sorted(max(0, r.max_tokens - r.num_output_tokens) for r in running)
    classes: dict[int, list[int]] = {}
    for r in waiting:
        c = classes.setdefault(r.priority, [0, 0])
        c[0] += 1
        c[1] += r.num_tokens - r.num_computed_tokens
    return LoadSnapshot(queued_prefill_tokens=queued, num_waiting=len(waiting),
                        waiting_by_priority=tuple((p, c[0], c[1]) for p, c in sorted(classes.items())),
                        num_decoding=len(decoding), num_prefilling=len(running) - len(decoding),
                        mean_context=context,
                        free_seq_slots=max(0, max_num_seqs - len(running)),
                        remaining_output_tokens=tuple(remaining), best_priority_seen=best_priority_seen)


class WaitForecast:
    """Forecasts a newcomer's wait from a `LoadSnapshot`, by the scheduler's own chunk rules."""

    def __init__(self, config: EngineConfig, cost_model: Optional[StepCostPredictor],
                 target_s: Optional[float]) -> None:
        self.config = config
        self.cost_model = cost_model
        self.target_s = target_s
        self.by_priority = config.scheduling_policy == "priority"

    def predict(self, snap: LoadSnapshot, prompt_tokens: int, priority: int = 0) -> Optional[float]:
        """Seconds until a request of `prompt_tokens` arriving now would have its prompt computed.

        Under the priority policy only the waiting requests of `priority` or higher (lower
        numbers) are ahead of it: a backlog of lower priority does not lengthen its forecast.

        From the cost model: the prompts queued ahead and its own go at the prefill rate the
        latency target leaves next to the current decodes (the rules of
        `ChunkSizer.prefill_chunk`, the bound on a lower class's given-way steps included), after a sequence slot frees up (running requests assumed to
        run to max_tokens, an upper bound). None without a model. Safe to call from another
        thread: it reads only the snapshot, config and model.
        """
        model = self.cost_model
        if model is None:
            return None
        if self.by_priority:
            snap = snap.ahead_of(priority)
        budget = self.config.max_num_batched_tokens
        rows = snap.num_decoding
        decode = StepShape(rows, rows, rows * snap.mean_context)
        chunk = budget
        if rows and self.target_s is not None and \
                not prompts_outnumber_decodes(snap.num_prefilling, snap.num_waiting + 1, snap.free_seq_slots, rows):
            fitted = max_fitting(model, decode, self.target_s, budget, lambda k: StepShape.chunk(0, k, False))
            if fitted >= min(budget, self.config.min_prefill_chunk):
                chunk = fitted
        if chunk == budget and self.target_s is not None and self.by_priority and \
                snap.best_priority_seen is not None and priority > snap.best_priority_seen:
            limit = give_way_bound(model, self.target_s, self.config.min_prefill_chunk, decode)
            fitted = max_fitting(model, decode, limit, budget, lambda k: StepShape.chunk(0, k, False))
            chunk = max(fitted, min(budget, self.config.min_prefill_chunk))
        tokens = snap.queued_prefill_tokens + prompt_tokens
        chunk = max(1, min(chunk, tokens))  # a step carries no more prompt than there is
        step_s = model.predict(decode.plus(StepShape.chunk(0, chunk, False)))
        prefill_s = tokens / chunk * step_s
        short = snap.num_waiting + 1 - snap.free_seq_slots  # slots that must free up first
        slot_s = 0.0
        if short > 0 and snap.remaining_output_tokens:
            k = min(short, len(snap.remaining_output_tokens)) - 1
            full = self.config.max_num_seqs
            slot_s = snap.remaining_output_tokens[k] * model.predict(StepShape(full, full, full * snap.mean_context))
        return slot_s + prefill_s
