"""Choosing the compute dtype: float32, bfloat16, or "auto" measured on this machine.

Why measure instead of a rule: on CPUs the answer depends on the instruction
set and the oneDNN kernels this torch build picks. With AVX512-BF16/AMX,
bfloat16 matmuls can be much faster than float32 and halve the memory read per
token; without them torch emulates bfloat16 and it is several times slower. At
batch 1 a small model is also dominated by per-op overhead, where the dtype
barely matters. So "auto" times the model's own linear shapes (one decoder
layer: fused QKV, output, fused gate/up, down) at batch 1 (a lone decode) and at
32 tokens (a busy serving step) in both dtypes, and picks bfloat16 only if its
summed time is clearly (>10 %) lower -- float32 is the more accurate choice and
wins ties. The whole measurement takes a few hundred milliseconds.
"""
from __future__ import annotations

import logging
import time
from typing import Union

import torch
import torch.nn.functional as F

from tessera.config import ModelConfig
from tessera.errors import TesseraError

logger = logging.getLogger(__name__)

_NAMED = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
SERVING_BATCH = 32
BF16_MARGIN = 0.9  # bfloat16 must take under 90 % of float32's time to be chosen


def resolve_dtype(choice: Union[str, torch.dtype], config: ModelConfig) -> torch.dtype:
    """Map a --dtype value to a torch dtype, measuring when it is "auto"."""
    if isinstance(choice, torch.dtype):
        if choice not in (torch.float32, torch.bfloat16):
            raise TesseraError(f"dtype {choice} is not supported; use float32 or bfloat16")
        return choice
    key = str(choice).lower()
    if key in _NAMED:
        return _NAMED[key]
    if key != "auto":
        raise TesseraError(f"unknown dtype {choice!r}; use auto, float32 or bfloat16")
    timings = measure_linear_speed(config)
    f32 = timings[torch.float32][1] + timings[torch.float32][SERVING_BATCH]
    bf16 = timings[torch.bfloat16][1] + timings[torch.bfloat16][SERVING_BATCH]
    chosen = torch.bfloat16 if bf16 < BF16_MARGIN * f32 else torch.float32
    logger.info(
        "dtype auto: one layer's linears take float32 %.0f us (batch 1) / %.0f us (batch %d), "
        "bfloat16 %.0f us / %.0f us; using %s",
        timings[torch.float32][1] * 1e6, timings[torch.float32][SERVING_BATCH] * 1e6, SERVING_BATCH,
        timings[torch.bfloat16][1] * 1e6, timings[torch.bfloat16][SERVING_BATCH] * 1e6,
        str(chosen).removeprefix("torch."),
    )
    return chosen


def layer_linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's fused linears."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
            (c.hidden_size, c.intermediate_size)]


@torch.inference_mode()
def measure_linear_speed(config: ModelConfig, budget_s: float = 0.1) -> dict[torch.dtype, dict[int, float]]:
    """Seconds per pass over one layer's linears, by dtype and batch size.

    The two dtypes are timed alternately and the fastest run of each is kept, so
    a burst of load from other processes cannot favour one of them.
    """
    gen = torch.Generator().manual_seed(0)
    shapes = layer_linear_shapes(config)
    weights32 = [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes]
    dtypes = (torch.float32, torch.bfloat16)
    weights = {dt: [w.to(dt) for w in weights32] for dt in dtypes}
    result: dict[torch.dtype, dict[int, float]] = {dt: {} for dt in dtypes}
    for batch in (1, SERVING_BATCH):
        xs32 = [torch.randn(batch, w.shape[1], generator=gen) for w in weights32]
        inputs = {dt: [x.to(dt) for x in xs32] for dt in dtypes}
        best = {dt: float("inf") for dt in dtypes}
        deadline = time.perf_counter() + budget_s
        rounds = 0
        while rounds < 3 or (time.perf_counter() < deadline and rounds < 100):
            for dt in dtypes:
                t0 = time.perf_counter()
                for x, w in zip(inputs[dt], weights[dt]):
                    F.linear(x, w)
                elapsed = time.perf_counter() - t0
                if rounds > 0:  # the first round warms up kernels and allocations
                    best[dt] = min(best[dt], elapsed)
            rounds += 1
        for dt in dtypes:
            result[dt][batch] = best[dt]
    return result
