"""Prefill/decode disaggregation (`--pd`): a prefill engine hands a prompt's KV blocks to a decode
engine, which loads them instead of computing them; greedy outputs must equal one engine's.
Engine level on a tiny random model; then `tessera serve --pd prefill=1,decode=1` with the
openai client on a packaged model against the same model in process."""
from __future__ import annotations

import random

import httpx
import openai
import pytest

from tessera.llm import LLM
from tessera.sampling_params import SamplingParams

from server_process import running_server
from tiny_model import make_tiny_model

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from tessera.models.loader import load_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama"), "float32")


def run(engine, prepared):
    engine.add_prepared(prepared)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step_with_stats()[0]:
            if out.finished:
                final = out
    return final


def test_kv_handed_over_gives_the_same_greedy_output(loaded):
    make = lambda: LLM(str(loaded.path), loaded=loaded, max_model_len=256, block_size=16).engine  # noqa: E731
    prefill, decode, alone = make(), make(), make()
    rng = random.Random(0)
    for i, n in enumerate((17, 40, 64, 100)):
        prompt = [rng.randrange(3, 300) for _ in range(n)]
        ref = run(alone, alone.prepare_request(f"ref{i}", prompt, GREEDY))
        p = prefill.prepare_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
        p.kv_export = True
        handed = run(prefill, p).kv_transfer
        assert handed is not None and len(handed.block_hashes) == n // 16
        assert len(handed.payload) == len(handed.block_hashes) * prefill.runner.block_bytes()
        d = decode.prepare_request(f"d{i}", prompt, GREEDY)
        d.kv_import = handed
        out = run(decode, d)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        # every handed block but one the last token needs was loaded, not computed
        assert out.num_cached_tokens == min(len(handed.block_hashes), (n - 1) // 16) * 16
    assert decode.get_scheduler_stats().num_blocks_free == decode.get_scheduler_stats().num_blocks_total


def test_foreign_or_short_transfers_are_ignored(loaded):
    """Blocks whose hashes do not head the prompt are never used (no other prompt's KV)."""
    engine = LLM(str(loaded.path), loaded=loaded, max_model_len=256, block_size=16).engine
    src = engine.prepare_request("src", list(range(3, 67)), SamplingParams(max_tokens=1, temperature=0))
    src.kv_export = True
    handed = run(engine, src).kv_transfer
    ref = run(engine, engine.prepare_request("ref", list(range(100, 164)), GREEDY))
    fresh = LLM(str(loaded.path), loaded=loaded, max_model_len=256, block_size=16).engine
    d = fresh.prepare_request("d", list(range(100, 164)), GREEDY)
    d.kv_import = handed  # another prompt's blocks
    out = run(fresh, d)
    assert out.num_cached_tokens == 0  # nothing taken from `handed`
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.model
def test_pd_server_matches_one_engine(tmp_path):
    prompts = ["Write a Python function that returns the nth Fibonacci number, with a docstring and tests. " * 3,
               "The history of the printing press begins in", "Hi"]
    # float32 and one prompt at a time, as the server gets them: in bfloat16 a batch of three and
    # one prompt alone go through matrix products of other shapes, and greedy text can part
    # (it did on an AVX512-BF16 host: "... by Johannes Brahms in 17" against "..., a German printer").
    llm = LLM("smollm2-135m", kv_cache_memory=128 * 2**20, max_model_len=1024, dtype="float32")
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = [llm.generate([p], params)[0].outputs[0].text for p in prompts]
    del llm
    with running_server(tmp_path / "server.log", "--pd", "prefill=1,decode=1", "--kv-cache-memory", "128MiB",
                        "--max-model-len", "1024", "--dtype", "float32") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        got = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=24, temperature=0).choices[0].text
               for p in prompts]
        stream = client.completions.create(model="smollm2-135m", prompt=prompts[0], max_tokens=24, temperature=0,
                                           stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        info = httpx.get(f"{server.url}/v1/engine/stats").json()["engine_core"]
    assert got == expected and streamed == expected[0]
    assert [r["role"] for r in info["replicas"]] == ["prefill", "decode"]
    assert info["pd"]["kv_transfers"] == 2  # the one prompt longer than a block, twice (plain and streamed)
    assert info["pd"]["kv_transfer_bytes"] > 0
