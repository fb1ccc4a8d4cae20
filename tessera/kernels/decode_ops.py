"""Tensor wrappers of the one-call decoder step (decode_step.c)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from tessera.kernels.bindings import DecodeDims, DecodeLayer, LoRAStep
from tessera.kernels.library import calls, load


def decode_step_workspace_bytes(layers: "ctypes.Array[DecodeLayer]", dims: DecodeDims, rows: int, max_len: int) -> int:
    return load().decode_step_workspace_bytes(ctypes.addressof(layers), len(layers), ctypes.byref(dims), rows, max_len)


def decode_step(layers: "ctypes.Array[DecodeLayer]", dims: DecodeDims, final_norm: torch.Tensor,
                x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                local_rope: Optional[tuple[torch.Tensor, torch.Tensor]], half: int, slots: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                workspace: torch.Tensor, lora: Optional[LoRAStep] = None) -> bool:
    """Run every layer of a decode step over x [M, H] in place (embeddings in, the final norm's output
    out): decode_step_bf16 for bfloat16 rows, decode_step_f32 for float32 (see decode_step.c; the
    layers' norms, operands and caches of the same dtype). `rope`: (cos, sin) [M, R] of x's dtype;
    `local_rope`: the sliding layers' own, or None; slots [G, M] and block_tables [G, M, max_blocks]
    int64 per KV-cache group, seq_lens [M] int64, all contiguous; `workspace` at least
    decode_step_workspace_bytes; `lora`: the rows' adapters, or None. False when a kernel refused its
    arguments."""
    fn = calls().decode_step_bf16 if x.dtype == torch.bfloat16 else calls().decode_step_f32
    return fn(
        layers=ctypes.addressof(layers), L=len(layers), d=ctypes.byref(dims), final_norm=final_norm.data_ptr(),
        M=x.shape[0], x=x.data_ptr(), cos=rope[0].data_ptr(), sin=rope[1].data_ptr(),
        cos_local=None if local_rope is None else local_rope[0].data_ptr(),
        sin_local=None if local_rope is None else local_rope[1].data_ptr(), half=half, slots=slots.data_ptr(),
        block_tables=block_tables.data_ptr(), seq_lens=seq_lens.data_ptr(), max_len=max_len,
        workspace=workspace.data_ptr(), lora=None if lora is None else ctypes.addressof(lora)) == 0
