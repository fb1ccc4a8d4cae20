"""The C kernels: built once per source and flags, and equal to the PyTorch operators they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels import capabilities, library, rowwise_ops
from tessera.layers import RMSNorm

pytestmark = pytest.mark.skipif(library.available() is not None, reason="C kernels unavailable here")


@pytest.mark.slow
def test_build_is_cached_by_source_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    path = library.build()
    assert path.parent == tmp_path / "kernels" and path.is_file()
    mtime = path.stat().st_mtime_ns
    assert library.build() == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    assert not list(path.parent.glob("*.partial"))


def test_build_without_compiler_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(library.KernelUnavailable, match="compiling the kernels failed"):
        library.build()


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_kernel_matches_torch(rows, with_residual, dtype):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    want_res = x + res if with_residual else x
    want = F.rms_norm(want_res, (576,), w, 1e-5)
    got_res = res.clone()
    got = rowwise_ops.rms_norm(x, w, 1e-5, got_res if with_residual else None)
    if with_residual:
        assert torch.equal(got_res, want_res)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        assert (got != want).float().mean() < 1e-3  # equal but for rare summation-order ties
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, inter", [(1, 1536), (33, 1536), (5, 40)])  # 40: a tail past the 16 lanes
def test_silu_mul_kernel_matches_torch(rows, inter):
    """The MLP activation in one pass equals F.silu(gate) * up with its bfloat16 roundings (the
    AVX-512 lanes and the scalar tail alike), and the layer takes it for bfloat16 rows."""
    from tessera.layers.mlp import GatedMLP
    from tessera.layers.quantization import QuantConfig

    gen = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 4).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(rowwise_ops.silu_mul(gu), F.silu(gate) * up)
    mlp = GatedMLP(64, inter, QuantConfig(mode="none"), "silu", "mlp")
    torch.manual_seed(rows)  # plain bfloat16 linears in place of the quantized ones: only the activation is under test
    mlp.gate_up_proj = torch.nn.Linear(64, 2 * inter, bias=False).bfloat16()
    mlp.down_proj = torch.nn.Linear(inter, 64, bias=False).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    want = mlp.down_proj(F.silu(mlp.gate_up_proj(x).chunk(2, -1)[0]) * mlp.gate_up_proj(x).chunk(2, -1)[1])
    assert torch.equal(mlp(x), want)
    assert mlp._c_silu == capabilities.bf16_matmuls()


def test_rms_norm_layer_uses_kernel_for_bf16_and_f32():
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        norm = RMSNorm(64, 1e-6, dtype)
        norm.weight_loader(torch.ones(64))
        assert norm.use_kernel
        x, r = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype)
        out, new_r = norm(x, r.clone())
        torch.testing.assert_close(out, F.rms_norm(x + r, (64,), norm.weight, 1e-6), atol=tol, rtol=tol)
        torch.testing.assert_close(new_r, x + r)
    assert not RMSNorm(64, 1e-6, torch.float16).use_kernel
    norm = RMSNorm(64, 1e-6, torch.bfloat16)
    norm.weight_loader(torch.ones(64))
    strided = torch.randn(64, 3).bfloat16().t()  # not contiguous: PyTorch path
    torch.testing.assert_close(norm(strided), F.rms_norm(strided, (64,), norm.weight, 1e-6))
