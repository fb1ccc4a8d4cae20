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
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tessera.kernels import bindings, capabilities, library, matmul_ops
from tessera.layers import FloatWeight, GGUFWeight, Linear, QuantConfig
from tessera.layers.quantization import (ROW_BUCKET_MIN, Int4Method, Int8Method, dense_linear, method_for,
                                        quantize_int4, row_bucket)
from tessera.llm import LLM
from tessera.sampling_params import SamplingParams

from quant_common import kernel_built_for, layer_of, random_blocks
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


@pytest.mark.parametrize("method_cls", [Int4Method, Int8Method])
@pytest.mark.parametrize("dense_copy", [False, True])
@pytest.mark.parametrize("rows", [300, 128])  # 300: not a whole number of 64-row int4 tiles
def test_small_and_large_steps_compute_the_same_weight(method_cls, dense_copy, rows):
    torch.manual_seed(0)
    w = torch.randn(rows, 64) * 0.05
    # unrounded activations: the float32 int4 kernel's int8 rows are tested below
    method, layer = layer_of(method_cls, w, dense_copy=dense_copy, int8_activations=False)
    deq = method.dequantize(layer)
    assert deq.shape == (rows, 64)
    assert (deq - w).abs().max() < (0.02 if method_cls is Int4Method else 0.002)  # a quantization step
    for t in (1, 3, method.config.small_batch_max, method.config.small_batch_max + 1, 64):
        x = torch.randn(t, 64)
        torch.testing.assert_close(method.apply(layer, x), x @ deq.T, atol=2e-5, rtol=1e-5)
    ids = torch.tensor([[0, 5], [63, rows - 1]])
    torch.testing.assert_close(method.embedding(layer, ids), deq[ids])


def test_int4_from_q4_1_keeps_the_codes_and_is_exact():
    rng = np.random.default_rng(1)
    src = gguf_weight(rng.standard_normal((64, 64)) * 0.05, Q.Q4_1)
    method, layer = layer_of(Int4Method, None, source=src, int8_activations=False)
    assert layer.int4_exact and method.describe(layer) == "int4"
    torch.testing.assert_close(method.dequantize(layer), src.dequantize(), atol=1e-6, rtol=1e-6)


def test_requantized_int4_is_marked_and_close():
    w = torch.randn(64, 64) * 0.05
    codes, scale, zero = quantize_int4(w)
    assert int(codes.max()) <= 15 and scale.shape == (64, 2)
    method, layer = layer_of(Int4Method, w)
    assert not layer.int4_exact and "requantized" in method.describe(layer)


def test_bfloat16_int4_scales_and_kernels():
    torch.manual_seed(0)
    w = torch.randn(128, 64) * 0.05
    method, layer = layer_of(Int4Method, w, dtype=torch.bfloat16)
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
    """Unrounded activations: the products then add nothing to the ~1e-6 differences a batch's shape
    makes in attention, which these near-tied random logits survive; rounding the activations to
    int8 (--int8-activations, on by default) can move a code on such a difference (a logprob by
    ~0.02 here), so with it a token may depend on its batch where the logits nearly tie."""
    opts = dict(dtype="float32", quantization=quantization, dense_weight_copy=dense_copy, max_model_len=128,
                int8_activations=False)
    llm = LLM(str(tiny_folder), **opts)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.quant_method.name == quantization
    ps = _prompts(24)
    alone = [o.outputs[0].token_ids for p in ps for o in llm.generate([p], GREEDY)]
    batched = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    chunked = LLM(str(tiny_folder), loaded=llm.engine.loaded, max_num_batched_tokens=7, max_num_seqs=5,
                  max_model_len=128, quantization=quantization, int8_activations=False)
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
    # the weights' mapping alone: what rounding the activations to int8 costs is benchmarks/perplexity.py's
    quant = load_model(path, "float32", quantization=quantization, int8_activations=False)
    ppl_q = perplexity(quant, ids)
    assert abs(ppl_q / ppl_ref - 1) <= limit, (ppl_ref, ppl_q)


@pytest.mark.parametrize("method_cls", [Int4Method, Int8Method])
def test_loading_in_row_chunks_gives_the_same_weight(monkeypatch, method_cls):
    """Large weights are converted a few thousand rows at a time; the result must not depend on it."""
    torch.manual_seed(3)
    w = torch.randn(300, 64) * 0.05
    rng = np.random.default_rng(3)
    q41 = gguf_weight(rng.standard_normal((200, 64)) * 0.05, Q.Q4_1)
    whole = [m.dequantize(l) for m, l in (layer_of(method_cls, w), layer_of(method_cls, None, source=q41))]
    monkeypatch.setattr(f"{method_cls.__module__}.LOAD_CHUNK_ROWS", 64)  # where the method reads it
    chunked = [m.dequantize(l) for m, l in (layer_of(method_cls, w), layer_of(method_cls, None, source=q41))]
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    method, layer = layer_of(method_cls, w, int8_activations=False)
    x = torch.randn(2, 64)
    torch.testing.assert_close(method.apply(layer, x), x @ method.dequantize(layer).T, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K])
def test_five_to_eight_bit_blocks_map_exactly_onto_int8_groups(qtype):
    src = random_blocks(qtype, 6, 2)
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
    src = random_blocks(qtype, 40, 1, seed=1)
    method, layer = layer_of(Int8Method, None, source=src, int8_activations=False)  # rows unrounded
    assert layer.int8_exact and method.describe(layer).startswith("int8") and "requantized" not in method.describe(layer)
    assert torch.equal(method.dequantize(layer), src.dequantize())
    x = torch.randn(5, src.shape[1])  # outputs of ~100 (random blocks have large weights): float32 rounding
    torch.testing.assert_close(method.apply(layer, x), x @ src.dequantize().T, atol=1e-3, rtol=1e-5)


@pytest.mark.skipif(not capabilities.int16_row_products(), reason="an AVX2 build of the kernels")
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_1])
def test_one_float32_row_meets_int8_weights_as_int16(qtype):
    """Decode and verification rows (the LM head's) through int8_gemv_i16: each row rounded to int16
    per 32 values (max|x| / 32767) meets the codes in exact integer sums, a group's zero takes the
    unrounded sum; a row's result is the same alone and beside others; --no-int8-activations keeps
    the rows in float32."""
    src = random_blocks(qtype, 40, 2, seed=4)
    method, layer = layer_of(Int8Method, None, source=src)
    assert layer.use_i16_kernel and method.kernel_operand(layer).kind == bindings.LINEAR_INT8_I16
    w = src.dequantize()
    x = torch.randn(2, src.shape[1])
    groups = x[:1].view(1, -1, 32)
    dx = groups.abs().amax(dim=-1, keepdim=True) / 32767
    rounded = (torch.round(groups / dx) * dx).view(1, -1)
    got = method.apply(layer, x[:1])
    if layer.zeros is None:
        torch.testing.assert_close(got, rounded @ w.T, atol=1e-3, rtol=1e-5)
    assert ((got - x[:1] @ w.T).norm() / (x[:1] @ w.T).norm()) < 1e-4
    assert torch.equal(method.apply(layer, x)[:1], got)
    _, exact = layer_of(Int8Method, None, source=src, int8_activations=False)
    assert not exact.use_i16_kernel


def test_merged_int8_pieces_take_the_finest_groups():
    """A fused projection of a Q8_0 piece (groups of 32) and a Q6_K piece (16) stores groups of 16,
    the coarser piece's scales repeated; both pieces stay exact."""
    q8, q6 = random_blocks(Q.Q8_0, 16, 8, seed=2), random_blocks(Q.Q6_K, 24, 1, seed=3)
    assert Int8Method.layout([Q.Q8_0, Q.Q6_K], 256) == (16, False)
    method, layer = layer_of(Int8Method, None, source=[q8, q6])
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


@pytest.mark.parametrize("isa", [["-mno-avx512f", "-mavx2", "-mfma"], ["-mno-avx512f", "-mno-avx2"]],
                         ids=["avx2", "plain-c"])
def test_int8_gemv_on_older_instruction_sets(isa, tmp_path):
    """The AVX2 and plain C branches of int8_gemv.c, compiled apart and called through ctypes."""
    import ctypes

    lib = kernel_built_for(("int8_gemv.c",), isa, tmp_path)
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
    method, layer = layer_of(Int8Method, w, dtype=dtype)
    assert layer.scales.shape == (70, 3) and not layer.int8_exact
    deq = method.dequantize(layer).float()
    for rows in (1, 2, 3, 8, 9, 17, method.config.small_batch_max):
        x = torch.randn(rows, 96).to(dtype)
        got = method.apply(layer, x)
        assert got.dtype == dtype and got.shape == (rows, 70)
        torch.testing.assert_close(got.float(), x.float() @ deq.T, atol=atol, rtol=0.02)


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
        "m = Int4Method(QuantConfig(mode='int4', dtype=torch.float32, int8_activations=False))\n"
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
