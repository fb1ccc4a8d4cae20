"""Tensor wrapper of the batched LoRA product (lora.c)."""
from __future__ import annotations

import torch

from tessera.kernels.library import calls


def lora_add(x: torch.Tensor, y: torch.Tensor, row_slots: int, a_ptrs: int, b_ptrs: int, ranks: int,
             num_slots: int, part_ends: int, num_parts: int, scratch: int, t_stride: int, weights_bf16: bool) -> None:
    """y[m] += Bt_s^T (At_s^T x[m]) in place for each row m whose slot (int32 `row_slots`[m]) s >= 0 (see
    lora.c): x [M, K] and y [M, N] rows of unit stride (both bfloat16 or both float32), each slot's
    At [K, P * r] and Bt [r, N] (bfloat16 with `weights_bf16`, else float32). The other arguments
    are addresses (int64 per slot: `a_ptrs`, `b_ptrs`, `ranks`; int64 [P] `part_ends`; float32
    scratch [M, t_stride >= P * max rank]), taken once by the caller: this runs once per
    projection and step."""
    rc = calls().lora_add(
        x=x.data_ptr(), x_stride=x.stride(0), y=y.data_ptr(), y_stride=y.stride(0),
        x_bf16=int(x.dtype == torch.bfloat16), w_bf16=int(weights_bf16), M=x.shape[0], K=x.shape[1], N=y.shape[1],
        row_slots=row_slots, a_ptrs=a_ptrs, b_ptrs=b_ptrs, ranks=ranks, num_slots=num_slots, part_ends=part_ends,
        P=num_parts, t=scratch, t_stride=t_stride)
    if rc == -2:
        raise MemoryError("lora_add: no memory for its row buffers")
    if rc != 0:
        raise ValueError("lora_add: a row's slot is out of range or its rank exceeds the scratch")
