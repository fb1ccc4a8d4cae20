"""The engine on a GPU (skipped without one): the same greedy tokens as on the CPU in float32,
seeded sampling reproducible, swap preemption through pinned host memory, no block leaked; and
the device flag's checks, which run everywhere."""
from __future__ import annotations

import pytest
import torch

from tessera.config import ConfigError, EngineConfig
from tessera.llm import LLM
from tessera.sampling_params import SamplingParams

from tiny_model import make_tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_device_flag_resolves_and_refuses_a_missing_gpu():
    assert EngineConfig(device="auto").device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert EngineConfig(device="cpu").device == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda: no CUDA GPU") as err:
            EngineConfig(device="cuda")
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="--device"):
        EngineConfig(device="tpu")


def test_host_swap_pool_is_not_pinned_beside_a_cpu_cache():
    from tessera.attention import get_backend

    (pool,) = get_backend("sdpa").allocate(1, 4, 16, 2, 8, torch.float32, host=True)
    assert pool.device.type == "cpu" and not pool.is_pinned()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2")


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (int(torch.randint(1, 70, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@cuda
def test_greedy_tokens_match_the_cpu_in_float32(folder):
    cpu = tokens(LLM(str(folder), device="cpu", dtype="float32", max_model_len=256).generate(prompts(16), GREEDY))
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=40)
    assert llm.engine.parts.attn_backend.name == "triton"
    assert tokens(llm.generate(prompts(16), GREEDY)) == cpu
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


@cuda
def test_seeded_sampling_and_swap_preemption_on_the_gpu(folder):
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=40, seed=7, ignore_eos=True)
    alone = tokens(LLM(str(folder), device="cuda", max_model_len=256).generate(prompts(1), params))
    again = tokens(LLM(str(folder), device="cuda", max_model_len=256).generate(prompts(1) * 3, params))
    assert again == alone * 3
    # 12 blocks of 16 tokens (2 layers x K and V x 2 heads x 16 x 16 float32 values each) for 8
    # requests of up to 94 tokens: requests are swapped out to pinned host memory and back.
    block = 2 * 2 * 2 * 16 * 16 * 4
    small = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, preemption_mode="swap",
                kv_cache_memory=12 * block, swap_space=64 * block)
    cpu = tokens(LLM(str(folder), device="cpu", dtype="float32", max_model_len=256).generate(prompts(8), GREEDY))
    assert tokens(small.generate(prompts(8), GREEDY)) == cpu
    kv = small.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_host_blocks > 0
