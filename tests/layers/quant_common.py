"""What the quantization tests share: a layer of a method over a weight, random GGUF blocks, and
kernel sources compiled apart for older instruction sets."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch import nn

from tessera.kernels import library
from tessera.layers import FloatWeight, GGUFWeight, QuantConfig
from tessera.layers.quantization import Int4Method


def layer_of(method_cls, w: torch.Tensor, dtype=torch.float32, dense_copy=False, source=None, int8_activations=True):
    cfg = QuantConfig("int4" if method_cls is Int4Method else "int8", dtype, dense_copy, int8_activations)
    layer = nn.Module()
    method = method_cls(cfg)
    method.load(layer, source if isinstance(source, list) else [source or FloatWeight(w)])
    return method, layer


def random_blocks(qtype: Q, rows: int, blocks: int, seed: int = 0) -> GGUFWeight:
    """Random GGUF blocks of `qtype` (every bit pattern is a valid block) with sane float16 headers."""
    rng = np.random.default_rng(seed)
    size, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    headers = {Q.Q8_0: [0], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q4_K: [0, 2]}[qtype]
    for off in headers:
        raw[..., off:off + 2] = rng.uniform(1e-3, 0.1, size=(rows, blocks)).astype(np.float16)[..., None].view(np.uint8)
    return GGUFWeight(raw.reshape(rows, -1), qtype, (rows, blocks * size))


def kernel_built_for(sources: tuple[str, ...], isa: list[str], tmp_path: Path):
    """Kernel sources compiled apart with `isa` flags (older instruction sets than the host's
    build), loaded through ctypes."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lib_path = tmp_path / f"{Path(sources[0]).stem}.so"
    subprocess.run([cc, "-O2", "-march=native", *isa, "-fopenmp", "-shared", "-fPIC", "-std=c11",
                    *(str(Path(library.__file__).parent / s) for s in sources), "-o", str(lib_path), "-lm"], check=True,
                   capture_output=True)
    return ctypes.CDLL(str(lib_path))


def assert_bf16_rounding_of(got: torch.Tensor, want: torch.Tensor) -> None:
    """got is want rounded to bfloat16 (half an ulp, 2^-9 relative), give or take float32
    accumulation (far below that on these sizes)."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6 * want.abs().max().item())
