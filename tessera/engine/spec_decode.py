"""Speculative decoding: proposers guess the next tokens, the target verifies them in one step.

A decoding request normally computes one token per step, and on a CPU at small batch that
step costs about as much as reading all the weights once. Verifying k guessed tokens costs
one step with k+1 query rows (the same weight reads), so every accepted guess is a token for
free. The guesses come from a `Proposer`; the scheduler feeds the request's last token and
its proposals through the model as one run, the sampler keeps the accepted prefix
(`Sampler.speculative`, which preserves the target's distribution exactly), and the KV slots
of rejected proposals are released (`KVCacheManager.release_tail`).

Four proposers:
- `NgramProposer`: prompt lookup over the request's own tokens; free, strong on copy-heavy text.
- `SuffixProposer`: suffix decoding, the longest match of the context's end in the request's own
  tokens and in a bounded cache of earlier requests' outputs, continued the way most matches
  continue; free, and it also catches what a workload repeats across requests.
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
Within that cap, `AdaptiveDraftLength` (engine/core/spec_acceptance.py) picks each request's k
every step from its acceptance so far, the proposal's match length and the step-cost model's price
of the extra rows, 0 (no extra rows) where verifying would not pay.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Protocol, Sequence

import numpy as np
import torch

from tessera.attention import AttentionBackend
from tessera.attention.kv_groups import KVCacheGroups
from tessera.engine.core.cost_model import StepShape
from tessera.engine.core.kv_cache_manager import KVCacheManager
from tessera.engine.core.request import Request
from tessera.engine.core.scheduler_output import Proposal
from tessera.engine.core.spec_acceptance import AdaptiveDraftLength
from tessera.engine.worker.model_executor import ModelExecutor
from tessera.engine.worker.sampler import Sampler
from tessera.models.base import CausalLM
from tessera.sampling_params import SamplingParams
from tessera.speculative_config import SpeculativeConfig

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
    num_prompt_tokens: int = 0  # token_ids past these are its output


class Proposer(Protocol):
    """Guesses up to `budget` next tokens for each request, from what it has seen so far."""

    # Whether proposing writes K/V into the request's blocks (drafting models): the lookahead
    # slots are then allocated before proposing rather than when the scheduler grants the run.
    writes_kv: bool
    # Whether proposing is a lookup (free, and its proposals carry a match length): draft lengths
    # are then chosen from the proposals; a drafting model's are chosen before it runs.
    lookup: bool

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
    lookup = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, inputs: Sequence[DraftInput]) -> dict[str, Proposal]:
        out = {}
        for d in inputs:
            tokens, n = self.find(list(d.token_ids), d.budget)
            if tokens:
                out[d.request_id] = Proposal(tokens, match_len=n)
        return out

    def retain(self, request_ids: Iterable[str]) -> None:
        """Nothing kept between steps."""

    def find(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram
        ending the context, and n (0: no match)."""
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return [], 0
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = arr[length - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match: most likely to continue the same way
                return tokens[start:start + k], n
        return [], 0


class SuffixProposer:
    """Suffix decoding (SuffixDecoding; vLLM's method "suffix"): the longest match of the
    context's end, up to `max_depth` tokens, in the request's own tokens (prompt and output) and
    in the outputs of the last `max_cached_requests` requests that left the batch; among the
    matches of that length, the continuation most of them share, token by token, while at least
    `min_token_prob` of the remaining matches agree, and at most `max_spec_factor` x the match
    length tokens (a short match is a weak hint).

    Matching the longest suffix anywhere (not only n-grams up to a fixed n) is what makes a long
    match informative, and the cache catches what a workload repeats across requests (the same
    answer to the same question, a file rewritten twice). Memory is bounded: the cache is one
    int64 array of the cached outputs (each followed by a -1 separator, so no match spans two),
    rebuilt when a request joins or leaves it; each step scans it and the request's own tokens
    once with numpy, so its cost grows with the cached tokens, not with their count squared.
    """

    writes_kv = False
    lookup = True

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth, self.max_cached_requests = max_depth, max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        # Request id -> (its tokens as last proposed for, its prompt length): its output is
        # cached when it leaves the batch.
        self._live: dict[str, tuple[Sequence[int], int]] = {}
        self._cached: OrderedDict[str, np.ndarray] = OrderedDict()  # outputs, oldest first
        self._joined: Optional[np.ndarray] = None  # the cached outputs with separators; None: rebuild

    def retain(self, request_ids: Iterable[str]) -> None:
        """Requests no longer in the batch leave their output in the cache (a preempted one
        comes back and is matched against its own tokens again)."""
        keep = set(request_ids)
        for rid in [r for r in self._live if r not in keep]:
            tokens, num_prompt = self._live.pop(rid)
            self._remember(rid, tokens[num_prompt:])

    def _remember(self, request_id: str, output: Sequence[int]) -> None:
        if self.max_cached_requests == 0 or not output:
            return
        self._cached.pop(request_id, None)
        self._cached[request_id] = np.asarray(output, dtype=np.int64)
        while len(self._cached) > self.max_cached_requests:
            self._cached.popitem(last=False)
        self._joined = None

    def cache_tokens(self) -> np.ndarray:
        """The cached outputs, each followed by -1."""
        if self._joined is None:
            parts = [x for out in self._cached.values() for x in (out, np.array([-1]))]
            self._joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return self._joined

    def propose(self, inputs: Sequence[DraftInput]) -> dict[str, Proposal]:
        out = {}
        for d in inputs:
            self._live[d.request_id] = (d.token_ids, d.num_prompt_tokens)
            tokens, n = self.find(d.token_ids, d.budget, with_cache=d.generator is None)
            if tokens:
                out[d.request_id] = Proposal(tokens, match_len=n)
        return out

    def find(self, context: Sequence[int], k: int, with_cache: bool = True) -> tuple[list[int], int]:
        """Up to k proposed tokens after `context`, and the length of the match they continue;
        `with_cache` False: from the context alone (a seeded request's proposals must depend on
        its own tokens only, for its seed to reproduce its output)."""
        n = len(context)
        if k <= 0 or n < 2:
            return [], 0
        ctx = np.asarray(context, dtype=np.int64)
        pattern = ctx[max(0, n - self.max_depth):][::-1]  # the context's end, latest token first
        # Haystacks with the positions right after each occurrence of the last token (where a
        # continuation starts): the context before its last token, then the cache.
        sources = [(ctx, np.flatnonzero(ctx[:n - 1] == pattern[0]) + 1)]
        cache = self.cache_tokens() if with_cache else np.empty(0, dtype=np.int64)
        if cache.size:
            sources.append((cache, np.flatnonzero(cache == pattern[0]) + 1))
        lengths = [_match_lengths(h, ends, pattern) for h, ends in sources]
        best = max((int(m.max()) for m in lengths if m.size), default=0)
        if best == 0:
            return [], 0
        matches = [(h, ends[m == best]) for (h, ends), m in zip(sources, lengths)]
        limit = min(k, max(1, int(best * self.max_spec_factor)))
        proposal: list[int] = []
        for j in range(limit):
            # Next tokens of the matches still agreeing, the latest in the context last.
            nexts = [(h, ends[ends + j < h.size]) for h, ends in matches]
            seen = [int(t) for h, ends in reversed(nexts) for t in h[ends + j] if t >= 0]
            if not seen:
                break
            counts = Counter(seen)
            last = {t: i for i, t in enumerate(seen)}  # ties go to the latest match
            token = max(counts, key=lambda t: (counts[t], last[t]))
            if counts[token] < self.min_token_prob * len(seen):
                break
            proposal.append(token)
            matches = [(h, ends[h[ends + j] == token]) for h, ends in nexts]
        return proposal, best


def _match_lengths(haystack: np.ndarray, ends: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """For each position in `ends`, how many tokens before it equal the end of the context
    (`pattern`: the context's end reversed, whose first token every position follows)."""
    lengths = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, pattern.size):
        pos = ends - 1 - j
        alive &= pos >= 0
        alive[alive] = haystack[pos[alive]] == pattern[j]
        if not alive.any():
            break
        lengths += alive
    return lengths


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
    lookup = False

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
    grows, none above `disable_by_batch_size` running requests or while any request waits.
    `adaptive`: within that cap, each request's k for the step from its acceptance and the
    step's cost (None: the cap itself)."""

    num_speculative_tokens: int
    disable_by_batch_size: int
    adaptive: Optional[AdaptiveDraftLength] = None

    def tokens_for(self, num_running: int, num_waiting: int) -> int:
        if num_waiting > 0 or num_running > self.disable_by_batch_size:
            return 0
        k = self.num_speculative_tokens
        if self.disable_by_batch_size <= 1:
            return k
        shrink = (num_running - 1) / self.disable_by_batch_size
        return max(1, round(k * (1 - shrink)))


def build_lookup(config: SpeculativeConfig) -> "NgramProposer | SuffixProposer":
    """The proposer of a lookup method (ngram, suffix)."""
    if config.method == "suffix":
        assert config.suffix_decoding_max_tree_depth is not None  # filled in by the config
        assert config.suffix_decoding_max_cached_requests is not None
        assert config.suffix_decoding_max_spec_factor is not None
        assert config.suffix_decoding_min_token_prob is not None
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def speculates(req: Request) -> bool:
    """Whether a request may verify proposals: it did not opt out, and penalties (which depend
    on every earlier token, which the batched verification does not replay) and logit_bias
    (which the verification does not apply) are off."""
    return req.params.speculative and not req.params.has_penalties and not req.params.has_logit_bias


def adapts(req: Request, adaptive: Optional[AdaptiveDraftLength]) -> bool:
    """Whether the request's draft length adapts. Not for a seeded request: which random draws
    its verification takes depends on the draft length, and a seed must reproduce its output
    whatever the other requests and the measured step times did (nor does the suffix cache
    serve it, for the same reason)."""
    return adaptive is not None and req.generator is None


def propose_all(proposer: Proposer, policy: SpeculationPolicy, running: Sequence[Request], num_waiting: int,
                max_model_len: int, kv: KVCacheManager) -> dict[str, Proposal]:
    """The step's proposals for the decoding requests that may speculate, as plain data for the
    scheduler to apply (`Scheduler.set_proposals`). Lookahead slots for drafting models are
    allocated here, and a request that cannot get them simply decodes one token. With an
    adaptive policy a request's proposal is cut to the draft length that pays, or withheld
    (no tokens) where none does."""
    proposer.retain(r.request_id for r in running)
    k = policy.tokens_for(len(running), num_waiting)
    if k == 0:
        return {}
    adaptive = policy.adaptive
    # Decoding requests only: a prompt's last token (after a chunk or a prefix hit) is prefill
    # work, which the latency target sizes; its first token comes from the target alone.
    decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and r.output_token_ids]
    step = StepShape()  # every decoding request's one plain row: what a draft length adds to
    for req in decoding:
        step = step.plus(StepShape.chunk(req.num_tokens - 1, 1, True))
    inputs: list[DraftInput] = []
    withheld: dict[str, Proposal] = {}
    for req in decoding:
        if not speculates(req):
            continue
        room = min(k, max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens - 1)
        if room > 0 and adapts(req, adaptive) and not proposer.lookup:  # a model drafts only what pays
            room = adaptive.choose(req.spec_acceptance, 0, room, step, req.num_tokens)
            if room == 0:
                withheld[req.request_id] = Proposal([])
        if room <= 0 or (proposer.writes_kv and not kv.allocate_slots(req, 1 + room)):
            continue
        inputs.append(DraftInput(req.request_id, req.all_token_ids, req.params, req.generator, room,
                                 kv.block_tables(req.request_id), req.num_prompt_tokens))
    proposals = proposer.propose(inputs) if inputs else {}
    if adaptive is not None and proposer.lookup:
        by_id = {r.request_id: r for r in decoding}
        for rid, p in proposals.items():
            req = by_id[rid]
            if not adapts(req, adaptive):
                continue
            n = adaptive.choose(req.spec_acceptance, p.match_len, len(p.token_ids), step, req.num_tokens)
            proposals[rid] = replace(p, token_ids=p.token_ids[:n])
    return {**withheld, **proposals}
