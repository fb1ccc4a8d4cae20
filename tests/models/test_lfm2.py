"""LFM2 (attention and gated short-convolution layers, tessera/models/families/lfm2.py) against
transformers' Lfm2ForCausalLM: a tiny random float32 model written by transformers, 32 greedy
tokens per prompt identical to its `generate`, through every path that must carry the
convolutions' per-request state: alone, batched with 8-token prompt chunks, after a preemption
(recompute), with prefix caching asked for (refused: no hit may skip a state), and through a real
`tessera serve` with the openai client. Every test ends with every state slot free."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recurrent_checks import assert_logits_match, generate_all_free
from tiny_gguf import write_tiny_gguf
from tessera.errors import TesseraError
from tessera.llm import LLM
from tessera.models.loader import forward_single, load_model
from tessera.sampling_params import InvalidRequestError, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], [250, 7, 7, 120, 64, 33, 8, 301, 19, 77, 150], [11, 200, 45, 9, 12, 13, 14, 15, 16, 18]]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory) -> tuple[Path, object, list[list[int]], Path]:
    """(HF folder, transformers' model, its greedy continuations of PROMPTS, the F32 GGUF llama.cpp's
    converter would write of it). The model: conftest's tiny LFM2 (conv, attention, conv, attention)."""
    base = tmp_path_factory.mktemp("lfm2")
    gguf, model = write_tiny_gguf("lfm2", base, quantized=False)
    model.generation_config.eos_token_id = None  # 32 tokens, as ignore_eos
    with torch.no_grad():
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return base / "hf", model, greedy, gguf


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return generate_all_free(llm, prompts, GREEDY)


def test_logits_and_config_match_transformers(lfm2):
    folder, model, _, _ = lfm2
    loaded = load_model(folder, "float32", quantization="none")
    c = loaded.config
    assert (c.layer_kinds, c.conv_kernel, c.intermediate_size) == (["conv", "attention"] * 2, 3, 128)
    assert_logits_match(model, loaded, PROMPTS[1] + PROMPTS[2])


def test_size_counts_the_states_and_only_the_attention_layers_kv(lfm2):
    from tessera.config import EngineConfig
    from tessera.sizing import estimate, format_estimate

    folder, _, _, _ = lfm2
    e = estimate(EngineConfig(model=str(folder), dtype="float32", max_num_seqs=4, max_model_len=512,
                              kv_cache_memory=1 << 20, enable_prefix_caching=True), memory=4 << 30)
    # (4 sequences + 8 prefix-cache snapshots) x conv layers x channels x (kernel - 1) x f32
    assert e.state_bytes == (4 + 8) * 2 * 64 * 2 * 4
    assert e.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # 2 attention layers' K and V, 2 heads of 16
    blocks = ((1 << 20) - e.state_bytes) // (16 * 512)  # the blocks take what the states leave: 125, not 128
    assert e.kv_cache_bytes == blocks * 16 * 512 + e.state_bytes and e.kv_cache_tokens == blocks * 16
    assert "recurrent layers' states" in format_estimate(e, None)


def test_gguf_as_llama_cpp_writes_it(lfm2, tmp_path):
    """The F32 GGUF: the same greedy tokens; a quantized one (Q8_0, Q4_0, ... projections): the
    logits of transformers holding the dequantized weights."""
    _, _, greedy, gguf = lfm2
    llm = LLM(str(gguf), dtype="float32", max_model_len=128, max_num_batched_tokens=8, max_num_seqs=3)
    assert llm.engine.model_config.layer_kinds == ["conv", "attention"] * 2
    assert _generate(llm) == greedy
    path, model = write_tiny_gguf("lfm2", tmp_path, quantized=True)
    ids = PROMPTS[1] + PROMPTS[2]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    loaded = load_model(path, "float32", quantization="none")
    assert (forward_single(loaded, ids) - ref).abs().max().item() < 1e-4


def test_greedy_alone_and_batched_with_prompt_chunks(lfm2):
    folder, _, greedy, _ = lfm2
    alone = LLM(str(folder), dtype="float32", max_model_len=128, max_num_seqs=1)
    assert _generate(alone) == greedy
    batched = LLM(str(folder), dtype="float32", max_model_len=128, max_num_batched_tokens=8, max_num_seqs=3)
    assert _generate(batched) == greedy
    # An abort mid-generation frees its slot; the next requests, taking the slots again, start from zeros.
    engine = batched.engine
    engine.add_request("a", PROMPTS[1], GREEDY)
    engine.add_request("b", PROMPTS[2], GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.get_scheduler_stats().num_state_slots_used == 2
    engine.abort_request("a")
    engine.abort_request("b")
    assert engine.get_scheduler_stats().num_state_slots_used == 0
    assert _generate(batched) == greedy


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_after_preemption(lfm2, mode):
    """4 blocks of 16 tokens for three sequences of up to 43: some must be preempted, and their
    prefill runs again from token 0, rebuilding the state (swap is refused for states)."""
    folder, _, greedy, _ = lfm2
    runner = LLM(str(folder), dtype="float32", max_model_len=128, max_num_seqs=3).engine.runner
    block_bytes = runner.block_bytes()
    assert block_bytes == 2 * 2 * 2 * 16 * 4 * 16  # K and V of the 2 attention layers only: 2 heads x 16 x f32 x 16
    state_bytes = sum(t.numel() * t.element_size() for layer in runner.state_caches for t in layer)
    rows = 3 * (3 if runner.config.enable_prefix_caching else 1)  # slots, and 2 snapshots a sequence with a cache
    assert state_bytes == rows * 2 * 64 * 2 * 4  # rows x conv layers x channels x (3 - 1) x f32
    small = LLM(str(folder), dtype="float32", max_model_len=128, max_num_seqs=3, preemption_mode=mode,
                kv_cache_memory=4 * block_bytes + state_bytes, max_num_batched_tokens=8)
    assert small.engine.kv.num_blocks == 4  # the states' bytes come out of the cache's
    assert _generate(small) == greedy
    assert small.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_resume_from_a_kept_state(lfm2):
    """A repeat of a 44-token prompt hits its first two blocks and starts from the state kept at
    their end; a longer prompt extending it hits them too; n = 2 samples share the first's prompt.
    Every answer is transformers' own."""
    folder, model, greedy, _ = lfm2
    long = PROMPTS[1] * 4
    longer = long + PROMPTS[2]
    with torch.no_grad():
        want = {len(p): model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       pad_token_id=0)[0, len(p):].tolist() for p in (long, longer)}
    llm = LLM(str(folder), dtype="float32", max_model_len=128, enable_prefix_caching=True,
              max_num_batched_tokens=16)
    assert llm.engine.config.enable_prefix_caching is True and llm.engine.kv.snapshots is not None
    assert _generate(llm, [long]) == [want[len(long)]]
    assert llm.engine.scheduler.stats().prefix_cache_hits == 0
    assert _generate(llm, [long]) == [want[len(long)]]
    assert llm.engine.scheduler.stats().prefix_cache_hits == 32  # 2 blocks of 16: the state kept at 32
    assert _generate(llm, [longer]) == [want[len(longer)]]
    assert llm.engine.scheduler.stats().prefix_cache_hits == 64
    both = llm.generate([PROMPTS[2]], SamplingParams(n=2, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in both[0].outputs] == [greedy[2]] * 2
    assert llm.engine.scheduler.stats().num_state_slots_used == 0


def test_without_prefix_caching_nothing_is_kept(lfm2):
    folder, _, greedy, _ = lfm2
    llm = LLM(str(folder), dtype="float32", max_model_len=128, enable_prefix_caching=False)
    assert llm.engine.kv.snapshots is None
    assert _generate(llm, [PROMPTS[1]] * 2) == [greedy[1]] * 2
    assert llm.engine.scheduler.stats().prefix_cache_hits == 0


def test_speculation_and_lora_are_refused(lfm2):
    folder, _, _, _ = lfm2
    with pytest.raises((InvalidRequestError, TesseraError), match="recurrent layers"):
        LLM(str(folder), dtype="float32", max_model_len=128,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises((InvalidRequestError, TesseraError), match="recurrent layers"):
        LLM(str(folder), dtype="float32", max_model_len=128, enable_lora=True)


def test_served_by_tessera_serve_to_the_openai_client(lfm2, tmp_path):
    """The real server (engine process, its own calibration and warm-up) with the openai client:
    the three prompts at once, their texts those of transformers' greedy tokens; then idle with every
    state slot free (the stats and the gauge)."""
    import concurrent.futures

    import httpx
    import openai

    from server_process import running_server
    from tessera.tokenizer import IncrementalDetokenizer, Tokenizer

    folder, _, greedy, _ = lfm2
    tokenizer = Tokenizer.from_hf_folder(folder)

    def text_of(prompt: list[int], tokens: list[int]) -> str:  # as the server detokenizes, after the prompt
        detok = IncrementalDetokenizer(tokenizer, prompt)
        return "".join(detok.add(t) for t in tokens) + detok.flush()

    with running_server(tmp_path / "server.log", "--dtype", "float32", "--max-model-len", "128",
                        "--max-num-batched-tokens", "8", model=str(folder)) as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id

        def complete(prompt: list[int]) -> str:
            return client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(complete, PROMPTS))
        assert texts == [text_of(p, g) for p, g in zip(PROMPTS, greedy)]
        scheduler = proc.wait_idle()["scheduler"]
        assert scheduler["num_state_slots_total"] > 0 and scheduler["num_state_slots_used"] == 0
        metrics = httpx.get(f"{proc.url}/metrics", timeout=5).text
        assert any(line.startswith("tessera:num_state_slots_used{") and line.endswith(" 0.0")
                   for line in metrics.splitlines())
