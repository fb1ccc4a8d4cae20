"""Weight-only quantization: exact GGUF -> int4 mapping, kernel choice by row count, embeddings,
--quantization auto's choices, batching invariance with each method, and perplexity against the
dequantized model on real packaged models."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from torch import nn

from tessera.kernels import bindings, capabilities, gguf_ops, library, matmul_ops
from tessera.layers import FloatWeight, GGUFWeight, Linear, QuantConfig
from tessera.layers.quantization.base import int4pack_layout
from tessera.layers.quantization.int4 import AVX2_LAYOUT, pack_avx2_layout
from tessera.layers.quantization import (ROW_BUCKET_MIN, Int4Method, Int8Method, dense_linear, method_for,
                                        quantize_int4, row_bucket)
from tessera.llm import LLM
from tessera.sampling_params import SamplingParams

from tiny_model import make_tiny_model

PPL_TEXT = Path(__file__).resolve().parents[1] / "data" / "gfdl-1.3-head.txt"


def gguf_weight(w: np.ndarray, qtype: Q) -> GGUFWeight:
    raw = quantize(w.astype(np.float32), qtype)
    return GGUFWeight(raw, qtype, w.shape)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_map_exactly_onto_int4_groups(qtype):
    rng = np.random.default_rng(0)
    src = gguf_weight(rng.standard_normal((70, 96)) * 0.05, qtype)
    codes, scale, zero = src.int4_groups()
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    rebuilt = ((codes.float().view(70, 3, 32) - 8) * scale[..., None] + zero[..., None]).view(70, 96)
    ref = torch.from_numpy(dequantize(src.raw, qtype).reshape(70, 96))
    torch.testing.assert_close(rebuilt, ref, atol=1e-6, rtol=1e-6)


def test_non_q4_types_have_no_exact_int4_form():
    w = gguf_weight(np.ones((4, 64)), Q.Q8_0)
    assert w.int4_groups() is None


@pytest.mark.model
def test_q4_k_blocks_map_exactly_onto_int4_groups(model_path):
    from tessera.models.gguf_file import read_gguf

    gf = read_gguf(model_path("qwen2.5-coder-0.5b"))
    try:
        name = next(n for n, t in gf.tensors.items() if t.ggml_type == Q.Q4_K)
        w = gf.raw_weight(name)
        part = GGUFWeight(w.raw[:64], w.ggml_type, (64, w.shape[1]))
        codes, scale, zero = part.int4_groups()
        k = w.shape[1]
        rebuilt = ((codes.float().view(64, k // 32, 32) - 8) * scale[..., None] + zero[..., None]).view(64, k)
        torch.testing.assert_close(rebuilt, part.dequantize(), atol=1e-5, rtol=1e-5)
    finally:
        del w, part
        gf.close()


def _layer(method_cls, w: torch.Tensor, dtype=torch.float32, dense_copy=False, source=None, int8_activations=True):
    cfg = QuantConfig("int4" if method_cls is Int4Method else "int8", dtype, dense_copy, int8_activations)
    layer = nn.Module()
    method = method_cls(cfg)
    method.load(layer, source if isinstance(source, list) else [source or FloatWeight(w)])
    return method, layer


@pytest.mark.parametrize("method_cls", [Int4Method, Int8Method])
@pytest.mark.parametrize("dense_copy", [False, True])
@pytest.mark.parametrize("rows", [300, 128])  # 300: not a whole number of 64-row int4 tiles
def test_small_and_large_steps_compute_the_same_weight(method_cls, dense_copy, rows):
    torch.manual_seed(0)
    w = torch.randn(rows, 64) * 0.05
    method, layer = _layer(method_cls, w, dense_copy=dense_copy)
    deq = method.dequantize(layer)
    assert deq.shape == (rows, 64)
    assert (deq - w).abs().max() < (0.02 if method_cls is Int4Method else 0.002)  # a quantization step
    for t in (1, 3, method.config.small_batch_max, method.config.small_batch_max + 1, 64):
        x = torch.randn(t, 64)
        torch.testing.assert_close(method.apply(layer, x), x @ deq.T, atol=2e-5, rtol=1e-5)
    ids = torch.tensor([[0, 5], [63, rows - 1]])
    torch.testing.assert_close(method.embedding(layer, ids), deq[ids])


@pytest.mark.skipif(not capabilities.avx2_matmuls(), reason="kernels built without AVX2 + FMA")
def test_float32_int4_takes_the_avx2_kernel_whatever_the_hosts_layout():
    """On an AVX-512 host without BF16 PyTorch packs its AVX-512 layout, which only its own
    ~1 GFLOP/s float32 product reads: the method packs the AVX2 layout itself there."""
    torch.manual_seed(0)
    method, layer = _layer(Int4Method, torch.randn(128, 64) * 0.05)
    assert layer.use_f32_kernel and method.layout.avx2_layout
    assert layer.torch_layout == (int4pack_layout() is method.layout)


def test_own_avx2_packing_is_the_layout_it_names():
    codes = torch.randint(0, 16, (64, 96), dtype=torch.uint8)
    packed = pack_avx2_layout(codes)
    tiles = packed.view(2, 96, 16)  # [tile, k, byte]
    low, high = AVX2_LAYOUT.rows_in_nibble(0), AVX2_LAYOUT.rows_in_nibble(1)
    unpacked = torch.empty(2, 32, 96, dtype=torch.uint8)
    unpacked[:, low], unpacked[:, high] = (tiles & 15).transpose(1, 2), (tiles >> 4).transpose(1, 2)
    assert torch.equal(unpacked.view(64, 96), codes)
    if int4pack_layout().avx2_layout:  # where PyTorch packs this layout itself, the same bytes
        assert torch.equal(packed, torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))


def test_int4_from_q4_1_keeps_the_codes_and_is_exact():
    rng = np.random.default_rng(1)
    src = gguf_weight(rng.standard_normal((64, 64)) * 0.05, Q.Q4_1)
    method, layer = _layer(Int4Method, None, source=src)
    assert layer.int4_exact and method.describe(layer) == "int4"
    torch.testing.assert_close(method.dequantize(layer), src.dequantize(), atol=1e-6, rtol=1e-6)


def test_requantized_int4_is_marked_and_close():
    w = torch.randn(64, 64) * 0.05
    codes, scale, zero = quantize_int4(w)
    assert int(codes.max()) <= 15 and scale.shape == (64, 2)
    method, layer = _layer(Int4Method, w)
    assert not layer.int4_exact and "requantized" in method.describe(layer)


def test_bfloat16_int4_scales_and_kernels():
    torch.manual_seed(0)
    w = torch.randn(128, 64) * 0.05
    method, layer = _layer(Int4Method, w, dtype=torch.bfloat16)
    x = torch.randn(2, 64).bfloat16()
    ref = x.float() @ method.dequantize(layer).float().T
    assert (method.apply(layer, x).float() - ref).abs().max() < 0.02


def _auto(*sources) -> str:
    return method_for(QuantConfig("auto", torch.float32), list(sources)).name


def test_auto_keeps_each_checkpoints_precision_class():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 64)) * 0.05
    assert _auto(gguf_weight(w, Q.Q4_1)) == "int4"
    assert _auto(gguf_weight(w, Q.Q4_0), gguf_weight(w, Q.Q4_1)) == "int4"
    assert _auto(gguf_weight(w, Q.Q8_0)) == "int8"
    assert _auto(gguf_weight(w, Q.Q4_0), gguf_weight(w, Q.Q8_0)) == "int8"  # a merged weight: the finer class
    assert _auto(FloatWeight(torch.from_numpy(w))) == "dense"
    assert method_for(QuantConfig("none"), [gguf_weight(w, Q.Q4_1)]).name == "dense"
    assert method_for(QuantConfig("int4"), [gguf_weight(w, Q.Q8_0)]).name == "int4"
    assert method_for(QuantConfig("int4"), [FloatWeight(torch.zeros(8, 48))]).name == "int8"  # 48 % 32 != 0
    with pytest.raises(ValueError, match="quantization must be one of"):
        QuantConfig("fp8")


def test_linear_rejects_wrong_shapes():
    from tessera.errors import ModelFormatError

    lin = Linear(64, [32, 16], QuantConfig("int8"), shard_names=["q", "k"], prefix="x.qkv_proj")
    with pytest.raises(ModelFormatError, match="x.qkv_proj.k has shape"):
        lin.weight_loader(torch.zeros(32, 64), "k")
    lin.weight_loader(torch.zeros(16, 64), "k")
    assert lin.missing_parts() == ["q"] and not lin.loaded
    lin.weight_loader(torch.zeros(32, 64), "q")
    assert lin.loaded and lin(torch.zeros(2, 64, dtype=torch.bfloat16)).shape == (2, 48)


# -- the engine with each method: batching must never change greedy output --------------------------

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(1, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-q") / "llama")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dense_copy", ["on", "off"])
def test_batching_invariance_with_each_method(tiny_folder, quantization, dense_copy):
    opts = dict(dtype="float32", quantization=quantization, dense_weight_copy=dense_copy, max_model_len=128)
    llm = LLM(str(tiny_folder), **opts)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.quant_method.name == quantization
    ps = _prompts(24)
    alone = [o.outputs[0].token_ids for p in ps for o in llm.generate([p], GREEDY)]
    batched = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    chunked = LLM(str(tiny_folder), loaded=llm.engine.loaded, max_num_batched_tokens=7, max_num_seqs=5,
                  max_model_len=128, quantization=quantization)
    assert batched == alone
    assert [o.outputs[0].token_ids for o in chunked.generate(ps, GREEDY)] == alone


# -- real models: perplexity against the dequantized model -------------------------------------------

def perplexity(loaded, ids: list[int]) -> float:
    from tessera.models.loader import forward_single

    with torch.inference_mode():
        logits = forward_single(loaded, ids)
    lp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return math.exp(-lp.mean().item())


@pytest.fixture(scope="module")
def ppl_ids():
    return PPL_TEXT.read_text()


@pytest.mark.model
@pytest.mark.parametrize("name, quantization, limit", [
    ("smollm2-135m", "auto", 0.01),  # Q4_1 -> int4 exactly, Q8_0 embeddings -> int8
    ("qwen2.5-coder-0.5b", "auto", 0.03),  # Q5_0 / Q6_K / Q8_0 requantized to int8, Q4_K -> int4 exactly
])
def test_perplexity_close_to_dequantized_model(model_path, ppl_ids, name, quantization, limit):
    from tessera.models.loader import load_model

    path = model_path(name)
    ref = load_model(path, "float32", quantization="none")
    ids = ref.tokenizer.encode(ppl_ids)[:1024]  # enough text for 1-3 % limits; float32 passes are the cost
    assert len(ids) == 1024
    ppl_ref = perplexity(ref, ids)
    del ref
    quant = load_model(path, "float32", quantization=quantization)
    ppl_q = perplexity(quant, ids)
    assert abs(ppl_q / ppl_ref - 1) <= limit, (ppl_ref, ppl_q)


@pytest.mark.parametrize("method_cls", [Int4Method, Int8Method])
def test_loading_in_row_chunks_gives_the_same_weight(monkeypatch, method_cls):
    """Large weights are converted a few thousand rows at a time; the result must not depend on it."""
    torch.manual_seed(3)
    w = torch.randn(300, 64) * 0.05
    rng = np.random.default_rng(3)
    q41 = gguf_weight(rng.standard_normal((200, 64)) * 0.05, Q.Q4_1)
    whole = [m.dequantize(l) for m, l in (_layer(method_cls, w), _layer(method_cls, None, source=q41))]
    monkeypatch.setattr(f"{method_cls.__module__}.LOAD_CHUNK_ROWS", 64)  # where the method reads it
    chunked = [m.dequantize(l) for m, l in (_layer(method_cls, w), _layer(method_cls, None, source=q41))]
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    method, layer = _layer(method_cls, w)
    x = torch.randn(2, 64)
    torch.testing.assert_close(method.apply(layer, x), x @ method.dequantize(layer).T, atol=2e-5, rtol=1e-5)


def _random_blocks(qtype: Q, rows: int, blocks: int, seed: int = 0) -> GGUFWeight:
    """Random GGUF blocks of `qtype` (every bit pattern is a valid block) with sane float16 headers."""
    rng = np.random.default_rng(seed)
    size, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    headers = {Q.Q8_0: [0], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q4_K: [0, 2]}[qtype]
    for off in headers:
        raw[..., off:off + 2] = rng.uniform(1e-3, 0.1, size=(rows, blocks)).astype(np.float16)[..., None].view(np.uint8)
    return GGUFWeight(raw.reshape(rows, -1), qtype, (rows, blocks * size))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K])
def test_five_to_eight_bit_blocks_map_exactly_onto_int8_groups(qtype):
    src = _random_blocks(qtype, 6, 2)
    codes, scale, zero = src.int8_groups()
    group = src.shape[1] // scale.shape[1]
    assert codes.dtype == torch.int8 and group == (16 if qtype == Q.Q6_K else 32)
    assert (zero is not None) == (qtype in (Q.Q5_1, Q.Q5_K))
    g = codes.float().view(6, -1, group)
    rebuilt = (torch.addcmul(zero[..., None], g, scale[..., None]) if zero is not None else g * scale[..., None])
    assert torch.equal(rebuilt.view(6, -1), src.dequantize())  # bit for bit


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_K, Q.Q6_K])
def test_int8_layers_hold_the_files_weights(qtype):
    """No second rounding: in float32 the int8 layer's weight is the dequantized GGUF tensor."""
    src = _random_blocks(qtype, 40, 1, seed=1)
    method, layer = _layer(Int8Method, None, source=src)
    assert layer.int8_exact and method.describe(layer) == "int8"
    assert torch.equal(method.dequantize(layer), src.dequantize())
    x = torch.randn(5, src.shape[1])  # outputs of ~100 (random blocks have large weights): float32 rounding
    torch.testing.assert_close(method.apply(layer, x), x @ src.dequantize().T, atol=1e-3, rtol=1e-5)


def test_merged_int8_pieces_take_the_finest_groups():
    """A fused projection of a Q8_0 piece (groups of 32) and a Q6_K piece (16) stores groups of 16,
    the coarser piece's scales repeated; both pieces stay exact."""
    q8, q6 = _random_blocks(Q.Q8_0, 16, 8, seed=2), _random_blocks(Q.Q6_K, 24, 1, seed=3)
    assert Int8Method.layout([Q.Q8_0, Q.Q6_K], 256) == (16, False)
    method, layer = _layer(Int8Method, None, source=[q8, q6])
    assert layer.scales.shape == (40, 16) and layer.zeros is None
    assert torch.equal(method.dequantize(layer), torch.cat([q8.dequantize(), q6.dequantize()]))
    assert Int8Method.storage_bytes(40, 256, method.config, [Q.Q8_0, Q.Q6_K]) == \
        sum(b.numel() * b.element_size() for b in (layer.qweight, layer.scales))


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_int8_kernels_against_the_reference(zeros, group, dtype, atol):

    if library.available() is not None:
        pytest.skip("C kernels unavailable")
    torch.manual_seed(group + zeros)
    n, k = 37, 192  # 37 rows: not a whole block of the gemm kernel's 4
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // group) * 1e-3
    zero = (torch.rand(n, k // group) - 0.5) * 1e-2 if zeros else None
    g = codes.float().view(n, -1, group)
    w = (torch.addcmul(zero[..., None], g, scale[..., None]) if zeros else g * scale[..., None]).view(n, k)
    for rows in (1, 2, 3, 5, 8):
        x = torch.randn(rows, k).to(dtype)
        got = matmul_ops.int8_gemv(x, codes, scale, zero)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), x.float() @ w.T, atol=atol, rtol=0.02)
        if dtype == torch.bfloat16 and capabilities.bf16_matmuls():
            got = matmul_ops.int8_gemm_bf16(x, codes, scale, zero)
            torch.testing.assert_close(got.float(), x.float() @ w.bfloat16().float().T, atol=atol, rtol=0.02)
    with pytest.raises(library.KernelUnavailable):
        matmul_ops.int8_gemv(torch.randn(9, k), codes, scale, zero)


def _kernel_built_for(sources: tuple[str, ...], isa: list[str], tmp_path: Path):
    """Kernel sources compiled apart with `isa` flags (older instruction sets than the host's
    build), loaded through ctypes."""
    import ctypes
    import shutil
    import subprocess


    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lib_path = tmp_path / f"{Path(sources[0]).stem}.so"
    subprocess.run([cc, "-O2", "-march=native", *isa, "-fopenmp", "-shared", "-fPIC", "-std=c11",
                    *(str(Path(library.__file__).parent / s) for s in sources), "-o", str(lib_path), "-lm"], check=True,
                   capture_output=True)
    return ctypes.CDLL(str(lib_path))


@pytest.mark.parametrize("isa", [["-mno-avx512f", "-mavx2", "-mfma"], ["-mno-avx512f", "-mno-avx2"]],
                         ids=["avx2", "plain-c"])
def test_int8_gemv_on_older_instruction_sets(isa, tmp_path):
    """The AVX2 and plain C branches of int8_gemv.c, compiled apart and called through ctypes."""
    import ctypes

    lib = _kernel_built_for(("int8_gemv.c",), isa, tmp_path)
    torch.manual_seed(5)
    n, k, group = 21, 96, 16
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale, zero = torch.rand(n, k // group) * 1e-3, (torch.rand(n, k // group) - 0.5) * 1e-2
    w = torch.addcmul(zero[..., None], codes.float().view(n, -1, group), scale[..., None]).view(n, k)
    p = ctypes.c_void_p
    lib.int8_gemv.argtypes = [p, p, p, p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int, p]
    for rows in (1, 3):  # AVX2: one row has its own loop
        x = torch.randn(rows, k)
        out, scratch = torch.empty(rows, n), torch.empty(rows * k)
        assert lib.int8_gemv(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), rows,
                             n, k, group, 0, scratch.data_ptr()) == 0
        torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_int8_small_batches_run_in_slices_of_the_kernels_rows(dtype, atol):
    torch.manual_seed(4)
    w = torch.randn(70, 96) * 0.05
    method, layer = _layer(Int8Method, w, dtype=dtype)
    assert layer.scales.shape == (70, 3) and not layer.int8_exact
    deq = method.dequantize(layer).float()
    for rows in (1, 2, 3, 8, 9, 17, method.config.small_batch_max):
        x = torch.randn(rows, 96).to(dtype)
        got = method.apply(layer, x)
        assert got.dtype == dtype and got.shape == (rows, 70)
        torch.testing.assert_close(got.float(), x.float() @ deq.T, atol=atol, rtol=0.02)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 64])  # 1, 3, 5, 17: row blocks of 4 left incomplete
def test_int4_gemm_kernel_matches_pytorchs(rows):
    from tessera.layers.quantization import INT4_GEMM_MAX_ROWS

    if not capabilities.bf16_matmuls():
        pytest.skip("no AVX512-BF16 matrix kernels here")
    torch.manual_seed(rows)
    w = torch.randn(200, 96) * 0.05  # 200 rows: the last 64-row tile is partly padding
    method, layer = _layer(Int4Method, w, dtype=torch.bfloat16, int8_activations=False)
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
    method, layer = _layer(Int4Method, w, dtype=torch.bfloat16)
    assert layer.use_i8_kernel
    xs = torch.randn(rows, 96).bfloat16()
    taken = method.apply(layer, xs)
    torch.testing.assert_close(taken, matmul_ops.int4_gemm_i8(xs, layer.qweight, layer.scales_zeros, 200), atol=0, rtol=0)
    # against the bfloat16 product: the activations' rounding, about 1 % of the output's scale
    exact = xs.float() @ method.dequantize(layer).float().T
    assert ((taken.float() - exact).norm() / exact.norm()).item() < 0.03


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64])  # 1-2: the factored path; odd counts: the last unpaired row
def test_int4_f32_kernel_matches_the_dequantized_weight(rows):
    """AVX2 hosts compute in float32, where PyTorch's int4pack kernel runs at ~1 GFLOP/s: our
    kernel (int4_avx2.c) takes 1-64 rows there and must compute what the dense path computes."""
    from tessera.layers.quantization import int4pack_layout

    layout = int4pack_layout()
    if layout is None or not layout.avx2_layout or not capabilities.avx2_matmuls():
        pytest.skip("not an AVX2 int4pack layout with the AVX2 + FMA kernel")
    torch.manual_seed(rows)
    w = torch.randn(200, 96) * 0.05  # 200 rows: the last 32-row tile is partly padding
    method, layer = _layer(Int4Method, w, dtype=torch.float32)
    assert layer.use_f32_kernel
    x = torch.randn(rows, 96)
    got = matmul_ops.int4_gemm_f32(x, layer.qweight, layer.scales_zeros, layer.out_rows)
    assert got.shape == (rows, 200)
    torch.testing.assert_close(got, x @ method.dequantize(layer).T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(method.apply(layer, x), got, atol=0, rtol=0)  # the route taken
    with pytest.raises(library.KernelUnavailable):
        matmul_ops.int4_gemm_f32(torch.randn(bindings.INT4_F32_MAX_ROWS + 1, 96), layer.qweight, layer.scales_zeros,
                              layer.out_rows)


def test_row_buckets_bound_padding_and_shape_count():
    """Dense matmuls see few distinct row counts (oneDNN keeps a kernel per shape), padded by <= 1/8."""
    for rows in range(1, 9000):
        b = row_bucket(rows)
        assert b >= rows and b == row_bucket(b)
        if rows <= ROW_BUCKET_MIN:
            assert b == rows
        else:
            assert b <= rows * 1.125
    assert len({row_bucket(r) for r in range(ROW_BUCKET_MIN + 1, 8193)}) == 72  # 8 per doubling


@pytest.mark.parametrize("rows", [3, 17, 70, 300])
def test_dense_linear_pads_only_bfloat16_and_returns_exact_rows(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=g)
    x = torch.randn(rows, 32, generator=g)
    assert torch.equal(dense_linear(x, w), torch.nn.functional.linear(x, w))  # float32: exact, unpadded
    xb, wb = x.bfloat16(), w.bfloat16()
    out = dense_linear(xb, wb)
    assert out.shape == (rows, 48)
    torch.testing.assert_close(out.float(), x @ w.T, rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_int4_dequantize_follows_the_hosts_int4pack_layout(capability):
    """PyTorch packs int4 differently per instruction set (AVX-512: 64-row tiles; AVX2 and plain C:
    32-row tiles paired differently). The dense path (prefill) must read the same weight as the
    weight-only kernel (decode) under each capability the host has."""
    import subprocess
    import sys

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if capability != "default" and f" {capability}" not in flags.replace("avx512f", "avx512"):
        pytest.skip(f"this CPU has no {capability} (PyTorch would run it anyway and fault)")

    code = (
        "import torch\n"
        "from tessera.layers.quantization import Int4Method, QuantConfig, int4pack_layout\n"
        "from tessera.layers.weights import FloatWeight\n"
        "torch.manual_seed(0)\n"
        "w = torch.randn(100, 96) * 0.05\n"
        "m = Int4Method(QuantConfig(mode='int4', dtype=torch.float32))\n"
        "layer = torch.nn.Module()\n"
        "m.load(layer, [FloatWeight(w)])\n"
        "x = torch.randn(3, 96)\n"
        "small = m._small(layer, x)\n"
        "dense = x @ m.dequantize(layer).T\n"
        "assert (small - dense).abs().max() < 1e-4, (small - dense).abs().max()\n"
        "routed = m.apply(layer, x)\n"  # the route decode takes (our AVX2 kernel where it applies)
        "assert (routed - dense).abs().max() < 1e-4, (routed - dense).abs().max()\n"
        "rows = torch.tensor([0, 17, 33, 63, 64, 99])\n"
        "assert torch.equal(m._rows(layer, rows), m.dequantize(layer)[rows])\n"
        "assert (m.dequantize(layer) - w).abs().max() < 0.02\n"
        "print(torch.backends.cpu.get_cpu_capability(), int4pack_layout().tile)\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


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


def _assert_bf16_rounding_of(got: torch.Tensor, want: torch.Tensor) -> None:
    """got is want rounded to bfloat16 (half an ulp, 2^-9 relative), give or take float32
    accumulation (far below that on these sizes)."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6 * want.abs().max().item())


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
    src = _random_blocks(qtype, 70, 3, seed=11)
    method, layer = _kquant_layer(src)
    assert torch.equal(method._weights(layer, slice(None)), src.dequantize())
    if qtype == Q.Q6_K:
        _, int8_layer = _layer(Int8Method, None, source=src)
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
    src = _random_blocks(qtype, 37, 3, seed=12)  # 37 rows: not a multiple of the threads' split
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
            _assert_bf16_rounding_of(got, want)
    with pytest.raises(library.KernelUnavailable):
        kernel(torch.randn(9, 768), layer.qweight, layer.scales, layer.d)


@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_layers_slice_small_batches_and_dequantize_large_ones(qtype):

    if not capabilities.kquant_matmuls():
        pytest.skip("no vector path for the K-quant kernels here")
    src = _random_blocks(qtype, 40, 2, seed=13)
    w = src.dequantize()
    for dense_copy in (False, True):
        method, layer = _kquant_layer(src, dense_copy)
        # without a dense copy, two calls of the kernel (8 rows and 3); with one, 8 rows at most
        x = torch.randn(min(11, method.config.small_batch_max), 512).bfloat16()
        _assert_bf16_rounding_of(method.apply(layer, x), _kquant_reference(x, w))
        # past the kernels' rows: the dense copy's product, or without one an int8 x int8 product
        big = torch.randn(method.config.small_batch_max + 1, 512).bfloat16()
        exact = big.double() @ w.double().T
        assert (method.apply(layer, big).double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_prefill_steps_multiply_in_int8(qtype):
    """Past the few-row kernels (no dense copy) the weight's columns are multiplied by the
    step's smoothing factors and requantized per row to int8, the activations divided by them and
    quantized per token: the result is that integer product, scaled, rounded to bfloat16 once,
    and within a few percent of the exact product (here with an outlier channel)."""
    from tessera.layers.quantization import SMOOTHING_ALPHA

    if not capabilities.kquant_matmuls():
        pytest.skip("no vector path for the K-quant kernels here")
    src = _random_blocks(qtype, 45, 2, seed=14)
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
    _assert_bf16_rounding_of(got, (xq.double() @ wq.double().T) * (amax / 127).double() * rs.double())
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).norm() / exact.norm()) < 0.02


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

    lib = _kernel_built_for(("kquant_gemm.c", "kquant_dequant.c"), isa, tmp_path)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.q6k_gemm if qtype == Q.Q6_K else lib.q4k_gemm
    fn.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_int, p]
    lib.kquant_scratch_bytes.argtypes = [i64, i64]
    lib.kquant_scratch_bytes.restype = i64
    src = _random_blocks(qtype, 21, 2, seed=14)
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
            _assert_bf16_rounding_of(got, want)
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

    lib = _kernel_built_for(("mxfp4_gemm.c",), isa, tmp_path)
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
