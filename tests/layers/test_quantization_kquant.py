"""K-quants (Q6_K, Q4_K) stored at their own width: the file's weights, the integer products with
int8 activations, routing by row count, and the kernels on older instruction sets."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from tessera.kernels import capabilities, gguf_ops, library
from tessera.layers import GGUFWeight, QuantConfig
from tessera.layers.quantization import Int8Method

from quant_common import assert_bf16_rounding_of, kernel_built_for, layer_of, random_blocks


# -- K-quants at their own width, int8 activations --------------------------------------------

KQUANTS = [Q.Q6_K, Q.Q4_K]


def _kquant_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the K-quant kernels compute, in float64: x quantized as they do (per 256 values,
    round(x * (127 / amax)), float32 arithmetic) times the exact weights."""
    m, k = x.shape
    xf = x.float().view(m, k // 256, 256)
    amax = xf.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, (xf * (torch.full_like(amax, 127.0) / amax)).round().clamp(-127, 127), 0.0)
    xd = torch.where(amax > 0, amax / 127.0, 0.0)
    return (q.double() * xd.double()).view(m, k) @ w.double().T


def _kquant_layer(src: GGUFWeight, dense_copy: bool = False):
    from tessera.layers.quantization import METHODS, KQUANT_TYPES

    method = METHODS[KQUANT_TYPES[src.ggml_type]](QuantConfig("auto", torch.bfloat16, dense_copy))
    layer = nn.Module()
    method.load(layer, [src])
    return method, layer


def _kquant_kernel(qtype):

    return gguf_ops.q6k_gemm if qtype == Q.Q6_K else gguf_ops.q4k_gemm


@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_storage_is_the_files_weights(qtype):
    """The repacked blocks decode to gguf's own values bit for bit (for Q6_K also the int8
    layer's weight), in the bytes storage_bytes (and so `tessera size`) counts."""
    src = random_blocks(qtype, 70, 3, seed=11)
    method, layer = _kquant_layer(src)
    assert torch.equal(method._weights(layer, slice(None)), src.dequantize())
    if qtype == Q.Q6_K:
        _, int8_layer = layer_of(Int8Method, None, source=src)
        assert torch.equal(method._weights(layer, slice(None)),
                           Int8Method(QuantConfig())._weights(int8_layer, slice(None)))
    assert torch.equal(method.dequantize(layer), src.dequantize().bfloat16())  # the C path of large steps
    ids = torch.tensor([[0, 69], [5, 5]])
    assert torch.equal(method.embedding(layer, ids), src.dequantize().bfloat16()[ids])
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert stored == method.storage_bytes(70, 768, method.config) == 70 * 3 * (212 if qtype == Q.Q6_K else 152)


@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kquant_kernels_are_the_integer_product(qtype, dtype):
    """Per 256-value super-block the kernels' sums are exact in integers; only the float scaling
    and the output rounding differ from the float64 reference."""

    if not capabilities.kquant_matmuls():
        pytest.skip("no vector path for the K-quant kernels here")
    src = random_blocks(qtype, 37, 3, seed=12)  # 37 rows: not a multiple of the threads' split
    method, layer = _kquant_layer(src)
    w, kernel = src.dequantize(), _kquant_kernel(qtype)
    torch.manual_seed(12)
    for rows in (1, 2, 3, 5, 8):
        x = torch.randn(rows, 768).to(dtype)
        x[0, :256] = 0  # an all-zero super-block of activations
        got = kernel(x, layer.qweight, layer.scales, layer.d)
        want = _kquant_reference(x, w)
        assert got.dtype == dtype and got.shape == (rows, 37)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-6)
        else:
            assert_bf16_rounding_of(got, want)
    with pytest.raises(library.KernelUnavailable):
        kernel(torch.randn(9, 768), layer.qweight, layer.scales, layer.d)


@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_layers_slice_small_batches_and_dequantize_large_ones(qtype):

    if not capabilities.kquant_matmuls():
        pytest.skip("no vector path for the K-quant kernels here")
    src = random_blocks(qtype, 40, 2, seed=13)
    w = src.dequantize()
    for dense_copy in (False, True):
        method, layer = _kquant_layer(src, dense_copy)
        # without a dense copy, two calls of the kernel (8 rows and 3); with one, 8 rows at most
        x = torch.randn(min(11, method.config.small_batch_max), 512).bfloat16()
        assert_bf16_rounding_of(method.apply(layer, x), _kquant_reference(x, w))
        # past the kernels' rows: the dense copy's product, or without one an int8 x int8 product
        big = torch.randn(method.config.small_batch_max + 1, 512).bfloat16()
        exact = big.double() @ w.double().T
        assert (method.apply(layer, big).double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_prefill_steps_multiply_in_int8(qtype, monkeypatch):
    """Past the few-row kernels (no dense copy) the weight's columns are multiplied by the
    step's smoothing factors and requantized per row to int8, the activations divided by them and
    quantized per token: the result is that integer product, scaled, rounded to bfloat16 once,
    and within a few percent of the exact product (here with an outlier channel)."""
    from tessera.layers.quantization import SMOOTHING_ALPHA

    if not capabilities.kquant_matmuls():
        pytest.skip("no vector path for the K-quant kernels here")
    monkeypatch.setattr(capabilities, "int8_products_fast", lambda: True)  # the host's own choice aside
    src = random_blocks(qtype, 45, 2, seed=14)
    w = src.dequantize()
    method, layer = _kquant_layer(src)
    torch.manual_seed(14)
    x = torch.randn(method.config.small_batch_max + 6, 512)
    x[:, 7] *= 40  # an outlier channel, as LLM activations have
    x = x.bfloat16()
    columns = x.float().abs().amax(dim=0).clamp_min(1e-5) ** SMOOTHING_ALPHA
    wq, rs = gguf_ops.kquant_dequant_int8(method.name, layer.qweight, layer.scales, layer.d, 512, columns=columns)
    smoothed = w * columns
    torch.testing.assert_close(rs, smoothed.abs().amax(dim=1) / 127, rtol=1e-6, atol=0)
    assert (wq.float() - smoothed / rs[:, None]).abs().max() <= 0.5 + 1e-3  # rounded to the nearest
    got = method.apply(layer, x)
    xs = x.float() * (1 / columns)
    amax = xs.abs().amax(dim=1, keepdim=True)
    xq = torch.round(xs * (torch.full_like(amax, 127.0) / amax))  # as the kernel rounds
    assert_bf16_rounding_of(got, (xq.double() @ wq.double().T) * (amax / 127).double() * rs.double())
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_prefill_steps_multiply_in_float32_without_fast_int8_products(qtype, monkeypatch):
    """Where PyTorch's int8 product is a plain loop (AVX2 alone) a step past SLICED_MAX_ROWS
    multiplies the weight's int8 rows (requantized per row, no smoothing) in float32, the
    activations unrounded: that product rounded to bfloat16 once."""
    if not capabilities.kquant_matmuls():
        pytest.skip("no vector path for the K-quant kernels here")
    from tessera.layers.quantization.kquant import SLICED_MAX_ROWS

    monkeypatch.setattr(capabilities, "int8_products_fast", lambda: False)
    src = random_blocks(qtype, 45, 2, seed=15)
    w = src.dequantize()
    method, layer = _kquant_layer(src)
    torch.manual_seed(15)
    x = (torch.randn(SLICED_MAX_ROWS + 6, 512)).bfloat16()
    # up to SLICED_MAX_ROWS rows the kernels still take the step, in slices
    mid = x[:method.config.small_batch_max + 6]
    assert torch.equal(method.apply(layer, mid), method._small(layer, mid))
    wq, rs = gguf_ops.kquant_dequant_int8(method.name, layer.qweight, layer.scales, layer.d, 512)
    got = method.apply(layer, x)
    assert got.dtype == x.dtype
    assert_bf16_rounding_of(got, x.double() @ (wq.double() * rs.double()[:, None]).T)
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).norm() / exact.norm()) < 0.01


def test_kquants_are_chosen_for_whole_kquant_weights_with_int8_activations():

    if not capabilities.kquant_matmuls():
        pytest.skip("no vector path for the K-quant kernels here")
    bf16 = QuantConfig("auto", torch.bfloat16)
    assert bf16.storage_for([Q.Q6_K], 1536) == "q6_k" and bf16.storage_for([Q.Q4_K], 1536) == "q4_k"
    assert bf16.storage_for([Q.Q6_K, Q.Q6_K], 1536) == "q6_k"
    assert bf16.storage_for([Q.Q4_K, Q.Q6_K], 1536) == "int8"  # a merged weight of two kinds
    assert bf16.storage_for([Q.Q4_K], 1600) == "int4"  # not whole super-blocks
    assert bf16.storage_for([Q.Q4_1], 1536) == "int4"
    f32 = QuantConfig("auto", torch.float32)  # hosts without native bfloat16: the same bytes per step
    assert f32.storage_for([Q.Q6_K], 1536) == "q6_k" and f32.storage_for([Q.Q4_K], 1536) == "q4_k"
    for dtype in (torch.bfloat16, torch.float32):  # exact products when asked for
        off = QuantConfig("auto", dtype, int8_activations=False)
        assert off.storage_for([Q.Q6_K], 1536) == "int8" and off.storage_for([Q.Q4_K], 1536) == "int4"
    assert QuantConfig("int8", torch.bfloat16).storage_for([Q.Q6_K], 1536) == "int8"  # asked for


@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("isa", [["-mno-avx512f", "-mavx2", "-mfma"], ["-mno-avx512f", "-mno-avx2"]],
                         ids=["avx2", "plain-c"])
def test_kquant_kernels_on_older_instruction_sets(qtype, isa, tmp_path):
    """The AVX2 and plain C branches of kquant_gemm.c and kquant_dequant.c, compiled apart and called
    through ctypes."""
    import ctypes

    lib = kernel_built_for(("kquant_gemm.c", "kquant_dequant.c"), isa, tmp_path)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.q6k_gemm if qtype == Q.Q6_K else lib.q4k_gemm
    fn.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_int, p]
    lib.kquant_scratch_bytes.argtypes = [i64, i64]
    lib.kquant_scratch_bytes.restype = i64
    src = random_blocks(qtype, 21, 2, seed=14)
    _, layer = _kquant_layer(src)
    torch.manual_seed(14)
    x = torch.randn(3, 512)
    out = torch.empty(3, 21)
    scratch = torch.empty(lib.kquant_scratch_bytes(3, 512), dtype=torch.uint8)
    assert fn(x.data_ptr(), layer.qweight.data_ptr(), layer.scales.data_ptr(), layer.d.data_ptr(), out.data_ptr(), 3,
              21, 512, 0, scratch.data_ptr()) == 0
    want = _kquant_reference(x, src.dequantize())
    torch.testing.assert_close(out.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-6)
    # the block decoder's plain branch: bfloat16 and int8 weights equal to the host build's

    name = "q6k" if qtype == Q.Q6_K else "q4k"
    bf16 = torch.empty(21, 512, dtype=torch.bfloat16)
    getattr(lib, f"{name}_dequant_bf16").argtypes = [p, p, p, p, i64, i64]
    getattr(lib, f"{name}_dequant_bf16")(layer.qweight.data_ptr(), layer.scales.data_ptr(), layer.d.data_ptr(),
                                         bf16.data_ptr(), 21, 512)
    assert torch.equal(bf16, src.dequantize().bfloat16())
    columns = torch.rand(512) + 0.5
    wq, rs = torch.empty(21, 512, dtype=torch.int8), torch.empty(21)
    getattr(lib, f"{name}_dequant_int8").argtypes = [p, p, p, p, p, p, i64, i64]
    getattr(lib, f"{name}_dequant_int8")(layer.qweight.data_ptr(), layer.scales.data_ptr(), layer.d.data_ptr(),
                                         columns.data_ptr(), wq.data_ptr(), rs.data_ptr(), 21, 512)
    host_wq, host_rs = gguf_ops.kquant_dequant_int8(f"{name[:2]}_{name[2]}", layer.qweight, layer.scales, layer.d, 512,
                                                   columns=columns)
    assert torch.equal(wq, host_wq) and torch.equal(rs, host_rs)


def test_workspace_reuses_its_buffers_up_to_its_limit():
    from tessera.layers.quantization import WORKSPACE_MAX_BYTES, Workspace

    ws = Workspace()
    a = ws.get("weight", (64, 256), torch.int8)
    b = ws.get("weight", (32, 256), torch.bfloat16)  # the same bytes, another view
    assert a.data_ptr() == b.data_ptr() and b.shape == (32, 256) and b.dtype == torch.bfloat16
    assert ws.get("products", (4, 4), torch.int32).data_ptr() != a.data_ptr()  # buffers by name
    grown = ws.get("weight", (128, 256), torch.bfloat16)
    assert grown.numel() == 128 * 256 and ws.get("weight", (64, 256), torch.int8).data_ptr() == grown.data_ptr()
    big = ws.get("weight", (WORKSPACE_MAX_BYTES + 1,), torch.int8)  # an LM head's: not kept
    assert big.data_ptr() != ws.get("weight", (8,), torch.int8).data_ptr()
    assert QuantConfig() == QuantConfig() and "workspace" not in repr(QuantConfig())
