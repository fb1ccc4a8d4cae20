"""Decides, every step, which requests run and how many tokens each computes.

There are no separate prefill and decode phases: each running request is
granted `num_new_tokens` (1 when decoding, a chunk when prefilling) within one
token budget and a sequence cap. Decodes are scheduled first, so they are never
starved. With a latency target (`target_itl_ms`) and a step-cost model, prefill
chunks are then sized so the predicted step time stays under the target
(`chunk_sizing.py`, which says when the target gives way). Waiting requests are admitted
first-come first-served while blocks, budget and the target allow; a newcomer's whole
prompt must fit beside what the running requests' prompts still need (`_prompt_fits`),
so admitting it does not preempt them later. When a running request cannot get a block
(decode growth), the most recently admitted request is preempted.

Under `--scheduling-policy priority` (vLLM's policy: lower `priority` first) the waiting queue
is kept in priority order (first come first served within a class), running requests are
granted tokens in that order, the preemption victim is the lowest-priority, most recently
admitted request, and a waiting request that finds no sequence slot or no room for its prompt
preempts running requests of lower priority; a prompt below the best class decoding in a step
gets only what fits under the target (it never makes the step give way), so a lower class does
not spend a higher one's inter-token latency. Requests at or past `background_priority` (the
Batch API's) are background work: they are scheduled after everything else in a step and only
into the room the latency target leaves (`ChunkSizer.background_limit`), so they fill the gaps of
interactive traffic without slowing it.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Optional

from tessera.config import EngineConfig
from tessera.engine.core.chunk_sizing import ChunkSizer, StepState, is_background
from tessera.engine.core.cost_model import StepCostPredictor, StepShape
from tessera.engine.core.kv_cache_manager import NO_HIT, KVCacheManager, PrefixHit
from tessera.engine.core.queue_stats import WaitForecast, load_snapshot, scheduler_stats
from tessera.engine.core.request import Request, RequestStatus
from tessera.engine.core.scheduler_output import GrammarBitmask, Proposal, SchedulerOutput, make_chunk
from tessera.engine.core.spec_acceptance import AcceptanceModel
from tessera.engine.stats import LoadSnapshot, SchedulerStats

if TYPE_CHECKING:
    from tessera.engine.core.structured_output import StructuredOutputManager


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int,
                 cost_model: Optional[StepCostPredictor] = None,
                 structured: Optional["StructuredOutputManager"] = None,
                 acceptance: Optional[AcceptanceModel] = None) -> None:
        """`structured`: fills the step's grammar masks from the requests' grammar states.
        `acceptance`: where verified runs are counted when draft lengths adapt to them."""
        self.config = config
        self.structured = structured
        self.acceptance = acceptance
        self.kv = kv
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self.sizing = ChunkSizer(config, cost_model)
        self.target_s = self.sizing.target_s  # None without a target or a model to predict against
        self.by_priority = self.sizing.by_priority
        self.forecast = WaitForecast(config, cost_model, self.target_s)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []  # since the last schedule(), for the runner to forget
        # LoRA adapters whose weights are in memory (set by the engine before each step): a request
        # for another waits, as does one that would bring more than max_loras adapters into a step.
        self.lora_ready: frozenset[str] = frozenset()

    # -- bookkeeping --------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.sizing.saw(req)
        self._enqueue(req, front=False)

    def _enqueue(self, req: Request, front: bool) -> None:
        """Into the waiting queue: at the back (a newcomer) or the front (a preempted request) of
        its priority class under the priority policy, of the whole queue under fcfs."""
        if not self.by_priority:
            (self.waiting.appendleft if front else self.waiting.append)(req)
            return
        if not front and (not self.waiting or self.waiting[-1].priority <= req.priority):
            self.waiting.append(req)
            return
        for i, other in enumerate(self.waiting):
            if other.priority > req.priority or (front and other.priority == req.priority):
                self.waiting.insert(i, req)
                return
        self.waiting.append(req)

    def is_background(self, req: Request) -> bool:
        """Whether `req` only fills the room other requests leave (see the module's docstring)."""
        return is_background(self.config, req)

    def set_proposals(self, proposals: dict[str, Proposal]) -> None:
        """Take a proposer's answer for the coming step: each running request verifies its own
        proposal, if any, and none left from an earlier step (the proposer sees plain inputs and
        returns plain data; only the scheduler writes its requests). A withheld proposal (no
        tokens) counts toward the request's next re-probe."""
        for req in self.running:
            p = proposals.get(req.request_id)
            req.spec_token_ids = list(p.token_ids) if p is not None else []
            req.spec_draft_probs = p.draft_probs if p is not None else None
            if p is None:
                continue
            est = req.spec_acceptance
            if p.token_ids:
                est.off_steps, est.match_len = 0, p.match_len
            else:
                est.off_steps += 1

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
        self._finished_ids.append(req.request_id)
        self.requests.pop(req.request_id, None)

    def stats(self) -> SchedulerStats:
        return scheduler_stats(self.running, self.waiting, self.kv, self.num_preemptions)

    def _lora_admissible(self, req: Request, adapters: set[str]) -> bool:
        """Whether `req`'s adapter may run now: loaded, and among the running requests' adapters
        or with a slot free for it (`adapters`: the running requests' adapters)."""
        name = req.lora_name
        return name is None or (name in self.lora_ready and
                                (name in adapters or len(adapters) < self.config.max_loras))

    # -- admission forecast ----------------------------------------------------
    def load_snapshot(self) -> LoadSnapshot:
        """Plain numbers describing the queue, published each step for predict_wait()."""
        return load_snapshot(self.running, self.waiting, self.config.max_num_seqs, self.sizing.best_priority_seen)

    def predict_wait(self, snap: LoadSnapshot, prompt_tokens: int, priority: int = 0) -> Optional[float]:
        """Seconds until a request of `prompt_tokens` arriving now would have its prompt computed
        (`WaitForecast.predict`; None without a cost model). Safe to call from another thread."""
        return self.forecast.predict(snap, prompt_tokens, priority)

    # -- the decision -------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        victim.clear_speculation()
        victim.history_sent = False  # the runner forgets it now and is sent it again on resuming
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
        self._enqueue(victim, front=True)

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Under the priority policy: while the first waiting request finds no sequence slot or
        no room for its prompt, preempt the lowest-priority running request below its priority.
        Done before anything is granted, so no granted work is undone."""
        if not self.by_priority or not self.waiting:
            return
        head = self.waiting[0]
        while self.running and self.running[-1].priority > head.priority and (
                len(self.running) >= self.config.max_num_seqs or not self._prompt_fits(head, NO_HIT)):
            self._preempt(self.running[-1], out)

    def _chunk(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        return max(0, min(remaining, budget, self.max_model_len - req.num_computed_tokens))

    def _grant(self, req: Request, n: int, out: SchedulerOutput, step: StepState, num_spec: int = 0) -> None:
        chunk = make_chunk(req, n, self.kv.block_tables(req.request_id), num_spec, with_history=not req.history_sent,
                           state_slot=self.kv.state_slot(req.request_id))
        req.history_sent = req.history_sent or chunk.sampling.history is not None
        out.scheduled.append(chunk)
        step.add(chunk, n, req.priority)

    def _num_spec(self, req: Request, budget: int) -> int:
        """How many of the request's proposals this step can verify: budget, context and
        max_tokens bound them (a proposal past max_tokens could never be emitted)."""
        if not req.spec_token_ids or not req.output_token_ids:  # proposals verify decodes only
            return 0
        room = min(budget - 1, self.max_model_len - req.num_tokens,
                   req.max_tokens - req.num_output_tokens - 1)
        return max(0, min(len(req.spec_token_ids), room))

    def _schedule_running(self, out: SchedulerOutput, step: StepState, decodes: bool,
                          background: bool = False, max_priority: Optional[int] = None) -> None:
        """Grant running requests their next tokens; `decodes` selects the one-token rows,
        `background` the background requests (scheduled after the others), `max_priority` only
        the classes at or above it."""
        for req in list(self.running):
            if step.budget <= 0:
                return
            if req.status != RequestStatus.RUNNING or req.request_id in step.ids:
                continue  # preempted earlier in this step, or already granted
            if self.is_background(req) != background or (max_priority is not None and req.priority > max_priority):
                continue
            is_decode = req.num_tokens - req.num_computed_tokens == 1
            if is_decode != decodes:
                continue
            cap = self._chunk(req, step.budget)
            # A prompt's last token (after a recompute or a prefix hit) is a prefill under the
            # latency target, like any prompt chunk, even though it runs with the decodes.
            is_prompt_tail = not req.output_token_ids
            if decodes and not is_prompt_tail:
                n = cap if self.sizing.background_decode_fits(req, step) else 0
            else:
                n = self.sizing.prompt_chunk(req, req.num_computed_tokens, cap, step)
                n = self.kv.clip_to_snapshot(req, req.num_computed_tokens, n)
                # A chunk takes blocks in every group, sliding ones included, until the window
                # moves past it: shrink it to the free blocks rather than preempt a running
                # request for it; only a prompt that cannot move at all preempts.
                n = self.kv.fitting_tokens(req, n) or n
            if n == 0:
                continue
            num_spec = self._num_spec(req, step.budget) if decodes and not background else 0
            n += num_spec
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                if victim.request_id in step.ids:
                    victim = req  # never undo work already granted this step
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._grant(req, n, out, step, num_spec)

    def _admit_pooling(self, req: Request, step: StepState) -> int:
        """Tokens to grant a waiting embedding request now: its whole prompt or nothing (0). A
        pooling prompt is never chunked, since an encoder's attention sees the whole input at once
        and pooling reads every hidden state; the input processor bounds it by the token budget.
        It takes no prefix-cache hits (pooling needs every token's hidden state) and ignores the
        latency target (it cannot shrink), so it waits only for budget and blocks."""
        n = req.num_tokens
        if n > step.budget or not self._prompt_fits(req, NO_HIT) or self.kv.fitting_tokens(req, n) < n:
            return 0
        if not self.sizing.background_pooling_fits(req, n, step):
            return 0  # background: only into the room left (or into a step of its own)
        return n if self.kv.allocate_slots(req, n) else 0

    def _finish_need(self, req: Request, cached: PrefixHit = NO_HIT) -> int:
        """Pool blocks `req` still has to take to keep its prompt (all its known tokens) and the
        next token."""
        return self.kv.blocks_to_reach(req, min(req.num_tokens + 1, self.max_model_len), cached)

    def _prompt_fits(self, req: Request, cached: PrefixHit) -> bool:
        """Admission that reserves the running requests' prompts: a newcomer is admitted only if
        its whole prompt fits in the free blocks left once every running request has finished its
        own. Without it a long prompt is admitted on its first chunk alone, its later chunks take
        blocks from requests that were already computed, and each recompute preemption costs a
        whole prompt again: Gemma 3's windowed layers left room to start three 2,000-token prompts
        that did not fit together (42 preemptions, 2.1x the time of a plain cache;
        docs/models.md, "Sliding-window layers"). Sliding groups count their window here; a step's chunk, which they
        hold until the window moves on, is fitted to the free blocks when it is scheduled. Decode
        growth is not reserved (a block every block_size tokens; preemption handles it, as in
        vLLM); with nothing running, a request is always admitted."""
        if not self.running:
            return True
        reserved = sum(self._finish_need(r) for r in self.running)
        return self._finish_need(req, cached) <= self.kv.num_free_blocks - reserved

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished_ids, state_copies=self.kv.take_state_copies())
        self._finished_ids = []
        step = StepState(budget=self.config.max_num_batched_tokens)
        if self.by_priority:  # stable: admission order within a class; the last is the first victim
            self.running.sort(key=lambda r: r.priority)
        self._preempt_for_waiting(out)
        priority_preempted = len(out.preempted)

        # 1. Running requests: decodes first (never starved), then prompts in progress.
        self._schedule_running(out, step, decodes=True)
        if step.unbounded is None and self.target_s is not None and self.sizing.queue_outnumbers_decodes(step, self.running, self.waiting):
            step.unbounded = "queue"
        # Under the priority policy, the prompts of classes below the first waiting request's go
        # after its admission: a newcomer of a higher class is not left the crumbs of the step.
        head = self.waiting[0].priority if self.by_priority and self.waiting else None
        self._schedule_running(out, step, decodes=False, max_priority=head)

        # 2. Then waiting requests, in order (first come first served, within a priority class),
        # unless a running request was preempted for blocks this step.
        admit = len(out.preempted) == priority_preempted
        if admit:
            self._admit_waiting(out, step, background=False)
        if head is not None:
            self._schedule_running(out, step, decodes=False)
        # 3. Background work, into the room left.
        if self.by_priority:
            step.background_limit = self.sizing.background_limit(step, self.waiting)
            self._schedule_running(out, step, decodes=True, background=True)
            self.sizing.gap_limit(step)
            self._schedule_running(out, step, decodes=False, background=True)
            if admit:
                self._admit_waiting(out, step, background=True)
        out.shape = step.shape
        out.prefill_unbounded = step.unbounded if step.has_prefill and step.has_decodes else None
        if self.cost_model is not None and out.scheduled:
            out.predicted_s = self.cost_model.predict(step.shape)
        out.grammar = self._grammar_bitmask(out)
        return out

    def _admit_waiting(self, out: SchedulerOutput, step: StepState, background: bool) -> None:
        """Admit waiting requests from the head of the queue while blocks, budget, sequence slots
        and the latency target allow; `background`: the background ones (the others first).
        Static batching admits a whole batch at once (its prompts are then computed over the next
        steps within the budget) and nothing more until it has finished."""
        static = self.config.scheduler_policy == "static"
        if static and self.running:
            return
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        passed: list[Request] = []  # waiting for their adapter: later requests go ahead of them
        try:
            self._admit_from_head(out, step, background, static, adapters, passed)
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit_from_head(self, out: SchedulerOutput, step: StepState, background: bool, static: bool,
                         adapters: set[str], passed: list[Request]) -> None:
        while self.waiting and (step.budget > 0 or static) and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.is_background(req) != background:
                break  # background work waits behind everything else
            if not self.kv.can_hold_state(req):
                break  # a model with recurrent layers: no state slot free for it (engine/core/state_slots.py)
            if not self._lora_admissible(req, adapters):
                passed.append(self.waiting.popleft())
                continue
            if req.wait_for is not None and not req.wait_for.is_finished and \
                    req.wait_for.num_computed_tokens < req.wait_for.num_prompt_tokens:
                break  # let the first sibling fill the prefix cache with the shared prompt
            if req.pooling is not None:
                n = self._admit_pooling(req, step)
                if n == 0:
                    break
            elif req.status == RequestStatus.SWAPPED:
                pairs = self.kv.swap_in(req)
                if pairs is None:
                    break
                out.swap_in.extend(pairs)
                n = self.sizing.prompt_chunk(req, req.num_computed_tokens, self._chunk(req, step.budget), step)
                if n and not self.kv.allocate_slots(req, n):
                    # Could not grow after swap-in: run nothing new for it this step.
                    n = 0
            else:
                cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else NO_HIT
                loaded = self.kv.find_offloaded(req, cached.num_blocks) if req.num_computed_tokens == 0 else []
                hit_tokens = (cached.num_blocks + len(loaded)) * self.kv.block_size
                start = req.num_computed_tokens + hit_tokens
                n = self.sizing.prompt_chunk(req, start, min(req.num_tokens - start, step.budget), step)
                n = self.kv.clip_to_snapshot(req, start, n)
                if n == 0 and not static:
                    break  # the step is full under the latency target; admit next step
                if not static:
                    if not self._prompt_fits(req, cached):
                        break  # its prompt would preempt a running one before it finished
                    n = self.kv.fitting_tokens(req, n, cached, len(loaded))  # its first chunk, as above
                    if n == 0:
                        break
                if not self.kv.allocate_slots(req, n, cached, [h for h, _ in loaded]):
                    break
                req.num_computed_tokens = start
                restore = self.kv.state_restore(req, cached)
                if restore is not None:  # the hit's state, into the request's slot before the step
                    out.state_copies.append(restore)
                if loaded:  # the runner fills these blocks from the disk tier before the step
                    ids = self.kv.block_tables(req.request_id)[0][cached.num_blocks:cached.num_blocks + len(loaded)]
                    out.kv_loads.extend(zip(ids, (payload for _, payload in loaded)))
                    out.kv_loaded_shape = out.kv_loaded_shape.plus(StepShape.chunk(
                        cached.num_blocks * self.kv.block_size, len(loaded) * self.kv.block_size, False))
                    self.kv.offload_hits += len(loaded) * self.kv.block_size
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
            if req.lora_name is not None:
                adapters.add(req.lora_name)
            if n > 0:
                self._grant(req, n, out, step)

    def _grammar_bitmask(self, out: SchedulerOutput) -> Optional[GrammarBitmask]:
        """The masks of the step's constrained sampled rows (proposals included), from the grammar
        states the scheduler keeps: the runner gets a bitmask, never a grammar state."""
        rows = []
        for s in out.scheduled:
            grammar = self.requests[s.request_id].grammar
            if s.samples and grammar is not None:
                rows.append((s.request_id, grammar, s.proposal))
        if not rows or self.structured is None:
            return None
        return self.structured.fill_bitmask(rows)

    def update_after_step(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Advance progress, append sampled tokens, and finish requests that hit a limit.

        `sampled` maps a request to the tokens the step emitted for it: one, or, for a verified
        run of proposals, the accepted ones and the target's next. Returns the tokens actually
        appended (a run stops at a stop token or a length limit).
        """
        if out.grammar is not None:
            out.grammar.wait()  # the grammar thread is done with the states before they advance
        appended: dict[str, list[int]] = {}
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.is_finished:
                continue
            if s.pooling is not None:  # computed and pooled in this step: done, its blocks freed
                req.num_computed_tokens += s.num_new_tokens
                self.finish_request(req, RequestStatus.FINISHED_STOPPED)
                continue
            req.clear_speculation()
            if req.num_output_tokens == 0:  # a step of its prompt: what its first token waits for
                req.metrics.prompt_steps += 1
                req.metrics.prompt_step_tokens += out.shape.num_tokens
            tokens = sampled.get(req.request_id) or []
            if s.num_spec_tokens and self.acceptance is not None and tokens:
                # A verified run emits its accepted proposals and the target's next token.
                self.acceptance.observe(req.spec_acceptance, s.num_spec_tokens, len(tokens) - 1)
            kept, reason = tokens, None
            for i, token in enumerate(tokens):  # a run ends at its first stop token or length limit
                if token in req.stop_token_ids:
                    kept, reason = tokens[:i + 1], RequestStatus.FINISHED_STOPPED
                    break
                if req.num_output_tokens + i + 1 >= req.max_tokens or req.num_tokens + i + 1 >= self.max_model_len:
                    kept, reason = tokens[:i + 1], RequestStatus.FINISHED_LENGTH
                    break
            # A verified run leaves valid K/V up to its last kept proposal: as many positions as
            # tokens kept (the run's first input was already-known); rejected slots are past it.
            req.num_computed_tokens += len(kept) if s.num_spec_tokens else s.num_new_tokens - s.num_spec_tokens
            for token in kept:
                req.append_token(token)
            if req.grammar is not None and kept:  # the runner's masks came from it: it takes what they allowed
                req.grammar.advance(kept)
            if s.num_spec_tokens:
                self.kv.release_tail(req, req.num_tokens)
            self.kv.cache_full_blocks(req)  # before finishing, so a finished request's blocks stay findable
            self.kv.free_out_of_window(req)
            if kept:
                appended[req.request_id] = kept
            if reason == RequestStatus.FINISHED_STOPPED:
                req.stop_reason = kept[-1]
            if reason is not None:
                self.finish_request(req, reason)
        return appended
