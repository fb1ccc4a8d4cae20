"""The pieces every quantization method shares: the config that picks a weight's storage, the
QuantMethod interface, dense products (with row bucketing and oneDNN's fused epilogues), the
workspace for large steps, the host's int4pack layout, and the limits measured for them."""
from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import Tensor, nn

from tessera.kernels import bindings, capabilities, library
from tessera.layers.weights import FIVE_TO_EIGHT_BIT, FOUR_BIT_OR_LESS, AnyWeight


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
INT4_GEMM_MAX_ROWS = bindings.INT4_GEMM_MAX_ROWS
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
    # (kquant.py) under `auto` in bfloat16; False keeps them int8 / int4 with bfloat16 activations.
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

    def storage_for(self, ggml_types: list[Optional[int]],
                    in_features: int) -> Literal["dense", "int8", "int4", "q6_k", "q4_k", "mxfp4"]:
        """How a weight made of pieces of these GGUF types (None: a float tensor) is stored; the
        one rule behind `method_for` and the sizing calculator (tessera/sizing.py). Under `auto`
        with `int8_activations`, a weight all of Q6_K or all of Q4_K keeps the file's blocks
        (Q6KMethod, Q4KMethod: int8 activations) in either compute dtype: float32 is the dtype of
        hosts without native bfloat16, where int8 groups and int4 tiles with float32 scales read
        1.4-1.8x the bytes (qwen2.5-coder-1.5b decoded 100 tokens in 12.9 s that way against 6.1 s
        on an Intel Xeon with AVX-512 VNNI and no BF16). Without `int8_activations` they become
        the exact int8 groups and int4 tiles times unrounded activations. A weight all
        of MXFP4 keeps the file's blocks under `auto` in either dtype where the kernels build
        (MXFP4Method: no int4 or int8 layout holds its values exactly)."""
        mode = self.mode
        if (mode == "auto" and ggml_types and all(t == GGMLQuantizationType.MXFP4 for t in ggml_types)
                and in_features % INT4_GROUP == 0 and library.available() is None):
            return "mxfp4"
        kinds = {KQUANT_TYPES.get(t) for t in ggml_types}
        if (mode == "auto" and self.int8_activations and len(kinds) == 1
                and None not in kinds and in_features % KQ_BLOCK == 0 and capabilities.kquant_matmuls()):
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

    def kernel_operand(self, layer: nn.Module) -> Optional[bindings.LinearOperand]:
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


class WeightOnlyMethod(QuantMethod):
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


KQ_BLOCK = 256  # values of a K-quant super-block
KQUANT_TYPES = {GGMLQuantizationType.Q6_K: "q6_k", GGMLQuantizationType.Q4_K: "q4_k"}


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
