"""Choosing the compute dtype: float32, bfloat16, or "auto".

"auto" first looks at the CPU's level as the kernels run it (kernels/isa.py: the
host's best, or the --cpu-isa cap, which caps oneDNN too): from avx512_bf16 up, oneDNN computes
bfloat16 natively and it halves the bytes read per token, so bfloat16 is
chosen without timing anything (a start-up timing of ~0.1 s once caught the
machine in a cold or contended state, measured bfloat16 40x slower than it is
and chose float32, which then served 1.6-2.8x slower). Below that level, where
the C kernels load, float32 is chosen by rule: the kernels that serve
quantized weights there (the one-call decode step, the int8-activation int4
and K-quant products) compute in float32, and a dense bfloat16 linear that
times faster (half the bytes) said nothing of them (SmolLM2 at --cpu-isa
avx512 on an AMD EPYC: bfloat16 by timing, 77 tok/s through the modules).
Without the C kernels torch emulates bfloat16; then both dtypes are timed on
the model's own linear shapes (one decoder layer at 1 and 32 rows), after a
warm-up, alternately, and compared by their medians, and bfloat16 must be
clearly (>10 %) faster to win, since float32 is the more accurate choice.
The log says which rule decided and why.
"""
from __future__ import annotations

import functools
import logging
import statistics
import time
from typing import Union

import torch
import torch.nn.functional as F

from tessera.config import ModelConfig
from tessera.errors import TesseraError
from tessera.kernels import isa, library

logger = logging.getLogger(__name__)

_NAMED = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
SERVING_BATCH = 32
BF16_MARGIN = 0.9  # bfloat16 must take under 90 % of float32's time to be chosen
NATIVE_BF16_LEVEL = "avx512_bf16"  # and every level above it (amx)


def resolve_dtype(choice: Union[str, torch.dtype], config: ModelConfig) -> torch.dtype:
    """Map a --dtype value to a torch dtype, deciding when it is "auto"."""
    if isinstance(choice, torch.dtype):
        if choice not in (torch.float32, torch.bfloat16):
            raise TesseraError(f"dtype {choice} is not supported; use float32 or bfloat16")
        return choice
    key = str(choice).lower()
    if key in _NAMED:
        return _NAMED[key]
    if key != "auto":
        raise TesseraError(f"unknown dtype {choice!r}; use auto, float32 or bfloat16")
    if isa.level_at_least(NATIVE_BF16_LEVEL):
        logger.info("dtype auto: bfloat16 (the CPU computes it natively at level %s)", isa.selected().name)
        return torch.bfloat16
    if library.available() is None:
        logger.info("dtype auto: float32 (no native bfloat16 at level %s: the C kernels compute in float32 here)",
                    isa.selected().name)
        return torch.float32
    timings = measure_linear_speed(config)
    f32 = timings[torch.float32][1] + timings[torch.float32][SERVING_BATCH]
    bf16 = timings[torch.bfloat16][1] + timings[torch.bfloat16][SERVING_BATCH]
    chosen = torch.bfloat16 if bf16 < BF16_MARGIN * f32 else torch.float32
    logger.info(
        "dtype auto: no native bfloat16 at level %s; median of one layer's linears: float32 %.0f us "
        "(batch 1) / %.0f us (batch %d), bfloat16 %.0f us / %.0f us; using %s",
        isa.selected().name, timings[torch.float32][1] * 1e6, timings[torch.float32][SERVING_BATCH] * 1e6,
        SERVING_BATCH,
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


def linear_param_count(config: ModelConfig) -> int:
    """Weights of every Linear of the model (decoder layers with all their experts, embedding
    table, untied LM head)."""
    c = config
    per_layer = sum(o * i for o, i in layer_linear_shapes(c))
    total = c.num_layers * per_layer
    if c.moe is not None:  # a sparse layer's experts and router instead of its dense MLP
        dense_mlp = 3 * c.intermediate_size * c.hidden_size
        experts = c.moe.num_experts * (3 * c.moe.expert_ffn + 1) * c.hidden_size
        total += sum(experts - dense_mlp for i in range(c.num_layers) if c.moe.is_sparse(i))
    tables = (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size
    return total + tables


def measure_linear_speed(config: ModelConfig, budget_s: float = 0.1) -> dict[torch.dtype, dict[int, float]]:
    """Median seconds per pass over one layer's linears, by dtype and batch size.

    Both dtypes are warmed up, then timed alternately, and the median of each is
    kept, so neither a cold first call nor a burst of load elsewhere decides. Measured once per
    process and shape: the memory check before loading and the loader both ask (seconds each).
    """
    return _measure_shapes(tuple(layer_linear_shapes(config)), budget_s)


@functools.lru_cache(maxsize=8)
@torch.inference_mode()
def _measure_shapes(shapes: tuple[tuple[int, int], ...], budget_s: float) -> dict[torch.dtype, dict[int, float]]:
    gen = torch.Generator().manual_seed(0)
    weights32 = [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes]
    dtypes = (torch.float32, torch.bfloat16)
    weights = {dt: [w.to(dt) for w in weights32] for dt in dtypes}
    result: dict[torch.dtype, dict[int, float]] = {dt: {} for dt in dtypes}
    for batch in (1, SERVING_BATCH):
        xs32 = [torch.randn(batch, w.shape[1], generator=gen) for w in weights32]
        inputs = {dt: [x.to(dt) for x in xs32] for dt in dtypes}
        runs: dict[torch.dtype, list[float]] = {dt: [] for dt in dtypes}
        for dt in dtypes:  # warm-up: first calls pay for kernel selection and allocation
            for _ in range(3):
                for x, w in zip(inputs[dt], weights[dt]):
                    F.linear(x, w)
        deadline = time.perf_counter() + budget_s
        rounds = 0
        while rounds < 5 or (time.perf_counter() < deadline and rounds < 100):
            for dt in dtypes:
                t0 = time.perf_counter()
                for x, w in zip(inputs[dt], weights[dt]):
                    F.linear(x, w)
                runs[dt].append(time.perf_counter() - t0)
            rounds += 1
        for dt in dtypes:
            result[dt][batch] = statistics.median(runs[dt])
    return result
