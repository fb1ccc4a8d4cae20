"""Tiny random Hugging Face models written as GGUF files the way llama.cpp's converter writes
them (names, llama's q/k permutation, a tokenizer), for loader and server tests."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from conftest import TINY_CHAT_TEMPLATE, TINY_SPECIAL_TOKENS, build_tiny_hf_model, build_tiny_tokenizer

_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# A mix of the block types the packaged models use (K-quants have no Python quantizer).
_QTYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q5_0, "attn_output": Q.Q4_1,
           "ffn_gate": Q.Q8_0, "ffn_up": Q.F16, "ffn_down": Q.Q5_0, "token_embd": Q.Q8_0,
           "ffn_gate_exps": Q.Q4_0, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q5_0}


# What convert_hf_to_gguf.py does per family: permute Q/K rows (llama's interleaved RoPE), store
# Gemma's norms as 1 + w, fuse Q/K/V and gate/up (Phi-3), name the norms around the sublayers.
_PERMUTED = {"llama", "granite", "smollm3"}
_GEMMA = {"gemma2", "gemma3"}
_POST_NORMS = {"gemma2", "gemma3", "olmo2"}
ARCH = {"llama": "llama", "llama3-rope": "llama", "llama-linear-rope": "llama", "qwen2": "qwen2",
        "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "olmo2": "olmo2",
        "granite": "granite", "smollm3": "smollm3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
        "gpt_oss": "gpt-oss", "lfm2": "lfm2"}
# LFM2's transformers names -> llama.cpp's (convert_hf_to_gguf.py's LFM2Model).
_LFM2 = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.out_proj": "attn_output",
         "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm", "feed_forward.w1": "ffn_gate",
         "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down", "conv.conv": "shortconv.conv",
         "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj"}
_MOE_PARTS = {"mlp.gate": "ffn_gate_inp", "mlp.router": "ffn_gate_inp", "self_attn.sinks": "attn_sinks"}


def _moe_tensors(hf: str, t: torch.Tensor, arch: str) -> list[tuple[str, np.ndarray]] | None:
    """(GGUF name, array) of a mixture-of-experts parameter of transformers' in-memory model, as
    convert_hf_to_gguf.py writes them (experts stacked [E, out, in], gpt-oss's interleaved gate/up
    split and transposed), or None for any other parameter. See _moe_state for the way back."""
    _, _, idx, rest = hf.split(".", 3)
    a = t.detach().float().numpy()
    if rest.startswith("mlp.experts."):
        part = rest.removeprefix("mlp.experts.")
        if arch == "gpt-oss":
            if part == "gate_up_proj":  # [E, in, 2 out]
                a = a.swapaxes(1, 2)
                return [(f"blk.{idx}.ffn_gate_exps.weight", a[:, 0::2]), (f"blk.{idx}.ffn_up_exps.weight", a[:, 1::2])]
            if part == "gate_up_proj_bias":
                return [(f"blk.{idx}.ffn_gate_exps.bias", a[:, 0::2]), (f"blk.{idx}.ffn_up_exps.bias", a[:, 1::2])]
            if part == "down_proj":
                return [(f"blk.{idx}.ffn_down_exps.weight", a.swapaxes(1, 2))]
            return [(f"blk.{idx}.ffn_down_exps.bias", a)]
        if part == "gate_up_proj":  # [E, 2 out, in]: gate rows, then up rows
            half = a.shape[1] // 2
            return [(f"blk.{idx}.ffn_gate_exps.weight", a[:, :half]), (f"blk.{idx}.ffn_up_exps.weight", a[:, half:])]
        return [(f"blk.{idx}.ffn_down_exps.weight", a)]
    part, _, kind = rest.rpartition(".")
    if rest == "self_attn.sinks":
        return [(f"blk.{idx}.attn_sinks.weight", a)]
    if part in _MOE_PARTS:
        return [(f"blk.{idx}.{_MOE_PARTS[part]}.{kind}", a)]
    return None


def _moe_state(hf: str, used: list[np.ndarray], arch: str) -> np.ndarray:
    """The in-memory parameter back from what the file holds (inverse of _moe_tensors)."""
    rest = hf.split(".", 3)[3]
    if arch == "gpt-oss" and rest.startswith("mlp.experts.gate_up_proj"):
        gate, up = used
        both = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],) if gate.ndim == 2 else
                        (gate.shape[0], 2 * gate.shape[1], gate.shape[2]), dtype=np.float32)
        both[:, 0::2], both[:, 1::2] = gate, up
        return both if gate.ndim == 2 else both.swapaxes(1, 2)
    if arch == "gpt-oss" and rest == "mlp.experts.down_proj":
        return used[0].swapaxes(1, 2)
    return np.concatenate(used, axis=1) if len(used) == 2 else used[0]


def _gguf_name(hf: str, arch: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    if hf == "model.embedding_norm.weight":  # LFM2's final norm
        return "token_embd_norm.weight"
    _, _, idx, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    if arch == "lfm2" and part in _LFM2:
        return f"blk.{idx}.{_LFM2[part]}.{kind}"
    if arch == "gpt-oss" and part == "post_attention_layernorm":  # its llama.cpp name
        return f"blk.{idx}.post_attention_norm.{kind}"
    if arch not in _POST_NORMS and part == "post_attention_layernorm":
        return f"blk.{idx}.ffn_norm.{kind}"
    fused = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    return f"blk.{idx}.{fused.get(part) or _LAYER[part]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer: GGUFWriter) -> None:
    tok = build_tiny_tokenizer()
    vocab = tok.backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Rows of float32 as Q4_K blocks (the gguf package has no K-quant quantizer): per 256 values a
    float16 scale and minimum over eight 32-value sub-blocks with 6-bit scales and minimums, and
    4-bit codes, laid out as ggml's block_q4_K (d, dmin, scales[12], qs[128])."""
    rows, cols = data.shape
    sub = data.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15.0
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (np.maximum(-lo, 0).max(-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dmin32, out=np.zeros_like(lo), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round(np.divide(sub + (dmin32 * mn)[..., None], step, out=np.zeros_like(sub), where=step > 0)),
                0, 15).astype(np.uint8)
    packed = np.zeros((rows, cols // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(rows, cols // 256, 128)
    block = np.concatenate([d[..., None].view(np.uint8).reshape(rows, -1, 2),
                            dmin[..., None].view(np.uint8).reshape(rows, -1, 2), packed, qs], axis=-1)
    return block.reshape(rows, -1)


def _add_metadata(w: GGUFWriter, cfg, arch: str) -> None:
    """The keys convert_hf_to_gguf.py writes for each family."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(_feed_forward_length(cfg, arch))
    w.add_head_count(cfg.num_attention_heads)
    if arch == "lfm2":  # per layer, 0 for a conv layer; the derived MLP width; the kernel length
        w.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_shortconv_l_cache(cfg.conv_L_cache)
        w.add_vocab_size(cfg.vocab_size)
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch not in ("phi3", "granite"):  # TextModel writes head_dim where the config has one
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    elif arch == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    elif arch == "phi3":
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
                                   // cfg.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(cfg.sliding_window or 0)
    elif arch == "gpt-oss":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    else:
        w.add_rope_dimension_count(head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":  # Mixtral's expert size is its feed_forward_length
            w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)


def _feed_forward_length(cfg, arch: str) -> int:
    """The MLP's width: LFM2's converter writes the one its config derives (Lfm2MLP's rule)."""
    if arch != "lfm2" or not cfg.block_auto_adjust_ff_dim:
        return cfg.intermediate_size
    size = int(2 * cfg.intermediate_size / 3)
    if cfg.block_ffn_dim_multiplier is not None:
        size = int(cfg.block_ffn_dim_multiplier * size)
        size = cfg.block_multiple_of * ((size + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
    return size


def _add_longrope(w: GGUFWriter, cfg) -> None:
    """Phi-3's LongRoPE factors as tensors, and their attention factor (Phi3MiniModel)."""
    import math

    rope = cfg.rope_parameters
    if rope.get("rope_type") != "longrope":
        return
    original = rope["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def write_tiny_gguf(kind: str, folder: Path, arch: str | None = None, quantized: bool = True,
                    qtypes: dict | None = None, wide: bool = False, config=None):
    """Write a tiny random HF model as GGUF; return (path, HF model holding the dequantized weights).
    `quantized`: matrices in a mix of block types (`qtypes`: short tensor name -> type, else the
    default mix; Q4_K where a row holds whole blocks, else Q8_0, as llama-quantize falls back),
    else every tensor F32. `wide`: the 256-wide model, `config`: a transformers config instead of the
    kind's tiny one (see build_tiny_hf_model)."""
    model = build_tiny_hf_model(kind, folder / "hf", wide=wide, config=config)
    cfg = model.config
    arch = arch or ARCH[kind]
    qtypes = _QTYPES if qtypes is None else qtypes
    path = folder / f"tiny-{kind}.gguf"
    w = GGUFWriter(path, arch)
    _add_metadata(w, cfg, arch)
    _add_tokenizer(w)
    if arch == "phi3":
        _add_longrope(w, cfg)
    state = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        pieces = _moe_tensors(hf_name, param, arch) if "layers." in hf_name else None
        if pieces is not None:
            used = [_add(w, name, np.ascontiguousarray(data), qtypes if quantized else {}) for name, data in pieces]
            state[hf_name] = torch.from_numpy(np.ascontiguousarray(_moe_state(hf_name, used, arch)))
            continue
        name = _gguf_name(hf_name, arch)
        data = param.detach().float().numpy().copy()
        if name.endswith("shortconv.conv.weight"):  # [C, 1, K] squeezed to [C, K], as the converter does
            data = data.squeeze(1)
        shift = 1.0 if arch in _GEMMA and name.endswith("norm.weight") else 0.0
        data = data + shift
        short = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        qtype = qtypes.get(short, Q.F32) if quantized and data.ndim == 2 else Q.F32
        if qtype == Q.Q4_K and data.shape[-1] % 256:
            qtype = Q.Q8_0
        if qtype in (Q.F32, Q.F16):
            stored = data.astype(np.float32 if qtype == Q.F32 else np.float16)
            used = stored.astype(np.float32)
        elif qtype == Q.Q4_K:
            stored = quantize_q4_k(data)
            used = dequantize(stored, qtype)
        else:
            stored = quantize(data, qtype)
            used = dequantize(stored, qtype)
        # the reference gets what the file holds, before llama.cpp's row permutation (rows quantize independently)
        state[hf_name] = torch.from_numpy(used - shift).reshape(param.shape)
        if arch in _PERMUTED and short in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads
            stored = _llama_cpp_permute(stored, heads)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, stored)
        else:
            w.add_tensor(name, stored, raw_shape=stored.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    if arch == "gpt-oss":  # a GGUF has no SwiGLU clamp: llama.cpp's is 7.0
        for m in model.modules():
            if hasattr(m, "limit"):
                m.limit = 7.0
    if arch in _GEMMA:  # a GGUF has no query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim)
        for layer in model.model.layers:
            layer.self_attn.scaling = cfg.head_dim ** -0.5
    return path, model


def _add(w: GGUFWriter, name: str, data: np.ndarray, qtypes: dict) -> np.ndarray:
    """Write one tensor of the experts (a stack quantized as its rows, as llama-quantize does);
    return the values the file holds."""
    qtype = qtypes.get(name.split(".")[-2], Q.F32) if data.ndim >= 2 else Q.F32
    if qtype == Q.F32:
        w.add_tensor(name, data.astype(np.float32))
        return data.astype(np.float32)
    rows = data.reshape(-1, data.shape[-1])
    stored = quantize_q4_k(rows) if qtype == Q.Q4_K else quantize(rows, qtype)
    w.add_tensor(name, stored.reshape(*data.shape[:-1], -1), raw_shape=stored.reshape(*data.shape[:-1], -1).shape,
                 raw_dtype=qtype)
    return dequantize(stored, qtype).reshape(data.shape)
