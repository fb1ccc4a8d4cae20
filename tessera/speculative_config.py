"""Speculative decoding's settings (vLLM's --speculative-config), checked as they are parsed."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Literal, Optional

from tessera.config_choices import QUANTIZATIONS
from tessera.errors import ConfigError

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "layer_skip")
# vLLM's defaults for suffix decoding, but for the cache: this one is scanned in Python's memory
# (about 4 bytes a cached token; each step scans it once with numpy), so it keeps fewer requests.
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 1000,
                   "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}


@dataclass
class SpeculativeConfig:
    """vLLM's --speculative-config, as JSON.

    - `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`: prompt lookup.
    - `{"method": "suffix", "num_speculative_tokens": 8}`: suffix decoding, the longest match of
      the context's end in the request's own tokens and in earlier requests' outputs (the last
      `suffix_decoding_max_cached_requests`), its most frequent continuation, at most
      `suffix_decoding_max_spec_factor` x the match length tokens, each seen after at least
      `suffix_decoding_min_token_prob` of the matches; matches up to `suffix_decoding_max_tree_depth`.
    - `{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}`: a smaller model with the
      same tokenizer drafts (method `draft_model`, implied by `model` as in vLLM).
    - `{"method": "layer_skip", "draft_layers": [0, 1, ...]}`: self-speculation, the target's own
      layers listed (default: the first half and every other one after) draft through its own
      head; no second model.
    `disable_by_batch_size`: no speculation above this many running requests (k also shrinks
    toward 1 as the batch grows to it). `adaptive` (default on): each step each request verifies
    the number of proposals that maximises expected tokens per second, from its acceptance so far
    and the step-cost model, none when that does not pay (engine/core/spec_acceptance.py);
    off, every proposal up to `num_speculative_tokens` is verified.
    """

    method: Optional[Literal["ngram", "suffix", "draft_model", "layer_skip"]] = None
    model: Optional[str] = None  # the draft model (name, alias or path), for draft_model
    # The draft's weight storage (vLLM's key); None = the target's --quantization. A draft is
    # read k times a step, so int4 everywhere (LM head included) is worth its small loss of agreement.
    quantization: Optional[Literal["auto", "none", "int8", "int4"]] = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_layers: Optional[list[int]] = None  # layer_skip: target layers the draft runs
    disable_by_batch_size: int = 1  # measured: at 4 running requests (k=1) random traffic ran at 0.83x
    adaptive: bool = True
    # suffix: None = SUFFIX_DEFAULTS
    suffix_decoding_max_tree_depth: Optional[int] = None
    suffix_decoding_max_cached_requests: Optional[int] = None
    suffix_decoding_max_spec_factor: Optional[float] = None
    suffix_decoding_min_token_prob: Optional[float] = None

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"not {self.method!r}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ConfigError('--speculative-config: method "draft_model" needs "model": the draft model\'s '
                              "name or path")
        if self.quantization is not None and (self.method != "draft_model" or self.quantization not in QUANTIZATIONS):
            raise ConfigError(f'--speculative-config: "quantization" applies to a draft model and is one of '
                              f"{', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f'--speculative-config: "model" only applies to method "draft_model", '
                              f"not {self.method!r}")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1),
                          ("disable_by_batch_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"--speculative-config: {name} must be an integer >= {low}, not {value!r}")
        if self.num_speculative_tokens > 16:
            raise ConfigError("--speculative-config: num_speculative_tokens must be at most 16")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("--speculative-config: prompt_lookup_min must not exceed prompt_lookup_max")
        if self.draft_layers is not None:
            if self.method != "layer_skip":
                raise ConfigError('--speculative-config: "draft_layers" only applies to method "layer_skip"')
            layers = self.draft_layers
            if (not isinstance(layers, list) or not layers
                    or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers)
                    or sorted(set(layers)) != layers):
                raise ConfigError("--speculative-config: draft_layers must be a non-empty ascending list of "
                                  f"distinct layer indices, not {layers!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"--speculative-config: adaptive must be true or false, not {self.adaptive!r}")
        self._check_suffix()

    def _check_suffix(self) -> None:
        """Suffix decoding's fields: only with method suffix, unset ones take SUFFIX_DEFAULTS."""
        given = [name for name in SUFFIX_DEFAULTS if getattr(self, name) is not None]
        if self.method != "suffix":
            if given:
                raise ConfigError(f'--speculative-config: {", ".join(given)} only apply to method "suffix"')
            return
        for name, default in SUFFIX_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        for name, low in (("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"--speculative-config: {name} must be an integer >= {low}, not {value!r}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor < math.inf:
            raise ConfigError(f"--speculative-config: suffix_decoding_max_spec_factor must be a positive number, "
                              f"not {factor!r}")
        if not isinstance(prob, (int, float)) or isinstance(prob, bool) or not 0 <= prob <= 1:
            raise ConfigError(f"--speculative-config: suffix_decoding_min_token_prob must be in [0, 1], "
                              f"not {prob!r}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"--speculative-config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(**value)
