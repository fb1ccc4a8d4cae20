"""How many prompt tokens a step may carry, and how much room background work gets in it.

With a latency target (`target_itl_ms`) and a step-cost model, prefill chunks are sized so the
predicted step time stays under the target while decodes are running; with no decode running,
prefill uses the whole budget. The target gives way, and prompts take the whole budget, in two
cases (`StepState.unbounded`): when the decodes leave room for less than `min_prefill_chunk`
prompt tokens under it (the step is late for every stream whatever it carries, and a prompt
chunk makes the step run the modules instead of one C call, so fewer, larger chunks serve the
prompts at the matmuls' best rate and leave the other steps decode-only), and when more requests
wait for their first token than are decoding (the queue is then the larger latency: a
32-request burst waited behind 64-token chunks for up to 15 s; see docs/performance.md,
"Capacity and tuning").

Under the priority policy a prompt below the best class decoding in a step gets only what fits
under the target (it never makes the step give way), and so does a prompt below the class that
made the step give way (a newcomer of priority 0 giving way for its own prompt must not wait for
lower classes' prompts filling the budget). A class below the best one served so far gives way
only up to a bound (`ChunkSizer.give_way_limit`): such a step is what an arrival of the better
class waits for, and a whole budget of SmolLM2 prompts on one core is ~3.6 s. Background
requests (at or past `background_priority`) only fill the room the target leaves
(`ChunkSizer.background_limit`).

The scheduler keeps a `StepState` per schedule() call and asks a `ChunkSizer` for sizes; the
sizer reads the step, the request and the queues it is given, and changes only the step.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Optional

from tessera.config import EngineConfig
from tessera.engine.core.cost_model import StepCostPredictor, StepShape, max_fitting
from tessera.engine.core.request import Request
from tessera.engine.core.scheduler_output import ScheduledChunk

# In a gap (a step of background work alone), prompt chunks may take the step up to the latency
# target, or to this many times the predicted time of its decodes with one least prompt chunk
# where that is longer (a host slower than the target would otherwise start one background prompt
# a step).
BACKGROUND_GAP_GROWTH = 1.5
# A step where the target gives way for a class below the best served so far may take up to the
# latency target, or this many times the predicted time of its decodes with one least prompt
# chunk where that is longer: an arrival of the better class waits for about that step.
GIVE_WAY_GROWTH = 1.0


@dataclass
class StepState:
    """What one schedule() call has granted so far."""

    budget: int
    shape: StepShape = field(default_factory=StepShape)
    ids: set[str] = field(default_factory=set)
    has_decodes: bool = False
    num_decodes: int = 0
    has_prefill: bool = False
    # The predicted step time background work may fill up to (ChunkSizer.background_limit); None
    # until the other requests are granted, or without a latency target.
    background_limit: Optional[float] = None
    background_gap: bool = False  # nothing but background work in this step
    top_decode_priority: Optional[int] = None  # the best (lowest) priority among the step's decodes
    # Why prompt chunks take the whole budget, not the latency target's share (see prefill_chunk).
    unbounded: Optional[str] = None
    unbounded_priority: Optional[int] = None  # the class whose prompt the target gave way for
    # The predicted step time an unbounded step may reach (ChunkSizer.give_way_limit); None: the budget.
    unbounded_limit: Optional[float] = None

    def add(self, chunk: ScheduledChunk, n: int, priority: int) -> None:
        """Count a granted chunk of `n` tokens of a request of `priority` in the step."""
        self.ids.add(chunk.request_id)
        self.budget -= n
        shape = StepShape.chunk(chunk.start, n, chunk.samples)
        if chunk.num_spec_tokens:  # every position of a verified run is sampled
            shape = dataclasses.replace(shape, num_sampled=n)
        self.shape = self.shape.plus(shape)
        if chunk.is_decode:
            self.has_decodes = True
            self.num_decodes += 1
            if self.top_decode_priority is None or priority < self.top_decode_priority:
                self.top_decode_priority = priority
        else:
            self.has_prefill = True


def is_background(config: EngineConfig, req: Request) -> bool:
    """Whether `req` only fills the room other requests leave (see the module's docstring)."""
    return config.scheduling_policy == "priority" and req.priority >= config.background_priority


def give_way_bound(model: StepCostPredictor, target_s: float, min_prefill_chunk: int, shape: StepShape) -> float:
    """The predicted time a step of `shape` (its decodes) may reach when the target gives way for
    a class below the best served (see GIVE_WAY_GROWTH); the wait forecast applies it too."""
    least = shape.plus(StepShape.chunk(0, min_prefill_chunk, False))
    return max(target_s, GIVE_WAY_GROWTH * model.predict(least))


def prompts_outnumber_decodes(num_prefilling: int, num_waiting: int, free_slots: int, num_decoding: int) -> bool:
    """The queue rule of `ChunkSizer.queue_outnumbers_decodes`, in plain counts (the forecast
    applies it too): running prompts plus the waiting requests a free slot would admit, against
    the decoding rows."""
    return num_prefilling + min(num_waiting, free_slots) > num_decoding


class ChunkSizer:
    """Prompt chunk sizes under the latency target, and the room background work may fill."""

    def __init__(self, config: EngineConfig, cost_model: Optional[StepCostPredictor]) -> None:
        self.config = config
        self.cost_model = cost_model
        # Latency targeting needs both a target and a model to predict against.
        self.target_s: Optional[float] = config.target_itl_ms / 1000 \
            if config.target_itl_ms and cost_model is not None else None
        self.by_priority = config.scheduling_policy == "priority"
        # The best (lowest) priority of any non-background request seen: an arrival of that class
        # waits for the step in flight, so steps given way for lower classes are bounded.
        self.best_priority_seen: Optional[int] = None

    def saw(self, req: Request) -> None:
        """Note a newcomer's class (see best_priority_seen)."""
        if self.by_priority and not is_background(self.config, req) and (
                self.best_priority_seen is None or req.priority < self.best_priority_seen):
            self.best_priority_seen = req.priority

    def give_way_limit(self, step: StepState, priority: int) -> Optional[float]:
        """The predicted time a step given way for a prompt of `priority` may reach: None (the
        whole budget) for the best class seen, else the larger of the target and GIVE_WAY_GROWTH
        times the step's decodes with one least chunk (prompts must not crawl either)."""
        if not self.by_priority or self.best_priority_seen is None or priority <= self.best_priority_seen:
            return None
        assert self.cost_model is not None and self.target_s is not None
        return give_way_bound(self.cost_model, self.target_s, self.config.min_prefill_chunk, step.shape)

    def prefill_chunk(self, req: Request, start: int, cap: int, step: StepState) -> int:
        """Tokens of `req`'s prompt (from position `start`) to compute this step, at most `cap`.

        Under a latency target with decodes in the step: the most that keeps the predicted
        step time under the target. Where the target leaves the step's first prefill less
        than `min_prefill_chunk` tokens, a chunk would either crawl (a token or a few a step)
        or overshoot the target on every step; the step becomes unbounded instead and its
        prompts take the whole budget: the prompts are computed at the matmuls' best rate in
        a few late steps, and the steps between them stay decode-only (a prompt chunk of any
        size makes a step of decodes run the modules instead of one C call: at 32 SmolLM2
        streams, 64-token chunks past the target kept nearly every step mixed, ~125 ms, where
        decode-only steps take ~60 ms). A step without decodes is unbounded from its first prompt.
        Under the priority policy the first prompt's class sets the bound (`give_way_limit`) and
        lower classes' prompts get only what fits under the target.
        """
        if cap <= 0 or self.target_s is None:
            return max(cap, 0)
        # Under the priority policy a prompt below the step's best decoding class never makes the
        # step unbounded, nor joins one: the higher class's inter-token latency is not its to spend;
        # nor does a prompt below the class the step gave way for, or the first prompt of a step
        # without decodes: a first token is not kept waiting by lower classes' prompts.
        lower = self.by_priority and any(p is not None and req.priority > p
                                         for p in (step.top_decode_priority, step.unbounded_priority))
        assert self.cost_model is not None
        total = req.num_tokens

        def fitting(limit: float) -> int:
            return max_fitting(self.cost_model, step.shape, limit, cap,
                               lambda k: StepShape.chunk(start, k, start + k == total))

        def give_way(reason: Optional[str]) -> int:
            """The step's first prompt takes the budget, or what the bound on its class allows
            (at least a least chunk: prompts must not crawl)."""
            step.unbounded, step.unbounded_priority = reason, req.priority
            step.unbounded_limit = self.give_way_limit(step, req.priority)
            if step.unbounded_limit is None:
                return cap
            return max(fitting(step.unbounded_limit), min(cap, self.config.min_prefill_chunk))

        if not step.has_decodes and not step.has_prefill:  # a step of prompts alone
            return give_way(None)
        if (step.unbounded is not None or not step.has_decodes) and not lower:
            if step.unbounded_priority is None:  # given way by the queue rule, before any prompt
                return give_way(step.unbounded)
            return cap if step.unbounded_limit is None else fitting(step.unbounded_limit)
        n = fitting(self.target_s)
        if not step.has_prefill and not lower and n < min(cap, self.config.min_prefill_chunk):
            return give_way("past_target")
        return n

    def background_limit(self, step: StepState, waiting: Collection[Request]) -> Optional[float]:
        """The predicted step time background work may fill up to, once everything else is
        granted; None without a latency target (background work then only goes last). A step
        carrying other requests may grow by `--background-step-slack` of its time (never past the
        target); with other requests `waiting` that could not be admitted, by nothing. A step of
        background work alone (a gap: `step.background_gap`) runs every background decode and
        fills the rest with prompt chunks up to the target (or BACKGROUND_GAP_GROWTH times the
        decodes and a least chunk, set once the decodes are granted: `gap_limit`), never the
        whole budget: a request arriving meanwhile waits for about that step before its prompt
        starts."""
        if self.target_s is None:
            return None
        assert self.cost_model is not None
        if any(not is_background(self.config, r) for r in waiting):
            return 0.0
        if step.ids:
            return min(self.target_s, self.cost_model.predict(step.shape) * (1 + self.config.background_step_slack))
        step.background_gap = True
        return self.target_s

    def gap_limit(self, step: StepState) -> None:
        """In a gap, once its decodes are granted: the room for prompt chunks (see background_limit)."""
        if step.background_gap:
            assert self.cost_model is not None and self.target_s is not None
            least = step.shape.plus(StepShape.chunk(0, self.config.min_prefill_chunk, False))
            step.background_limit = max(self.target_s, BACKGROUND_GAP_GROWTH * self.cost_model.predict(least))

    def prompt_chunk(self, req: Request, start: int, cap: int, step: StepState) -> int:
        """`prefill_chunk`, or for background work under a limit the largest chunk within it (in a
        gap, the first prompt chunk is at least `min_prefill_chunk`, as `prefill_chunk` gives
        way to the budget where the target leaves less: prompts must not crawl)."""
        if step.background_limit is None or not is_background(self.config, req):
            return self.prefill_chunk(req, start, cap, step)
        assert self.cost_model is not None
        total = req.num_tokens
        n = max_fitting(self.cost_model, step.shape, step.background_limit, cap,
                        lambda k: StepShape.chunk(start, k, start + k == total))
        if step.background_gap and not step.has_prefill:
            n = max(n, min(cap, self.config.min_prefill_chunk))
        return n

    def background_decode_fits(self, req: Request, step: StepState) -> bool:
        """Whether a background decode fits the room left; in a gap every one does (decode rows
        cost least, and a model predicting more than the limit for any step must not stall them)."""
        limit = step.background_limit
        if limit is None or not is_background(self.config, req) or step.background_gap:
            return True
        assert self.cost_model is not None
        return self.cost_model.predict(step.shape.plus(StepShape.chunk(req.num_computed_tokens, 1, True))) <= limit

    def background_pooling_fits(self, req: Request, n: int, step: StepState) -> bool:
        """Whether a background embedding prompt of `n` tokens fits the room left (or a step of
        its own); anything else always does."""
        limit = step.background_limit
        return not (limit is not None and is_background(self.config, req) and (step.ids or limit == 0) and
                    self.cost_model is not None and
                    self.cost_model.predict(step.shape.plus(StepShape.chunk(0, n, False))) > limit)

    def queue_outnumbers_decodes(self, step: StepState, running: list[Request], waiting: Collection[Request]) -> bool:
        """Whether more requests wait for prompt work (running prompts, and waiting requests a
        free sequence slot would admit) than the step decodes. A step's delay then costs fewer
        streams than a faster prefill saves, so the latency target gives way to the budget: a
        burst of 32 requests otherwise waited behind small chunks sized for the first few."""
        if self.by_priority:  # only the prompt work of the best decoding class and above
            top = step.top_decode_priority if step.top_decode_priority is not None else self.config.background_priority
            prefilling = sum(1 for r in running if r.request_id not in step.ids and r.priority <= top
                             and not is_background(self.config, r))
            num_waiting = sum(1 for r in waiting if r.priority <= top and not is_background(self.config, r))
        else:
            prefilling = sum(1 for r in running if r.request_id not in step.ids)
            num_waiting = len(waiting)
        slots = max(0, self.config.max_num_seqs - len(running))
        return prompts_outnumber_decodes(prefilling, num_waiting, slots, step.num_decodes)
