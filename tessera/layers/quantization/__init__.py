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
MXFP4 tensors (gpt-oss's experts: a power-of-two scale per 32 E2M1 values, 4.25 bits a weight)
keep the file's blocks in either dtype (MXFP4Method): up to 32 rows multiply activations quantized
to int8 per 32 values by the codes looked up 32 at a time (tessera/kernels/mxfp4_gemm.c: 2.7-12x a
dense float32 matmul at 1-8 rows on the AVX2 host, level at 64), larger steps the weight decoded
for the call.

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

from tessera.layers.quantization.base import (
    INT4_GEMM_MAX_ROWS, INT4_GROUP, KQUANT_TYPES, QUANTIZATION_MODES, ROW_BUCKET_MIN, SMOOTHING_ALPHA,
    WORKSPACE_MAX_BYTES, Activation, DenseMethod, Int4PackLayout, QuantConfig, QuantizationMode, QuantMethod,
    WeightOnlyMethod, Workspace, dense_bytes, dense_linear, int4pack_layout, resolve_dense_copy, row_bucket,
)
from tessera.layers.quantization.int4 import Int4Method, quantize_int4
from tessera.layers.quantization.int8 import Int8Method, quantize_int8
from tessera.layers.quantization.kquant import KQuantMethod, Q4KMethod, Q6KMethod
from tessera.layers.quantization.mxfp4 import MXFP4_KERNEL_MAX_ROWS, MXFP4Method
from tessera.layers.weights import AnyWeight, FloatWeight

METHODS: dict[str, type[QuantMethod]] = {"dense": DenseMethod, "int8": Int8Method, "int4": Int4Method,
                                         "q6_k": Q6KMethod, "q4_k": Q4KMethod, "mxfp4": MXFP4Method}


def method_for(config: QuantConfig, sources: list[AnyWeight]) -> QuantMethod:
    """The method for one (possibly merged) weight given where its pieces come from.

    `auto` keeps the checkpoint's precision class: float tensors stay dense,
    4-bit-or-less GGUF types become int4 (exactly for Q4_0/Q4_1/Q4_K), 5- to
    8-bit types become int8. A merged weight takes the most precise class of
    its pieces. Weights whose input size is not a multiple of the int4 group
    use int8 instead of int4. MXFP4 weights keep the file's blocks (MXFP4Method) where the kernels
    build; int4 and int8 requantize them from their values.
    """
    types = [None if isinstance(s, FloatWeight) else s.ggml_type for s in sources]
    return METHODS[config.storage_for(types, sources[0].shape[-1])](config)


__all__ = [
    "Activation",
    "DenseMethod",
    "INT4_GEMM_MAX_ROWS",
    "INT4_GROUP",
    "Int4Method",
    "Int4PackLayout",
    "Int8Method",
    "KQUANT_TYPES",
    "KQuantMethod",
    "MXFP4Method",
    "MXFP4_KERNEL_MAX_ROWS",
    "METHODS",
    "Q4KMethod",
    "Q6KMethod",
    "QUANTIZATION_MODES",
    "QuantConfig",
    "QuantMethod",
    "QuantizationMode",
    "ROW_BUCKET_MIN",
    "SMOOTHING_ALPHA",
    "WORKSPACE_MAX_BYTES",
    "WeightOnlyMethod",
    "Workspace",
    "dense_bytes",
    "dense_linear",
    "int4pack_layout",
    "method_for",
    "quantize_int4",
    "quantize_int8",
    "resolve_dense_copy",
    "row_bucket",
]
