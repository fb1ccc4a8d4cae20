"""Weight storage and matrix products for Linear layers: dense, int8 and int4 weight-only.

A `QuantMethod` owns how a Linear keeps its weight and how it multiplies by
it. Measured on the development machines (benchmarks/kernels.py): PyTorch's
weight-only CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
read 2-4x fewer bytes and run 2.5-4x faster than a bfloat16 matmul for a few
rows, but fall 2-3x behind from about 8-16 rows, where the matmul is
compute-bound. No single kernel wins everywhere, so the quantized methods
choose per call by row count: the weight-only kernel for decode-sized steps,
a dense matmul for prefill-sized ones. The dense matmul reads either a dense
copy kept beside the quantized weight (`dense_copy`, for small models where
the memory is cheap) or a copy dequantized for that call (large models, where
keeping two copies would double the weights' memory). For int4 in bfloat16,
Tessera's own few-row kernel (tessera/kernels/int4_gemv.c) takes 1-64 rows:
it computes from the codes, so it reads a quarter of the bytes and, on a
model's weights streamed from memory, beats the dense matmul by 1.7-4x at
2-16 rows and 1.3x at 32-64 (PyTorch's int4 kernel by 1.6-1.8x at 32-64).
On AVX2 hosts (no AVX-512, float32 compute) PyTorch's weight-only kernels run
at 1-2 GFLOP/s; there Tessera's float32 int4 kernel (tessera/kernels/int4_avx2.c)
takes 1-64 rows (10-65x faster per matrix, ahead of a dense float32 copy in
that range). Int8 weights keep the checkpoint's groups (a scale per 16 or 32
values), which PyTorch's int8 kernel (one scale per row) cannot read, so every
small int8 product runs through Tessera's kernels (tessera/kernels/int8_gemv.c). In bfloat16,
Q6_K and Q4_K tensors keep the file's blocks instead (Q6KMethod: a third fewer bytes than int8
groups; Q4KMethod) and multiply activations quantized to int8 (tessera/kernels/kquant_gemm.c).

The int4 format is PyTorch's CPU int4pack: codes in 0..15 and per-group
(scale, zero) with `w = (code - 8) * scale + zero`, groups of 32 along the
input dimension. GGUF Q4_0, Q4_1 and Q4_K blocks map onto it exactly (no
re-rounding of codes; scales and zeros are stored in the compute dtype).
Where each code lands in the packed bytes depends on the instruction set
PyTorch dispatches to on the host (AVX-512: tiles of 64 rows; AVX2 and
plain C: tiles of 32, nibbles paired differently), so the layout is probed
once per process (`int4pack_layout`) rather than assumed.
"""
from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gguf import GGMLQuantizationType

from tessera import kernels
from tessera.layers.weights import (
    FIVE_TO_EIGHT_BIT, FOUR_BIT_OR_LESS, INT8_GROUPS, AnyWeight, FloatWeight, GGUFWeight,
)

QuantizationMode = Literal["auto", "none", "int8", "int4"]
QUANTIZATION_MODES: tuple[str, ...] = ("auto", "none", "int8", "int4")
INT4_GROUP = 32
INT4_ROW_TILE = 64  # rows are padded to whole tiles of 64, which every int4pack layout's tile divides
# Largest row count sent to the weight-only kernels (measured crossovers, benchmarks/kernels.py):
# with a dense copy at hand bf16 wins from ~8-16 rows; when the dense weight must first be
# dequantized, that cost moves the crossover to ~32-64 rows.
SMALL_BATCH_WITH_DENSE_COPY = 8
SMALL_BATCH_DEQUANTIZING = 32
# The int8 products' smoothing (SmoothQuant's migration, made per step): activation column k is
# divided by max_t |x[t, k]| ** alpha and the weight's column multiplied by it before both are
# rounded, so outlier channels no longer set every token's scale (and, too high, one channel sets
# every weight row's). qwen2.5-coder-1.5b's perplexity against the bfloat16 product of the same
# weights, 512-token passes: alpha 0 (per-token scales alone) +3.97 %, 0.5 +0.75 %, 0.6 +0.08 %,
# 0.7 +0.6 to +1.4 % (between two builds rounding x / col and x * (1 / col)), 0.85 +2.40 %,
# 1.0 +6.52 %; 256-token passes: 0.5 +1.13 %, 0.6 +0.21 %.
SMOOTHING_ALPHA = 0.6
# The largest scratch buffer a model keeps for large steps (Workspace): a decoder layer's weight
# or product; an LM head's are allocated per call.
WORKSPACE_MAX_BYTES = 96 << 20
LOAD_CHUNK_ROWS = 4096  # rows dequantized at a time while loading
# Symmetric int8 groups for weights that come without groups of their own (float tensors, 4-bit
# GGUF types forced to int8).
INT8_REQUANT_GROUP = 32
# The few-row int4 C kernel (int4_gemm_bf16) against the dense bf16 copy, over a whole model's
# weights as a step reads them (from memory, not cache): 1.7-4x faster at 2-16 rows, 1.3x at
# 32-64, break-even at 128 (benchmarks/kernels.py, results/int4_gemm.json). Above 64, the dense copy
# (decode_step.c splits its int4 products at the same count).
INT4_GEMM_MAX_ROWS = kernels.INT4_GEMM_MAX_ROWS
# Dense bf16 matmuls go to oneDNN, which JIT-compiles and caches one kernel per row count (M): a
# server meeting ever new step sizes grows by ~0.3 MiB of code and buffers per new (M, N, K) until
# the primitive cache (1,024 entries) is full (docs/operations.md, "Reliability"). Rows above
# ROW_BUCKET_MIN are padded to a few sizes per octave so the shapes repeat: at most 1/8 more rows.
ROW_BUCKET_MIN = 16
ROW_BUCKETS_PER_OCTAVE = 8


@dataclass(frozen=True)
class Int4PackLayout:
    """Where `torch._convert_weight_to_int4pack_for_cpu` puts each code, on this host.

    Output rows are packed in tiles of `tile` rows; a tile holds all K columns, one k after the
    other, each k taking tile/2 bytes. Local row r of a tile sits in nibble `slot[r]` of its k's
    bytes (byte slot // 2, high nibble when slot is odd). Measured with torch 2.13: AVX-512 has
    tile 64 with rows c and 32 + c in byte c; AVX2 tile 32 with rows c and 16 + c; the plain C
    build tile 32 with rows 2c and 2c + 1."""

    tile: int
    slot: tuple[int, ...]

    def rows_in_nibble(self, high: int) -> "slice | Tensor":
        """The local rows held by the low (0) or high (1) nibbles of a k's bytes, byte by byte:
        a slice when they are evenly spaced (every layout measured), else an index tensor."""
        rows = sorted(range(self.tile), key=lambda r: self.slot[r])[high::2]
        step = rows[1] - rows[0]
        if step > 0 and all(b - a == step for a, b in zip(rows, rows[1:])):
            return slice(rows[0], rows[-1] + 1, step)
        return torch.tensor(rows)

    @functools.cached_property
    def slot_tensor(self) -> Tensor:
        """`slot` as a tensor, for gathering embedding rows (built once, not per lookup)."""
        return torch.tensor(self.slot)

    @property
    def kernel_layout(self) -> bool:
        """The AVX-512 layout, the one the bfloat16 int4 kernels (int4_gemv.c) read."""
        return self.tile == 64 and self.slot == tuple(2 * r if r < 32 else 2 * (r - 32) + 1 for r in range(64))

    @property
    def avx2_layout(self) -> bool:
        """The AVX2 layout, the one the float32 int4 kernel (int4_avx2.c) reads."""
        return self.tile == 32 and self.slot == tuple(2 * r if r < 16 else 2 * (r - 16) + 1 for r in range(32))


@functools.cache
def int4pack_layout() -> Optional[Int4PackLayout]:
    """Probe the host's int4pack layout by packing codes that spell each weight's position
    (four 4-bit digits of its index); None if it is not a tiled layout (int4 is then not used).
    Cached: the layout is fixed for a process (PyTorch picks its kernels once, by CPU)."""
    n, k = INT4_ROW_TILE, 64
    index = torch.arange(n * k, dtype=torch.int32).view(n, k)
    where = torch.zeros(n * k, dtype=torch.int64)  # where[nibble] = row * k + column
    for digit in range(4):
        packed = torch._convert_weight_to_int4pack_for_cpu((index >> (4 * digit)) & 15, 1)
        nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(-1).long()
        where += nibbles << (4 * digit)
    rows, cols = (where // k).tolist(), (where % k).tolist()
    tile = next((i for i, c in enumerate(cols) if c != 0), len(cols))
    if tile not in (16, 32, 64) or sorted(rows[:tile]) != list(range(tile)):
        return None
    slot = [0] * tile
    for i, r in enumerate(rows[:tile]):
        slot[r] = i
    for i, (r, c) in enumerate(zip(rows, cols)):  # every nibble where the tiled formula says
        t, rest = divmod(i, tile * k)
        if (r, c) != (t * tile + rows[rest % tile], rest // tile):
            return None
    return Int4PackLayout(tile, tuple(slot))


class Workspace:
    """Scratch memory a model's large-step products reuse: a weight dequantized (or requantized
    to int8) for one call, an int32 product. Allocations of 1 MiB and more are each their own
    mmap (hostinfo.map_large_allocations), so a fresh one is page-faulted in on every call: the
    1.5B model's K-quant layers spent ~1.2 s of a 512-token prefill step dequantizing into fresh
    bfloat16 buffers, mostly in page faults. Buffers of up to WORKSPACE_MAX_BYTES are kept and
    grown; larger requests (an LM head) get fresh memory. One per QuantConfig, so one per model:
    its forward runs on one thread at a time."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        n = math.prod(shape) * dtype.itemsize
        if n > WORKSPACE_MAX_BYTES:
            return torch.empty(shape, dtype=dtype)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n:
            buf = self._buffers[name] = torch.empty(n, dtype=torch.uint8)
        return buf[:n].view(dtype).view(shape)


@dataclass(frozen=True)
class QuantConfig:
    """How a model's Linear layers store weights; one object handed to every layer."""

    mode: QuantizationMode = "auto"
    dtype: torch.dtype = torch.bfloat16  # compute dtype of activations and dense weights
    dense_copy: bool = False  # keep a dense copy of quantized weights for large steps
    # Q6_K and Q4_K tensors kept at the file's width and multiplied by int8-quantized activations
    # (_KQuantMethod) under `auto` in bfloat16; False keeps them int8 / int4 with bfloat16 activations.
    int8_activations: bool = True
    workspace: Workspace = field(default_factory=Workspace, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, not {self.mode!r}")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"compute dtype must be float32 or bfloat16, not {self.dtype}")

    @property
    def small_batch_max(self) -> int:
        return SMALL_BATCH_WITH_DENSE_COPY if self.dense_copy else SMALL_BATCH_DEQUANTIZING

    def method_for(self, sources: list[AnyWeight]) -> "QuantMethod":
        """The method for one (possibly merged) weight given where its pieces come from.

        `auto` keeps the checkpoint's precision class: float tensors stay dense,
        4-bit-or-less GGUF types become int4 (exactly for Q4_0/Q4_1/Q4_K), 5- to
        8-bit types become int8. A merged weight takes the most precise class of
        its pieces. Weights whose input size is not a multiple of the int4 group
        use int8 instead of int4.
        """
        types = [None if isinstance(s, FloatWeight) else s.ggml_type for s in sources]
        return METHODS[self.storage_for(types, sources[0].shape[-1])](self)

    def storage_for(self, ggml_types: list[Optional[int]],
                    in_features: int) -> Literal["dense", "int8", "int4", "q6_k", "q4_k"]:
        """How a weight made of pieces of these GGUF types (None: a float tensor) is stored; the
        one rule behind `method_for` and the sizing calculator (tessera/sizing.py). Under `auto`
        in bfloat16, a weight all of Q6_K or all of Q4_K keeps the file's blocks (Q6KMethod,
        Q4KMethod: int8 activations); float32 compute keeps the exact int8 groups and int4
        tiles, so its products are the file's weights times unrounded activations."""
        mode = self.mode
        kinds = {KQUANT_TYPES.get(t) for t in ggml_types}
        if (mode == "auto" and self.int8_activations and self.dtype == torch.bfloat16 and len(kinds) == 1
                and None not in kinds and in_features % KQ_BLOCK == 0 and kernels.kquant_matmuls()):
            return kinds.pop()
        if mode == "auto":
            kinds = set()
            for t in ggml_types:
                if t is None:
                    kinds.add("none")
                elif t in FOUR_BIT_OR_LESS:
                    kinds.add("int4")
                elif t in FIVE_TO_EIGHT_BIT:
                    kinds.add("int8")
                else:
                    kinds.add("none")
            mode = "none" if "none" in kinds else "int8" if "int8" in kinds else "int4"
        if mode == "none":
            return "dense"
        if mode == "int4" and in_features % INT4_GROUP == 0 and int4pack_layout() is not None:
            return "int4"
        return "int8"


def row_bucket(rows: int) -> int:
    """The padded row count for a dense matmul: exact up to ROW_BUCKET_MIN, then
    ROW_BUCKETS_PER_OCTAVE evenly spaced sizes per doubling (17..32 by 2, 33..64 by 4, ...)."""
    if rows <= ROW_BUCKET_MIN:
        return rows
    step = 1 << max((rows - 1).bit_length() - ROW_BUCKETS_PER_OCTAVE.bit_length(), 0)
    return -(-rows // step) * step


# Activations a dense bfloat16 product can apply on its output (oneDNN's post-ops); GELU exact or tanh.
Activation = Literal["gelu", "gelu_tanh"]
# oneDNN's fused linear (the op PyTorch's own compiler emits for CPU linear + bias [+ GELU]), where its
# bfloat16 kernels exist: without AVX-512 (AVX2-only hosts) it cannot make the primitive at all.
_ONEDNN_LINEAR = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                  and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """x [T, K] followed by zero rows up to `rows`: only the new rows are zeroed (F.pad fills the
    whole output first, then copies: a prefill step's 120 pads took 47 ms of a 1 s SmolLM2 step)."""
    out = torch.empty((rows, x.shape[1]), dtype=x.dtype)
    out[:x.shape[0]] = x
    out[x.shape[0]:].zero_()
    return out


def dense_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                 activation: Optional[Activation] = None, residual: Optional[Tensor] = None) -> Tensor:
    """act(x [T, in] @ weight.T + bias) (+ residual) with bfloat16 row counts padded to
    `row_bucket` (see ROW_BUCKET_MIN).

    A bfloat16 product with a bias, an activation or a residual is one oneDNN call that applies
    them on its output (`mkldnn._linear_pointwise`, the op PyTorch's own compiler emits): addmm
    first copies the bias into every output row, and the GELU and the residual add are each
    another pass over it; on BERT's steps here those passes cost as much as the products. float32
    goes to MKL's sgemm, which keeps no per-shape kernels, so it is left exact.
    """
    assert activation is None or residual is None, "one post-op: an activation or a residual"
    rows = x.shape[0]
    bf16 = x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_cpu  # oneDNN's shapes and ops: CPU only
    padded = row_bucket(rows) if bf16 else rows
    if padded != rows:
        x = _pad_rows(x, padded)
        residual = None if residual is None else _pad_rows(residual, padded)
    if bf16 and _ONEDNN_LINEAR and residual is not None and residual.dtype == torch.bfloat16:
        y = torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), weight, bias, "add")
    elif bf16 and _ONEDNN_LINEAR and (bias is not None or activation is not None):
        attr, algorithm = ("none", "") if activation is None else ("gelu", "tanh" if activation == "gelu_tanh" else "none")
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
    else:
        y = F.linear(x, weight, bias)
        if activation is not None:
            y = F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
        if residual is not None:
            y = y + residual
    return y if padded == rows else y[:rows]


class QuantMethod(ABC):
    """Storage and matmul of one Linear's weight; `layer` is the Linear that owns the buffers."""

    name: str = ""

    def __init__(self, config: QuantConfig):
        self.config = config

    @abstractmethod
    def load(self, layer: nn.Module, sources: list[AnyWeight]) -> None:
        """Store the weight made of `sources` stacked along output rows."""

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> Tensor:
        """The whole weight [out, in] in the compute dtype."""

    @abstractmethod
    def embedding(self, layer: nn.Module, ids: Tensor) -> Tensor:
        """Rows `ids` of the weight in the compute dtype (for embedding tables)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        """x [T, in] @ weight.T -> [T, out] (no bias)."""

    def apply_with_bias(self, layer: nn.Module, x: Tensor, bias: Optional[Tensor],
                        activation: Optional[Activation] = None, residual: Optional[Tensor] = None) -> Tensor:
        """act(x @ weight.T + bias) + residual; methods whose matrix product can apply them itself
        override this."""
        y = self.apply(layer, x)
        y = y if bias is None else y + bias
        y = y if activation is None else F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
        return y if residual is None else y + residual

    def nbytes(self, layer: nn.Module) -> int:
        return sum(b.numel() * b.element_size() for b in layer.buffers(recurse=False))

    def describe(self, layer: nn.Module) -> str:
        return self.name

    def kernel_operand(self, layer: nn.Module) -> Optional[kernels.LinearOperand]:
        """The weight as the C decode step reads it (tessera/kernels/decode_step.c), or None where
        no C kernel reads this storage here; the bias is the caller's to add."""
        return None


def _stack(sources: list[AnyWeight], dtype: torch.dtype) -> Tensor:
    """Sources stacked by rows in `dtype`, converted a chunk of rows at a time."""
    out = torch.empty(sum(s.shape[0] for s in sources), sources[0].shape[1], dtype=dtype)
    r = 0
    for s in sources:
        for w in s.row_chunks(LOAD_CHUNK_ROWS):
            out[r:r + len(w)] = w
            r += len(w)
    return out


class DenseMethod(QuantMethod):
    name = "dense"

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        """Bytes `load` keeps for a [rows, cols] weight made of pieces of `ggml_types` (the
        sizing calculator's figure)."""
        return rows * cols * config.dtype.itemsize

    def load(self, layer, sources):
        layer.register_buffer("weight", _stack(sources, self.config.dtype), persistent=False)

    def dequantize(self, layer):
        return layer.weight

    def embedding(self, layer, ids):
        return F.embedding(ids, layer.weight)

    def apply(self, layer, x):
        return dense_linear(x, layer.weight)

    def apply_with_bias(self, layer, x, bias, activation=None, residual=None):
        return dense_linear(x, layer.weight, bias, activation, residual)

    def describe(self, layer):
        return str(self.config.dtype).removeprefix("torch.")


class _WeightOnlyMethod(QuantMethod):
    """Shared routing for the quantized methods: kernel by row count, dense copy if kept."""

    def _finish(self, layer: nn.Module) -> None:
        if self.config.dense_copy:
            dense = self.dequantize(layer)
            if dense.untyped_storage().nbytes() > dense.numel() * dense.element_size():
                dense = dense.clone()  # a view of int4's row-padded tiles: keep only the real rows
            layer.register_buffer("dense_weight", dense.contiguous(), persistent=False)

    def apply(self, layer, x):
        if x.shape[0] <= self.config.small_batch_max:
            return self._small(layer, x)
        dense = getattr(layer, "dense_weight", None)
        return dense_linear(x, dense if dense is not None else self.dequantize(layer))

    @abstractmethod
    def _small(self, layer: nn.Module, x: Tensor) -> Tensor: ...

    def nbytes(self, layer):
        return sum(b.numel() * b.element_size() for n, b in layer.named_buffers(recurse=False)
                   if n != "dense_weight")


class Int8Method(_WeightOnlyMethod):
    """Int8 codes with a float32 scale (and, for asymmetric types, a zero) per group of 16 or 32
    values along each row: GGUF Q8_0, Q5_0, Q5_1, Q5_K and Q6_K blocks keep their own codes and
    scales (`GGUFWeight.int8_groups`), so the product is the file's weights exactly; any other
    source is rounded to symmetric groups of 32.

    Up to 8 rows at a time go through Tessera's C kernels (tessera/kernels/int8_gemv.c), a
    larger small batch in slices of 8: float32 accumulation over the exact weights, or from 3
    bfloat16 rows AVX512-BF16 dot products over the weights rounded once to bfloat16.
    """

    name = "int8"

    @staticmethod
    def layout(ggml_types: Sequence[Optional[int]], in_features: int) -> tuple[int, bool]:
        """(group size, whether zeros are kept) for a weight made of pieces of these GGUF types
        (None: a float tensor): the finest of the pieces' groups, zeros if any piece has them."""
        groups, zeros = [], False
        for t in ggml_types:
            g, z = INT8_GROUPS.get(t, (INT8_REQUANT_GROUP, False)) if t is not None else (INT8_REQUANT_GROUP, False)
            groups.append(g)
            zeros = zeros or z
        group = min(groups)
        while in_features % group:
            group //= 2  # a float matrix whose width is not a multiple of 32 (never a GGUF one)
        return max(group, 1), zeros

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        """Bytes `load` keeps: codes, float32 scales (and zeros) per group, and the dense copy
        when one is kept."""
        group, zeros = Int8Method.layout(ggml_types or [None], cols)
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return rows * cols + rows * (cols // group) * 4 * (2 if zeros else 1) + dense

    def load(self, layer, sources):
        # A few thousand rows at a time, so no float32 copy of a whole large matrix (a 151k x
        # 1536 LM head would be 0.9 GB) ever exists.
        rows, cols = sum(s.shape[0] for s in sources), sources[0].shape[1]
        types = [s.ggml_type if isinstance(s, GGUFWeight) else None for s in sources]
        group, has_zeros = self.layout(types, cols)
        q = torch.empty(rows, cols, dtype=torch.int8)
        scale = torch.empty(rows, cols // group, dtype=torch.float32)
        zero = torch.zeros(rows, cols // group, dtype=torch.float32) if has_zeros else None
        r, exact = 0, True
        for src in sources:
            for c, sc, z in self._groups(src):
                # A piece with coarser groups (Q8_0's 32 beside Q6_K's 16) repeats its scales.
                rep = scale.shape[1] // sc.shape[1]
                q[r:r + len(c)] = c
                scale[r:r + len(c)] = sc.repeat_interleave(rep, dim=1) if rep > 1 else sc
                if zero is not None and z is not None:
                    zero[r:r + len(c)] = z.repeat_interleave(rep, dim=1) if rep > 1 else z
                r += len(c)
            exact = exact and isinstance(src, GGUFWeight) and src.ggml_type in INT8_GROUPS
        layer.register_buffer("qweight", q, persistent=False)
        layer.register_buffer("scales", scale, persistent=False)
        if zero is not None:
            layer.register_buffer("zeros", zero, persistent=False)
        else:
            layer.zeros = None
        layer.int8_exact = exact
        layer.use_kernels = kernels.available() is None and group % 16 == 0
        layer.use_gemm_kernel = (layer.use_kernels and self.config.dtype == torch.bfloat16 and cols % 32 == 0
                                 and kernels.bf16_matmuls())
        self._finish(layer)

    def _groups(self, src: AnyWeight):
        """(codes, scale, zero or None) chunks of rows: the file's own for INT8_GROUPS types,
        else symmetric groups of INT8_REQUANT_GROUP (or finer, see `layout`)."""
        if isinstance(src, GGUFWeight) and src.ggml_type in INT8_GROUPS:
            for i in range(0, src.shape[0], LOAD_CHUNK_ROWS):
                part = src.raw[i:i + LOAD_CHUNK_ROWS]
                yield GGUFWeight(part, src.ggml_type, (len(part), src.shape[1])).int8_groups()
        else:
            group, _ = self.layout([None], src.shape[1])
            for w in src.row_chunks(LOAD_CHUNK_ROWS):
                yield (*quantize_int8(w, group), None)

    def _weights(self, layer: nn.Module, rows: "slice | Tensor") -> Tensor:
        """Rows of the weight in float32: code * scale (+ zero) per group."""
        q, sc = layer.qweight[rows], layer.scales[rows]
        g = q.view(q.shape[0], sc.shape[1], -1).float()
        w = torch.addcmul(layer.zeros[rows].unsqueeze(-1), g, sc.unsqueeze(-1)) if layer.zeros is not None \
            else g * sc.unsqueeze(-1)
        return w.view(q.shape[0], -1)

    def dequantize(self, layer):
        return self._weights(layer, slice(None)).to(self.config.dtype)

    def embedding(self, layer, ids):
        flat = ids.reshape(-1)
        return self._weights(layer, flat).to(self.config.dtype).view(*ids.shape, -1)

    def _small(self, layer, x):
        if not layer.use_kernels:
            return (x.float() @ self._weights(layer, slice(None)).T).to(x.dtype)
        gemm = layer.use_gemm_kernel and x.dtype == torch.bfloat16 and x.shape[0] >= 3
        step = kernels.INT8_GEMM_MAX_ROWS if gemm else kernels.INT8_GEMV_MAX_ROWS
        parts = []
        for i in range(0, x.shape[0], step):
            rows = x[i:i + step]
            if gemm and rows.shape[0] >= 3:
                parts.append(kernels.int8_gemm_bf16(rows, layer.qweight, layer.scales, layer.zeros))
            else:
                parts.append(kernels.int8_gemv(rows, layer.qweight, layer.scales, layer.zeros))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def kernel_operand(self, layer):
        if not layer.use_kernels or self.config.dtype != torch.bfloat16:
            return None
        n, k = layer.qweight.shape
        return kernels.LinearOperand(kind=kernels.LINEAR_INT8, weight=layer.qweight.data_ptr(),
                                     scales=layer.scales.data_ptr(),
                                     zeros=None if layer.zeros is None else layer.zeros.data_ptr(),
                                     n_pad=n, n=n, k=k, group=k // layer.scales.shape[1],
                                     int8_gemm=int(layer.use_gemm_kernel))

    def describe(self, layer):
        return "int8" + ("" if layer.int8_exact else " (requantized)")


KQ_BLOCK = 256  # values of a K-quant super-block
KQUANT_TYPES = {GGMLQuantizationType.Q6_K: "q6_k", GGMLQuantizationType.Q4_K: "q4_k"}


class _KQuantMethod(_WeightOnlyMethod):
    """GGUF K-quant matrices at the file's width, multiplied by activations quantized to int8 per
    256 values (tessera/kernels/kquant_gemm.c): integer dot products per super-block (pmaddubsw,
    then the sub-block's scale by pmaddwd or VNNI's vpdpwssd), one or two float multiplies per
    super-block. The activations' rounding (Q8_K's, as llama.cpp's own K-quant products do) is
    the price; `QuantConfig.int8_activations=False` keeps the int8 and int4 layouts with
    bfloat16 activations, and benchmarks/perplexity.py --activations measures the difference.

    Up to 8 rows a call, a larger small batch in slices of 8; larger steps multiply a dense copy
    (kept, or dequantized for the call) as the other methods do. Subclasses say how a kind is
    stored (`storage_bytes`, `_blocks`), decoded (`_weights`, float32) and multiplied (`kernel`).
    """

    kernel: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # x, codes, scales, floats -> x @ W.T

    def load(self, layer, sources):
        rows, cols = sum(s.shape[0] for s in sources), sources[0].shape[1]
        parts: list[list[Tensor]] = []
        for src in sources:
            for i in range(0, src.shape[0], LOAD_CHUNK_ROWS):
                part = src.raw[i:i + LOAD_CHUNK_ROWS]
                parts.append(list(self._blocks(GGUFWeight(part, src.ggml_type, (len(part), cols)))))
        buffers = [torch.cat(p) if len(parts) > 1 else p[0] for p in zip(*parts)]
        assert buffers[0].shape[0] == rows
        for name, b in zip(("qweight", "scales", "d"), buffers):
            layer.register_buffer(name, b, persistent=False)
        self._finish(layer)

    @staticmethod
    @abstractmethod
    def _blocks(src: GGUFWeight) -> tuple[Tensor, Tensor, Tensor]: ...

    @abstractmethod
    def _weights(self, layer: nn.Module, rows: "slice | Tensor") -> Tensor: ...

    def dequantize(self, layer):
        if self.config.dtype == torch.bfloat16:  # as storage_for picks these: in C, not a dozen torch passes
            in_features = layer.scales.shape[1] * 16  # both kinds keep 16 scale bytes per 256 values
            return kernels.kquant_dequant_bf16(self.name, layer.qweight, layer.scales, layer.d, in_features)
        return self._weights(layer, slice(None)).to(self.config.dtype)

    def embedding(self, layer, ids):
        flat = ids.reshape(-1)
        return self._weights(layer, flat).to(self.config.dtype).view(*ids.shape, -1)

    def _small(self, layer, x):
        step = kernels.KQUANT_MAX_ROWS
        parts = [self.kernel(x[i:i + step], layer.qweight, layer.scales, layer.d) for i in range(0, x.shape[0], step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def apply(self, layer, x):
        if x.shape[0] <= self.config.small_batch_max:
            return self._small(layer, x)
        dense = getattr(layer, "dense_weight", None)
        if dense is not None:
            return dense_linear(x, dense)
        return self._int8_matmul(layer, x)

    def _int8_matmul(self, layer: nn.Module, x: Tensor) -> Tensor:
        """A prefill-sized step as int8 x int8 -> int32 (kernels.int8_matmul: torch._int_mm, oneDNN's
        VNNI kernels): the activations quantized per token, the weight requantized per row from
        the file's blocks for the call (in C, as `dequantize` does for bfloat16), both smoothed by
        the step's column maxima (SMOOTHING_ALPHA), then one float32 multiply by the two scales.
        Every step past the few-row kernels (without a dense copy) takes it: against the bfloat16
        product of the weight dequantized for the call, qwen2.5-coder-1.5b's K-quant layers ran
        1.16x at 33 rows and 1.19-1.38x at 64-512 (benchmarks/kquant.py --prefill);
        benchmarks/perplexity.py measures what the roundings cost."""
        n, k = layer.d.shape[0], layer.scales.shape[1] * 16
        ws = self.config.workspace
        columns = x.abs().amax(dim=0).float().clamp_min_(1e-5).pow_(SMOOTHING_ALPHA)
        wq, row_scales = kernels.kquant_dequant_int8(self.name, layer.qweight, layer.scales, layer.d, k,
                                                     ws.get("weight", (n, k), torch.int8), columns)
        return kernels.int8_matmul(x, wq, row_scales, ws.get("products", (x.shape[0], n), torch.int32), columns)

    def kernel_operand(self, layer):
        """Up to `small_batch_max` rows, as `apply` routes them: past that the C step declines."""
        if self.config.dtype != torch.bfloat16 or not kernels.kquant_matmuls():
            return None
        n = layer.d.shape[0]
        kind = kernels.LINEAR_Q4K if self.name == "q4_k" else kernels.LINEAR_Q6K
        return kernels.LinearOperand(kind=kind, weight=layer.qweight.data_ptr(), scales=layer.scales.data_ptr(),
                                     zeros=layer.d.data_ptr(), n_pad=n, n=n, k=layer.scales.shape[1] * 16,
                                     max_rows=self.config.small_batch_max)

    def describe(self, layer):
        return f"{self.name} (int8 activations)"


class Q6KMethod(_KQuantMethod):
    """Q6_K at 0.83 bytes a weight (192 code bytes, 16 int8 scales and a float32 d per 256
    values) against int8 groups' 1.25: a Q4_K_M model's LM head and half its down projections
    stream a third fewer bytes a decode step. Dequantized, the weight is Int8Method's (the same
    code x (d x sc) in float32)."""

    name = "q6_k"
    kernel = staticmethod(kernels.q6k_gemm)

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return rows * (cols // KQ_BLOCK) * (192 + 16 + 4) + dense

    @staticmethod
    def _blocks(src):
        return src.q6k_blocks()

    def _weights(self, layer, rows):
        """Rows of the weight in float32: (code - 32) x d x sc per 16 values."""
        b = layer.qweight[rows]
        n = b.shape[0]
        b = b.view(n, -1, 192)
        ql0, ql1, qh = b[..., :64], b[..., 64:128], b[..., 128:]
        codes = torch.cat([(ql0 & 15) | ((qh & 3) << 4), (ql0 >> 4) | (((qh >> 2) & 3) << 4),
                           (ql1 & 15) | (((qh >> 4) & 3) << 4), (ql1 >> 4) | ((qh >> 6) << 4)], dim=-1)
        scale = layer.d[rows].repeat_interleave(16, dim=1) * layer.scales[rows].float()  # [n, K/16]
        w = (codes.view(n, scale.shape[1], 16).float() - 32) * scale.unsqueeze(-1)
        return w.view(n, -1)


class Q4KMethod(_KQuantMethod):
    """Q4_K at 0.59 bytes a weight (128 code bytes, 8 scales and 8 minimums, float32 d and dmin
    per 256 values) against int4pack's 0.625 (bfloat16 scale and zero per 32), and the products
    in integers (int4_gemv.c widens every code to bfloat16)."""

    name = "q4_k"
    kernel = staticmethod(kernels.q4k_gemm)

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return rows * (cols // KQ_BLOCK) * (128 + 16 + 8) + dense

    @staticmethod
    def _blocks(src):
        return src.q4k_blocks()

    def _weights(self, layer, rows):
        """Rows of the weight in float32: d x sc x code - dmin x mn per 32 values."""
        b = layer.qweight[rows]
        n = b.shape[0]
        b = b.view(n, -1, 128)
        lo, hi = b[..., :64], b[..., 64:]
        codes = torch.cat([lo & 15, lo >> 4, hi & 15, hi >> 4], dim=-1).view(n, -1, 32).float()  # [n, K/32, 32]
        sm = layer.scales[rows].view(n, -1, 16).float()
        dm = layer.d[rows]  # [n, K/256, 2]
        scale = (dm[..., :1] * sm[..., :8]).reshape(n, -1, 1)
        minimum = (dm[..., 1:] * sm[..., 8:]).reshape(n, -1, 1)
        return (codes * scale - minimum).view(n, -1)


def quantize_int8(w: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Round a float [N, K] weight to symmetric int8 groups of `group` values (max |w| per group)."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    scale = (g.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)
    codes = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    return codes, scale


class Int4Method(_WeightOnlyMethod):
    """Group-wise asymmetric int4 (groups of 32) in PyTorch's CPU int4pack layout."""

    name = "int4"

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        """Bytes `load` keeps: packed codes over rows padded to the int4pack tile, a scale and a
        zero per group of 32 in the compute dtype, and the dense copy when one is kept."""
        padded = -(-rows // INT4_ROW_TILE) * INT4_ROW_TILE
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return padded * cols // 2 + (cols // INT4_GROUP) * padded * 2 * config.dtype.itemsize + dense

    def load(self, layer, sources):
        # Codes, scales and zeros are gathered (and packed) a few thousand rows at a time: the
        # packing wants int32 codes, 4 bytes a weight, which for a 151k x 1536 table would be
        # 0.9 GB at once.
        n, k = sum(s.shape[0] for s in sources), sources[0].shape[1]
        n_pad = n + (-n % INT4_ROW_TILE)  # the packed layout needs whole tiles of 64 rows
        codes = torch.zeros(n_pad, k, dtype=torch.uint8)
        scale = torch.zeros(n_pad, k // INT4_GROUP)
        zero = torch.zeros(n_pad, k // INT4_GROUP)
        r, exact = 0, True
        for src in sources:
            for c, sc, z in self._groups(src):
                codes[r:r + len(c)], scale[r:r + len(c)], zero[r:r + len(c)] = c, sc, z
                r += len(c)
            exact = exact and isinstance(src, GGUFWeight) and src.int4_exact
        packed = torch.empty(n_pad, k // 2, dtype=torch.uint8)
        step = LOAD_CHUNK_ROWS  # a multiple of the 64-row tile: tiles pack independently
        for i in range(0, n_pad, step):
            packed[i:i + step] = torch._convert_weight_to_int4pack_for_cpu(codes[i:i + step].to(torch.int32), 1)
        del codes
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(self.config.dtype)
        layer.register_buffer("qweight", packed, persistent=False)
        layer.register_buffer("scales_zeros", sz, persistent=False)  # [K/32, N_padded, 2]
        layer.out_rows = n
        layer.int4_exact = exact
        native = self.config.dtype == torch.bfloat16 and self.layout.kernel_layout and kernels.bf16_matmuls()
        layer.use_gemm_kernel = native
        layer.use_i8_kernel = native and getattr(layer, "int8_inputs", True) and self.int8_activation_kernel(self.config)
        layer.use_f32_kernel = self.config.dtype == torch.float32 and self.layout.avx2_layout \
            and kernels.avx2_matmuls()
        self._finish(layer)

    @staticmethod
    def int8_activation_kernel(config: QuantConfig) -> bool:
        """Whether int4 weights multiply int8-quantized activations here (int4_gemm_i8, AVX512-VNNI:
        bfloat16 compute, `int8_activations` on, the AVX-512 int4pack layout), for the layers
        whose inputs allow it (`Linear.int8_inputs`). It then takes every step, one row to a whole
        prompt: over SmolLM2-135M's projections read from memory, on par with the bfloat16 kernel
        at one row, 1.1-1.5x faster at 2-32 rows, faster than the dense bfloat16 copy up to
        256 and level with it at 512 (benchmarks/kernels.py, results/int4_i8/)."""
        layout = int4pack_layout()
        return (config.dtype == torch.bfloat16 and config.int8_activations and layout is not None
                and layout.kernel_layout and kernels.bf16_matmuls() and kernels.int4_i8_matmuls())

    @staticmethod
    def _groups(src: AnyWeight):
        """(codes, scale, zero) chunks of rows: the file's own for Q4 GGUF types, else requantized."""
        if isinstance(src, GGUFWeight) and src.int4_exact:
            for i in range(0, src.shape[0], LOAD_CHUNK_ROWS):
                part = src.raw[i:i + LOAD_CHUNK_ROWS]
                yield GGUFWeight(part, src.ggml_type, (len(part), src.shape[1])).int4_groups()
        else:
            for w in src.row_chunks(LOAD_CHUNK_ROWS):
                yield quantize_int4(w)

    @property
    def layout(self) -> Int4PackLayout:
        layout = int4pack_layout()
        assert layout is not None, "storage_for never picks int4 without a known int4pack layout"
        return layout

    def _rows(self, layer: nn.Module, rows: Tensor) -> Tensor:
        """Dequantize selected output rows (see Int4PackLayout for where each code is)."""
        layout = self.layout
        k = layer.scales_zeros.shape[0] * INT4_GROUP
        tiles = layer.qweight.view(-1, k, layout.tile // 2)
        slot = layout.slot_tensor[rows % layout.tile]
        bytes_ = tiles[rows // layout.tile, :, slot // 2]  # [R, K]
        codes = (bytes_ >> (4 * (slot % 2)).unsqueeze(1).to(torch.uint8)) & 0x0F
        sz = layer.scales_zeros[:, rows].transpose(0, 1)  # [R, K/32, 2]
        w = (codes.view(len(rows), -1, INT4_GROUP).to(self.config.dtype) - 8) * sz[..., :1] + sz[..., 1:]
        return w.view(len(rows), k)

    def dequantize(self, layer):
        layout = self.layout
        k = layer.scales_zeros.shape[0] * INT4_GROUP
        tiles = layer.qweight.view(-1, k, layout.tile // 2)
        nt = tiles.shape[0]
        out = torch.empty(nt, layout.tile, k, dtype=self.config.dtype)
        out[:, layout.rows_in_nibble(0)] = (tiles & 0x0F).transpose(1, 2)
        out[:, layout.rows_in_nibble(1)] = (tiles >> 4).transpose(1, 2)
        w = out.view(-1, k // INT4_GROUP, INT4_GROUP)
        sz = layer.scales_zeros.transpose(0, 1)  # [N, K/32, 2]
        w.sub_(8).mul_(sz[..., :1]).add_(sz[..., 1:])
        return out.view(-1, k)[:layer.out_rows]

    def embedding(self, layer, ids):
        flat = ids.reshape(-1)
        return self._rows(layer, flat).view(*ids.shape, -1)

    def apply(self, layer, x):
        rows = x.shape[0]
        if rows <= kernels.INT4_F32_MAX_ROWS and layer.use_f32_kernel:
            try:
                return kernels.int4_gemm_f32(x, layer.qweight, layer.scales_zeros, layer.out_rows)
            except kernels.KernelUnavailable:  # built without AVX2 + FMA: PyTorch's kernels from now on
                layer.use_f32_kernel = False
        if rows > 0 and layer.use_i8_kernel:
            try:
                return kernels.int4_gemm_i8(x, layer.qweight, layer.scales_zeros, layer.out_rows)
            except kernels.KernelUnavailable:  # built without VNNI/VBMI: the bfloat16 paths from now on
                layer.use_i8_kernel = False
        if 0 < rows <= INT4_GEMM_MAX_ROWS and layer.use_gemm_kernel:
            try:
                return kernels.int4_gemm_bf16(x, layer.qweight, layer.scales_zeros, layer.out_rows)
            except kernels.KernelUnavailable:  # built without AVX512-BF16: PyTorch's kernels from now on
                layer.use_gemm_kernel = False
        return super().apply(layer, x)

    def _small(self, layer, x):
        out = torch._weight_int4pack_mm_for_cpu(x, layer.qweight, INT4_GROUP, layer.scales_zeros)
        return out if out.shape[1] == layer.out_rows else out[:, :layer.out_rows]

    def kernel_operand(self, layer):
        if not layer.use_gemm_kernel:  # the AVX-512 layout and bfloat16 scales that int4_gemm_bf16 reads
            return None
        sz = layer.scales_zeros
        kind = kernels.LINEAR_INT4_I8 if layer.use_i8_kernel else kernels.LINEAR_INT4
        return kernels.LinearOperand(kind=kind, weight=layer.qweight.data_ptr(), scales=sz.data_ptr(),
                                     n_pad=sz.shape[1], n=layer.out_rows, k=sz.shape[0] * INT4_GROUP)

    def describe(self, layer):
        return "int4" + ("" if layer.int4_exact else " (requantized)") + (" (int8 activations)" if layer.use_i8_kernel else "")


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Round a float [N, K] weight to asymmetric int4 groups of 32 (min/max per group)."""
    n, k = w.shape
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return codes, scale, lo + 8.0 * scale


def dense_bytes(num_params: int, dtype: torch.dtype) -> int:
    return num_params * dtype.itemsize


def resolve_dense_copy(choice: Optional[bool], num_linear_params: int, dtype: torch.dtype,
                       available_bytes: int) -> bool:
    """Whether to keep dense copies of quantized weights: yes when asked, else when they are
    small (at most 1 GiB and an eighth of available memory)."""
    if choice is not None:
        return choice
    need = dense_bytes(num_linear_params, dtype)
    return need <= min(1 << 30, available_bytes // 8)


METHODS: dict[str, type[QuantMethod]] = {"dense": DenseMethod, "int8": Int8Method, "int4": Int4Method,
                                         "q6_k": Q6KMethod, "q4_k": Q4KMethod}
