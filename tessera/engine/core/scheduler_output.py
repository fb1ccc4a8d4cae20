"""What the scheduler hands the model runner each step: plain data, no live requests.

A `ScheduledChunk` is one request's work in a step (the tokens to feed, where they
start, the block tables to address, what to sample with); `SchedulerOutput` is the
step's chunks with the block copies to make first. The runner reads nothing else, so
a runner is a new file (another device, another process) rather than an edit of the
scheduler or the engine, and the request objects the scheduler mutates stay on its side.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from tessera.engine.core.cost_model import StepShape
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import SamplingParams
from tessera.vision import ImageInput

if TYPE_CHECKING:
    from tessera.engine.core.request import Request


@dataclass
class Proposal:
    """Guessed tokens for one request, as a proposer hands them to the scheduler (which puts
    them in the request's next chunk); `draft_probs` [len, vocab] is the distribution each was
    drawn from (rejection sampling needs it), None when they were fixed (lookup or greedy).
    `match_len`: how many tokens of the context a lookup matched to find them (0: not a lookup);
    a longer match is accepted more often. No tokens: the proposer had some, but verifying
    them would not pay this step (`spec_acceptance.py`)."""

    token_ids: list[int]
    draft_probs: Optional[torch.Tensor] = None
    match_len: int = 0


@dataclass
class TokenHistory:
    """A request's tokens so far (copies), sent once so the runner keeps its own for penalties."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplingInputs:
    """What sampling a request's next token reads: its parameters and its own generator when it
    is seeded. Penalties read the request's tokens, which the runner keeps
    (engine/worker/penalty_history.py): `history` brings them in the first chunk after the
    request's admission or preemption, None otherwise and without penalties."""

    params: SamplingParams
    generator: Optional[torch.Generator] = None
    history: Optional[TokenHistory] = None


@dataclass
class ScheduledChunk:
    """One request's tokens in a step.

    `token_ids` are fed at positions `start`, `start + 1`, ...: a prompt chunk, one decode
    token, or a decode token followed by `num_spec_tokens` proposals to verify (a run).
    """

    request_id: str
    token_ids: list[int]
    start: int  # tokens of the request already in the cache (its num_computed_tokens)
    block_tables: list[list[int]]  # one per group of layers (the KV manager's, read-only here)
    sampling: SamplingInputs
    samples: bool = False  # the chunk reaches the end of the known tokens, so a token is sampled
    is_decode: bool = False  # continues a generation (one known token) rather than computing a prompt
    num_spec_tokens: int = 0
    draft_probs: Optional[torch.Tensor] = None  # [num_spec_tokens, vocab] q the proposals were drawn from
    # An embedding request's whole prompt: the runner pools its hidden states instead of sampling.
    pooling: Optional[PoolingParams] = None
    lora_name: Optional[str] = None  # the LoRA adapter its rows run through (None: the base)
    # The request's images whose placeholder runs overlap these tokens (by reference: the runner
    # reads their pixels only when it has no encoder output for them yet).
    images: list[ImageInput] = field(default_factory=list)
    # Models with recurrent layers: the request's index in each such layer's state tensor (the
    # runner's); its state carries over from the request's earlier chunks unless `start` is 0.
    state_slot: Optional[int] = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def proposal(self) -> list[int]:
        return self.token_ids[1:] if self.num_spec_tokens else []


@dataclass
class GrammarBitmask:
    """The step's structured-output masks, filled by the scheduler from its grammar states
    (engine/core/structured_output.py) so the runner needs none: bit t of a row set means token
    t is allowed there. A request's rows start at `rows[request_id]`: one for a sampled token,
    or one per position of a verified run (its proposals + 1), in order."""

    bitmask: torch.Tensor  # int32 [rows, ceil(vocab / 32)], on the host
    rows: dict[str, int]
    fill_s: float = 0.0  # seconds the scheduler's grammar thread spent filling it
    # While the scheduler's grammar thread still fills `bitmask` (alongside the forward pass);
    # whoever reads the bits calls `wait()` first (a runner elsewhere would be sent it after).
    pending: Optional[Future] = None

    def wait(self) -> "GrammarBitmask":
        if self.pending is not None:
            self.fill_s = self.pending.result()
            self.pending = None
        return self


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)  # (device block, disk tier payload)
    # Recurrent layers' states to copy before the step, in order, as (source row, destination row)
    # of every state tensor: states saved into snapshot rows, then snapshots restored into slots.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    kv_loaded_shape: StepShape = field(default_factory=StepShape)  # the prefill those loads replace
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # since the last step: the runner forgets them
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    shape: StepShape = field(default_factory=StepShape)  # the step's work, for the cost model
    predicted_s: Optional[float] = None  # the cost model's prediction for it, if there is a model
    # Why the step's prompt chunks took the whole budget instead of the latency target's share:
    # "past_target" (the decodes left no room under it) or "queue" (more requests waited for
    # prompt work than decoded); None when the target sized them or there was none.
    prefill_unbounded: Optional[str] = None
    grammar: Optional[GrammarBitmask] = None  # masks for the constrained rows, if any

    @property
    def total_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def make_chunk(req: "Request", n: int, block_tables: list[list[int]], num_spec: int = 0,
               with_history: bool = False, state_slot: Optional[int] = None) -> ScheduledChunk:
    """The runner's view of `n` tokens of `req` from its computed ones (`num_spec` of them its
    proposals): plain data copied off the request, so the runner never reads the request.
    `with_history`: send the request's tokens for its penalties (if it has any), which the
    runner then keeps."""
    start = req.num_computed_tokens
    if num_spec:
        token_ids = req.all_token_ids[start:start + 1] + req.spec_token_ids[:num_spec]
    else:
        token_ids = req.all_token_ids[start:start + n]
    params = req.params
    history = TokenHistory(list(req.prompt_token_ids), list(req.output_token_ids)) \
        if with_history and params.has_penalties else None
    sampling = SamplingInputs(params, req.generator, history)
    q = req.spec_draft_probs
    return ScheduledChunk(
        request_id=req.request_id, token_ids=token_ids, start=start, block_tables=block_tables,
        sampling=sampling, samples=start + n - num_spec == req.num_tokens and req.pooling is None,
        is_decode=n - num_spec == 1 and bool(req.output_token_ids) and start == req.num_tokens - 1,
        num_spec_tokens=num_spec, draft_probs=q[:num_spec] if num_spec and q is not None else None,
        pooling=req.pooling, lora_name=req.lora_name, state_slot=state_slot,
        images=[im for im in req.images if im.overlaps(start, start + len(token_ids))] if req.images else [])
