"""Speculative decoding: proposers guess the next tokens, the target verifies them in one step.

A decoding request normally computes one token per step, and on a CPU at small batch that
step costs about as much as reading all the weights once. Verifying k guessed tokens costs
one step with k+1 query rows (the same weight reads), so every accepted guess is a token for
free. The guesses come from a `Proposer`; the scheduler feeds the request's last token and
its proposals through the model as one run, the sampler keeps the accepted prefix
(`Sampler.speculative`, which preserves the target's distribution exactly), and the KV slots
of rejected proposals are released (`KVCacheManager.release_tail`).

At large batch a step is compute-bound and verification rows are no longer free, so
`SpeculationPolicy` shrinks k as the running batch grows and turns speculation off above a
threshold or while requests wait, as sources 000 and 002 advise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np

from tessera.config import SpeculativeConfig
from tessera.engine.request import Request


class Proposer(Protocol):
    """Guesses up to `k` next tokens for a request from what it has seen so far."""

    def propose(self, req: Request, k: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it.

    Free to compute and strong wherever the output copies its input (code edits, extraction,
    summaries quoting the source): the case source 002 measures.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Request, k: int) -> list[int]:
        tokens = req.all_token_ids
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


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"unknown speculative method {config.method!r}")


def speculates(req: Request) -> bool:
    """Whether a request may verify proposals: penalties depend on every earlier token, which
    the batched verification does not replay, so those requests decode one token at a time."""
    return not req.params.has_penalties


def propose_all(proposer: Proposer, policy: SpeculationPolicy, running: Sequence[Request], num_waiting: int,
                max_model_len: int) -> Optional[int]:
    """Set `spec_token_ids` on each decoding request; returns the k used (None when off)."""
    k = policy.tokens_for(len(running), num_waiting)
    for req in running:
        req.spec_token_ids = []
        # Decoding requests only: a prompt's last token (after a chunk or a prefix hit) is prefill
        # work, which the latency target sizes; its first token comes from the target alone.
        if k == 0 or req.num_computed_tokens != req.num_tokens - 1 or not req.output_token_ids \
                or not speculates(req):
            continue
        room = min(k, max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens - 1)
        req.spec_token_ids = proposer.propose(req, room) if room > 0 else []
    return k or None
