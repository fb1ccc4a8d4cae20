"""The one-call C decode step with mixture-of-experts layers (kernels/moe_step.c) against the module
path (layers/moe.py) on tiny random Mixtral, Qwen3-MoE (renormalised top-k, and softmax over all
experts taken at the top k, with a dense layer between sparse ones) and gpt-oss (biased router,
experts with biases and the clamped SwiGLU, attention sinks, an output bias on attention), and
experts kept as a GGUF's blocks (gpt-oss's MXFP4, Q4_K). Each test first checks that the model takes the C step, so none passes
vacuously; the multi-row cases check that their rows both share experts and choose some alone."""
from __future__ import annotations

import logging
import random
from collections import Counter

import pytest
import torch

from conftest import build_tiny_hf_model, tiny_hf_config
from tessera import LLM, SamplingParams
from tessera.attention.paged import PagedBackend
from tessera.kernels import library
from tessera.layers.moe import SparseMoE
from tessera.models.base import ExecutionPath

from test_fused_decode import _prefill_then_decode  # noqa: E402  (tests/models is on the path)
from test_fused_decode_families import _dtype  # noqa: E402

pytestmark = pytest.mark.skipif(library.available() is not None, reason="no C kernels here")

# (transformers family, config changes): gpt-oss's heads widened to 32, the step's smallest head.
KINDS = {"mixtral": ("mixtral", {}), "qwen3_moe": ("qwen3_moe", {}),
         "qwen3_moe-all-softmax": ("qwen3_moe", {"norm_topk_prob": False}), "gpt_oss": ("gpt_oss", {"head_dim": 32})}
ROWS = {"one": [5], "three": [17, 1, 40], "eight": [9, 3, 20, 30, 11, 7, 2, 25]}  # prompt lengths


def _config(name: str):
    kind, changes = KINDS[name]
    cfg = tiny_hf_config(kind, wide=True)
    for key, value in changes.items():
        setattr(cfg, key, value)
    return kind, cfg


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    made: dict = {}

    def make(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(f"fused-moe-{name}")
            kind, cfg = _config(name)
            build_tiny_hf_model(kind, folder, std=0.08, wide=True, config=cfg)
            made[name] = folder
        return made[name]

    return make


def _routes(model, run) -> list:
    """`run()`'s result, and the expert ids [T, top_k] each SparseMoE call of the modules chose."""
    seen = []
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    real = [b.route for b in blocks]
    for b, r in zip(blocks, real):
        b.route = lambda x, r=r: seen.append(r(x)[1]) or r(x)
    try:
        return run(), seen
    finally:
        for b in blocks:
            del b.route


def _check_sharing(counts: list[Counter]) -> None:
    """Among the decode steps' mixture-of-experts calls (expert -> rows that chose it), some expert
    serves several rows and some serves one alone."""
    assert counts, "no mixture-of-experts call of the steps' rows"
    assert any(max(c.values()) > 1 for c in counts), "no two rows chose the same expert"
    assert any(min(c.values()) == 1 for c in counts), "every expert served several rows"


@pytest.fixture(scope="module")
def exact_llm(moe_folder):
    """Float32 with int8 groups and unrounded activations, one engine per model."""
    made: dict = {}

    def make(name: str) -> LLM:
        if name not in made:
            made[name] = LLM(str(moe_folder(name)), dtype=_dtype("float32"), quantization="int8", max_model_len=256,
                             int8_activations=False)
        return made[name]

    return make


@pytest.mark.parametrize("name", list(KINDS))
def test_hidden_states_and_cache_writes_are_the_modules(exact_llm, name):
    """Float32 with int8 groups (exact products): one decode step of 1, 3 and 8 rows after prefills
    through the modules gives the modules' final hidden states and cache writes, up to float32 sum
    order (the router's product, the exponentials)."""
    model = exact_llm(name).engine.runner.model
    assert model.decode_step_limits() == [] and model.plan_fused_decode() is not None
    backend = PagedBackend()
    counts = []
    for lens in ROWS.values():
        (ref, ref_caches, _), routes = _routes(model, lambda: _prefill_then_decode(model, backend, lens, use_c=False))
        got, caches, ran = _prefill_then_decode(model, backend, lens, use_c=True)
        assert ran, f"the C decode step did not take the step of {len(lens)} rows"
        counts += [Counter(ids.flatten().tolist()) for ids in routes if len(lens) > 1 and ids.shape[0] == len(lens)]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        for a, b in zip(caches, ref_caches):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    _check_sharing(counts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(KINDS))
def test_moe_families_take_the_c_step_with_the_modules_tokens(moe_folder, exact_llm, name, dtype):
    """Whole requests through the engine, several at once: the C step is planned and taken, and
    greedy tokens are the modules'."""
    dtype = _dtype(dtype)
    folder = moe_folder(name)
    exact = dict(int8_activations=False) if dtype == "float32" else {}
    opts = dict(dtype=dtype, quantization="int8", max_model_len=256, **exact)
    llm = exact_llm(name) if dtype == "float32" else LLM(str(folder), **opts)
    executor = llm.engine.runner.executor
    assert executor.paths == {ExecutionPath.MODULES, ExecutionPath.C_DECODE}
    taken = []
    real_run = executor.c_decode.run
    executor.c_decode.run = lambda *args: taken.append(args[0].shape[0]) or real_run(*args)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with_c = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert taken and max(taken) > 1, "no multi-row decode step of the engine took the C step"
    eager = LLM(str(folder), loaded=llm.engine.loaded, enforce_eager=True, **opts)
    assert eager.engine.runner.executor.c_decode is None
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, greedy)] == with_c


def _gguf(name: str, experts: str, folder):
    """A tiny GGUF of `name` with its experts in `experts` blocks (MXFP4: gpt-oss's published file;
    Q4_K: a Q4_K_M Qwen3-MoE's), the other matrices Q8_0."""
    from gguf import GGMLQuantizationType as Q

    from tiny_gguf import write_tiny_gguf

    kind, cfg = _config(name)
    qtypes = {part: Q[experts] for part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    qtypes.update({part: Q.Q8_0 for part in ("attn_q", "attn_k", "attn_v", "attn_output", "token_embd", "ffn_gate",
                                             "ffn_up", "ffn_down")})  # the dense layer's too (Qwen3-MoE)
    return write_tiny_gguf(kind, folder, qtypes=qtypes, wide=True, config=cfg)[0]


@pytest.mark.parametrize("name, experts, method", [("gpt_oss", "MXFP4", "MXFP4Method"),
                                                   ("qwen3_moe", "Q4_K", "Q4KMethod")])
def test_experts_at_file_width_take_the_c_step(tmp_path, name, experts, method):
    """Experts stored as the GGUF's blocks (MXFP4, gpt-oss's; Q4_K) stay so, and the C step multiplies
    them with their kernels (mxfp4_gemm, q4k_gemm), an expert's rows in one call: the modules' hidden
    states for 1 and 8 rows, and their greedy tokens. Both kernels round activations to int8 on both
    paths, so a last-bit difference of float32 sums upstream (the router's product) may move a code
    by one step: hence the tolerance of the quantized dense cases (test_fused_decode_families.py)."""
    from tessera.layers import quantization

    path = _gguf(name, experts, tmp_path)
    opts = dict(dtype=_dtype("float32"), max_model_len=256)
    llm = LLM(str(path), **opts)
    model = llm.engine.runner.model
    stored = [m for n, m in model.named_modules() if ".experts." in n and hasattr(m, "quant_method")]
    assert stored and all(isinstance(m.quant_method, getattr(quantization, method)) for m in stored)
    backend = PagedBackend()
    for lens in (ROWS["one"], ROWS["eight"]):
        ref, _, _ = _prefill_then_decode(model, backend, lens, use_c=False)
        got, _, ran = _prefill_then_decode(model, backend, lens, use_c=True)
        assert ran, f"the C decode step did not take the step of {len(lens)} rows"
        assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.9998
        torch.testing.assert_close(got, ref, rtol=0.05, atol=0.05)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with_c = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    eager = LLM(str(path), loaded=llm.engine.loaded, enforce_eager=True, **opts)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, greedy)] == with_c


def test_experts_without_a_c_product_keep_the_model_on_the_modules(moe_folder, caplog):
    """Experts stored densely (--quantization none) have no product in the step: the plan refuses
    the model, says why in the log, and the modules run every step; the family itself is eligible."""
    llm = LLM(str(moe_folder("mixtral")), dtype=_dtype("float32"), quantization="none", max_model_len=256)
    model = llm.engine.runner.model
    assert model.decode_step_limits() == [] and model.family.decode_step() == "yes"
    with caplog.at_level(logging.INFO, logger="tessera.models.fused_decode"):
        assert model.plan_fused_decode() is None
    assert "experts stored as dense" in caplog.text
    assert llm.engine.runner.executor.c_decode is None
