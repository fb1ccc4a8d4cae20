"""Turning a request into engine input: tokenize, validate, size; no model needed.

Kept apart from LLMEngine so the API process can do it when the engine runs in
a process of its own (tessera/engine/frontend/core_client.py): the engine-core process
then only receives token ids and checked parameters, and a request that can
never run is refused (HTTP 400) before it crosses over.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Union

from tessera.engine.outputs import KVTransfer
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.tokenizer import Tokenizer


@dataclass
class PreparedRequest:
    """A request validated and tokenized off the engine thread, ready to enqueue."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    grammar: object = None  # the compiled structured-output constraint (xgrammar.CompiledGrammar)
    grammar_compile_time: Optional[float] = None
    # Prefill/decode disaggregation: a prefill replica returns the prompt's KV blocks with the
    # final output (kv_export); a decode replica loads them instead of computing them (kv_import).
    kv_export: bool = False
    kv_import: Optional[KVTransfer] = None


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Refuse a prompt of token ids the model has no embedding for (InvalidRequestError, HTTP 400);
    decoding one (an echo) before this check raised the tokenizer's OverflowError instead."""
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})")


@dataclass(frozen=True)
class InputLimits:
    """What a request is checked against: the model's vocabulary and the engine's sizes."""

    vocab_size: int
    max_model_len: int
    # The longest sequence the KV cache can hold (all its blocks): a request needing more can never run.
    kv_capacity_tokens: int


class InputProcessor:
    """Tokenizes and checks requests; thread-safe (the tokenizer is)."""

    def __init__(self, tokenizer: Tokenizer, limits: InputLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def process(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                arrival_time: Optional[float] = None, add_special_tokens: bool = True) -> PreparedRequest:
        """Tokenize and check a request; raises InvalidRequestError if it can never run."""
        lim = self.limits
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt must not be empty")
            text: Optional[str] = prompt
            ids = self.tokenizer.encode_bounded(prompt, lim.max_model_len, add_special_tokens)
        else:
            text, ids = None, list(prompt)
            check_token_ids(ids, lim.vocab_size)
        if not ids:
            raise InvalidRequestError("prompt must contain at least one token")
        if params.logit_bias and max(params.logit_bias) >= lim.vocab_size:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids below the vocabulary size {lim.vocab_size}")
        limit = lim.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens; the prompt has {len(ids)} "
                f"tokens, which leaves no room to generate.")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the prompt or max_tokens.")
        if len(ids) + max_tokens > lim.kv_capacity_tokens:
            raise InvalidRequestError(
                f"prompt plus max_tokens ({len(ids) + max_tokens} tokens) can never fit the KV cache, "
                f"which holds a sequence of at most {lim.kv_capacity_tokens} tokens; raise --kv-cache-memory")
        return PreparedRequest(request_id, text, ids, params, max_tokens, arrival_time or time.time())
