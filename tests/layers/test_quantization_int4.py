"""int4 weights' kernels: the few-row products of PyTorch's int4pack layout (bfloat16, int8
activations) and of the float32 layout (float32 and float32 with int8 activations) against PyTorch
and the dequantized weight, and the float32 layout Tessera packs itself."""
from __future__ import annotations

import pytest
import torch

from tessera.kernels import bindings, capabilities, library, matmul_ops
from tessera.layers.quantization import Int4Method, int4_f32_layout

from quant_common import layer_of


@pytest.mark.skipif(not capabilities.avx2_matmuls(), reason="kernels built without AVX2 + FMA")
def test_float32_int4_takes_the_float32_kernels_whatever_the_hosts_layout():
    """PyTorch's float32 int4pack product runs at ~1 GFLOP/s: float32 weights are packed in the
    float32 kernels' own layout on every AVX2 or AVX-512 host, which PyTorch's product never reads."""
    torch.manual_seed(0)
    method, layer = layer_of(Int4Method, torch.randn(128, 64) * 0.05)
    assert layer.use_f32_kernel and method.f32_layout and not layer.torch_layout
    assert layer.qweight.shape == (128 // 32, 64 // 32, int4_f32_layout.GROUP_BYTES)
    assert not hasattr(layer, "scales_zeros")


@pytest.mark.skipif(not capabilities.avx2_matmuls(), reason="kernels built without AVX2 + FMA")
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_float32_int4_with_int8_activations_is_the_rounded_rows_product(rows):
    """int4_gemm_i8_f32: each row rounded to int8 per group of 32 (scale max|x| / 127) meets the
    codes in exact integer sums; a group's zero-point term (z - 8 s) takes the unrounded sum of x.
    So the product is that of the rounded rows plus (z - 8 s) times what rounding took from each
    group's sum, within ~2 % of the unrounded product; the C step takes the same kernel."""
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    method, layer = layer_of(Int4Method, w)
    assert layer.use_i8_f32_kernel and method.kernel_operand(layer).kind == bindings.LINEAR_INT4_I8
    deq = method.dequantize(layer)
    x = torch.randn(rows, 128)
    groups = x.view(rows, -1, 32)
    dx = groups.abs().amax(dim=-1, keepdim=True) / 127
    rounded = (torch.round(groups / dx).clamp(-128, 127) * dx).view(rows, 128)
    got = method.apply(layer, x)
    _, s, z = int4_f32_layout.unpack(layer.qweight)
    s, z = s[:96].T, z[:96].T  # [K/32, N]
    lost = (x - rounded).view(rows, -1, 32).sum(dim=-1)  # [rows, K/32]
    torch.testing.assert_close(got, rounded @ deq.T + lost @ (z - 8 * s), atol=1e-5, rtol=1e-5)
    assert ((got - x @ deq.T).norm() / (x @ deq.T).norm()) < 0.02
    _, exact = layer_of(Int4Method, w, int8_activations=False)
    assert not exact.use_i8_f32_kernel


@pytest.mark.skipif(not capabilities.avx2_matmuls(), reason="kernels built without AVX2 + FMA")
@pytest.mark.parametrize("rows", [1, 5, 8, 9])
def test_float32_int4_inputs_kept_from_int8_take_int16_up_to_a_few_rows(rows):
    """A layer whose inputs int8 would flatten (Linear.int8_inputs False: the down projection) takes
    int4_gemm_i16_f32 up to INT4_I16_MAX_ROWS rows (decode and verification steps): each row rounded to int16 per group of 32 (scale
    max|x| / 32767) meets the codes in exact integer sums; with an outlier channel the product stays
    closer to the float32 kernel's than rounding the rows to bfloat16 would (int8 would be ~100x
    further); past that row count, the float32 kernel."""
    from torch import nn
    from tessera.layers.quantization import QuantConfig
    from tessera.layers.weights import FloatWeight

    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    layer, method = nn.Module(), Int4Method(QuantConfig("int4", torch.float32, False, True))
    layer.int8_inputs = False
    method.load(layer, [FloatWeight(w)])
    assert layer.use_i16_f32_kernel and not layer.use_i8_f32_kernel
    assert method.kernel_operand(layer).kind == bindings.LINEAR_INT4_I16
    deq = method.dequantize(layer)
    x = torch.randn(rows, 256)
    x[:, 7] *= 300  # an outlier channel: int8 would leave its group's other values ~2 codes
    groups = x.view(rows, -1, 32)
    dx = groups.abs().amax(dim=-1, keepdim=True) / 32767
    rounded = (torch.round(groups / dx) * dx).view(rows, 256)
    got = method.apply(layer, x)
    if rows <= bindings.INT4_I16_MAX_ROWS:
        _, s, z = int4_f32_layout.unpack(layer.qweight)
        s, z = s[:96].T, z[:96].T
        lost = (x - rounded).view(rows, -1, 32).sum(dim=-1)
        torch.testing.assert_close(got, rounded @ deq.T + lost @ (z - 8 * s), atol=1e-4, rtol=1e-5)
    else:
        torch.testing.assert_close(got, matmul_ops.int4_gemm_f32(x, layer.qweight, 96))
    f32 = matmul_ops.int4_gemm_f32(x, layer.qweight, 96)
    assert ((got - f32).norm() / f32.norm()) < 1e-3  # rounding these rows to bfloat16 costs ~1e-3
    _, exact = layer_of(Int4Method, w, int8_activations=False)
    assert not exact.use_i16_f32_kernel


def test_float32_layout_is_the_one_it_names():
    """Tile t, group g: 512 code bytes (column k, byte c: row c low nibble, row 16 + c high), then 32
    scales and 32 zeros as halves; unpack and rows_of give back codes, and scales rounded to halves."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 96), dtype=torch.uint8, generator=g)
    scale, zero = torch.rand(64, 3, generator=g) * 0.02, torch.randn(64, 3, generator=g) * 0.02
    packed = int4_f32_layout.pack(codes, scale, zero)
    assert packed.shape == (2, 3, 640)
    n, k = 37, 70  # row 37: tile 1, row 5 (a low nibble); column 70: group 2, column 6
    byte = packed[1, 2, 6 * 16 + 5]
    assert byte & 15 == codes[n, k] and byte >> 4 == codes[n + 16, k]
    halves = packed[1, 2, 512:].contiguous().view(torch.float16)
    assert halves[5] == scale[n, 2].half() and halves[32 + 5] == zero[n, 2].half()
    back, s, z = int4_f32_layout.unpack(packed)
    assert torch.equal(back, codes)
    assert torch.equal(s, scale.half().float()) and torch.equal(z, zero.half().float())
    rows = torch.tensor([63, 0, 37, 16, 5])
    r_codes, r_s, r_z = int4_f32_layout.rows_of(packed, rows)
    assert torch.equal(r_codes, codes[rows]) and torch.equal(r_s, s[rows]) and torch.equal(r_z, z[rows])


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 64])  # 1, 3, 5, 17: row blocks of 4 left incomplete
def test_int4_gemm_kernel_matches_pytorchs(rows):
    from tessera.layers.quantization import INT4_GEMM_MAX_ROWS

    if not capabilities.bf16_matmuls():
        pytest.skip("no AVX512-BF16 matrix kernels here")
    torch.manual_seed(rows)
    w = torch.randn(200, 96) * 0.05  # 200 rows: the last 64-row tile is partly padding
    method, layer = layer_of(Int4Method, w, dtype=torch.bfloat16, int8_activations=False)
    assert layer.use_gemm_kernel and not layer.use_i8_kernel and rows <= INT4_GEMM_MAX_ROWS
    x = torch.randn(rows, 96).bfloat16()
    got = matmul_ops.int4_gemm_bf16(x, layer.qweight, layer.scales_zeros, layer.out_rows)
    want = torch._weight_int4pack_mm_for_cpu(x, layer.qweight, 32, layer.scales_zeros)[:, :layer.out_rows]
    assert got.shape == want.shape == (rows, 200)
    torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)
    torch.testing.assert_close(method.apply(layer, x).float(), got.float(), atol=0, rtol=0)  # the route taken


def _int4_i8_reference(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """What int4_gemm_i8 computes, in float64: x rounded to int8 per group of 32 (scale amax / 127),
    the codes' integer dot products, then s * (dx * Q - 8 * sum x) + z * sum x per group."""
    m, k = x.shape
    xf = x.double().view(m, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127).float() / amax.float()  # (127 / amax is 127 * (1 / amax) in torch)
    xq = torch.where(amax > 0, torch.round(xf.float() * inv).double(), torch.zeros_like(xf))
    q = torch.einsum("mgi,ngi->mng", xq, codes.view(codes.shape[0], k // 32, 32).double())
    s, z = sz[..., 0].double().T, sz[..., 1].double().T  # [N, K/32]
    dx, sx = (amax / 127).squeeze(-1), xf.sum(-1)
    return (s * (dx[:, None] * q - 8 * sx[:, None]) + z * sx[:, None]).sum(-1)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 150])  # blocks of 6 rows, whole and not
def test_int4_int8_activation_kernel_is_exact_to_its_rounding(rows):
    """int4_gemm_i8 (VNNI) must compute the integer products of the codes and int8 activations
    exactly, each output rounded once to bfloat16; and the layer takes it when int8 activations
    are on (--int8-activations), the bfloat16 kernel when they are off."""

    if not capabilities.int4_i8_matmuls():
        pytest.skip("no AVX512-VNNI/VBMI int4 kernel here")
    g = torch.Generator().manual_seed(rows)
    n, k = 130, 96  # 130: the last 64-row tile mostly padding; 96: three groups
    codes = torch.randint(0, 16, (192, k), dtype=torch.int32, generator=g)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.stack([torch.rand(192, k // 32, generator=g) * 0.02, torch.randn(192, k // 32, generator=g) * 0.02],
                     -1).transpose(0, 1).contiguous().bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    x[0, 32:64] = 0  # a group of zeros: scale 0, no division by it
    got = matmul_ops.int4_gemm_i8(x, packed, sz, n)
    want = _int4_i8_reference(x, codes, sz)[:, :n]
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # one bfloat16 rounding of each output (8 bits of mantissa), float32 sums of a few terms
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=2 ** -8)

    w = torch.randn(200, 96) * 0.05
    method, layer = layer_of(Int4Method, w, dtype=torch.bfloat16)
    assert layer.use_i8_kernel
    xs = torch.randn(rows, 96).bfloat16()
    taken = method.apply(layer, xs)
    torch.testing.assert_close(taken, matmul_ops.int4_gemm_i8(xs, layer.qweight, layer.scales_zeros, 200), atol=0, rtol=0)
    # against the bfloat16 product: the activations' rounding, about 1 % of the output's scale
    exact = xs.float() @ method.dequantize(layer).float().T
    assert ((taken.float() - exact).norm() / exact.norm()).item() < 0.03


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64])  # 1-2: the factored path; odd counts: the last unpaired row
def test_int4_f32_kernel_matches_the_dequantized_weight(rows):
    """Hosts below avx512_bf16 compute in float32, where PyTorch's int4pack kernel runs at ~1 GFLOP/s:
    our kernel (int4_avx2.c, on the float32 layout the method packs itself)
    takes 1-64 rows there and must compute what the dense path computes; without int8 activations it
    is the route the method takes."""
    if not capabilities.avx2_matmuls():
        pytest.skip("kernels built without AVX2 + FMA")
    torch.manual_seed(rows)
    w = torch.randn(200, 96) * 0.05  # 200 rows: the last 32-row tile is partly padding
    method, layer = layer_of(Int4Method, w, dtype=torch.float32, int8_activations=False)
    assert layer.use_f32_kernel and method.f32_layout
    x = torch.randn(rows, 96)
    got = matmul_ops.int4_gemm_f32(x, layer.qweight, layer.out_rows)
    assert got.shape == (rows, 200)
    torch.testing.assert_close(got, x @ method.dequantize(layer).T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(method.apply(layer, x), got, atol=0, rtol=0)  # the route taken
    with pytest.raises(library.KernelUnavailable):
        matmul_ops.int4_gemm_f32(torch.randn(bindings.INT4_F32_MAX_ROWS + 1, 96), layer.qweight, layer.out_rows)
