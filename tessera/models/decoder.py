"""The decoder every family runs: the shared blocks arranged as the family's description says.

Module names follow Hugging Face (model.layers.N.self_attn.qkv_proj, ...), with Q/K/V and gate/up
fused into one Linear each: on CPU a small model pays per-op overhead as much as FLOPs, so fewer,
larger matrix products win. RoPE rotates Q and K together from a table gathered once per step.
What differs between families (tessera/models/families) is data: where the norms sit, q/k norms,
the activation, RoPE's form per layer, multipliers and soft-caps. A block with norms before the
sublayers only keeps the residual add inside the next norm's kernel. Every family of attention
layers, mixtures of experts too, may take the one-call C decode step (models/fused_decode.py),
which reads the same modules. A layer's mixer is attention or, where `ModelConfig.layer_kinds`
says so, a recurrent mixer whose per-request state tensors take the place of the layer's KV cache:
"conv", a gated short convolution (LFM2, layers/short_conv.py), or "mamba", a Mamba-2 mixer
(Granite 4.0-H, layers/mamba2.py).
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.attention.base import AttentionMetadata, KeyBias
from tessera.config import ModelConfig
from tessera.errors import ModelFormatError
from tessera.kernels import bindings
from tessera.layers import Attention, GatedMLP, Linear, QuantConfig, RMSNorm, RotaryEmbedding, VocabEmbedding, apply_rope
from tessera.layers.moe import SparseMoE
from tessera.layers.mamba2 import Mamba2Mixer
from tessera.layers.short_conv import ShortConv
from tessera.layers.weights import AnyWeight, GGUFWeight
from tessera.models.base import ExecutionPath, ModelBase
from tessera.models.families import Block, Family, family
from tessera.models.families.base import decode_step_limits
from tessera.models.fused_decode import DecoderLayerParts, DecoderParts, FusedDecode
from tessera.models.weights import as_float_tensor, load_named_weights

logger = logging.getLogger(__name__)

# Which RoPE table a layer reads: the global one, the sliding layers' own base (Gemma 3), or none.
GLOBAL, LOCAL, NOPE = "global", "local", "nope"
_ROPE_CODES = {GLOBAL: bindings.ROPE_GLOBAL, LOCAL: bindings.ROPE_LOCAL, NOPE: bindings.ROPE_NONE}  # decode_step.c's


class DecoderAttention(nn.Module):
    def __init__(self, c: ModelConfig, block: Block, quant: QuantConfig, prefix: str, window: Optional[int]):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        self.qk_norm_kind = block.qk_norm
        self.qkv_proj = Linear(c.hidden_size, [self.q_size, self.kv_size, self.kv_size], quant,
                               bias=c.attention_bias, shard_names=["q", "k", "v"], prefix=prefix + ".qkv_proj")
        self.o_proj = Linear(self.q_size, c.hidden_size, quant, bias=c.attention_output_bias, prefix=prefix + ".o_proj")
        if block.qk_norm is not None:
            q_dim, k_dim = (c.head_dim, c.head_dim) if block.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_dim, c.rms_norm_eps, quant.dtype, block.norm_offset, prefix + ".q_norm")
            self.k_norm = RMSNorm(k_dim, c.rms_norm_eps, quant.dtype, block.norm_offset, prefix + ".k_norm")
        self.attn = Attention(c.num_heads, c.head_dim, c.attention_scale(), c.num_kv_heads, window,
                              softcap=c.attn_logit_softcapping or None)
        # Per-head norms: [Hq + Hkv, D], q_norm rows then k_norm rows (a buffer: it follows the model's device).
        self.register_buffer("qk_scale", None, persistent=False)
        # gpt-oss's learned per-head sink logits, float32 [Hq] (loaded from `self_attn.sinks`).
        self.register_buffer("sinks", torch.zeros(c.num_heads) if c.attention_sinks else None, persistent=False)
        # The key bias's outlier pairs for an int8 cache (attention/base.py's KeyBias), derived from
        # the loaded bias on first use (private: a model restored from the weight cache derives it too).
        self._key_bias: Optional[KeyBias | bool] = None

    def finish_loading(self) -> None:
        if self.qk_norm_kind == "head":
            self.qk_scale = torch.cat([self.q_norm.weight.expand(self.num_heads, -1),
                                       self.k_norm.weight.expand(self.num_kv_heads, -1)]).contiguous()

    def _qk(self, qkv: Tensor) -> Tensor:
        """Queries and keys [T, Hq + Hkv, D], normalised as the family does, before RoPE."""
        t, nq, nkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk_end = self.q_size + self.kv_size
        if self.qk_norm_kind == "head":  # every head with its own row of scales, in one call
            return F.rms_norm(qkv[:, :qk_end].view(t, nq + nkv, d), (d,), None, self.eps) * self.qk_scale
        if self.qk_norm_kind == "proj":
            q, k = self.q_norm(qkv[:, :self.q_size]), self.k_norm(qkv[:, self.q_size:qk_end])
            return torch.cat([q, k], dim=-1).view(t, nq + nkv, d)
        return qkv[:, :qk_end].view(t, nq + nkv, d)

    def forward(self, h: Tensor, rope: Optional[tuple[Tensor, Tensor]], cache: Tensor, meta: AttentionMetadata,
                rotary: RotaryEmbedding) -> Tensor:
        """`rope`: the step's rows of `rotary`'s cos/sin tables, None in a layer without RoPE."""
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(h)
        qk = self._qk(qkv)
        if rope is not None:
            qk = apply_rope(qk, rope[0], rope[1], rotary.half)
        v = qkv[:, self.q_size + self.kv_size:].view(h.shape[0], nkv, d)
        out = self.attn(qk[:, :nq], qk[:, nq:], v, cache, meta, self._bias_share(meta, rotary),
                        **({} if self.sinks is None else {"sinks": self.sinks}))
        return self.o_proj(out)

    def _bias_share(self, meta: AttentionMetadata, rotary: RotaryEmbedding) -> Optional[KeyBias]:
        """The key bias an int8 cache keeps out of its rounding (Qwen2's), else None."""
        if not meta.backend.quantized or self.qkv_proj.bias is None:
            return None
        if self._key_bias is None:  # built on first use; False when no pair stands out
            k_bias = self.qkv_proj.bias[self.q_size:self.q_size + self.kv_size]
            self._key_bias = KeyBias.for_layer(k_bias, self.num_kv_heads, self.head_dim, rotary.inv_freq,
                                               rotary.exact_cos_sin, rotary.attention_scaling) or False
        return self._key_bias or None


class DecoderLayer(nn.Module):
    """Attention then the MLP, each around the residual stream, with the family's norms. Module
    names are Hugging Face's: llama's pre-MLP norm is `post_attention_layernorm`; with norms after
    the sublayers too (Gemma) that name is the attention output's norm and the MLP's are
    `pre_feedforward_layernorm` and `post_feedforward_layernorm`."""

    def __init__(self, c: ModelConfig, block: Block, quant: QuantConfig, prefix: str, window: Optional[int],
                 rope: str, sparse: bool, kind: str = "attention"):
        super().__init__()
        self.rope = rope
        self.residual_multiplier = c.residual_multiplier
        self.kind = kind

        def norm(name: str) -> RMSNorm:
            return RMSNorm(c.hidden_size, c.rms_norm_eps, quant.dtype, block.norm_offset, f"{prefix}.{name}")

        if kind == "conv":
            self.conv = ShortConv(c.hidden_size, c.conv_kernel, c.conv_bias, quant, prefix + ".conv")
        elif kind == "mamba" and c.mamba is not None:
            self.mamba = Mamba2Mixer(c.hidden_size, c.mamba, c.rms_norm_eps, quant, prefix + ".mamba")
        else:
            self.self_attn = DecoderAttention(c, block, quant, prefix + ".self_attn", window)
        self.mlp: nn.Module = (SparseMoE(c.hidden_size, c.moe, quant, prefix + ".mlp") if sparse else
                               GatedMLP(c.hidden_size, c.intermediate_size, quant, block.activation, prefix + ".mlp"))
        self.fused_residual = block.pre_norms and not block.post_norms
        if block.pre_norms:
            self.input_layernorm = norm("input_layernorm")
        # llama: the MLP's input norm; with norms after the sublayers, the attention output's.
        self.post_attention_layernorm = norm("post_attention_layernorm")
        if not self.fused_residual:
            self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
            if block.pre_norms:
                self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        # (input norm, output norm) of each sublayer; None where the family has none.
        self.attn_norms = (getattr(self, "input_layernorm", None),
                           None if self.fused_residual else self.post_attention_layernorm)
        self.mlp_norms = ((self.post_attention_layernorm, None) if self.fused_residual else
                          (getattr(self, "pre_feedforward_layernorm", None), self.post_feedforward_layernorm))

    def sublayer(self, x: Tensor, residual: Optional[Tensor], norms: tuple[Optional[RMSNorm], Optional[RMSNorm]],
                 fn: Callable[..., Tensor], *args) -> tuple[Tensor, Optional[Tensor]]:
        """One sublayer `fn(h, *args)` around the stream, which is `x` (+ `residual` when one is pending).

        Norm before only (llama): the add is left pending and folded into the next norm's call,
        which returns the new residual; the result is (the sublayer's output, the residual).
        A norm after: the stream is added up here and the result is (new stream, None)."""
        norm_in, norm_out = norms
        m = self.residual_multiplier
        if norm_out is None:
            h, residual = (norm_in(x), x) if residual is None else norm_in(x, residual)
            y = fn(h, *args)
            return (y if m == 1.0 else y * m), residual
        stream = x if residual is None else x + residual
        y = norm_out(fn(stream if norm_in is None else norm_in(stream), *args))
        return stream + (y if m == 1.0 else y * m), None


class DecoderModel(nn.Module):
    def __init__(self, c: ModelConfig, block: Block, quant: QuantConfig, ropes: Sequence[str]):
        super().__init__()
        windows = c.layer_windows()
        kinds = c.layer_kinds or ["attention"] * c.num_layers
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, quant, prefix="model.embed_tokens")
        self.layers = nn.ModuleList(DecoderLayer(c, block, quant, f"model.layers.{i}", windows[i], ropes[i],
                                                 c.moe is not None and c.moe.is_sparse(i), kinds[i])
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, quant.dtype, block.norm_offset, prefix="model.norm")


class DecoderForCausalLM(nn.Module, ModelBase):
    """A decoder of any family (tessera/models/families). Besides its modules' forward it offers
    decode steps as one C call (models/fused_decode.py) where families/base.py's decode_step_limits
    finds nothing against it, which the runner takes where the plan applies."""

    def __init__(self, config: ModelConfig, quant: QuantConfig):
        super().__init__()
        c = config
        self.config = c
        self.family: Family = family(c.architecture)
        self.dtype = quant.dtype
        windows = c.layer_windows()
        local = c.rope_local_base_freq is not None
        nope = set(c.nope_layers)
        self.ropes = [NOPE if i in nope else LOCAL if local and windows[i] is not None else GLOBAL
                      for i in range(c.num_layers)]
        self.model = DecoderModel(c, self.family.block, quant, self.ropes)
        self.lm_head = (self.model.embed_tokens if c.tie_word_embeddings
                        else VocabEmbedding(c.vocab_size, c.hidden_size, quant, prefix="lm_head"))
        # Rebuilt in load_weights when the GGUF carries rope_freqs; built here so that a model restored
        # from the packed-weight cache (models/weight_cache.py) has the same modules.
        self.rotary_emb = self._rotary(c.rope_theta, c.rope_scaling)
        self.rotary_local = self._rotary(c.rope_local_base_freq, None) if local else None
        self.embed_scale: Optional[Union[Tensor, float]] = None
        if self.family.block.embed_scale:  # HF rounds the scale to the compute dtype; so do we
            self.embed_scale = torch.tensor(c.hidden_size ** 0.5, dtype=quant.dtype)
        elif c.embedding_multiplier is not None:
            self.embed_scale = float(c.embedding_multiplier)

    def _rotary(self, theta: float, scaling, freq_factors: Optional[Tensor] = None) -> RotaryEmbedding:
        c = self.config
        return RotaryEmbedding(c.rotary_dim or c.head_dim, theta, scaling, c.max_position_embeddings, self.dtype,
                               freq_factors)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
                     source: str = "checkpoint") -> None:
        extra: dict = {}
        if self.family.renames:
            weights = _renamed(weights, self.family.renames)
        if self.family.fused_projections:
            weights = _split_fused(weights, self.config)
        if self.config.moe is not None:
            weights = _split_experts(weights, self.config)
        load_named_weights(self, weights, source, extra)
        if self.config.attention_sinks:
            for i, layer in enumerate(self.model.layers):
                name = f"model.layers.{i}.self_attn.sinks"
                sinks = extra.get(name, extra.get(name + ".weight"))  # the GGUF's attn_sinks.weight
                if sinks is None or tuple(sinks.shape) != (self.config.num_heads,):
                    raise ModelFormatError(f"{source}: layer {i}'s attention sinks are missing or not "
                                           f"[{self.config.num_heads}]")
                layer.self_attn.sinks = as_float_tensor(sinks).float().contiguous()
        freqs = extra.get("rope_freqs")
        if freqs is not None:
            self.rotary_emb = self._rotary(self.config.rope_theta, self.config.rope_scaling, as_float_tensor(freqs))
        for i, layer in enumerate(self.model.layers):
            try:
                if layer.kind == "conv":
                    name = f"model.layers.{i}.conv.conv"
                    weight = extra.get(name + ".weight")
                    if weight is None:
                        raise ValueError(f"{source}: layer {i}'s short convolution weight {name}.weight is missing")
                    bias = extra.get(name + ".bias")
                    layer.conv.load_conv(as_float_tensor(weight), None if bias is None else as_float_tensor(bias),
                                         self.dtype, source)
                elif layer.kind == "mamba":
                    prefix = f"model.layers.{i}.mamba."
                    layer.mamba.load({k.removeprefix(prefix): as_float_tensor(v) for k, v in extra.items()
                                      if k.startswith(prefix)}, self.dtype, source)
                else:
                    layer.self_attn.finish_loading()
            except ValueError as exc:
                raise ModelFormatError(str(exc)) from None

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                attn_meta: AttentionMetadata, layers: Optional[Sequence[int]] = None,
                embeds: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
        """Final hidden states of the packed batch through the modules; `layers` runs only those
        decoder layers (self-speculative drafting), each still with its own cache. `embeds`: (rows,
        their embeddings) that replace those rows' token embeddings (an image's placeholders)."""
        tables = {GLOBAL: self.rotary_emb(positions), NOPE: None}
        if self.rotary_local is not None:
            tables[LOCAL] = self.rotary_local(positions)
        x = self.model.embed_tokens.embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        residual = None
        for i in (range(len(self.model.layers)) if layers is None else layers):
            layer, cache, meta = self.model.layers[i], kv_caches[i], attn_meta.for_layer(i)
            if layer.kind != "attention":  # `cache`: the layer's state tensors, a row per state slot
                mixer = layer.conv if layer.kind == "conv" else layer.mamba
                x, residual = layer.sublayer(x, residual, layer.attn_norms, mixer, cache, meta)
            else:
                rope, rotary = tables[layer.rope], self.rotary_local if layer.rope == LOCAL else self.rotary_emb
                x, residual = layer.sublayer(x, residual, layer.attn_norms, layer.self_attn, rope, cache, meta, rotary)
            x, residual = layer.sublayer(x, residual, layer.mlp_norms, layer.mlp)
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden).float()
        c = self.config
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def fit_context(self, max_model_len: int) -> None:
        if self.rotary_emb.long_inv_freq is not None:
            long = self.rotary_emb.use_long_factors(max_model_len)
            logger.info("LongRoPE: the %s factors for every position (max_model_len %d %s the pretraining "
                        "length %d)", "long" if long else "short", max_model_len, ">" if long else "<=",
                        self.rotary_emb.original_max_positions)

    def decode_step_limits(self) -> list[str]:
        """What keeps this model's decode steps off the one-call C step (empty: nothing)."""
        return decode_step_limits(self.family.block, self.config, recurrent=self.family.recurrent)

    def execution_paths(self) -> frozenset[ExecutionPath]:
        if self.decode_step_limits():
            return frozenset({ExecutionPath.MODULES})
        return frozenset({ExecutionPath.MODULES, ExecutionPath.C_DECODE})

    def plan_fused_decode(self) -> Optional[FusedDecode]:
        """The C decode step over these weights (see ModelBase), or None where some part has no
        C kernel here."""
        layers = []
        for layer in self.model.layers:
            attn = layer.self_attn
            (attn_norm, attn_out_norm), (mlp_norm, mlp_out_norm) = layer.attn_norms, layer.mlp_norms
            qk_norm = attn.qk_norm_kind is not None
            layers.append(DecoderLayerParts(
                attn_norm, attn_out_norm, attn.qkv_proj, attn.q_norm if qk_norm else None,
                attn.k_norm if qk_norm else None, attn.attn, attn.o_proj, mlp_norm, mlp_out_norm, layer.mlp,
                _ROPE_CODES[layer.rope], attn.sinks))
        return FusedDecode.build(DecoderParts(
            self.config, self.dtype, self.model.embed_tokens, self.embed_scale, self.rotary_emb, self.rotary_local,
            self.family.block.qk_norm, layers, self.model.norm))


def _renamed(weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
             renames: tuple[tuple[str, str], ...]) -> Iterator[tuple[str, Union[Tensor, AnyWeight]]]:
    """Checkpoint names in the shared decoder's module names (the family's `renames`)."""
    for name, w in weights:
        for old, new in renames:
            name = name.replace(old, new)
        yield name, w


def _split_rows(w: Union[Tensor, AnyWeight], sizes: Sequence[int]) -> list[Union[Tensor, AnyWeight]]:
    """A fused matrix's row blocks (blocks of a quantized GGUF matrix never cross rows)."""
    out, start = [], 0
    for n in sizes:
        if isinstance(w, GGUFWeight):
            out.append(GGUFWeight(w.raw[start:start + n], w.ggml_type, (n, w.shape[1])))
        else:
            out.append(as_float_tensor(w)[start:start + n])
        start += n
    return out


_FUSED = re.compile(r"(.*)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)")


def _split_fused(weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
                 c: ModelConfig) -> Iterator[tuple[str, Union[Tensor, AnyWeight]]]:
    """Phi-3's fused `qkv_proj` and `gate_up_proj` tensors as the q/k/v and gate/up parts the
    packed-module map routes (the layers fuse them again, checking each part's shape)."""
    q, kv, ff = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    parts = {"self_attn.qkv_proj": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), (q, kv, kv)),
             "mlp.gate_up_proj": (("mlp.gate_proj", "mlp.up_proj"), (ff, ff))}
    for name, w in weights:
        m = _FUSED.fullmatch(name)
        if m is None:
            yield name, w
            continue
        layer, fused, kind = m.groups()
        names, sizes = parts[fused]
        if w.shape[0] != sum(sizes):
            raise ModelFormatError(f"{name} has {w.shape[0]} rows; the config implies {sum(sizes)} "
                                   f"({' + '.join(map(str, sizes))})")
        for part, piece in zip(names, _split_rows(w, sizes)):
            yield f"{layer}.{part}.{kind}", piece


# Expert tensors as checkpoints lay them out, renamed to SparseMoE's `gate` and per-expert
# `experts.N.{gate,up,down}_proj`: Mixtral's block_sparse_moe and w1/w3/w2, gpt-oss's `router`.
_EXPERT_RENAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                   (".w2.", ".down_proj."), ("mlp.router.", "mlp.gate."))
_MOE = re.compile(r"(model\.layers\.\d+\.)(block_sparse_moe|mlp)\.(.*)")
# Stacked tensors, one row block per expert: GGUF's *_exps ([E, out, in] named here
# mlp.experts.{gate,up,down}_proj.{weight,bias}) and gpt-oss's transposed, gate/up-interleaved
# mlp.experts.gate_up_proj [E, in, 2 out] and down_proj [E, in, out] (with `_bias` [E, 2 out] / [E, out]).
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj|gate_up_proj)"
                      r"(\.weight|\.bias|_bias)?")


def _split_experts(weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
                   c: ModelConfig) -> Iterator[tuple[str, Union[Tensor, AnyWeight]]]:
    """Every layout of expert weights as SparseMoE's per-expert names. A GGUF's quantized stacks
    are split into row blocks of the mapped file (no copy); each expert's Linear keeps its blocks."""
    experts = c.moe.num_experts

    def stack(name: str, w: Union[Tensor, AnyWeight], dims: int) -> Tensor:
        t = as_float_tensor(w)
        if t.dim() != dims or t.shape[0] != experts:
            raise ModelFormatError(f"{name} has shape {tuple(t.shape)}; expected {dims} dimensions, the first "
                                   f"the config's {experts} experts")
        return t

    for name, w in weights:
        if _MOE.fullmatch(name) is None:
            yield name, w
            continue
        for old, new in _EXPERT_RENAMES:
            name = name.replace(old, new)
        s = _STACKED.fullmatch(name)
        if s is None:
            yield name, w
            continue
        prefix, proj, kind = s.groups()
        if kind in ("_bias", ".bias"):  # [E, out]; gpt-oss's gate_up bias interleaves gate and up
            t = stack(name, w, 2)
            for e in range(experts):
                if proj == "gate_up_proj":
                    yield f"{prefix}.{e}.gate_proj.bias", t[e, 0::2]
                    yield f"{prefix}.{e}.up_proj.bias", t[e, 1::2]
                else:
                    yield f"{prefix}.{e}.{proj}.bias", t[e]
            continue
        if kind is None:  # gpt-oss (Hugging Face): x @ W, [E, in, out], gate/up columns interleaved
            t = stack(name, w, 3)
            for e in range(experts):
                if proj == "gate_up_proj":
                    yield f"{prefix}.{e}.gate_proj.weight", t[e, :, 0::2].t().contiguous()
                    yield f"{prefix}.{e}.up_proj.weight", t[e, :, 1::2].t().contiguous()
                else:
                    yield f"{prefix}.{e}.{proj}.weight", t[e].t().contiguous()
            continue
        # [E, out, in]; a GGUF's quantized stack comes as its E * out rows. llama.cpp's
        # --fuse-gate-up-exps writes gate_up_exps: each expert's gate rows, then its up rows.
        if isinstance(w, GGUFWeight):
            rows = w.shape[0] // experts
            if rows == 0 or w.shape[0] != experts * rows:
                raise ModelFormatError(f"{name} has {w.shape[0]} rows, not a whole number per expert of {experts}")
            pieces = _split_rows(w, [rows] * experts)
        else:
            pieces = list(stack(name, w, 3))
        for e, piece in enumerate(pieces):
            if proj == "gate_up_proj":
                gate, up = _split_rows(piece, [piece.shape[0] // 2] * 2)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.{e}.{proj}.weight", piece
