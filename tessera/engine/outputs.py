"""What the engine hands back to its callers, one object per request per step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # decoded text of this single token
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob), best first


@dataclass
class CompletionOutput:
    """One of the n samples of a request."""

    index: int
    text: str = ""  # all text generated so far (stop string excluded)
    token_ids: list[int] = field(default_factory=list)  # all generated ids so far
    delta_text: str = ""  # text new since the previous RequestOutput
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None  # all so far, when requested
    delta_logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Union[int, str, None] = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class KVTransfer:
    """A prompt's KV blocks handed from a prefill replica to a decode replica (`--pd`): the chain
    hashes of its full leading blocks and their bytes, in the runner's block layout."""

    block_hashes: list[int]
    payload: bytes  # len(block_hashes) blocks of len(payload) // len(block_hashes) bytes, in order

    def blocks(self) -> dict[int, bytes]:
        n = len(self.block_hashes)
        size = len(self.payload) // n if n else 0
        return {h: self.payload[i * size:(i + 1) * size] for i, h in enumerate(self.block_hashes)}


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life, for metrics and traces."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    preempted_times: list[float] = field(default_factory=list)
    # The steps that computed part of its prompt before its first token, and the tokens those steps
    # computed in all (its own and other requests'): where a slow first token spent its time.
    prompt_steps: int = 0
    prompt_step_tokens: int = 0
    # Speculative decoding: proposed tokens verified for this request, and how many were accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    grammar_compile_time: Optional[float] = None  # seconds to compile its structured-output constraint


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: Optional[RequestMetrics] = None
    kv_transfer: Optional[KVTransfer] = None  # on the final output of a request sent with kv_export
    embedding: Optional[list[float]] = None  # an embedding request's vector, on its (only, final) output
