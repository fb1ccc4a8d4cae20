"""LFM2's gated short convolution: a mixer that keeps a fixed-size state per request, not K/V.

    B, C, x = in_proj(h)                  (three slices of one projection)
    y = out_proj(C * conv(B * x))         (conv: depthwise and causal, over each request's tokens)

The convolution reads the kernel's last `kernel` inputs of a channel, so all a request carries
from one step to the next is its last `kernel - 1` inputs of each channel: its state. The states
live in one tensor per layer, [slots, channels, kernel - 1], a row per request (its slot, from the
engine's scheduler through `AttentionMetadata.state_slots`); a request's first chunk starts from
zeros (`state_continues` False), as transformers' convolution pads with zeros, and every chunk
leaves its last inputs there for the next. One packed step carries decodes (a row each: batched
over their slots in one call) and prompt chunks (a call each, with the state prepended).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.attention.base import AttentionMetadata
from tessera.layers.linear import Linear
from tessera.layers.quantization import QuantConfig


def conv_decode(x: Tensor, weight: Tensor, bias: Optional[Tensor], state: Tensor, slots: Tensor,
                continues: Tensor) -> Tensor:
    """One new input per request: x [R, C] for the requests in `slots` [R]; their states
    [R, C, K - 1] shift by one (a request without a carried state starts from zeros). Returns [R, C]."""
    past = state.index_select(0, slots)
    if not bool(continues.all()):
        past = past * continues.view(-1, 1, 1).to(past.dtype)
    window = torch.cat([past, x.unsqueeze(-1)], dim=-1)  # [R, C, K]
    state.index_copy_(0, slots, window[:, :, 1:])
    return F.conv1d(window, weight.unsqueeze(1), bias, groups=window.shape[1]).squeeze(-1)


def conv_prefill(x: Tensor, weight: Tensor, bias: Optional[Tensor], state: Tensor, slot: int,
                 continues: bool) -> Tensor:
    """A chunk of one request's inputs x [T, C] after its state (zeros when it has none yet); the
    chunk's last K - 1 inputs become its state. Returns [T, C]."""
    width = state.shape[-1]
    past = state[slot] if continues else torch.zeros_like(state[slot])
    seq = torch.cat([past, x.t()], dim=-1).unsqueeze(0)  # [1, C, K - 1 + T]
    if width:
        state[slot] = seq[0, :, -width:]
    return F.conv1d(seq, weight.unsqueeze(1), bias, groups=seq.shape[1])[0].t()


def causal_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], state: Tensor, meta: AttentionMetadata) -> Tensor:
    """The depthwise causal convolution of a packed step's rows x [T, C]: decodes first (as the
    metadata orders requests), then each prompt chunk, each request with its own state."""
    slots, continues, starts = meta.state_slots, meta.state_continues, meta.query_start_loc
    if slots is None or continues is None:
        raise RuntimeError("a step through a short-convolution layer needs the requests' state slots")
    out = torch.empty_like(x)
    d = meta.num_decodes
    if d:
        out[:d] = conv_decode(x[:d], weight, bias, state, torch.tensor(slots[:d], device=x.device),
                              torch.tensor(continues[:d], device=x.device))
    for i in range(d, len(slots)):
        a, b = starts[i], starts[i + 1]
        out[a:b] = conv_prefill(x[a:b], weight, bias, state, slots[i], continues[i])
    return out


class ShortConv(nn.Module):
    """The mixer of an LFM2 conv layer (transformers' Lfm2ShortConv: module names `in_proj`,
    `out_proj`, and the convolution's weight [C, 1, K] loaded into `conv_weight` [C, K])."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, quant: QuantConfig, prefix: str):
        super().__init__()
        self.hidden_size, self.kernel = hidden_size, kernel
        self.in_proj = Linear(hidden_size, 3 * hidden_size, quant, bias=bias, prefix=prefix + ".in_proj")
        self.out_proj = Linear(hidden_size, hidden_size, quant, bias=bias, prefix=prefix + ".out_proj",
                               int8_inputs=False)
        # Set at load (decoder.py) from the checkpoint's `conv.weight` / `conv.bias`, in the compute dtype.
        self.register_buffer("conv_weight", None, persistent=False)
        self.register_buffer("conv_bias", None, persistent=False)
        self.has_bias = bias

    def load_conv(self, weight: Tensor, bias: Optional[Tensor], dtype: torch.dtype, source: str) -> None:
        """The convolution's weight ([C, 1, K] as transformers stores it, or [C, K]) and bias."""
        c, k = self.hidden_size, self.kernel
        if weight.numel() != c * k:
            raise ValueError(f"{source}: a short convolution's weight has shape {tuple(weight.shape)}; "
                             f"expected [{c}, 1, {k}]")
        self.conv_weight = weight.reshape(c, k).to(dtype).contiguous()
        if self.has_bias:
            if bias is None or bias.numel() != c:
                raise ValueError(f"{source}: a short convolution's bias is missing or not [{c}]")
            self.conv_bias = bias.reshape(c).to(dtype).contiguous()

    def forward(self, h: Tensor, states: list[Tensor], meta: AttentionMetadata) -> Tensor:
        """`states`: the layer's state tensors (one here: the convolution's inputs)."""
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        y = causal_conv(b * x, self.conv_weight, self.conv_bias, states[0], meta)
        return self.out_proj(c * y)
