"""Structured output on the runner's side: apply the step's grammar bitmask to the logits.

The scheduler fills the masks before the step (engine/core/structured_output.py) and sends
them as an int32 bitmask with the row each request starts at (`GrammarBitmask`); the runner
holds no grammar state, so one in another process needs nothing but the bitmask.
"""
from __future__ import annotations

import time

import torch

from tessera.engine.core.scheduler_output import GrammarBitmask, ScheduledChunk


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask, sample_chunks: list[ScheduledChunk],
                          spec_chunks: list[ScheduledChunk]) -> float:
    """Mask `logits` (float32, in place; rows: each sampled chunk, then each verified run's
    positions) with the scheduler's bitmask; returns the seconds applying took. The bitmask's rows
    are in the scheduler's order, so they are gathered into the runner's first."""
    import xgrammar as xgr

    grammar.wait()  # its bits were filled alongside the forward pass
    t0 = time.perf_counter()
    src: list[int] = []
    dst: list[int] = []
    for i, c in enumerate(sample_chunks):
        first = grammar.rows.get(c.request_id)
        if first is not None:
            src.append(first)
            dst.append(i)
    row = len(sample_chunks)
    for c in spec_chunks:
        first = grammar.rows.get(c.request_id)
        if first is not None:
            src.extend(range(first, first + c.num_new_tokens))
            dst.extend(range(row, row + c.num_new_tokens))
        row += c.num_new_tokens
    if not dst:
        return time.perf_counter() - t0
    mask = grammar.bitmask
    if src != dst or mask.shape[0] != logits.shape[0]:
        mask = torch.full((logits.shape[0], mask.shape[1]), -1, dtype=torch.int32)
        mask[dst] = grammar.bitmask[src]
    if logits.is_cuda:  # xgrammar's own GPU kernel (Triton), the mask copied over once a step
        mask = mask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=dst,
                                    backend="cpu" if logits.is_cpu else "auto")
    return time.perf_counter() - t0
