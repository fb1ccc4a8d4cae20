"""Speculative decoding: proposers guess the next tokens, the target verifies them in one step.

A decoding request normally computes one token per step, and on a CPU at small batch that
step costs about as much as reading all the weights once. Verifying k guessed tokens costs
one step with k+1 query rows (the same weight reads), so every accepted guess is a token for
free. The guesses come from a `Proposer`; the scheduler feeds the request's last token and
its proposals through the model as one run, the sampler keeps the accepted prefix
(`Sampler.speculative`, which preserves the target's distribution exactly), and the KV slots
of rejected proposals are released (`KVCacheManager.release_tail`).

Three proposers:
- `NgramProposer`: prompt lookup over the request's own tokens; free, strong on copy-heavy text.
- `DraftModelProposer`: a smaller model with the same tokenizer runs k autoregressive steps.
  Its KV cache has the target's block layout and uses the target's block ids, so a request's
  block table addresses both; it catches up lazily (only tokens it has not seen, and none at
  all while speculation is off, so a full server never runs it).
- `LayerSkipProposer`: self-speculation, the target's own first layers (or any listed subset)
  and its own head draft; it reads the target's cache for the context and writes only slots
  the verification step rewrites, so it needs no memory and no catch-up.

At large batch a step is compute-bound and verification rows are no longer free, so
`SpeculationPolicy` shrinks k as the running batch grows and turns speculation off above a
threshold or while requests wait: verification rows stop being free once a step is compute-bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol, Sequence

import numpy as np
import torch

from tessera.attention import AttentionBackend
from tessera.attention.kv_groups import KVCacheGroups
from tessera.config import SpeculativeConfig
from tessera.engine.core.kv_cache_manager import KVCacheManager
from tessera.engine.core.request import Request
from tessera.engine.core.scheduler_output import Proposal
from tessera.engine.worker.model_executor import ModelExecutor
from tessera.engine.worker.sampler import Sampler
from tessera.models.base import CausalLM
from tessera.sampling_params import SamplingParams

@dataclass
class DraftInput:
    """What a proposer reads of one decoding request. Plain data, so a proposer never holds or
    writes a `Request`: its answer goes back to the scheduler, which applies it."""

    request_id: str
    token_ids: Sequence[int]  # every token of the request so far (read only)
    params: SamplingParams
    generator: Optional[torch.Generator]
    budget: int  # the most tokens to propose
    block_tables: list[list[int]]  # the KV manager's tables (drafting models address their cache with them)


class Proposer(Protocol):
    """Guesses up to `budget` next tokens for each request, from what it has seen so far."""

    # Whether proposing writes K/V into the request's blocks (drafting models): the lookahead
    # slots are then allocated before proposing rather than when the scheduler grants the run.
    writes_kv: bool

    def propose(self, inputs: Sequence[DraftInput]) -> dict[str, Proposal]:
        """Request id -> its proposal (requests with nothing to propose may be left out)."""
        ...

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget what it keeps for any other request (finished, or preempted: its blocks were
        freed or moved, so a draft cache starts over)."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it.

    Free to compute and strong wherever the output copies its input (code edits, extraction,
    summaries quoting the source).
    """

    writes_kv = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, inputs: Sequence[DraftInput]) -> dict[str, Proposal]:
        return {d.request_id: Proposal(self.lookup(list(d.token_ids), d.budget)) for d in inputs}

    def retain(self, request_ids: Iterable[str]) -> None:
        """Nothing kept between steps."""

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = arr[length - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match: most likely to continue the same way
                return tokens[start:start + k]
        return []


# forward(input_ids, positions, each request's block tables (one per group), query lens, seq lens,
# rows to return) -> logits
DraftForward = Callable[[list[int], list[int], list[list[list[int]]], list[int], list[int], list[int]], torch.Tensor]


class ModelProposer:
    """Drafts with a model, k autoregressive steps batched over the requests.

    Each request first feeds what the drafter has not computed yet (a whole prompt the first
    time for a separate draft model; only the last token for layer skipping), samples a
    token, then feeds each guess back. Sampled requests draw from the draft's distribution
    after their own temperature and truncation (the closer q is to p, the more is accepted)
    and hand it over for rejection sampling; greedy ones take the draft's argmax.
    """

    writes_kv = True

    def __init__(self, forward: DraftForward, sampler: Sampler, max_chunk: int, catch_up: bool) -> None:
        self.forward = forward
        self.sampler = sampler
        self.max_chunk = max_chunk  # tokens of one request per drafting forward (a long catch-up is chunked)
        self.catch_up = catch_up
        # Request id -> what the draft's cache holds for it: valid K/V for its first `num_valid`
        # tokens, then for `tail` (guesses fed back) as far as they match what was then accepted.
        self._drafted: dict[str, tuple[int, list[int]]] = {}

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = set(request_ids)
        self._drafted = {rid: v for rid, v in self._drafted.items() if rid in keep}

    def _draft_start(self, d: DraftInput) -> int:
        """First position whose draft K/V must be (re)computed: past the drafted tokens that turned out right."""
        num_tokens = len(d.token_ids)
        if not self.catch_up:
            return num_tokens - 1
        valid, tail = self._drafted.get(d.request_id, (0, []))
        for tok in tail:
            if valid >= num_tokens or d.token_ids[valid] != tok:
                break
            valid += 1
        return min(valid, num_tokens - 1)

    def propose(self, inputs: Sequence[DraftInput]) -> dict[str, Proposal]:
        tokens: list[list[int]] = [[] for _ in inputs]
        probs: list[list[torch.Tensor]] = [[] for _ in inputs]
        # input index -> (position of the first token to feed, tokens to feed)
        pending: dict[int, tuple[int, list[int]]] = {}
        for i, d in enumerate(inputs):
            if d.budget > 0:
                start = self._draft_start(d)
                pending[i] = (start, list(d.token_ids[start:]))
        while pending:
            # Rows of one token first: the attention metadata wants decodes ahead of chunks.
            order = sorted(pending, key=lambda i: len(pending[i][1]) != 1)
            ids, pos, tables, qlens, seqlens, rows, sampling = [], [], [], [], [], [], []
            for i in order:
                start, feed = pending[i]
                take = feed[:self.max_chunk]
                ids.extend(take)
                pos.extend(range(start, start + len(take)))
                tables.append(inputs[i].block_tables)
                qlens.append(len(take))
                seqlens.append(start + len(take))
                if len(take) == len(feed):
                    rows.append(len(ids) - 1)
                    sampling.append(i)
                else:
                    pending[i] = (start + len(take), feed[len(take):])
            logits = self.forward(ids, pos, tables, qlens, seqlens, rows)
            if not sampling:  # only chunks of long catch-ups this time
                continue
            drafted, q = self.sampler.draft(logits, [inputs[i] for i in sampling])
            for row, i in enumerate(sampling):
                tokens[i].append(drafted[row])
                if q is not None and not inputs[i].params.greedy:
                    probs[i].append(q[row])
                start, feed = pending[i]
                if len(tokens[i]) < inputs[i].budget:
                    pending[i] = (start + len(feed), [drafted[row]])
                else:
                    del pending[i]
        for i, d in enumerate(inputs):
            if tokens[i] and self.catch_up:  # the guesses fed back have their K/V in the draft's cache
                self._drafted[d.request_id] = (len(d.token_ids), tokens[i][:-1])
        return {d.request_id: Proposal(t, torch.stack(p) if p else None)
                for d, t, p in zip(inputs, tokens, probs) if t}


class DraftModelProposer(ModelProposer):
    """A separate draft model, with its own KV cache addressed by the target's block ids. Its
    steps take the execution paths the target's runner would (`ModelExecutor`): its decode steps
    are the C decode step's where the draft offers one, unless `enforce_eager`."""

    def __init__(self, draft: CausalLM, caches: list[torch.Tensor], backend: AttentionBackend, block_size: int,
                 vocab_size: int, sampler: Sampler, max_chunk: int, enforce_eager: bool = False) -> None:
        self.draft, self.caches, self.backend = draft, caches, backend
        self.executor = ModelExecutor(draft, enforce_eager)  # draft: a loaded model, also a ModelBase
        self.block_size, self.vocab_size = block_size, vocab_size
        super().__init__(self._forward, sampler, max_chunk, catch_up=True)

    def _forward(self, ids, pos, tables, qlens, seqlens, rows) -> torch.Tensor:
        # The draft's own cache, one layer per tensor, addressed by the target's group 0 (full attention).
        meta = self.backend.build_metadata(qlens, seqlens, [t[0] for t in tables], self.block_size)
        hidden = self.executor.forward(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
        logits = self.draft.compute_logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long)))
        return _fit_vocab(logits, self.vocab_size)


class LayerSkipProposer(ModelProposer):
    """Self-speculation: a subset of the target's layers and its own head draft.

    The drafting layers read the target's cache for every position before the request's last
    token (exactly what they would compute themselves, as they are the target's own layers)
    and write their guesses' K/V at positions the verification step then overwrites, so the
    target never reads a drafted slot. A subset of layers runs through the target's modules (the
    C decode step takes whole models only).
    """

    def __init__(self, target: CausalLM, caches: list[torch.Tensor], backend: AttentionBackend, block_size: int,
                 layers: Sequence[int], sampler: Sampler, groups: KVCacheGroups) -> None:
        self.target, self.caches, self.backend = target, caches, backend
        self.block_size, self.layers, self.groups = block_size, list(layers), groups
        super().__init__(self._forward, sampler, max_chunk=1, catch_up=False)

    def _forward(self, ids, pos, tables, qlens, seqlens, rows) -> torch.Tensor:
        meta = self.groups.build_metadata(self.backend, qlens, seqlens, tables, self.block_size)
        hidden = self.target(torch.tensor(ids), torch.tensor(pos), self.caches, meta, layers=self.layers)
        return self.target.compute_logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long)))


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary: extra ids cut, missing ones impossible."""
    n = logits.shape[1]
    if n > vocab_size:
        return logits[:, :vocab_size]
    if n < vocab_size:
        pad = torch.full((logits.shape[0], vocab_size - n), float("-inf"), dtype=logits.dtype)
        return torch.cat([logits, pad], dim=1)
    return logits


def default_draft_layers(num_layers: int) -> list[int]:
    """Layer skipping's default: the first half of the layers and every other one of the second
    half (Draft & Verify's pattern). Measured on qwen2.5-coder-1.5b (28 layers), code edits:
    exiting after the first half was never right (0 of 242 proposals), 22 leading layers 25 %,
    this 21-layer pattern 37 %: untrained exits disagree with the full model."""
    half = max(1, num_layers // 2)
    return list(range(half)) + list(range(half + 1, num_layers, 2))


@dataclass
class SpeculationPolicy:
    """How many tokens to propose given the load: k at one running request, fewer as the batch
    grows, none above `disable_by_batch_size` running requests or while any request waits."""

    num_speculative_tokens: int
    disable_by_batch_size: int

    def tokens_for(self, num_running: int, num_waiting: int) -> int:
        if num_waiting > 0 or num_running > self.disable_by_batch_size:
            return 0
        k = self.num_speculative_tokens
        if self.disable_by_batch_size <= 1:
            return k
        shrink = (num_running - 1) / self.disable_by_batch_size
        return max(1, round(k * (1 - shrink)))


def build_ngram(config: SpeculativeConfig) -> NgramProposer:
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def speculates(req: Request) -> bool:
    """Whether a request may verify proposals: it did not opt out, and penalties (which depend
    on every earlier token, which the batched verification does not replay) and logit_bias
    (which the verification does not apply) are off."""
    return req.params.speculative and not req.params.has_penalties and not req.params.has_logit_bias


def propose_all(proposer: Proposer, policy: SpeculationPolicy, running: Sequence[Request], num_waiting: int,
                max_model_len: int, kv: KVCacheManager) -> dict[str, Proposal]:
    """The step's proposals for the decoding requests that may speculate, as plain data for the
    scheduler to apply (`Scheduler.set_proposals`). Lookahead slots for drafting models are
    allocated here, and a request that cannot get them simply decodes one token."""
    proposer.retain(r.request_id for r in running)
    k = policy.tokens_for(len(running), num_waiting)
    if k == 0:
        return {}
    inputs: list[DraftInput] = []
    for req in running:
        # Decoding requests only: a prompt's last token (after a chunk or a prefix hit) is prefill
        # work, which the latency target sizes; its first token comes from the target alone.
        if req.num_computed_tokens != req.num_tokens - 1 or not req.output_token_ids or not speculates(req):
            continue
        room = min(k, max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens - 1)
        if room <= 0 or (proposer.writes_kv and not kv.allocate_slots(req, 1 + room)):
            continue
        inputs.append(DraftInput(req.request_id, req.all_token_ids, req.params, req.generator, room,
                                 kv.block_tables(req.request_id)))
    return proposer.propose(inputs) if inputs else {}
