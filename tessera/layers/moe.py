"""A mixture-of-experts feed-forward block: a router, and experts that each run over their tokens.

For every token the router scores all experts and the `top_k` best run; their outputs are summed
with the routing weights. A step's tokens are grouped by expert, so each active expert's two
projections run once over all the tokens routed to it (one matrix product of many rows for a
prompt, the few-row kernels for decode), and an expert no token chose is never read: a decode
step of gpt-oss-20b reads 4 of each layer's 32 experts. The experts are ordinary gated MLPs whose
Linear layers keep the checkpoint's storage (the GGUF file's blocks: MXFP4, Q4_K, ...), so an
expert costs its file size and nothing is held twice.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from tessera.config import MoEConfig
from tessera.layers.linear import Linear
from tessera.layers.mlp import GatedMLP
from tessera.layers.quantization import QuantConfig


class SparseMoE(nn.Module):
    """Module names follow Hugging Face's Qwen3-MoE: `gate` (the router) and `experts.N.*`; the
    other layouts (Mixtral's w1/w2/w3, gpt-oss's stacked tensors, GGUF's *_exps) are renamed and
    split to these when loading (models/decoder.py)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = moe.num_experts, moe.top_k, moe.renormalize
        # The router runs in float32 on unquantized weights whatever --quantization and --dtype say
        # (as llama.cpp's F32 router): its few weights cost nothing, and a logit rounded to
        # bfloat16 flips near-tied experts, which changes the token's output discontinuously.
        self.gate = Linear(hidden_size, moe.num_experts, dataclasses.replace(quant, mode="none", dtype=torch.float32),
                           bias=moe.router_bias, prefix=prefix + ".gate")
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.expert_ffn, quant, moe.activation, f"{prefix}.experts.{e}",
                     bias=moe.expert_bias, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha)
            for e in range(moe.num_experts))
        # Distinct experts the last call ran (the step's cost grows with it: engine/core/cost_model.py).
        self.last_active: int = 0

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(routing weights float32 [T, top_k], expert ids int64 [T, top_k]) for each token. The
        softmax over the chosen logits equals the renormalised softmax over all experts."""
        logits = self.gate(x.float())
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        if self.renormalize:
            return torch.softmax(top, dim=-1), ids
        return torch.softmax(logits, dim=-1).gather(1, ids), ids

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.route(x)
        if x.shape[0] == 1:  # decode of one sequence: its experts in turn, no grouping to do
            self.last_active = self.top_k
            out: Optional[Tensor] = None
            for w, e in zip(weights[0].tolist(), ids[0].tolist()):
                y = self.experts[e](x) * w
                out = y if out is None else out + y
            return out
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        token_weights = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        out = torch.zeros_like(x)
        start, active = 0, 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            out.index_add_(0, rows, self.experts[e](x[rows]) * token_weights[start:start + n])
            start += n
            active += 1
        self.last_active = active
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}"
