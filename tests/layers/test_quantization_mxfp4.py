"""MXFP4 (gpt-oss's expert format): exact decoding, the integer-product kernel, routing by rows,
expert tensors as views of the file, and the kernel on older instruction sets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from torch import nn

from tessera.kernels import gguf_ops, library
from tessera.layers import GGUFWeight, QuantConfig
from tessera.layers.quantization import method_for

from quant_common import assert_bf16_rounding_of, kernel_built_for


# ---- MXFP4 (gpt-oss's expert format) ----

MXFP4_KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)


def _mxfp4_blocks(rows: int, k: int, seed: int, exponents=(118, 131)) -> GGUFWeight:
    """Random MXFP4 blocks: any codes, exponents drawn from `exponents` (a half-open range)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(*exponents, (rows, k // 32))
    return GGUFWeight(raw.reshape(rows, -1), Q.MXFP4, (rows, k))


def _mxfp4_by_the_spec(src: GGUFWeight) -> np.ndarray:
    """The weight as the format defines it, written apart from gguf's decoder: value j (< 16) of a
    block in the low nibble of code byte j, value 16 + j in its high nibble, kvalues (E2M1 doubled)
    times 2^(e - 128) (ggml's E8M0 half; only e >= 2 here: below are subnormal special cases)."""
    n, k = src.shape
    b = src.raw.reshape(n, k // 32, 17)
    codes = np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], axis=-1)
    scale = np.ldexp(1.0, b[..., 0].astype(np.int64) - 128)[..., None]
    return (MXFP4_KVALUES[codes] * scale).reshape(n, k)


def _mxfp4_reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what mxfp4_gemm computes, in float64: x quantized as it does, per 32 values, round(x *
    (127 / amax)) in float32, times the exact weight; the bound on its distance from the exact
    product x @ w.T that this rounding allows: half a step, amax / 254, per value, times |w|)."""
    m, k = x.shape
    xf = x.float().view(m, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, (xf * (torch.full_like(amax, 127.0) / amax)).round().clamp(-127, 127), 0.0)
    xd = torch.where(amax > 0, amax / 127.0, 0.0)
    step = (amax.double() / 254).expand(m, k // 32, 32).reshape(m, k)
    return (q.double() * xd.double()).view(m, k) @ w.double().T, step @ w.double().abs().T


def _mxfp4_layer(src: GGUFWeight, dtype=torch.float32, dense_copy: bool = False):
    cfg = QuantConfig("auto", dtype, dense_copy)
    method = method_for(cfg, [src])
    layer = nn.Module()
    method.load(layer, [src])
    return method, layer


def test_mxfp4_blocks_decode_exactly():
    """gguf's decoder, the C one (float32 and bfloat16) and the format's definition agree bit for
    bit, subnormal and large exponents included; the layer stores the file's bytes unchanged, in
    the bytes storage_bytes (and so `tessera size`) counts: 17 a block of 32."""

    src = _mxfp4_blocks(70, 96, seed=1)
    assert np.array_equal(src.dequantize().numpy().astype(np.float64), _mxfp4_by_the_spec(src))
    edge = _mxfp4_blocks(9, 64, seed=2, exponents=(0, 251))  # from 251 up, 12 x 2^(e - 128) overflows
    edge.raw.reshape(9, 2, 17)[:3, 0, 0] = [0, 1, 250]
    for w in (src, edge):
        blocks = torch.from_numpy(w.raw)
        gguf_values = torch.from_numpy(dequantize(w.raw, Q.MXFP4).reshape(w.shape))
        assert torch.equal(gguf_ops.mxfp4_dequant(blocks, w.shape[1], torch.float32), gguf_values)
        assert torch.equal(gguf_ops.mxfp4_dequant(blocks, w.shape[1], torch.bfloat16), gguf_values.bfloat16())
    method, layer = _mxfp4_layer(src)
    assert method.name == "mxfp4" and torch.equal(layer.blocks, torch.from_numpy(src.raw))
    assert torch.equal(method.dequantize(layer), src.dequantize())
    ids = torch.tensor([[0, 69], [5, 5]])
    assert torch.equal(method.embedding(layer, ids), src.dequantize()[ids])
    assert method.nbytes(layer) == method.storage_bytes(70, 96, method.config) == 70 * 3 * 17


@pytest.mark.parametrize("k", [96, 256, 320])  # 320: ten blocks, eight a vector and two more
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_kernel_is_the_integer_product(k, dtype):
    """Per block the kernel's sums are exact in integers: against x quantized as it does, only
    float32 scaling (and bfloat16's output rounding) differs; against the exact product, within
    the bound the activations' rounding allows (and well away from it on average)."""

    src = _mxfp4_blocks(37, k, seed=3)  # 37 rows: not a multiple of the threads' split
    w = src.dequantize()
    torch.manual_seed(3)
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, k).to(dtype)
        x[0, :32] = 0  # an all-zero block of activations
        got = gguf_ops.mxfp4_gemm(x, torch.from_numpy(src.raw))
        want, bound = _mxfp4_reference(x, w)
        assert got.dtype == dtype and got.shape == (rows, 37)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-6)
            exact = x.double() @ w.double().T
            assert ((got.double() - exact).abs() <= bound + 1e-5 * exact.abs().max()).all()
            assert (got.double() - exact).norm() / exact.norm() < 0.02
        else:
            assert_bf16_rounding_of(got, want)
    with pytest.raises(library.KernelUnavailable):
        gguf_ops.mxfp4_gemm(torch.randn(65, k), torch.from_numpy(src.raw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dense_copy", [False, True])
def test_mxfp4_layers_route_by_rows_with_bias(dtype, dense_copy):
    """Up to MXFP4_KERNEL_MAX_ROWS rows the kernel's product, past it the decoded weight's dense
    product (float32: exact to float32 sums); the bias is added either way."""
    from tessera.layers.quantization import MXFP4_KERNEL_MAX_ROWS

    src = _mxfp4_blocks(50, 320, seed=4)
    w = src.dequantize()
    method, layer = _mxfp4_layer(src, dtype, dense_copy)
    assert method.name == "mxfp4"
    bias = torch.randn(50).to(dtype)
    torch.manual_seed(4)
    for rows in (1, 3, 17, 64, 300):
        x = torch.randn(rows, 320).to(dtype)
        got = method.apply_with_bias(layer, x, bias)
        assert got.dtype == dtype and got.shape == (rows, 50)
        exact = x.double() @ w.double().T + bias.double()
        if rows <= MXFP4_KERNEL_MAX_ROWS:
            want = _mxfp4_reference(x, w)[0] + bias.double()
        else:
            want = exact
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert (got.double() - want).abs().max() <= tol * want.abs().max()
        assert (got.double() - exact).norm() / exact.norm() < 0.02


def test_mxfp4_is_chosen_for_whole_mxfp4_weights_and_requantized_when_asked():
    f32, bf16 = QuantConfig("auto", torch.float32), QuantConfig("auto", torch.bfloat16)
    assert f32.storage_for([Q.MXFP4], 2880) == "mxfp4" and bf16.storage_for([Q.MXFP4, Q.MXFP4], 2880) == "mxfp4"
    assert f32.storage_for([Q.MXFP4, Q.Q4_0], 2880) == "int4"  # a merged weight of two kinds: 4-bit class
    assert f32.storage_for([Q.MXFP4, None], 2880) == "dense"
    src = _mxfp4_blocks(64, 96, seed=5)
    w = src.dequantize().double()
    for mode, limit in (("int8", 0.01), ("int4", 0.15)):  # requantized from the decoded values
        method = method_for(QuantConfig(mode, torch.float32), [src])
        assert method.name == mode
        layer = nn.Module()
        method.load(layer, [src])
        err = (method.dequantize(layer).double() - w).norm() / w.norm()
        assert 0 < err < limit


def test_mxfp4_expert_tensors_stay_views_of_the_file(tmp_path):
    """A 3-D MXFP4 tensor ([experts, rows, cols], as gpt-oss's ffn_*_exps) comes from the loader
    as the blocks of every expert's rows over the mapped file; expert(e) is expert e's matrix, a
    view again, decoding to that expert's slice."""
    from gguf import GGUFWriter

    from tessera.models.gguf_file import read_gguf

    experts, rows, cols = 4, 24, 96
    values = np.random.default_rng(6).standard_normal((experts, rows, cols)).astype(np.float32)
    stored = quantize(values, Q.MXFP4)
    path = tmp_path / "experts.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", stored, raw_shape=stored.shape, raw_dtype=Q.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gf = read_gguf(path)
    try:
        assert gf.tensors["blk.0.ffn_gate_exps.weight"].shape == (experts, rows, cols)
        stack = gf.raw_weight("blk.0.ffn_gate_exps.weight")
        assert stack.shape == (experts * rows, cols) and stack.experts == experts and stack.raw.shape[1] == 3 * 17
        mapped = np.frombuffer(gf._buf, dtype=np.uint8)
        decoded = dequantize(stored, Q.MXFP4).reshape(experts, rows, cols)
        for e in range(experts):
            one = stack.expert(e)
            assert one.shape == (rows, cols) and np.shares_memory(one.raw, mapped)
            assert np.array_equal(one.dequantize().numpy(), decoded[e])
        method, layer = _mxfp4_layer(stack.expert(2))
        assert torch.equal(method.dequantize(layer), torch.from_numpy(decoded[2]))
        del stack, one, mapped
    finally:
        gf.close()


@pytest.mark.parametrize("isa", [["-mno-avx512f", "-mavx2", "-mfma"], ["-mno-avx512f", "-mno-avx2"]],
                         ids=["avx2", "plain-c"])
def test_mxfp4_kernel_on_older_instruction_sets(isa, tmp_path):
    """The AVX2 and plain C branches of mxfp4_gemm.c, compiled apart and called through ctypes."""
    import ctypes

    lib = kernel_built_for(("mxfp4_gemm.c",), isa, tmp_path)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mxfp4_gemm.argtypes = [p, p, p, i64, i64, i64, ctypes.c_int, p]
    lib.mxfp4_dequant.argtypes = [p, p, i64, i64, ctypes.c_int]
    lib.mxfp4_scratch_bytes.argtypes = [i64, i64]
    lib.mxfp4_scratch_bytes.restype = i64
    src = _mxfp4_blocks(21, 320, seed=7)
    blocks = torch.from_numpy(src.raw)
    w = src.dequantize()
    torch.manual_seed(7)
    for rows in (3, 9):  # a group of eight rows and one more
        x = torch.randn(rows, 320)
        out = torch.empty(rows, 21)
        scratch = torch.empty(lib.mxfp4_scratch_bytes(rows, 320), dtype=torch.uint8)
        assert lib.mxfp4_gemm(x.data_ptr(), blocks.data_ptr(), out.data_ptr(), rows, 21, 320, 0,
                              scratch.data_ptr()) == 0
        want = _mxfp4_reference(x, w)[0]
        torch.testing.assert_close(out.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-6)
    dense = torch.empty(21, 320)
    lib.mxfp4_dequant(blocks.data_ptr(), dense.data_ptr(), 21, 320, 0)
    assert torch.equal(dense, w)
