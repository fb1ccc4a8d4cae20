"""A decoder's decode step in one C call (tessera/kernels/decode_step.c).

Why: at one to a few decode rows, the module path's ~20 operators and kernel calls per layer
cost more in dispatch than their arithmetic (SmolLM2-135M: ~600 calls a token, of a few
microseconds each, against ~3 ms of weight reads). The C step runs the same kernels in the
same order with the same roundings, so it is a faster route to the same result, taken only
where every piece has a kernel: bfloat16 compute on an AVX512-BF16 host or float32 compute (hosts
and levels without native bfloat16: int4 through the AVX2 kernel), int4, int8-group, Q4_K/Q6_K or
MXFP4 projections, mixture-of-experts layers whose experts are such projections (fused_moe.py), the
paged backend's cache of the compute dtype, decode-only steps, rows of LoRA adapters among them
(lora.c beside each projection, as layers/linear.py adds them; experts have none). Everything
else (prefill, mixed steps, other weight formats, int8 caches) runs the modules. Which families'
blocks it expresses is decided in one place (families/base.py's decode_step_limits); what is
checked here is what depends on the loaded weights and the host.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from tessera.activations import ACTIVATIONS
from tessera.kernels import bindings, capabilities, decode_ops, library
from tessera.attention.base import AttentionMetadata
from tessera.config import ModelConfig
from tessera.layers import Attention, GatedMLP, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding
from tessera.layers.lora import LoRASlots
from tessera.layers.moe import SparseMoE
from tessera.models.fused_moe import MoEOperands, moe_limits

logger = logging.getLogger(__name__)

# Rows per step taken in C: int4_gemm_bf16's limit, past which the module path's dense matmuls win.
MAX_ROWS = 64
_QK_NORMS = {None: bindings.QK_NORM_NONE, "head": bindings.QK_NORM_HEAD, "proj": bindings.QK_NORM_PROJ}


@dataclass(frozen=True)
class DecoderLayerParts:
    """One decoder layer's modules in the order decode_step.c runs them. A model names its own
    modules here, so this plan needs no knowledge of any model class. Each sublayer has an input
    norm, an output norm (before the residual add), or both (models/decoder.py's DecoderLayer)."""

    attn_norm: Optional[RMSNorm]
    attn_out_norm: Optional[RMSNorm]
    qkv_proj: Linear  # fused Q, K, V rows; the only projection that may carry a bias
    q_norm: Optional[RMSNorm]  # q/k norms (per head or over the projection), before RoPE
    k_norm: Optional[RMSNorm]
    attn: Attention
    o_proj: Linear
    mlp_norm: Optional[RMSNorm]
    mlp_out_norm: Optional[RMSNorm]
    mlp: Union[GatedMLP, SparseMoE]  # fused gate and up rows, then down; or a mixture of such experts
    rope: int  # bindings.ROPE_GLOBAL, ROPE_LOCAL or ROPE_NONE
    sinks: Optional[Tensor] = None  # float32 [Hq] attention sink logits (gpt-oss)

    def projections(self) -> tuple[Linear, Linear, Optional[Linear], Optional[Linear]]:
        """QKV, O, and the dense MLP's gate/up and down (None in a mixture-of-experts layer), in
        layer_t's order."""
        mlp = self.mlp
        if isinstance(mlp, SparseMoE):
            return self.qkv_proj, self.o_proj, None, None
        return self.qkv_proj, self.o_proj, mlp.gate_up_proj, mlp.down_proj


@dataclass(frozen=True)
class DecoderParts:
    """A decoder's modules, as the C step reads them."""

    config: ModelConfig
    dtype: torch.dtype  # the compute dtype the model was built for
    embed: VocabEmbedding
    embed_scale: Optional[Union[Tensor, float]]  # the embeddings' factor, as the modules multiply by it
    rotary: RotaryEmbedding
    rotary_local: Optional[RotaryEmbedding]  # the sliding layers' own base (Gemma 3)
    qk_norm: Optional[str]  # "head", "proj" or None (families/base.py's Block.qk_norm)
    layers: Sequence[DecoderLayerParts]
    final_norm: RMSNorm


def _norm_ptr(norm: Optional[RMSNorm]) -> Optional[int]:
    return None if norm is None else norm.weight.data_ptr()


def _plan_limits(parts: DecoderParts) -> list[str]:
    """What of these loaded weights, on this host, has no C kernel in the step (empty: none)."""
    c, dtype = parts.config, parts.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return [f"{dtype} compute"]
    if dtype == torch.bfloat16 and not capabilities.bf16_matmuls():
        return ["bfloat16 compute without AVX512-BF16"]
    if library.available() is not None:
        return ["no kernel library"]
    why = []
    if c.hidden_size > bindings.MAX_NORM_HIDDEN or c.head_dim > bindings.MAX_HEAD_DIM or c.head_dim % 32:
        why.append(f"hidden size {c.hidden_size} or head size {c.head_dim}")
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if parts.qk_norm == "proj" and max(q_size, kv_size) > bindings.MAX_NORM_HIDDEN:
        why.append("q/k norms wider than the norm kernel's rows")
    if len({layer.attn.scale for layer in parts.layers}) != 1 or len({layer.attn.softcap for layer in parts.layers}) != 1:
        why.append("attention scales or soft-caps that differ between layers")
    norms = [parts.final_norm]
    for layer in parts.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            why += moe_limits(mlp, dtype)
        elif (not isinstance(mlp, GatedMLP) or ACTIVATIONS[mlp.activation].c_code is None
              or mlp.activation == "swiglu_clamped"):  # dims_t carries no clamp for a dense MLP
            why.append(f"an MLP of {type(mlp).__name__} ({getattr(mlp, 'activation', '')})")
            continue
        lins = [lin for lin in layer.projections() if lin is not None]
        if any(lin.bias is not None and lin.bias.dtype != dtype for lin in lins):
            why.append("a projection bias of another dtype")
        if layer.sinks is not None and (layer.sinks.dtype != torch.float32 or layer.sinks.numel() != c.num_heads
                                        or not layer.sinks.is_contiguous()):
            why.append("attention sinks not float32 [heads]")
        if layer.rope == bindings.ROPE_LOCAL and parts.rotary_local is None:
            why.append("a local RoPE layer without its table")
        if any(lin.kernel_operand() is None for lin in lins):
            why.append("a projection's weight format")
        norms += [n for n in (layer.attn_norm, layer.attn_out_norm, layer.mlp_norm, layer.mlp_out_norm,
                              layer.q_norm, layer.k_norm) if n is not None]
    if any(n.weight.dtype != dtype for n in norms):
        why.append("norm weights of another dtype")
    return sorted(set(why))


class FusedDecode:
    """The weights' addresses, laid out once as decode_step.c reads them; `run` per step
    (a `tessera.models.base.FusedDecodeStep`)."""

    def __init__(self, parts: DecoderParts, layers: "ctypes.Array[bindings.DecodeLayer]",
                 dims: bindings.DecodeDims, max_rows: int = MAX_ROWS, moe: Sequence[MoEOperands] = ()) -> None:
        self.parts = parts
        self.layers = layers
        self.moe = tuple(moe)  # the mixture-of-experts blocks `layers` points at
        self.dims = dims
        self.max_rows = max_rows  # past it some projection's module path multiplies another way
        self._caches: Optional[tuple[int, ...]] = None  # the cache addresses `layers` holds
        self._groups: Optional[tuple[int, ...]] = None  # each layer's KV-cache group `layers` holds
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._lora_step = bindings.LoRAStep()
        self._lora_bound: Optional[tuple[LoRASlots, list]] = None  # the slots and tables `layers` points at

    @classmethod
    def build(cls, parts: DecoderParts) -> Optional["FusedDecode"]:
        """The plan for a decoder's loaded weights, or None (said in the log) where some part has no
        C kernel here."""
        why = _plan_limits(parts)
        if why:
            logger.info("the one-call C decode step has no kernel here for %s", ", ".join(why))
            return None
        c, first = parts.config, parts.layers[0]
        rows, max_rows, blocks = [], MAX_ROWS, []
        for layer in parts.layers:
            ops = [bindings.LinearOperand() if lin is None else lin.kernel_operand() for lin in layer.projections()]
            limits = [op.max_rows for op in ops if op.max_rows]
            moe = None
            if isinstance(layer.mlp, SparseMoE):
                moe = MoEOperands(layer.mlp)
                blocks.append(moe)
                limits += [moe.max_rows] if moe.max_rows else []
            max_rows = min([max_rows] + limits)
            norms = (layer.attn_norm, layer.attn_out_norm, layer.mlp_norm, layer.mlp_out_norm, layer.q_norm,
                     layer.k_norm)
            rows.append(bindings.DecodeLayer(*map(_norm_ptr, norms), *ops, None, layer.rope,
                                             layer.attn.sliding_window or 0, 0, None if moe is None else moe.address,
                                             None if layer.sinks is None else layer.sinks.data_ptr()))
        dense = next((layer.mlp for layer in parts.layers if isinstance(layer.mlp, GatedMLP)), None)
        dims = bindings.DecodeDims(hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                   head_dim=c.head_dim, intermediate=c.intermediate_size, eps=c.rms_norm_eps,
                                   scale=first.attn.scale, rotary_dim=c.rotary_dim or c.head_dim,
                                   qk_norm=_QK_NORMS[parts.qk_norm],
                                   activation=ACTIVATIONS[dense.activation].c_code if dense else bindings.ACT_SILU,
                                   residual_multiplier=c.residual_multiplier, softcap=first.attn.softcap or 0.0)
        logger.info("decode steps of 1-%d rows take the one-call C decode step%s", max_rows,
                    f" ({len(blocks)} mixture-of-experts layers in it)" if blocks else "")
        return cls(parts, (bindings.DecodeLayer * len(rows))(*rows), dims, max_rows, blocks)

    def applies(self, input_ids: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata) -> bool:
        """Whether this step is one the C step takes: decode rows only, few enough, a cache the
        backend lets C write and read (each layer with its KV-cache group's tables)."""
        return (meta.num_decodes == meta.num_reqs and 0 < meta.num_reqs <= self.max_rows
                and input_ids.is_cpu and kv_caches[0].dtype == self.parts.dtype
                and meta.backend.decode_in_c(self.dims.num_heads, kv_caches[0]))

    def _bind_caches(self, kv_caches: list[Tensor]) -> None:
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs == self._caches:
            return
        shapes = {tuple(c.shape) for c in kv_caches}
        if len(shapes) != 1 or len(kv_caches) != len(self.layers):
            raise ValueError("every layer's KV cache must have the same shape")
        _, _, num_blocks, block_size, _ = kv_caches[0].shape
        self.dims.num_blocks, self.dims.block_size = num_blocks, block_size
        for layer, p in zip(self.layers, ptrs):
            layer.kv_cache = p
        self._caches = ptrs

    def _bind_lora(self, lora: LoRASlots) -> None:
        """Point each projection at its LoRA table. The tables are made with their `LoRASlots` when
        adapters are enabled (after this plan; again for an engine made anew on the same loaded
        model), and their address arrays stay put while slots change hands: binding is per slots
        object, not per step."""
        tables = [None if lin is None else lin.lora for layer in self.parts.layers for lin in layer.projections()]
        ops = [op for row in self.layers for op in (row.qkv, row.o, row.gate_up, row.down)]
        for table, op in zip(tables, ops):
            if table is None:
                op.lora_a = op.lora_b = op.lora_ends = None
                op.lora_parts = 0
            else:
                op.lora_a, op.lora_b, op.lora_ends, op.lora_parts = table.addresses
        self._lora_bound = (lora, tables)  # kept alive while `layers` holds their addresses

    def _lora_args(self, lora: LoRASlots) -> bindings.LoRAStep:
        """This step's lora_step_t."""
        if self._lora_bound is None or self._lora_bound[0] is not lora:
            self._bind_lora(lora)
        rows_p, ranks_p, num_slots, scratch_p, width = lora.step_args
        step = self._lora_step
        step.row_slots, step.ranks, step.num_slots, step.t, step.t_stride = rows_p, ranks_p, num_slots, scratch_p, width
        step.w_bf16 = int(lora.dtype == torch.bfloat16)
        return step

    def _step_tables(self, meta: AttentionMetadata, m: int) -> tuple:
        """(seq_lens [M], block tables [G, M, W], slots [G, M], max_len, each layer's group) of a step,
        made once and shared with later calls on the same metadata. G: the step's KV-cache groups
        (kv_groups.py; one without sliding layers or hybrid groups), in order of first use."""
        cached = meta._cache.get("paged_decode_c")
        if cached is not None:
            return cached
        groups: list[AttentionMetadata] = []
        index: dict[int, int] = {}
        layer_groups = []
        for i in range(len(self.layers)):
            g = meta.for_layer(i)
            if id(g) not in index:
                index[id(g)] = len(groups)
                groups.append(g)
            layer_groups.append(index[id(g)])
        if len(groups) == 1:
            tables = groups[0].block_tables[:m].contiguous().unsqueeze(0)
        else:  # each group's tables, padded to the widest
            tables = torch.zeros(len(groups), m, max(g.block_tables.shape[1] for g in groups), dtype=torch.long)
            for j, g in enumerate(groups):
                tables[j, :, :g.block_tables.shape[1]] = g.block_tables[:m]
        slots = torch.stack([g.slot_mapping[:m] for g in groups]).contiguous()
        cached = (torch.tensor(meta.seq_lens, dtype=torch.long), tables, slots, max(meta.seq_lens),
                  tuple(layer_groups))
        meta._cache["paged_decode_c"] = cached
        return cached

    def run(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
            meta: AttentionMetadata, lora: Optional[LoRASlots] = None) -> Optional[Tensor]:
        """The final hidden states [M, H] of a decode step, or None if a kernel refused (the caller
        then runs the modules, which rewrite every cache slot this step wrote). `lora`: the step's
        adapters, when some row has one."""
        parts = self.parts
        self._bind_caches(kv_caches)
        lora_args = self._lora_args(lora) if lora is not None and lora.active else None
        m = input_ids.shape[0]
        x = parts.embed.embed(input_ids)
        x = (x if parts.embed_scale is None else x * parts.embed_scale).contiguous()

        def table(rotary: RotaryEmbedding) -> tuple[Tensor, Tensor]:
            cos, sin = rotary(positions)
            return cos.view(m, -1).contiguous(), sin.view(m, -1).contiguous()

        rope = table(parts.rotary)
        local = None if parts.rotary_local is None else table(parts.rotary_local)
        seq_lens, tables, slots, max_len, layer_groups = self._step_tables(meta, m)
        if layer_groups != self._groups:
            for layer, g in zip(self.layers, layer_groups):
                layer.group = g
            self._groups = layer_groups
        self.dims.max_blocks = tables.shape[2]
        need = decode_ops.decode_step_workspace_bytes(self.layers, self.dims, m, max_len)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(max(need, 2 * self._workspace.numel()), dtype=torch.uint8)
        ok = decode_ops.decode_step(self.layers, self.dims, parts.final_norm.weight, x, rope, local,
                                    parts.rotary.half, slots, tables, seq_lens, max_len, self._workspace, lora_args)
        return x if ok else None
