"""What a decoder family is: how its layers differ from the shared blocks, and where its file says so.

Every decoder Tessera runs is one network (tessera/models/decoder.py): token embedding, layers of
attention and a gated MLP around a residual stream, a final norm and the LM head. Families differ
in a handful of choices, written here as data: where the norms sit, whether queries and keys are
normalised, the activation, RoPE's form, multipliers and soft-caps. A family is then a short file:
its `Block`, and two small readers for the values its Hugging Face config.json and its GGUF
metadata hold beyond the common ones. The fast paths (the C decode step, the int8-activation
projections, the C attention kernels) are chosen per loaded model from the same data, so every
family they can express takes them; `decode_step_limits` is the one place that says which cannot
take the one-call C decode step, and why.

Nothing here imports torch: the API process of a server reads configs without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Protocol

from tessera.activations import ACTIVATIONS, ActivationName
from tessera.config import ModelConfig
from tessera.errors import ModelFormatError


class GGUFMetadata(Protocol):
    """The part of an open GGUF file a family reads (tessera/models/gguf_file.GGUFFile)."""

    metadata: dict[str, Any]
    tensors: dict[str, Any]

    def arch_key(self, key: str, default: Any = None) -> Any: ...

    def dequantize(self, name: str) -> Any: ...


@dataclass(frozen=True)
class Block:
    """A decoder layer's shape, as differences from llama's: RMSNorm before attention and before the
    MLP (the residual add folded into the next norm), no q/k norm, SwiGLU, RoPE on every head
    dimension of every layer."""

    # Norm scales are stored as w of (1 + w) (Gemma): the offset is added at load.
    norm_offset: float = 0.0
    # A norm on each sublayer's input (all but OLMo 2).
    pre_norms: bool = True
    # A norm on each sublayer's output, before the residual add (Gemma 2 and 3, OLMo 2).
    post_norms: bool = False
    # "head": RMSNorm over each query and key head (Qwen3, Gemma 3); "proj": over the whole query
    # and key projections (OLMo 2).
    qk_norm: Optional[Literal["head", "proj"]] = None
    activation: ActivationName = "silu"  # tessera/activations.py's table
    # Embeddings times sqrt(hidden size), rounded to the compute dtype (Gemma).
    embed_scale: bool = False

    def __post_init__(self) -> None:
        if not (self.pre_norms or self.post_norms):
            raise ValueError("a block needs norms before or after its sublayers")


@dataclass(frozen=True)
class Family:
    """One decoder family: its block and how its files describe it."""

    name: str  # llama.cpp's general.architecture, also the ModelConfig's architecture
    hf_model_types: tuple[str, ...]  # config.json's model_type values it reads
    block: Block = field(default_factory=Block)
    # Reads the family's own config.json fields into the config, and refuses what it cannot run.
    from_hf: Optional[Callable[[dict[str, Any], ModelConfig], None]] = None
    # The same from a GGUF file's metadata (llama.cpp's keys).
    from_gguf: Optional[Callable[[GGUFMetadata, ModelConfig], None]] = None
    # llama.cpp's converter permutes Q and K rows for families it runs with "normal" (interleaved)
    # RoPE (llama and its kin); the loader undoes it.
    gguf_permuted_qk: bool = False
    # The checkpoint fuses Q/K/V into `qkv_proj` and gate/up into `gate_up_proj` (Phi-3), as its GGUF
    # does (`attn_qkv`, and `ffn_up` holding gate then up).
    fused_projections: bool = False
    # Whether the LM head is the embedding table when config.json does not say (Gemma's default).
    tied_by_default: bool = False
    # How it differs from llama's block, for `tessera models` and docs/models.md.
    summary: str = ""
    # Mixture-of-experts feed-forward blocks (tessera/layers/moe.py); its GGUF architecture may
    # also hold dense models (Mixtral's is llama).
    moe: bool = False
    # (checkpoint name part, the shared decoder's) replacements applied to every tensor name
    # before loading, for families whose modules are named otherwise (LFM2's operator_norm, w1...).
    renames: tuple[tuple[str, str], ...] = ()
    # llama.cpp's names for tensors the shared table (models/gguf_loader.py) does not know: a whole
    # name ("token_embd_norm.weight") or a layer's part ("shortconv.conv"), and the HF name (part).
    gguf_tensors: tuple[tuple[str, str], ...] = ()
    # Layers that keep a per-request state instead of K/V (LFM2's short convolutions, Mamba-2): no
    # swap, disk tier, speculation or one-call C decode step for them (docs/models.md).
    recurrent: bool = False

    def decode_step(self) -> str:
        """Whether decode steps take the one-call C step, for `tessera models`."""
        limits = decode_step_limits(self.block, recurrent=self.recurrent)
        return f"no: {', '.join(limits)}" if limits else "yes"


def decode_step_limits(block: Block, config: Optional[ModelConfig] = None, recurrent: bool = False) -> list[str]:
    """Why the one-call C decode step (models/fused_decode.py, kernels/decode_step.c) cannot run a
    model of this block and, where known, this config; empty when it can. The one place that decides:
    `tessera models` asks it of a family's block, the decoder of its loaded config (and logs the
    answer at start-up). The step expresses every block of attention layers here: norms before and/or after the
    sublayers ((1 + w) scales are folded at load), q/k norms per head or per projection, SiLU and
    GELU (tanh), scaled embeddings, multipliers, NoPE layers, partial rotary, sliding windows (with
    their own RoPE base, in hybrid cache groups), soft-capped scores, attention sinks, biases on any
    projection, and mixture-of-experts layers (softmax-then-top-k or top-k-then-softmax routing,
    biased routers, SwiGLU or gpt-oss's clamped SwiGLU experts; kernels/moe_step.c). What depends on
    the loaded weights and the host (storage formats, the experts' among them, dtypes, kernels) is
    the plan's (FusedDecode.build), which logs what it finds."""
    checks = [
        (ACTIVATIONS[block.activation].c_code is None or block.activation == "swiglu_clamped",
         f"a dense MLP of the {block.activation} activation"),
        (recurrent or (config is not None and bool(config.state_layers())), "recurrent layers"),
    ]
    if config is not None and config.moe is not None:
        checks.append((ACTIVATIONS[config.moe.activation].c_code is None, f"experts of {config.moe.activation}"))
    return [why for blocked, why in checks if blocked]


def need(hf: dict[str, Any], key: str, family: str) -> Any:
    """A config.json field the family cannot run without: a clear error, not a guessed default."""
    if hf.get(key) is None:
        raise ModelFormatError(f"config.json of a {family} model lacks {key!r}; the folder is incomplete")
    return hf[key]


def need_gguf(gf: GGUFMetadata, key: str, family: str) -> Any:
    value = gf.arch_key(key)
    if value is None:
        raise ModelFormatError(f"GGUF metadata key {family}.{key} is missing; the file is incomplete")
    return value


def hf_layer_types(hf: dict[str, Any], cfg: ModelConfig) -> None:
    """config.json's per-layer `layer_types` (sliding_attention / full_attention) with its window."""
    layer_types = hf.get("layer_types")
    window = hf.get("sliding_window")
    if layer_types and "sliding_attention" in layer_types:
        if not window:
            raise ModelFormatError("config.json lists sliding_attention layers but no sliding_window")
        cfg.sliding_window = int(window)
        cfg.sliding_layers = [t == "sliding_attention" for t in layer_types]


def refuse_biases(hf: dict[str, Any], family: str) -> None:
    """llama-style `attention_bias` (Q, K, V *and* output) and `mlp_bias` are not run."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ModelFormatError(f"{family} models with attention or MLP biases are not supported")


def refuse_sliding(hf: dict[str, Any], family: str) -> None:
    """Qwen-style `use_sliding_window` (off in every released checkpoint) is not run."""
    if hf.get("use_sliding_window"):
        raise ModelFormatError(f"{family} models with use_sliding_window are not supported")


def hf_experts(hf: dict[str, Any], family: str) -> tuple[int, int]:
    """(experts, experts per token) from config.json; transformers 5 writes `num_local_experts`
    where older Qwen configs say `num_experts`."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ModelFormatError(f"config.json of a {family} model lacks 'num_local_experts'; the folder is incomplete")
    return int(experts), int(need(hf, "num_experts_per_tok", family))


def gguf_experts(gf: GGUFMetadata, family: str) -> tuple[int, int, Optional[list[bool]]]:
    """(experts, experts per token, sparse layers or None when all are) from llama.cpp's keys; a
    layer is sparse when its router tensor is in the file."""
    experts, top_k = int(need_gguf(gf, "expert_count", family)), int(need_gguf(gf, "expert_used_count", family))
    layers = int(need_gguf(gf, "block_count", family))
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in gf.tensors for i in range(layers)]
    return experts, top_k, None if all(sparse) else sparse
