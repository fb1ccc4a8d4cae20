"""Turning a request into engine input: tokenize, validate, size; no model needed.

Kept apart from LLMEngine so the API process can do it when the engine runs in
a process of its own (tessera/engine/frontend/core_client.py): the engine-core process
then only receives token ids and checked parameters, and a request that can
never run is refused (HTTP 400) before it crosses over.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from tessera.config import EngineConfig, ModelConfig
from tessera.engine.outputs import KVTransfer
from tessera.pooling_params import PoolerConfig, PoolingParams, cannot_embed, embeds_only
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.tokenizer import Tokenizer
from tessera.vision import ImageInput


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
    # An embedding request (resolved): its prompt is computed in one step and pooled, nothing sampled.
    pooling: Optional[PoolingParams] = None
    # The LoRA adapter this request runs with (a name the engine was given by add_lora); None: the base.
    lora_name: Optional[str] = None
    # Its images, in prompt order, each placed over its run of placeholder tokens.
    images: list[ImageInput] = field(default_factory=list)


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
    # Embeddings: a pooling prompt runs whole in one step, so it is bounded by the step's token budget.
    max_num_batched_tokens: int = 0
    hidden_size: int = 0
    pooler: Optional[PoolerConfig] = None  # how the engine embeds; None: it does not
    generates: bool = True  # False for an encoder: it only embeds
    model_name: str = ""
    # A vision-language model's placeholder token and how many of them each image fills; None: text only.
    image_token_id: Optional[int] = None
    image_tokens: int = 0
    image_shape: tuple[int, ...] = ()  # the processed pixels' (channels, height, width)

    @classmethod
    def for_engine(cls, model: ModelConfig, config: EngineConfig, kv_capacity_tokens: int) -> "InputLimits":
        """The limits of an engine of `config` over `model` (resolved: max_model_len set)."""
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        v = model.vision
        return cls(model.vocab_size, config.max_model_len, kv_capacity_tokens, config.max_num_batched_tokens,
                   model.hidden_size, config.pooler_for(model), model.is_causal, config.model,
                   v.image_token_id if v is not None else None, v.num_image_tokens if v is not None else 0,
                   v.pixel_shape if v is not None else ())


class InputProcessor:
    """Tokenizes and checks requests; thread-safe (the tokenizer is)."""

    def __init__(self, tokenizer: Tokenizer, limits: InputLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def process(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                arrival_time: Optional[float] = None, add_special_tokens: bool = True,
                pooling: Optional[PoolingParams] = None,
                images: Optional[list[ImageInput]] = None) -> PreparedRequest:
        """Tokenize and check a request (an embedding one with `pooling`); raises
        InvalidRequestError if it can never run. `images`: processed, in the order of the prompt's
        image tokens, each of which becomes the run of placeholders the image fills."""
        lim = self.limits
        if images and pooling is not None:
            raise InvalidRequestError("embedding inputs cannot hold images")
        if pooling is not None:
            return self._process_pooling(request_id, prompt, pooling, arrival_time, add_special_tokens, params.priority)
        if not lim.generates:
            raise embeds_only(lim.model_name)
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
        placed = self._place_images(ids, images or [])
        if placed:
            ids, images = placed
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
        return PreparedRequest(request_id, text, ids, params, max_tokens, arrival_time or time.time(),
                               images=list(images or []))

    def _place_images(self, ids: list[int], images: list[ImageInput]
                      ) -> Optional[tuple[list[int], list[ImageInput]]]:
        """The prompt with each image token repeated as many times as its image has features, and
        the images placed over those runs; None for a prompt with neither."""
        lim = self.limits
        if lim.image_token_id is None:
            if images:
                raise InvalidRequestError(f"the model `{lim.model_name}` does not take images; it reads text only")
            return None
        at = [i for i, t in enumerate(ids) if t == lim.image_token_id]
        if len(at) != len(images):
            raise InvalidRequestError(f"the prompt has {len(at)} image placeholders but the request holds "
                                      f"{len(images)} images")
        if not images:
            return None
        out: list[int] = []
        placed: list[ImageInput] = []
        prev = 0
        for i, image in zip(at, images):
            if tuple(image.shape) != lim.image_shape or len(image.pixels) != 4 * math.prod(lim.image_shape):
                raise InvalidRequestError(f"an image's pixels must be float32 of shape {lim.image_shape}")
            out += ids[prev:i]
            placed.append(ImageInput(image.hash, image.pixels, tuple(image.shape), len(out), lim.image_tokens))
            out += [lim.image_token_id] * lim.image_tokens
            prev = i + 1
        return out + ids[prev:], placed

    def _process_pooling(self, request_id: str, prompt: Union[str, list[int]], pooling: PoolingParams,
                         arrival_time: Optional[float], add_special_tokens: bool, priority: int = 0) -> PreparedRequest:
        """An embedding input: a text is truncated at the model's max_seq_length as
        sentence-transformers does (unless `truncate` is off); the result must fit one step's
        token budget, since a pooling prompt is never split across steps."""
        lim = self.limits
        if lim.pooler is None:
            raise cannot_embed(lim.model_name)
        resolved = pooling.resolve(lim.pooler, lim.hidden_size)
        budget = lim.max_num_batched_tokens or lim.max_model_len
        model_limit = min(lim.max_model_len, lim.pooler.max_seq_length or lim.max_model_len)
        limit = min(model_limit, lim.kv_capacity_tokens, budget)
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("input must not be empty")
            text: Optional[str] = prompt
            if resolved.truncate and lim.pooler.max_seq_length is not None:
                ids = self.tokenizer.encode_truncated(prompt, model_limit, add_special_tokens)
            else:
                ids = self.tokenizer.encode_bounded(prompt, limit, add_special_tokens)
        else:
            text, ids = None, list(prompt)
            check_token_ids(ids, lim.vocab_size)
        if not ids:
            raise InvalidRequestError("input must contain at least one token")
        if len(ids) > limit:
            why = ("--max-num-batched-tokens, the step's token budget: an embedding input is computed whole in one "
                   "step" if limit == budget < model_limit else "the model's maximum input length")
            raise InvalidRequestError(
                f"This model's maximum input length for embeddings is {limit} tokens ({why}); the input has "
                f"{len(ids)} tokens. Please shorten it{' or leave truncation on' if not resolved.truncate else ''}.")
        return PreparedRequest(request_id, text, ids, SamplingParams(priority=priority), 0, arrival_time or time.time(),
                               pooling=resolved)
