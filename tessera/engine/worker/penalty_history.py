"""The token histories penalties read, kept by the runner for the requests that use them.

Repetition, presence and frequency penalties depend on every token a request has seen. The
runner keeps its own copy (as vLLM's input batch does): the scheduler sends a request's tokens
once, in its first chunk after admission or preemption (`SamplingInputs.history`), and the
runner appends what it samples; so nothing on this side reads or holds a `Request`'s lists,
and a runner in another process needs no more. A history is dropped when the scheduler says
the request finished or was preempted (a preempted one is sent again when it resumes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from tessera.engine.core.scheduler_output import ScheduledChunk
from tessera.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler reads of one row (`sampler.SampledRow`)."""

    params: SamplingParams
    generator: Optional[torch.Generator]
    output_token_ids: Sequence[int] = ()
    all_token_ids: Sequence[int] = ()


class PenaltyHistories:
    """Request id -> (prompt tokens, output tokens), for the requests with penalties."""

    def __init__(self) -> None:
        self._prompt: dict[str, list[int]] = {}
        self._output: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._prompt)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._prompt.pop(rid, None)
            self._output.pop(rid, None)

    def start(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Take the histories the step's chunks carry (a request new to the runner, or resumed)."""
        for c in chunks:
            h = c.sampling.history
            if h is not None:
                self._prompt[c.request_id] = list(h.prompt_token_ids)
                self._output[c.request_id] = list(h.output_token_ids)

    def append(self, sampled: dict[str, list[int]]) -> None:
        """Add the tokens the step emitted. A run the scheduler cuts short (a stop token or a
        length limit inside it) finishes its request, so the extra tokens are never read."""
        for rid, tokens in sampled.items():
            out = self._output.get(rid)
            if out is not None:
                out.extend(tokens)

    def rows(self, chunks: Sequence[ScheduledChunk]) -> list[SamplingRow]:
        """The sampler's rows for `chunks`, with their histories where penalties read them."""
        rows = []
        for c in chunks:
            params, gen = c.sampling.params, c.sampling.generator
            if not params.has_penalties:
                rows.append(SamplingRow(params, gen))
                continue
            out = self._output[c.request_id]  # sent in the request's first chunk: a KeyError is a bug
            everything = self._prompt[c.request_id] + out if params.repetition_penalty != 1.0 else ()
            rows.append(SamplingRow(params, gen, out, everything))
        return rows
