"""LFM2 (Liquid AI): llama's block with per-head q/k RMSNorm in its attention layers, and most
layers a gated short convolution (layers/short_conv.py) instead of attention, whose per-request
state lives in the engine's state slots (engine/core/state_slots.py) rather than KV blocks."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.errors import ModelFormatError
from tessera.models.families.base import Block, Family, GGUFMetadata, need, need_gguf

# transformers' module names -> the shared decoder's (the conv layers' `conv.in_proj` / `conv.out_proj`
# and the convolution's own weight keep theirs).
RENAMES = (("model.embedding_norm.", "model.norm."), (".operator_norm.", ".input_layernorm."),
           (".ffn_norm.", ".post_attention_layernorm."), (".self_attn.out_proj.", ".self_attn.o_proj."),
           (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
           (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
           (".feed_forward.w2.", ".mlp.down_proj."))


def feed_forward_size(size: int, auto_adjust: bool, multiplier: Any, multiple_of: int) -> int:
    """The MLP's width as transformers' Lfm2MLP derives it from the config's: two thirds, times the
    multiplier, rounded up to a multiple of `multiple_of` (when auto-adjusted)."""
    if not auto_adjust:
        return size
    size = int(2 * size / 3)
    if multiplier is not None:
        size = int(multiplier * size)
        size = multiple_of * ((size + multiple_of - 1) // multiple_of)
    return size


def layer_kinds(kinds: list[str], num_layers: int) -> list[str]:
    """"attention" / "conv" per layer from the file's per-layer names."""
    if len(kinds) != num_layers or not set(kinds) <= {"full_attention", "attention", "conv"}:
        raise ModelFormatError(f"an lfm2 model's layer types {kinds} are not {num_layers} of full_attention / conv")
    return ["conv" if k == "conv" else "attention" for k in kinds]


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    kinds = hf.get("layer_types")
    if kinds is None:
        attn = set(hf.get("full_attn_idxs") or range(cfg.num_layers))
        kinds = ["full_attention" if i in attn else "conv" for i in range(cfg.num_layers)]
    cfg.layer_kinds = layer_kinds(list(kinds), cfg.num_layers)
    cfg.conv_kernel = int(need(hf, "conv_L_cache", "lfm2"))
    if cfg.conv_kernel < 1:
        raise ModelFormatError(f"an lfm2 model's conv_L_cache is {cfg.conv_kernel}")
    cfg.conv_bias = bool(hf.get("conv_bias", False))
    cfg.rms_norm_eps = float(hf.get("norm_eps", 1e-5))
    if "tie_embedding" in hf:
        cfg.tie_word_embeddings = bool(hf["tie_embedding"])
    cfg.intermediate_size = feed_forward_size(int(hf.get("block_ff_dim") or cfg.intermediate_size),
                                              bool(hf.get("block_auto_adjust_ff_dim", True)),
                                              hf.get("block_ffn_dim_multiplier", 1.0),
                                              int(hf.get("block_multiple_of", 256)))


# llama.cpp's names (convert_hf_to_gguf.py's LFM2Model): the final norm is `token_embd_norm`
# (transformers' embedding_norm), the conv layers' tensors `shortconv.*` (the convolution's
# weight squeezed to [C, K]).
GGUF_TENSORS = (("token_embd_norm.weight", "model.norm.weight"), ("shortconv.conv", "conv.conv"),
                ("shortconv.in_proj", "conv.in_proj"), ("shortconv.out_proj", "conv.out_proj"))


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    """llama.cpp writes a KV head count per layer, 0 for a conv layer, and the kernel length as
    `shortconv.l_cache`; `feed_forward_length` is already the derived MLP width."""
    kv = gf.arch_key("attention.head_count_kv")
    if not isinstance(kv, list):
        raise ModelFormatError("an lfm2 GGUF has one attention.head_count_kv for all layers; llama.cpp writes "
                               "one per layer (0 for a conv layer)")
    cfg.layer_kinds = layer_kinds(["full_attention" if int(n) else "conv" for n in kv], cfg.num_layers)
    cfg.conv_kernel = int(need_gguf(gf, "shortconv.l_cache", "lfm2"))
    if cfg.conv_kernel < 1:
        raise ModelFormatError(f"an lfm2 GGUF's shortconv.l_cache is {cfg.conv_kernel}")


FAMILY = Family(name="lfm2", hf_model_types=("lfm2",), block=Block(qk_norm="head"), from_hf=_from_hf,
                from_gguf=_from_gguf, tied_by_default=True, renames=RENAMES, gguf_tensors=GGUF_TENSORS, recurrent=True,
                summary="llama + per-head q/k RMSNorm; most layers a gated short convolution with per-request state")
