"""Embedding (pooling) settings: how a model turns a prompt's hidden states into one vector.

Two levels, as in vLLM V1. `PoolerConfig` is the model's: which pooling, whether the vector
is L2-normalised, the longest input (sentence-transformers truncates to `max_seq_length`),
and whether `dimensions` may shorten it (Matryoshka-trained models). It comes from a
sentence-transformers folder (modules.json, 1_Pooling/config.json,
sentence_bert_config.json) or, for a decoder, from `--pooling`. `PoolingParams` is one
request's: the resolved pooling and the dimensions it asked for. A pooling request runs
its whole prompt in one step and returns the pooled vector instead of sampling.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from tessera.errors import ConfigError, ModelFormatError
from tessera.sampling_params import InvalidRequestError

PoolingType = Literal["mean", "cls", "last"]
POOLING_TYPES: tuple[str, ...] = ("mean", "cls", "last")


@dataclass(frozen=True)
class PoolerConfig:
    """How a model embeds (see the module docstring)."""

    pooling: PoolingType
    normalize: bool = True
    max_seq_length: Optional[int] = None  # inputs are truncated to this many tokens (specials included)
    matryoshka: bool = False  # `dimensions` may truncate the vector (it is renormalised after)

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ConfigError(f"--pooling must be one of {', '.join(POOLING_TYPES)}, not {self.pooling!r}")
        if self.max_seq_length is not None and self.max_seq_length < 1:
            raise ConfigError("a pooler's max_seq_length must be at least 1")


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's pooling: what the runner computes from its hidden states.

    As a caller writes it, None fields mean "the model's own" (its PoolerConfig); the input
    processor hands the engine a resolved copy (`resolve`), every field set.
    """

    pooling: Optional[PoolingType] = None
    normalize: Optional[bool] = None
    dimensions: Optional[int] = None  # keep the first this many values (then normalise), if set
    # Cut a text longer than the model's max_seq_length as sentence-transformers does (True), or
    # refuse it (False: Ollama's `truncate`); inputs past the engine's own limits are refused.
    truncate: bool = True

    def resolve(self, pooler: PoolerConfig, hidden_size: int) -> "PoolingParams":
        """Every field filled from the model's pooler; raises InvalidRequestError for a
        `dimensions` the model cannot give."""
        dims = self.dimensions
        if dims is not None:
            if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= hidden_size:
                raise InvalidRequestError(f"dimensions must be an integer in [1, {hidden_size}]")
            if not pooler.matryoshka:
                raise InvalidRequestError("This model does not support matryoshka representation: changing the "
                                          "output dimensions would give poor results")
            if dims == hidden_size:
                dims = None
        return PoolingParams(self.pooling or pooler.pooling,
                             pooler.normalize if self.normalize is None else self.normalize, dims, self.truncate)


def cannot_embed(model: str) -> InvalidRequestError:
    """The error (HTTP 400) for an embedding request to a model that does not embed."""
    return InvalidRequestError(f"model {model!r} does not serve embeddings: start it with --pooling mean|cls|last "
                               "to embed with it, or use an embedding model (e.g. all-minilm-l6-v2)")


def embeds_only(model: str) -> InvalidRequestError:
    """The error (HTTP 400) for a generation request to an encoder."""
    return InvalidRequestError(f"model {model!r} is an embedding model: it serves /v1/embeddings (and /api/embed), "
                               "not text generation")


def read_sentence_transformers(folder: Path) -> Optional[PoolerConfig]:
    """The pooling a sentence-transformers folder declares, or None when it is not one.

    modules.json lists the pipeline (Transformer, Pooling, optionally Normalize); the Pooling
    module's config.json says which pooling; sentence_bert_config.json the truncation length.
    """
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pooling_module = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        if pooling_module is None:
            return None
        pool_cfg = json.loads((folder / pooling_module.get("path", "1_Pooling") / "config.json").read_text())
        normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
        st_file = folder / "sentence_bert_config.json"
        max_len = json.loads(st_file.read_text()).get("max_seq_length") if st_file.is_file() else None
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ModelFormatError(f"{folder}: unreadable sentence-transformers configuration ({exc})") from None
    modes = [mode for key, mode in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                                    ("pooling_mode_lasttoken", "last")) if pool_cfg.get(key)]
    other = [k for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens") if pool_cfg.get(k)]
    if len(modes) != 1 or other:
        raise ModelFormatError(f"{folder}: sentence-transformers pooling {pool_cfg} is not supported; Tessera "
                               "pools by one of mean, cls or last token")
    return PoolerConfig(modes[0], normalize, int(max_len) if max_len else None)  # type: ignore[arg-type]
