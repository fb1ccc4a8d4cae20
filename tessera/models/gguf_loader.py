"""Reading GGUF files: metadata into a ModelConfig, tensors into float weights. The file itself
(header, tensor table, mapped bytes) is read by gguf_file.py.

Tensors come out under Hugging Face parameter names with Hugging Face value
conventions (llama.cpp's Q/K row permutation undone, Gemma's `1 + w` norms
stored as `w`), so one model module serves both GGUF files and HF folders.

Reading the header and the config needs neither torch nor the layers: a process that only
tokenizes for an engine elsewhere (the API server's) reads them and stays free of torch's
memory. The weight readers import them where they are called.
"""
from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

import numpy as np
from gguf import LlamaFileType

from tessera.config import ModelConfig
from tessera.errors import ModelFormatError
from tessera.models.families import FAMILIES, Family, family
from tessera.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    import torch

    from tessera.layers.weights import GGUFWeight

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# metadata -> ModelConfig


def config_from_gguf(gf: GGUFFile, name: str = "") -> ModelConfig:
    """Network shape from GGUF metadata (llama.cpp key names): the keys every decoder has, then
    the family's own (tessera/models/families)."""
    arch = gf.architecture
    try:
        fam = family(arch)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{gf.path.name}: {exc}") from None

    def need(key: str) -> Any:
        value = gf.arch_key(key)
        if value is None:
            raise ModelFormatError(f"{gf.path.name}: metadata key {arch}.{key} is missing; the file is incomplete")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = gf.arch_key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts: one value, or 0 for LFM2's conv layers
        num_kv_heads = max(num_kv_heads)
    # Not rope.dimension_count: with partial rotary (Phi-3) it is less than a head.
    head_dim = gf.arch_key("attention.key_length") or hidden // num_heads
    ffn = gf.arch_key("feed_forward_length") or need("expert_feed_forward_length")
    if isinstance(ffn, list):
        ffn = max(ffn)
    if "token_embd.weight" not in gf.tensors:
        raise ModelFormatError(f"{gf.path.name} has no token_embd.weight tensor; the file is incomplete")
    vocab = gf.arch_key("vocab_size") or gf.tensors["token_embd.weight"].shape[0]

    eos = gf.metadata.get("tokenizer.ggml.eos_token_id")
    eot = gf.metadata.get("tokenizer.ggml.eot_token_id")
    eos_ids = [int(t) for t in (eos, eot) if t is not None]

    file_type = gf.metadata.get("general.file_type")
    try:
        quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        quant = ""

    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(gf.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gf.arch_key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gf),
        max_position_embeddings=int(gf.arch_key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors or "blk.0.attn_qkv.bias" in gf.tensors,
        bos_token_id=gf.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        name=name or gf.path.stem,
        quantization=quant,
    )
    if fam.from_gguf is not None:
        try:
            fam.from_gguf(gf, cfg)
        except (TypeError, ValueError) as exc:
            raise ModelFormatError(f"{gf.path.name}: bad {arch} metadata ({exc})") from None
    _check_shapes(gf, cfg, fam)
    return cfg


def _check_shapes(gf: GGUFFile, cfg: ModelConfig, fam: Family) -> None:
    """The metadata must agree with the tensors the file holds: the model is built from the
    metadata before any weight loads, so absurd values (a fuzzed or hostile header) would otherwise
    become absurd allocations. Tensor sizes are bounded by the file's size, so this bounds them."""
    def fail(what: str) -> ModelFormatError:
        return ModelFormatError(f"{gf.path.name}: {what}; the file is corrupt or not a model Tessera can run")

    for field_name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "max_position_embeddings"):
        if getattr(cfg, field_name) <= 0:
            raise fail(f"{field_name} is {getattr(cfg, field_name)}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise fail(f"{cfg.num_heads} attention heads do not divide into {cfg.num_kv_heads} KV heads")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attending = cfg.attention_layers()  # every layer but a recurrent model's conv layers
    if not attending:
        raise fail("no layer attends")
    first, last = attending[0], attending[-1]
    expected = {"token_embd.weight": (cfg.vocab_size, cfg.hidden_size)}
    if fam.fused_projections:
        expected.update({f"blk.{first}.attn_qkv.weight": (q + 2 * kv, cfg.hidden_size),
                         "blk.0.ffn_up.weight": (2 * cfg.intermediate_size, cfg.hidden_size),
                         f"blk.{last}.attn_qkv.weight": (q + 2 * kv, cfg.hidden_size)})
    else:
        expected.update({f"blk.{first}.attn_q.weight": (q, cfg.hidden_size),
                         f"blk.{first}.attn_k.weight": (kv, cfg.hidden_size),
                         f"blk.{last}.attn_q.weight": (q, cfg.hidden_size)})
        moe = cfg.moe
        if moe is not None and moe.is_sparse(0):
            expected.update({"blk.0.ffn_gate_inp.weight": (moe.num_experts, cfg.hidden_size),
                             "blk.0.ffn_up_exps.weight": (moe.num_experts, moe.expert_ffn, cfg.hidden_size)})
        else:
            expected["blk.0.ffn_up.weight"] = (cfg.intermediate_size, cfg.hidden_size)
    for name, shape in expected.items():
        info = gf.tensors.get(name)
        if info is None:
            raise fail(f"tensor {name} is missing (the metadata says {cfg.num_layers} layers)")
        if tuple(info.shape) != shape:
            raise fail(f"tensor {name} has shape {tuple(info.shape)}, the metadata implies {shape}")


def _rope_scaling(gf: GGUFFile) -> Optional[dict[str, Any]]:
    kind = gf.arch_key("rope.scaling.type")
    factor = gf.arch_key("rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(gf.arch_key("rope.scaling.original_context_length"))}
        for key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if gf.arch_key(key) is not None:
                scaling[hf_key] = float(gf.arch_key(key))
        return scaling
    raise ModelFormatError(
        f"{gf.path.name}: RoPE scaling type {kind!r} is not supported (linear and yarn are); use another model file"
    )


# ---------------------------------------------------------------------------
# tensors -> HF-named weights

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3-style per-frequency divisors
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, and each projection's experts stacked [E, out, in]
    # (split per expert by models/decoder.py).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "attn_sinks": "self_attn.sinks",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_.]+)\.(weight|bias)")


# Tensors the family's config reader takes (LongRoPE's factors), not weights.
CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})


def hf_name(gguf_name: str, arch: str) -> Optional[str]:
    """Hugging Face parameter name of a GGUF tensor, or None for tensors the model does not use."""
    fam = FAMILIES.get(arch)
    own = dict(fam.gguf_tensors) if fam is not None else {}
    if gguf_name in _GLOBAL_NAMES or gguf_name in own:
        return own.get(gguf_name) or _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m:
        return None
    layer, part, kind = m.groups()
    if part in own:
        target = own[part]
    elif part == "ffn_norm":
        # The pre-MLP norm: llama's post_attention_layernorm; Gemma's has that name for another.
        target = "pre_feedforward_layernorm" if fam is not None and fam.block.post_norms else "post_attention_layernorm"
    elif part == "attn_qkv":
        target = "self_attn.qkv_proj"
    elif part == "ffn_up" and fam is not None and fam.fused_projections:
        target = "mlp.gate_up_proj"  # Phi-3: gate rows, then up rows
    else:
        target = _LAYER_NAMES.get(part)
        if target is None:
            return None
    return f"model.layers.{layer}.{target}.{kind}"


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(
    gf: GGUFFile, config: ModelConfig, num_threads: Optional[int] = None,
) -> Iterator[tuple[str, Union[torch.Tensor, GGUFWeight]]]:
    """Yield (HF name, weight) pairs: quantized matrices as their raw GGUF blocks (a
    `GGUFWeight`, memory-mapped, so a quantization method can take the 4-bit codes over
    exactly), everything else as float32 tensors.

    Q/K rows are un-permuted on the raw blocks (blocks never cross rows). Float
    tensors are read on a thread pool (numpy releases the GIL while converting).
    """
    import torch

    from tessera.layers.weights import FLOAT_TYPES

    arch = config.architecture
    fam = family(arch)
    jobs = []
    for name in gf.tensors:
        target = hf_name(name, arch)
        if target is None and name in CONFIG_TENSORS:
            continue
        if target is None:
            logger.warning("ignoring tensor %s in %s (not used by the %s model)", name, gf.path.name, arch)
            continue
        jobs.append((name, target))

    def load(job: tuple[str, str]) -> tuple[str, Union[torch.Tensor, GGUFWeight]]:
        name, target = job
        info = gf.tensors[name]
        qk_heads = None
        if fam.gguf_permuted_qk and (".attn_q." in name or ".attn_k." in name):
            qk_heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
        if len(info.shape) in (2, 3) and info.ggml_type not in FLOAT_TYPES:  # 3-D: MoE experts, stacked rows
            w = gf.raw_weight(name)
            if qk_heads is not None:
                w = w.permute_rows(_unpermute_qk(np.arange(info.shape[0]), qk_heads))
            return target, w
        w = gf.dequantize(name)
        if qk_heads is not None:
            w = _unpermute_qk(w, qk_heads)
        if fam.block.norm_offset and name.endswith("norm.weight"):
            w = w - fam.block.norm_offset  # llama.cpp stores Gemma's (1 + w) norm scale; HF keeps w
        return target, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    workers = max(1, num_threads or torch.get_num_threads())
    with ThreadPoolExecutor(max_workers=workers) as pool:
        previous: Optional[str] = None
        for (name, _), item in zip(jobs, pool.map(load, jobs)):
            if previous is not None:
                gf.release(previous)  # consumed (or waiting as a view that re-reads on demand)
            yield item
            previous = name
        if previous is not None:
            gf.release(previous)
