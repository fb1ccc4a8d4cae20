"""The one-call C decode step (kernels/decode_step.c) for every dense family, against the module path
(models/decoder.py) on tiny random models with each family's features switched on (conftest's tiny
configs, 256 wide so that int4 and int8 groups fit): q/k norms per head (Qwen3, Gemma 3) and over the
projections (OLMo 2), norms after the sublayers (Gemma 2 and 3, OLMo 2), GELU (Gemma), scaled
embeddings (Gemma, Granite), Granite's multipliers, a NoPE layer (SmolLM3), partial rotary (Phi-3),
soft-capped scores (Gemma 2), sliding layers with their own RoPE base in hybrid KV-cache groups
(Gemma 2 and 3). Each test first checks that the model takes the C step, so none passes vacuously."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import build_tiny_hf_model
from tessera import LLM, SamplingParams
from tessera.attention.paged import PagedBackend
from tessera.kernels import capabilities, library
from tessera.models.base import ExecutionPath

from test_fused_decode import _prefill_then_decode  # noqa: E402  (tests/models is on the path)

pytestmark = pytest.mark.skipif(library.available() is not None, reason="no C kernels here")

DENSE = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "granite", "smollm3", "phi3"]


@pytest.fixture(scope="module")
def family_folder(tmp_path_factory):
    made: dict = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(f"fused-{kind}")
            build_tiny_hf_model(kind, folder, std=0.08, wide=True)
            made[kind] = folder
        return made[kind]

    return make


def _dtype(name: str) -> str:
    if name == "bfloat16" and not capabilities.bf16_matmuls():
        pytest.skip("the bfloat16 C decode step needs AVX512-BF16")
    if name == "float32" and not capabilities.avx2_matmuls():
        pytest.skip("the float32 C decode step's int4 products need AVX2")
    return name


def _spy(executor) -> list:
    """The adapters' activity of each C step the executor runs (False: no adapter rows)."""
    taken = []
    real_run = executor.c_decode.run
    executor.c_decode.run = lambda *args: taken.append(args[4] is not None and args[4].active) or real_run(*args)
    return taken


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", DENSE)
def test_every_dense_family_takes_the_c_step_with_the_modules_tokens(family_folder, kind, dtype):
    """Whole requests through the engine (hybrid cache groups where the family has sliding layers,
    prompts longer than their window): the C step is planned and taken, and greedy tokens are the
    modules'. Float32 projections read unrounded activations (int8 rounding would turn the last-bit
    differences of the two paths' float32 sums into a code's step)."""
    dtype = _dtype(dtype)
    folder = family_folder(kind)
    exact = dict(int8_activations=False) if dtype == "float32" else {}
    opts = dict(dtype=dtype, quantization="int8", max_model_len=256, **exact)
    llm = LLM(str(folder), **opts)
    model, executor = llm.engine.runner.model, llm.engine.runner.executor
    assert model.decode_step_limits() == []
    assert model.plan_fused_decode() is not None
    assert executor.paths == {ExecutionPath.MODULES, ExecutionPath.C_DECODE}
    taken = _spy(executor)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with_c = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert taken, "no decode step of the engine took the C step"
    eager = LLM(str(folder), loaded=llm.engine.loaded, enforce_eager=True, **opts)
    assert eager.engine.runner.executor.c_decode is None
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, greedy)] == with_c


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "olmo2", "granite", "smollm3", "phi3"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_hidden_states_and_cache_writes_match_the_modules(family_folder, kind, quantization):
    """One decode step of one row and of three (the per-projection q/k norm takes the norm kernel for
    one row and PyTorch's rms_norm for several) after prefills through the modules: the same final
    hidden states and the same keys and values written, in float32 (bfloat16 where the host has it).
    Float32 projections read unrounded activations: rounded to int8, a last-bit difference between
    the two paths' float32 sums can move one code and one output by more than the tolerance."""
    dtype = "bfloat16" if capabilities.bf16_matmuls() else _dtype("float32")
    exact = dict(int8_activations=False) if dtype == "float32" else {}
    llm = LLM(str(family_folder(kind)), dtype=dtype, quantization=quantization, max_model_len=256, **exact)
    model = llm.engine.runner.model
    backend = PagedBackend()
    for lens in ([5], [17, 1, 40]):
        ref, ref_caches, _ = _prefill_then_decode(model, backend, lens, use_c=False)
        got, caches, ran = _prefill_then_decode(model, backend, lens, use_c=True)
        assert ran, "the C decode step did not take the step"
        cos = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1)
        assert cos.min() > 0.999, f"{kind} {lens}: {cos}"
        torch.testing.assert_close(got.float(), ref.float(), rtol=0.05, atol=0.05)
        for a, b in zip(caches, ref_caches):
            torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "olmo2", "granite"])
def test_float32_hidden_states_are_the_modules_to_the_last_bits(family_folder, kind):
    """float32 with int8 groups: the products are exact, so only float32 sum order (norms, the
    activation's exponential or tanh) separates the two paths: a wrong rounding point, norm or
    multiplier would show far above this."""
    dtype = _dtype("float32")
    llm = LLM(str(family_folder(kind)), dtype=dtype, quantization="int8", max_model_len=256,
              int8_activations=False)
    model = llm.engine.runner.model
    backend = PagedBackend()
    ref, ref_caches, _ = _prefill_then_decode(model, backend, [17, 1, 40], use_c=False)
    got, caches, ran = _prefill_then_decode(model, backend, [17, 1, 40], use_c=True)
    assert ran
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches, ref_caches):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_adapter_rows_take_the_c_step_with_the_modules_tokens(family_folder, tmp_path, kind, dtype):
    """LoRA rows beside base rows in blocks with q/k norms (per head; over the projections, with norms
    after the sublayers): each row's adapter is added beside every projection, before the q/k norms,
    as the modules add it."""
    from tiny_model import write_peft

    dtype = _dtype(dtype)
    folder = family_folder(kind)
    llm = LLM(str(folder), dtype=dtype, quantization="int8", max_model_len=256)
    config = llm.engine.runner.model.config
    adapters = {f"a{i}": write_peft(tmp_path / f"a{i}", config, 8, seed=i) for i in range(2)}
    opts = dict(loaded=llm.engine.loaded, dtype=dtype, quantization="int8", max_model_len=256,
                enable_lora=True, max_lora_rank=8, lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 20))] for _ in range(2)]
    batch = [p for p in prompts for _ in range(3)]
    names = [n for _ in prompts for n in (None, *adapters)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with_c = LLM(str(folder), **opts)
    taken = _spy(with_c.engine.runner.executor)
    got = [o.outputs[0].token_ids for o in with_c.generate(batch, greedy, lora=names)]
    assert any(taken), "no decode step with adapter rows took the C step"
    eager = LLM(str(folder), enforce_eager=True, **opts)
    want = [o.outputs[0].token_ids for o in eager.generate(batch, greedy, lora=names)]
    assert len({str(want[i]) for i in range(3)}) == 3, "each adapter must change the tokens"
    assert got == want
