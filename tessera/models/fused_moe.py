"""Mixture-of-experts layers in the one-call C decode step (kernels/moe_step.c).

Why: a decode step of a mixture of experts through the modules is a router product, a top-k, and per
chosen expert three products and a handful of element-wise operators, each a PyTorch dispatch
(hundreds a step for gpt-oss-20b's 24 layers): the step's cost was dispatch, not weight reads. In
the C step the same arithmetic runs in one call with the experts' weights as the module path keeps
them (MXFP4 and K-quant blocks at file width, int4 layouts, int8 groups), rows that chose an expert
multiplied through it together. Here: what of a loaded SparseMoE the C code can read, and its
moe_t, laid out once.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from tessera.activations import ACTIVATIONS
from tessera.kernels import bindings
from tessera.layers.moe import SparseMoE


def moe_limits(moe: SparseMoE, dtype: torch.dtype) -> list[str]:
    """What of this block's loaded weights has no C path in the step (empty: none). Each reason
    names the part, so the start-up log says which format or tensor kept the model off the step."""
    why = []
    router = getattr(moe.gate, "weight", None)
    if router is None or router.dtype != torch.float32 or not router.is_contiguous():
        why.append("a mixture-of-experts router not stored as float32")
    if moe.gate.bias is not None and moe.gate.bias.dtype != torch.float32:
        why.append("a mixture-of-experts router bias not in float32")
    expert = moe.experts[0]
    if ACTIVATIONS[expert.activation].c_code is None:
        why.append(f"experts with the {expert.activation} activation")
    for e in moe.experts:
        for lin in (e.gate_up_proj, e.down_proj):
            if lin.kernel_operand() is None:
                how = lin.quant_method.name if lin.quant_method is not None else "unloaded"
                why.append(f"experts stored as {how} (no C product for that format here)")
            elif lin.bias is not None and lin.bias.dtype != dtype:
                why.append("expert biases of another dtype")
    return sorted(set(why))


class MoEOperands:
    """One SparseMoE as moe_step.c reads it (moe_t), with the operand arrays it points at kept
    alive as long as this object. Build only where `moe_limits` found nothing."""

    def __init__(self, moe: SparseMoE):
        experts = moe.experts
        ups = [e.gate_up_proj.kernel_operand() for e in experts]
        downs = [e.down_proj.kernel_operand() for e in experts]
        self.gate_up = (bindings.LinearOperand * len(ups))(*ups)
        self.down = (bindings.LinearOperand * len(downs))(*downs)
        first = experts[0]
        bias: Optional[torch.Tensor] = moe.gate.bias
        self.block = bindings.MoEBlock(
            router=moe.gate.weight.data_ptr(), router_bias=None if bias is None else bias.data_ptr(),
            gate_up=ctypes.addressof(self.gate_up), down=ctypes.addressof(self.down), num_experts=moe.num_experts,
            top_k=moe.top_k, ffn=first.down_proj.input_size, renormalize=int(moe.renormalize),
            activation=ACTIVATIONS[first.activation].c_code, swiglu_limit=first.limit, swiglu_alpha=first.alpha)
        # Rows past which some expert's module path multiplies another way (0: no limit).
        self.max_rows = min((op.max_rows for op in ups + downs if op.max_rows), default=0)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.block)
