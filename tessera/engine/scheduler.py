"""Decides, every step, which requests run and how many tokens each computes.

There are no separate prefill and decode phases: each running request is
granted `num_new_tokens` (1 when decoding, a chunk when prefilling) within one
token budget and a sequence cap. Waiting requests are admitted first-come
first-served while blocks and budget allow. When a running request cannot get
a block, the most recently admitted request is preempted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tessera.config import EngineConfig
from tessera.engine.kv_cache_manager import KVCacheManager
from tessera.engine.request import Request, RequestStatus
from tessera.engine.stats import SchedulerStats


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def produces_token(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    preempted: list[str] = field(default_factory=list)
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- bookkeeping --------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting(self) -> int:
        return sum(1 for r in self.waiting if r.status != RequestStatus.SWAPPED)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Release everything the request holds; safe on any state."""
        if req.is_finished:
            return
        if req.status in (RequestStatus.RUNNING,):
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        req.metrics.finished_time = time.time()
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def stats(self) -> SchedulerStats:
        swapped = sum(1 for r in self.waiting if r.status == RequestStatus.SWAPPED)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) - swapped,
            num_swapped=swapped,
            kv_cache_usage=self.kv.usage(),
            num_blocks_total=self.kv.num_blocks,
            num_blocks_free=self.kv.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    # -- the decision -------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        pairs = None
        if self.config.preemption_mode == "swap" and victim.num_computed_tokens > 0:
            pairs = self.kv.swap_out(victim)
        if pairs is not None:
            out.swap_out.extend(pairs)
            victim.status = RequestStatus.SWAPPED
        else:  # recompute: drop the KV, keep the tokens
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        victim.metrics.preempted_times.append(time.time())
        self.num_preemptions += 1
        out.preempted.append(victim.request_id)
        self.waiting.appendleft(victim)

    def _chunk(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        return max(0, min(remaining, budget, self.max_model_len - req.num_computed_tokens))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        static = self.config.scheduler_policy == "static"
        scheduled_ids: set[str] = set()

        # 1. Running requests first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                if victim.request_id in scheduled_ids:
                    victim = req  # never undo work already granted this step
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                scheduled_ids.add(req.request_id)
                budget -= n
                i += 1
                continue
            # req itself was preempted; the list shifted, do not advance i

        # 2. Then waiting requests, first come first served.
        # Static batching admits a whole batch at once (its prompts are then computed
        # over the next steps within the budget) and nothing more until it has finished.
        admit = not out.preempted and (not static or not self.running)
        while admit and self.waiting and (budget > 0 or static) and \
                len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.wait_for is not None and not req.wait_for.is_finished and \
                    req.wait_for.num_computed_tokens < req.wait_for.num_prompt_tokens:
                break  # let the first sibling fill the prefix cache with the shared prompt
            if req.status == RequestStatus.SWAPPED:
                pairs = self.kv.swap_in(req)
                if pairs is None:
                    break
                out.swap_in.extend(pairs)
                n = self._chunk(req, budget)
                if n and not self.kv.allocate_slots(req, n):
                    # Could not grow after swap-in: run nothing new for it this step.
                    n = 0
            else:
                cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
                hit_tokens = len(cached) * self.kv.block_size
                n = min(req.num_tokens - hit_tokens, budget)
                if not self.kv.allocate_slots(req, n, cached):
                    break
                if req.status == RequestStatus.WAITING:
                    req.num_cached_tokens = hit_tokens
                    out.num_prefix_queries += req.num_prompt_tokens
                    out.num_prefix_hits += hit_tokens
                    self.kv.record_prefix_query(req.num_prompt_tokens, hit_tokens)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.time()
            self.running.append(req)
            if n > 0:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
        return out

    def update_after_step(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress, append sampled tokens, and finish requests that hit a limit.

        Returns the requests that received a token this step.
        """
        got_token = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_token(token)
            got_token.append(req)
            if token in req.stop_token_ids:
                req.stop_reason = token
                self.finish_request(req, RequestStatus.FINISHED_STOPPED)
            elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
                self.finish_request(req, RequestStatus.FINISHED_LENGTH)
        return got_token
