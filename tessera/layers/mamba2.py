"""Mamba-2's mixer (Granite 4.0-H's `mamba` layers): a selective state-space model whose per-request
state is fixed in size, kept in the engine's state slots like LFM2's convolutions (short_conv.py).

    z, xBC, dt = in_proj(h)
    x, B, C = silu(causal_conv(xBC))                   (the conv's state: its last kernel - 1 inputs)
    dt = softplus(dt + dt_bias);  per head h, per token t:
        S = exp(dt A) S + dt x B^T                    (the SSM state S: [heads, head_dim, d_state])
        y = S C + D x
    out = out_proj(rmsnorm_per_group(y * silu(z)))

A request's two states (the convolution's and the SSM's) sit at its slot in the layer's two state
tensors. The recurrence runs token by token for a prompt chunk (transformers' chunked scan
computes the same sums in another order) and once for all decode rows of a step, in float32.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.attention.base import AttentionMetadata
from tessera.config import MambaConfig
from tessera.layers.linear import Linear
from tessera.layers.quantization import QuantConfig
from tessera.layers.short_conv import causal_conv


def ssm_step(state: Tensor, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """One token for R requests: state [R, H, P, N] (float32, updated in place), x [R, H, P],
    dt [R, H] (after softplus), b and c [R, H, N] (each head's group's); returns y [R, H, P]."""
    decay = torch.exp(dt * a)  # [R, H]
    state.mul_(decay[..., None, None]).add_((dt[..., None] * x)[..., None] * b[:, :, None, :])
    return torch.einsum("rhpn,rhn->rhp", state, c) + d[:, None] * x


class Mamba2Mixer(nn.Module):
    """transformers' GraniteMoeHybridMambaLayer: module names `in_proj`, `out_proj`, `norm`
    (gated, per group), and the parameters `conv1d.weight` / `conv1d.bias`, `dt_bias`, `A_log`, `D`
    (buffers here, set at load by the decoder)."""

    def __init__(self, hidden_size: int, m: MambaConfig, eps: float, quant: QuantConfig, prefix: str):
        super().__init__()
        self.m, self.eps = m, eps
        self.in_proj = Linear(hidden_size, m.inner + m.conv_dim + m.heads, quant, bias=m.proj_bias,
                              prefix=prefix + ".in_proj")
        self.out_proj = Linear(m.inner, hidden_size, quant, bias=m.proj_bias, prefix=prefix + ".out_proj",
                               int8_inputs=False)
        for name in ("conv_weight", "conv_bias", "dt_bias", "A", "D", "norm_weight"):
            self.register_buffer(name, None, persistent=False)

    def load(self, tensors: dict[str, Optional[Tensor]], dtype: torch.dtype, source: str) -> None:
        """The layer's non-Linear parameters by transformers' names (conv1d.weight, conv1d.bias,
        dt_bias, A_log, D, norm.weight), checked against the config's shapes."""
        m = self.m
        shapes = {"conv1d.weight": m.conv_dim * m.conv_kernel, "dt_bias": m.heads, "A_log": m.heads, "D": m.heads,
                  "norm.weight": m.inner}
        if m.conv_bias:
            shapes["conv1d.bias"] = m.conv_dim
        for name, size in shapes.items():
            t = tensors.get(name)
            if t is None or t.numel() != size:
                raise ValueError(f"{source}: a Mamba-2 layer's {name} is missing or not of {size} values")
        self.conv_weight = tensors["conv1d.weight"].reshape(m.conv_dim, m.conv_kernel).to(dtype).contiguous()
        self.conv_bias = tensors["conv1d.bias"].reshape(-1).to(dtype) if m.conv_bias else None
        self.dt_bias = tensors["dt_bias"].reshape(-1).float()
        self.A = -torch.exp(tensors["A_log"].reshape(-1).float())
        self.D = tensors["D"].reshape(-1).float()
        self.norm_weight = tensors["norm.weight"].reshape(-1).to(dtype)

    def _scan(self, x: Tensor, b: Tensor, c: Tensor, dt: Tensor, state: Tensor, meta: AttentionMetadata) -> Tensor:
        """y [T, H, P] in float32 for the step's rows (x [T, H, P], b and c [T, H, N], dt [T, H]),
        each request from its SSM state (zeros on its first chunk), which it leaves updated."""
        slots, continues, starts = meta.state_slots, meta.state_continues, meta.query_start_loc
        y = torch.empty_like(x)
        nd = meta.num_decodes
        if nd:
            idx = torch.tensor(slots[:nd], device=x.device)
            s = state.index_select(0, idx)
            s *= torch.tensor(continues[:nd], device=x.device, dtype=s.dtype).view(-1, 1, 1, 1)
            y[:nd] = ssm_step(s, x[:nd], dt[:nd], self.A, b[:nd], c[:nd], self.D)
            state.index_copy_(0, idx, s)
        for i in range(nd, len(slots)):
            s = state[slots[i]:slots[i] + 1].clone() if continues[i] else torch.zeros_like(state[:1])
            for t in range(starts[i], starts[i + 1]):
                y[t:t + 1] = ssm_step(s, x[t:t + 1], dt[t:t + 1], self.A, b[t:t + 1], c[t:t + 1], self.D)
            state[slots[i]] = s[0]
        return y

    def forward(self, h: Tensor, states: list[Tensor], meta: AttentionMetadata) -> Tensor:
        m, n = self.m, h.shape[0]
        z, xbc, dt = self.in_proj(h).split([m.inner, m.conv_dim, m.heads], dim=-1)
        xbc = F.silu(causal_conv(xbc, self.conv_weight, self.conv_bias, states[0], meta))
        x, b, c = xbc.float().split([m.inner, m.groups * m.d_state, m.groups * m.d_state], dim=-1)
        per_group = m.heads // m.groups
        b = b.view(n, m.groups, m.d_state).repeat_interleave(per_group, dim=1)
        c = c.view(n, m.groups, m.d_state).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias).clamp(m.dt_min, m.dt_max)
        y = self._scan(x.view(n, m.heads, m.head_dim), b, c, dt, states[1], meta).reshape(n, m.inner)
        y = y * F.silu(z.float())  # the gated norm, per group of channels, as transformers computes it
        g = y.view(n, m.groups, m.inner // m.groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.out_proj(self.norm_weight * g.view(n, m.inner).to(h.dtype))
