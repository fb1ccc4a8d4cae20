"""The C decode step (models/fused_decode.py, kernels/decode_step.c) against the module path, and
the runner's choice between them (engine/worker/model_executor.py)."""
from __future__ import annotations

import random

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.kernels import bindings, capabilities, library
from tessera.attention.paged import PagedBackend
from tessera.attention.sdpa import SdpaBackend
from tessera.engine.worker.model_executor import ModelExecutor
from tessera.models.base import ExecutionPath
from tessera.models.fused_decode import FusedDecode

from tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(library.available() is not None, reason="no C kernels here")

# head_dim 32 (the kernels' smallest vector of pairs), three query heads per KV head.
SHAPE = dict(hidden_size=192, intermediate_size=320, num_attention_heads=6, num_key_value_heads=2)
BLOCK = 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: a bias on the QKV projection
def folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fused") / request.param, arch=request.param, shape=SHAPE,
                           std=0.05)


@pytest.fixture(params=["bfloat16", "float32"])
def dtype(request):
    """The step's dtype: bfloat16 where the host computes it natively, float32 where the AVX2 int4
    kernel runs (every x86-64-v3 host and up)."""
    if request.param == "bfloat16" and not capabilities.bf16_matmuls():
        pytest.skip("the bfloat16 C decode step needs AVX512-BF16")
    if request.param == "float32" and not capabilities.avx2_matmuls():
        pytest.skip("the float32 C decode step's int4 products need AVX2")
    return request.param


def _model(folder, quantization, dtype="bfloat16", **opts):
    llm = LLM(str(folder), dtype=dtype, quantization=quantization, max_model_len=256, **opts)
    return llm, llm.engine.runner.model


def _prefill_then_decode(model, backend, lens: list[int], use_c: bool, seed: int = 0):
    """Prefill requests of `lens` tokens through the modules, then one decode row each; returns the
    decode step's hidden states, the caches, and whether the C step ran."""
    c = model.config
    caches = backend.allocate(c.num_layers, 64, BLOCK, c.num_kv_heads, c.head_dim, model.dtype)
    rng = random.Random(seed)
    tables, nxt = [], 1
    for n in lens:
        need = -(-(n + 1) // BLOCK)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    ids = [rng.randrange(3, 300) for n in lens for _ in range(n)]
    pos = [p for n in lens for p in range(n)]
    meta = backend.build_metadata(list(lens), list(lens), tables, BLOCK)
    model(torch.tensor(ids), torch.tensor(pos), caches, meta)  # a model's forward runs the modules
    meta = backend.build_metadata([1] * len(lens), [n + 1 for n in lens], tables, BLOCK)
    dec_ids = torch.tensor([rng.randrange(3, 300) for _ in lens])
    executor = ModelExecutor(model, enforce_eager=not use_c)
    ran = []
    if executor.c_decode is not None:
        real_run = executor.c_decode.run

        def spy(*args):
            out = real_run(*args)
            ran.append(out is not None)
            return out
        executor.c_decode.run = spy
    hidden = executor.forward(dec_ids, torch.tensor(lens), caches, meta)
    return hidden, caches, ran == [True]


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("lens", [[5], [17, 1, 40], [33] * 9])  # 1 row (gemv), 3 rows, 9 (past int8's 8)
def test_c_decode_step_matches_the_modules(folder, quantization, lens, dtype):
    _, model = _model(folder, quantization, dtype)
    backend = PagedBackend()
    ref, ref_caches, _ = _prefill_then_decode(model, backend, lens, use_c=False)
    got, caches, ran = _prefill_then_decode(model, backend, lens, use_c=True)
    assert ran, "the C decode step did not take the step"
    assert got.dtype == model.dtype and got.shape == ref.shape
    # Same roundings; only float32 sum order differs between the kernels, which bfloat16 rounds and an
    # int8-rounded activation (int4 weights) may turn into a code's step; float32 int8 groups are exact.
    exact = dtype == "float32" and quantization == "int8"
    tol = 1e-3 if exact else 0.05
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    cos = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1)
    assert cos.min() > (0.99999 if exact else 0.999)
    for a, b in zip(caches, ref_caches):  # the new keys and values went to the same slots
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_steps_it_does_not_take_run_the_modules(folder, dtype):
    _, model = _model(folder, "int4", dtype)
    plan = model.plan_fused_decode()
    assert plan is not None
    c = model.config
    sdpa = SdpaBackend()
    caches = sdpa.allocate(c.num_layers, 8, BLOCK, c.num_kv_heads, c.head_dim, model.dtype)
    decode = sdpa.build_metadata([1, 1], [3, 4], [[1], [2]], BLOCK)
    assert not plan.applies(torch.tensor([5, 6]), caches, decode)  # another backend's cache
    paged = PagedBackend()
    caches = paged.allocate(c.num_layers, 8, BLOCK, c.num_kv_heads, c.head_dim, model.dtype)
    assert plan.applies(torch.tensor([5, 6]), caches, paged.build_metadata([1, 1], [3, 4], [[1], [2]], BLOCK))
    mixed = paged.build_metadata([1, 3], [3, 4], [[1], [2]], BLOCK)
    assert not plan.applies(torch.tensor([5, 6, 7, 8]), caches, mixed)  # a prefill row in the step
    int8 = PagedBackend("int8").allocate(c.num_layers, 8, BLOCK, c.num_kv_heads, c.head_dim, model.dtype)
    assert not plan.applies(torch.tensor([5, 6]), int8, paged.build_metadata([1, 1], [3, 4], [[1], [2]], BLOCK))


def test_no_plan_for_dense_weights_or_another_cache_dtype(folder, dtype):
    assert _model(folder, "none", dtype)[1].plan_fused_decode() is None
    llm, model = _model(folder, "int4", dtype)
    plan = model.plan_fused_decode()
    assert plan is not None
    other = torch.float32 if dtype == "bfloat16" else torch.bfloat16
    c, paged = model.config, PagedBackend()
    caches = paged.allocate(c.num_layers, 8, BLOCK, c.num_kv_heads, c.head_dim, other)
    assert not plan.applies(torch.tensor([5, 6]), caches, paged.build_metadata([1, 1], [3, 4], [[1], [2]], BLOCK))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_generation_is_unchanged(arch, tmp_path, dtype):
    """Whole requests through the engine: the same tokens with the C step on as with it off (sharp
    logits, as in the other greedy tests, so that bfloat16 sum order does not decide near-ties). In
    float32 the products' activations stay unrounded: rounded to int8, a last-bit difference between
    the C step's SiLU and PyTorch's (which differs by instruction set) may move a code and a token."""
    exact = dict(int8_activations=False) if dtype == "float32" else {}
    folder = make_tiny_model(tmp_path / arch, arch=arch, shape=SHAPE, std=0.25)
    llm, _ = _model(folder, "int4", dtype, **exact)
    executor = llm.engine.runner.executor
    assert executor.paths == {ExecutionPath.MODULES, ExecutionPath.C_DECODE}
    taken = []
    real_run = executor.c_decode.run
    executor.c_decode.run = lambda *args: taken.append(1) or real_run(*args)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_c = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert taken, "no decode step of the engine took the C step"
    # A fresh engine on the same model object, every step through the modules (and no prefix-cache
    # hits from the first run).
    again = LLM(str(folder), loaded=llm.engine.loaded, dtype=dtype, quantization="int4", max_model_len=256,
                enforce_eager=True, **exact)
    assert again.engine.runner.executor.c_decode is None
    without = [o.outputs[0].token_ids for o in again.generate(prompts, greedy)]
    assert with_c == without


def test_adapter_rows_take_the_c_step_with_the_modules_tokens(tmp_path, dtype):
    """Decode rows of LoRA adapters beside base rows: the C step adds each row's adapter beside every
    projection (lora.c), and greedy tokens are those of the modules (which add them in
    layers/linear.py); an adapter the C step ignored would give the base's tokens instead."""
    from tiny_model import write_peft

    folder = make_tiny_model(tmp_path / "llama", arch="llama", shape=SHAPE, std=0.25)
    # float32 activations unrounded, as in test_greedy_generation_is_unchanged: int8 rounding turns
    # last-bit differences between the two paths' sums into different codes
    exact = dict(int8_activations=False) if dtype == "float32" else {}
    llm, model = _model(folder, "int4", dtype, **exact)
    adapters = {f"a{i}": write_peft(tmp_path / f"a{i}", model.config, 8, seed=i) for i in range(2)}
    opts = dict(loaded=llm.engine.loaded, dtype=dtype, quantization="int4", max_model_len=256,
                enable_lora=True, max_lora_rank=8, lora_modules=[f"{n}={p}" for n, p in adapters.items()], **exact)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(3)]
    batch = [p for p in prompts for _ in range(3)]
    names = [n for _ in prompts for n in (None, *adapters)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    with_c = LLM(str(folder), **opts)
    executor = with_c.engine.runner.executor
    taken = []
    real_run = executor.c_decode.run
    executor.c_decode.run = lambda *args: taken.append(args[4] is not None and args[4].active) or real_run(*args)
    got = [o.outputs[0].token_ids for o in with_c.generate(batch, greedy, lora=names)]
    assert any(taken), "no decode step with adapter rows took the C step"

    eager = LLM(str(folder), enforce_eager=True, **opts)
    assert eager.engine.runner.executor.c_decode is None
    want = [o.outputs[0].token_ids for o in eager.generate(batch, greedy, lora=names)]
    assert len({str(want[i]) for i in range(3)}) == 3, "each adapter must change the tokens"
    assert got == want


def test_enforce_eager_runs_the_modules(folder, dtype):
    from tessera.engine.args import add_engine_args, config_from_args
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--enforce-eager"]), str(folder)).enforce_eager
    assert not config_from_args(parser.parse_args([]), str(folder)).enforce_eager
    llm = LLM(str(folder), dtype=dtype, quantization="int4", max_model_len=256, enforce_eager=True)
    executor = llm.engine.runner.executor
    assert executor.c_decode is None and executor.paths == {ExecutionPath.MODULES}
    assert llm.engine.runner.model.plan_fused_decode() is not None  # offered, but not taken
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


@pytest.mark.model
@pytest.mark.parametrize("lens", [[7], [30, 12, 61]])
def test_c_decode_step_takes_kquant_projections(model_path, lens, dtype):
    """qwen2.5-coder-0.5b's Q4_K and Q6_K down projections (whole super-blocks of 256) stay in
    their blocks and run in the C step through q4k_gemm / q6k_gemm, as the modules run them."""
    if not capabilities.kquant_matmuls():
        pytest.skip("no vector path for the K-quant kernels here")
    llm = LLM(str(model_path("qwen2.5-coder-0.5b")), dtype=dtype, max_model_len=256)
    model = llm.engine.runner.model
    plan = model.plan_fused_decode()
    assert isinstance(plan, FusedDecode)
    kinds = {layer.down.kind for layer in plan.layers}
    assert kinds == {bindings.LINEAR_Q4K, bindings.LINEAR_Q6K}
    assert plan.max_rows == model.model.layers[0].mlp.down_proj.quant_method.config.small_batch_max
    backend = PagedBackend()
    ref, ref_caches, _ = _prefill_then_decode(model, backend, lens, use_c=False)
    got, caches, ran = _prefill_then_decode(model, backend, lens, use_c=True)
    assert ran, "the C decode step did not take the step"
    cos = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1)
    assert cos.min() > 0.999
    # The activations are rounded to int8 per row: a last-bit difference upstream (float32's SiLU
    # here against PyTorch's) may move one code of a later layer's product by a step.
    for a, b in zip(caches, ref_caches):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.1)
    n = plan.max_rows + 1  # a decode step past the kernels' rows runs the modules
    many = backend.build_metadata([1] * n, [3] * n, [[1]] * n, BLOCK)
    assert not plan.applies(torch.arange(n), caches, many)
