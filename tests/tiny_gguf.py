"""Tiny random Hugging Face models written as GGUF files the way llama.cpp's converter writes
them (names, llama's q/k permutation, a tokenizer), for loader and server tests."""
from __future__ import annotations

from pathlib import Path

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
           "ffn_gate": Q.Q8_0, "ffn_up": Q.F16, "ffn_down": Q.Q5_0, "token_embd": Q.Q8_0}


def _gguf_name(hf: str, arch: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, idx, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    if arch != "gemma3" and part == "post_attention_layernorm":
        return f"blk.{idx}.ffn_norm.{kind}"
    return f"blk.{idx}.{_LAYER[part]}.{kind}"


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


def write_tiny_gguf(kind: str, folder: Path, arch: str | None = None, quantized: bool = True):
    """Write a tiny random HF model as GGUF; return (path, HF model holding the dequantized weights)."""
    model = build_tiny_hf_model(kind, folder / "hf")
    cfg = model.config
    arch = arch or ("gemma3" if kind == "gemma3" else "qwen2" if kind == "qwen2" else "llama")
    path = folder / f"tiny-{kind}.gguf"
    w = GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if kind == "gemma3":
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    else:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    _add_tokenizer(w)
    state = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name, arch)
        data = param.detach().float().numpy().copy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        short = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        qtype = _QTYPES.get(short, Q.F32) if quantized and data.ndim == 2 else Q.F32
        if qtype in (Q.F32, Q.F16):
            stored = data.astype(np.float32 if qtype == Q.F32 else np.float16)
            used = stored.astype(np.float32)
        else:
            stored = quantize(data, qtype)
            used = dequantize(stored, qtype)
        # the reference gets what the file holds, before llama.cpp's row permutation (rows quantize independently)
        state[hf_name] = torch.from_numpy((used - 1.0) if arch == "gemma3" and name.endswith("norm.weight") else used)
        if arch == "llama" and short in ("attn_q", "attn_k"):
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
    if arch == "gemma3":  # a GGUF has no query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim)
        for layer in model.model.layers:
            layer.self_attn.scaling = cfg.head_dim ** -0.5
    return path, model
