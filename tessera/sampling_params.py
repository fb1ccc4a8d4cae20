"""Per-request sampling settings, validated once at the door."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


# Bounds on a request's stop conditions: stop strings are searched in the text after every token,
# so ten thousand of them would slow every step of the batch (OpenAI allows 4; vLLM no limit).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000
MAX_LOGIT_BIAS = 1024  # OpenAI's limit is 300 tokens


class InvalidRequestError(ValueError):
    """Raised for a request the engine can never serve; the server maps it to HTTP 400."""


StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
STRUCTURED_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# The most whitespace characters JSON may put between tokens: unbounded whitespace lets a small
# model loop on newlines forever at temperature > 0, while the schema stays satisfiable.
MAX_JSON_WHITESPACE = 16


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `structured_outputs`); exactly one field is set.

    `json`: a JSON schema (dict or JSON text); `json_object`: any JSON object; `regex`; `choice`:
    one of these strings; `grammar`: an EBNF grammar (GBNF, as llama.cpp and xgrammar write it);
    `structural_tag`: xgrammar's structural-tag JSON (free text with constrained tagged parts,
    which is how tool calls are enforced). Compiled by the engine's grammar backend; the
    server maps OpenAI's `response_format` and `tools` onto it.
    """

    json: Union[None, str, dict] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    structural_tag: Optional[str] = None
    # JSON without free whitespace between tokens (vLLM's flag); small models tend to loop on
    # whitespace when any amount is allowed.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_fields = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise InvalidRequestError(
                "structured output needs exactly one of json, json_object, regex, choice, grammar, "
                f"structural_tag; got {', '.join(set_fields) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError("a json schema must be an object or its JSON text")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured output {name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured output choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> StructuredKind:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))  # type: ignore[return-value]

    def key(self) -> str:
        """A stable text of the constraint, to cache its compiled grammar by."""
        value: Any = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: Optional[int] = 16  # None = up to max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-N logprobs per generated token (0 = only the sampled one)
    skip_special_tokens: bool = True
    # False opts this request out of speculative decoding (when the server has it configured).
    speculative: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    # OpenAI's logit_bias: token id -> value in [-100, 100] added to its logit before sampling.
    logit_bias: Optional[dict[int, float]] = None
    # vLLM's request priority: lower runs earlier. It orders admission, the token budget and
    # preemption under --scheduling-policy priority, and is ignored under fcfs; a priority at or
    # past --background-priority runs only in the gaps the latency target leaves.
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        """Whether repetition, presence or frequency penalties change the logits."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in self.stop):
            bad(f"each stop string may be at most {MAX_STOP_CHARS} characters")
        # Integers travel to the engine process as msgpack (64 bits): larger ones are refused here.
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            bad(f"priority must be an integer, got {self.priority!r}")
        for name in ("n", "max_tokens", "top_k", "seed", "priority"):
            value = getattr(self, name)
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                bad(f"{name} must fit in 64 bits, got {value}")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**63 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative token ids")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            bad(f"stop_token_ids may hold at most {MAX_STOP_STRINGS} ids, got {len(self.stop_token_ids)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias must map token ids to numbers")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    bad(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                    bad(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if self.top_k < 0:
            bad(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
