"""MXFP4 weights (gpt-oss's expert format in GGUF) kept in the file's blocks, multiplied by the C
kernel (tessera/kernels/mxfp4_gemm.c) for decode-sized steps and dequantized for prompt-sized ones."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

from tessera.kernels import bindings, gguf_ops, library
from tessera.layers.quantization.base import QuantConfig, WeightOnlyMethod, dense_linear
from tessera.layers.weights import GGUFWeight

MXFP4_BLOCK, MXFP4_BLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4]  # 32 values in 17 bytes
# Rows up to which a step multiplies the blocks directly (mxfp4_gemm); past it the weight is
# dequantized for the call and multiplied densely. On the AVX2 EPYC host (one thread, shared
# with other work: benchmarks/mxfp4.py, results/mxfp4/) at 2880x2880 and 5760x2880 the kernel ran
# 8-12x a dense float32 matmul at one row, 2.7-6.8x at 8 and 0.8-1.0x at 64; at 512 the dense
# product dominates and decoding the weight for it adds 2-3 %.
MXFP4_KERNEL_MAX_ROWS = 32


class MXFP4Method(WeightOnlyMethod):
    """MXFP4 at 4.25 bits a weight (a power-of-two scale byte and 16 bytes of E2M1 codes per 32
    values), stored exactly as the file has them: `blocks` [N, K/32 * 17] uint8. Decode-sized
    steps quantize the activations to int8 per 32 values (llama.cpp's q8_0) and multiply the codes
    in integers, so their only error is that rounding; larger steps decode the weight (every value
    is exact in float32, and in bfloat16 but for the two subnormal scales) into the workspace, or
    use the dense copy if one is kept, and multiply it densely. Without the kernel library the
    blocks are decoded in torch and multiplied densely at every row count."""

    name = "mxfp4"

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return rows * (cols // MXFP4_BLOCK) * MXFP4_BLOCK_BYTES + dense

    def load(self, layer, sources):
        rows, cols = sum(s.shape[0] for s in sources), sources[0].shape[1]
        blocks = torch.empty(rows, cols // MXFP4_BLOCK * MXFP4_BLOCK_BYTES, dtype=torch.uint8)
        r = 0
        for src in sources:
            assert isinstance(src, GGUFWeight) and src.ggml_type == GGMLQuantizationType.MXFP4
            blocks.numpy()[r:r + src.shape[0]] = np.asarray(src.raw).reshape(src.shape[0], -1)  # from the mapped file
            r += src.shape[0]
        layer.register_buffer("blocks", blocks, persistent=False)
        self._finish(layer)

    def _in_features(self, layer) -> int:
        return layer.blocks.shape[1] // MXFP4_BLOCK_BYTES * MXFP4_BLOCK

    def _weights(self, blocks: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """Rows of blocks decoded to the compute dtype (into `out` if given)."""
        k = blocks.shape[1] // MXFP4_BLOCK_BYTES * MXFP4_BLOCK
        if library.available() is None:
            return gguf_ops.mxfp4_dequant(blocks.contiguous(), k, self.config.dtype, out)
        w = GGUFWeight(blocks.numpy(), GGMLQuantizationType.MXFP4, (blocks.shape[0], k)).dequantize()
        return w.to(self.config.dtype) if out is None else out.copy_(w)

    def dequantize(self, layer):
        return self._weights(layer.blocks)

    def embedding(self, layer, ids):
        flat = ids.reshape(-1)
        return self._weights(layer.blocks[flat]).view(*ids.shape, -1)

    def _small(self, layer, x):
        return gguf_ops.mxfp4_gemm(x, layer.blocks)

    def apply(self, layer, x):
        if x.shape[0] <= MXFP4_KERNEL_MAX_ROWS and library.available() is None:
            return self._small(layer, x)
        dense = getattr(layer, "dense_weight", None)
        if dense is None:
            n, k = layer.blocks.shape[0], self._in_features(layer)
            dense = self._weights(layer.blocks, self.config.workspace.get("weight", (n, k), self.config.dtype))
        return dense_linear(x, dense)

    def kernel_operand(self, layer):
        """The file's blocks for mxfp4_gemm, up to the rows `apply` multiplies them directly (past
        that the C step declines, as `apply` takes the dense product)."""
        if library.available() is not None:
            return None
        n = layer.blocks.shape[0]
        return bindings.LinearOperand(kind=bindings.LINEAR_MXFP4, weight=layer.blocks.data_ptr(), n_pad=n, n=n,
                                      k=self._in_features(layer), max_rows=MXFP4_KERNEL_MAX_ROWS)

    def describe(self, layer):
        return f"{self.name} (int8 activations up to {MXFP4_KERNEL_MAX_ROWS} rows)"
