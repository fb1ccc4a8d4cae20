"""Configuration objects passed down from the CLI to every engine part.

One `ModelConfig` describes the network (read from GGUF metadata or a
Hugging Face config.json); one `EngineConfig` holds every serving knob. Both
are plain dataclasses so they can be logged, compared and copied freely.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from tessera.errors import ConfigError


@dataclass
class ModelConfig:
    """Shape of a decoder-only transformer, independent of file format."""

    architecture: str  # "llama", "qwen2" or "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (qwen2)
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    # gemma3 only
    sliding_window: Optional[int] = None
    sliding_window_pattern: Optional[int] = None  # every Nth layer is global
    rope_local_base_freq: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    name: str = ""  # display name (registry name or file stem)
    quantization: str = ""  # e.g. "Q4_1" as found in the file, informational


DTYPES = ("auto", "bfloat16", "float32")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
DENSE_WEIGHT_COPIES = ("auto", "on", "off")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULER_POLICIES = ("continuous", "static")
ATTENTION_BACKENDS = ("auto", "paged", "sdpa", "reference")


@dataclass
class EngineConfig:
    """Every serving knob; the CLI maps flags 1:1 onto these fields."""

    model: str = "smollm2-135m"
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # Weight storage of Linear layers (vLLM's --quantization): auto keeps the file's precision class.
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    # Quantized weights also kept dense for large steps (prefill, big batches): auto = when small.
    dense_weight_copy: Literal["auto", "on", "off"] = "auto"
    block_size: int = 16
    kv_cache_memory: Optional[int] = None  # bytes; None = derived from RAM and model size
    max_model_len: Optional[int] = None  # None = min(model max positions, 4096)
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    enable_prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space: int = 1 << 30  # bytes of host memory for swapped-out blocks
    scheduler_policy: Literal["continuous", "static"] = "continuous"
    attention_backend: Literal["auto", "paged", "sdpa", "reference"] = "auto"
    num_threads: Optional[int] = None
    seed: int = 0

    def __post_init__(self) -> None:
        choices = [("quantization", QUANTIZATIONS), ("dense_weight_copy", DENSE_WEIGHT_COPIES),
                   ("preemption_mode", PREEMPTION_MODES), ("scheduler_policy", SCHEDULER_POLICIES),
                   ("attention_backend", ATTENTION_BACKENDS)]
        if isinstance(self.dtype, str):  # a torch.dtype from the Python API is checked when resolved
            choices.append(("dtype", DTYPES))
        for name, allowed in choices:
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, not {value!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")

    @property
    def dense_copy(self) -> Optional[bool]:
        return {"auto": None, "on": True, "off": False}[self.dense_weight_copy]
