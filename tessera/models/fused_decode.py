"""A llama-family decode step in one C call (tessera/kernels/decode_step.c).

Why: at one to a few decode rows, the module path's ~20 operators and kernel calls per layer
cost more in dispatch than their arithmetic (SmolLM2-135M: ~600 calls a token, of a few
microseconds each, against ~3 ms of weight reads). The C step runs the same kernels in the
same order with the same roundings, so it is a faster route to the same result, taken only
where every piece has a kernel: bfloat16 compute on an AVX512-BF16 host or float32 compute (hosts
and levels without native bfloat16: int4 through the AVX2 kernel), int4, int8-group or Q4_K/Q6_K
projections, the paged backend's cache of the compute dtype, decode-only steps, rows of
LoRA adapters among them (lora.c beside each projection, as layers/linear.py adds them). Everything
else (prefill, mixed steps, other weight formats, int8 caches) runs the modules.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from tessera.kernels import bindings, capabilities, decode_ops, library
from tessera.attention.base import AttentionMetadata
from tessera.config import ModelConfig
from tessera.layers import Attention, GatedMLP, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding
from tessera.layers.lora import LoRASlots

# Rows per step taken in C: int4_gemm_bf16's limit, past which the module path's dense matmuls win.
MAX_ROWS = 64


@dataclass(frozen=True)
class DecoderLayerParts:
    """One pre-norm decoder layer's modules in the order decode_step.c runs them. A model names
    its own modules here, so this plan needs no knowledge of any model class."""

    input_norm: RMSNorm
    qkv_proj: Linear  # fused Q, K, V rows; the only projection that may carry a bias
    attn: Attention
    o_proj: Linear
    post_norm: RMSNorm
    mlp: GatedMLP  # fused gate and up rows, then down


@dataclass(frozen=True)
class DecoderParts:
    """A llama-shaped decoder's modules, as the C step reads them."""

    config: ModelConfig
    dtype: torch.dtype  # the compute dtype the model was built for
    embed: VocabEmbedding
    rotary: RotaryEmbedding
    layers: Sequence[DecoderLayerParts]
    final_norm: RMSNorm


class FusedDecode:
    """The weights' addresses, laid out once as decode_step.c reads them; `run` per step
    (a `tessera.models.base.FusedDecodeStep`)."""

    def __init__(self, parts: DecoderParts, layers: "ctypes.Array[bindings.DecodeLayer]",
                 dims: bindings.DecodeDims, max_rows: int = MAX_ROWS) -> None:
        self.parts = parts
        self.layers = layers
        self.dims = dims
        self.max_rows = max_rows  # past it some projection's module path multiplies another way
        self._caches: Optional[tuple[int, ...]] = None  # the cache addresses `layers` holds
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._lora_step = bindings.LoRAStep()
        self._lora_bound: Optional[tuple[LoRASlots, list]] = None  # the slots and tables `layers` points at

    @classmethod
    def build(cls, parts: DecoderParts) -> Optional["FusedDecode"]:
        """The plan for a decoder's loaded weights, or None where some part has no C kernel here."""
        c, dtype = parts.config, parts.dtype
        if dtype == torch.bfloat16 and not capabilities.bf16_matmuls():
            return None
        if dtype not in (torch.bfloat16, torch.float32) or library.available() is not None:
            return None
        if c.hidden_size > bindings.MAX_NORM_HIDDEN or c.head_dim > bindings.MAX_HEAD_DIM or c.head_dim % 32:
            return None
        rows, max_rows = [], MAX_ROWS
        for layer in parts.layers:
            mlp = layer.mlp
            if layer.attn.sliding_window is not None or mlp.activation != "silu":
                return None
            if any(lin.bias is not None for lin in (layer.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                return None
            if layer.qkv_proj.bias is not None and layer.qkv_proj.bias.dtype != dtype:
                return None
            ops = [lin.kernel_operand() for lin in (layer.qkv_proj, layer.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (layer.input_norm.weight, layer.post_norm.weight)
            if any(op is None for op in ops) or any(w.dtype != dtype for w in norms):
                return None
            max_rows = min([max_rows] + [op.max_rows for op in ops if op.max_rows])
            rows.append(bindings.DecodeLayer(norms[0].data_ptr(), norms[1].data_ptr(), *ops, None))
        if parts.final_norm.weight.dtype != dtype:
            return None
        dims = bindings.DecodeDims(hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                  head_dim=c.head_dim, intermediate=c.intermediate_size,
                                  eps=c.rms_norm_eps, scale=parts.layers[0].attn.scale)
        return cls(parts, (bindings.DecodeLayer * len(rows))(*rows), dims, max_rows)

    def applies(self, input_ids: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata) -> bool:
        """Whether this step is one the C step takes: decode rows only, few enough, every layer
        reading the same tables, a cache the backend lets C write and read."""
        return (meta.num_decodes == meta.num_reqs and 0 < meta.num_reqs <= self.max_rows and meta.layers is None
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
        tables = [lin.lora for layer in self.parts.layers
                  for lin in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
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

    def run(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
            meta: AttentionMetadata, lora: Optional[LoRASlots] = None) -> Optional[Tensor]:
        """The final hidden states [M, H] of a decode step, or None if a kernel refused (the caller
        then runs the modules, which rewrite every cache slot this step wrote). `lora`: the step's
        adapters, when some row has one."""
        parts = self.parts
        self._bind_caches(kv_caches)
        lora_args = self._lora_args(lora) if lora is not None and lora.active else None
        m = input_ids.shape[0]
        x = parts.embed.embed(input_ids).contiguous()
        cos, sin = parts.rotary(positions)
        cos, sin = cos.view(m, -1).contiguous(), sin.view(m, -1).contiguous()
        cached = meta._cache.get("paged_decode_c")
        if cached is None:
            tables = meta.block_tables[:m].contiguous()
            cached = (torch.tensor(meta.seq_lens, dtype=torch.long), tables, max(meta.seq_lens))
            meta._cache["paged_decode_c"] = cached
        seq_lens, tables, max_len = cached
        self.dims.max_blocks = tables.shape[1]
        need = decode_ops.decode_step_workspace_bytes(self.layers, self.dims, m, max_len)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(max(need, 2 * self._workspace.numel()), dtype=torch.uint8)
        ok = decode_ops.decode_step(self.layers, self.dims, parts.final_norm.weight, x, cos, sin,
                                      parts.rotary.half, meta.slot_mapping.contiguous(), tables, seq_lens,
                                      max_len, self._workspace, lora_args)
        return x if ok else None
