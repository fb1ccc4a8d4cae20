"""Granite 4.0-H's dense hybrid (Mamba-2 and attention layers, tessera/models/families/granitehybrid.py)
against transformers' GraniteMoeHybridForCausalLM: a tiny random float32 model (conftest's), 32 greedy
tokens per prompt identical to its `generate` alone, batched with 8-token prompt chunks (each
Mamba-2 layer's convolution and SSM states carried from chunk to chunk) and after preemptions;
every state slot free afterwards."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import build_tiny_hf_model, tiny_hf_config
from recurrent_checks import assert_logits_match, generate_all_free
from tessera.errors import ModelFormatError
from tessera.llm import LLM
from tessera.models.loader import forward_single, load_model
from tessera.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], [250, 7, 7, 120, 64, 33, 8, 301, 19, 77, 150], [11, 200, 45, 9, 12, 13, 14, 15, 16, 18]]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(HF folder, transformers' model, its greedy continuations of PROMPTS)."""
    folder = tmp_path_factory.mktemp("granitehybrid") / "hf"
    model = build_tiny_hf_model("granitemoehybrid", folder)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return folder, model, greedy


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return generate_all_free(llm, prompts, GREEDY)


def test_logits_match_transformers_at_once_and_token_by_token(granite):
    folder, model, _ = granite
    loaded = load_model(folder, "float32", quantization="none")
    c = loaded.config
    assert c.layer_kinds == ["mamba", "attention", "mamba", "mamba"] and c.mamba.conv_dim == 128 + 2 * 2 * 16
    assert_logits_match(model, loaded, PROMPTS[1] + PROMPTS[2])


def test_greedy_alone_batched_and_after_preemption(granite):
    folder, model, greedy = granite
    alone = LLM(str(folder), dtype="float32", max_model_len=128, max_num_seqs=1)
    assert _generate(alone) == greedy
    runner = alone.engine.runner
    # Per slot: the convolution's last 3 inputs of 192 channels (x, then B and C of 2 groups) in the
    # compute dtype, and the SSM state (4 heads x 32 x 16) in float32, for each of the 3 Mamba-2 layers.
    assert [[tuple(t.shape[1:]) for t in layer] for layer in runner.state_caches] == [[(192, 3), (4, 32, 16)]] * 3
    batched = LLM(str(folder), dtype="float32", max_model_len=128, max_num_batched_tokens=8, max_num_seqs=3)
    assert _generate(batched) == greedy
    # A repeat of a 33-token prompt hits 32 tokens and resumes from both states kept there.
    long = PROMPTS[1] * 3
    with torch.no_grad():
        want = model.generate(torch.tensor([long]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)[0, len(long):].tolist()
    assert generate_all_free(batched, [long] * 2, GREEDY) == [want] * 2  # together: each computes it
    assert _generate(batched, [long])[0] == want and batched.engine.scheduler.stats().prefix_cache_hits >= 32
    block = runner.block_bytes()
    state = sum(t.numel() * t.element_size() for layer in batched.engine.runner.state_caches for t in layer)
    small = LLM(str(folder), dtype="float32", max_model_len=128, max_num_seqs=3, max_num_batched_tokens=8,
                kv_cache_memory=4 * block + state)
    assert small.engine.kv.num_blocks == 4
    assert _generate(small) == greedy
    assert small.engine.scheduler.num_preemptions > 0


def test_without_rope_and_mixtures_of_experts_refused(tmp_path):
    config = tiny_hf_config("granitemoehybrid")
    config.position_embedding_type = None  # Granite 4.0-H's own setting: no RoPE anywhere
    model = build_tiny_hf_model("granitemoehybrid", tmp_path / "nope", config=config)
    ids = PROMPTS[2] + PROMPTS[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    loaded = load_model(tmp_path / "nope", "float32", quantization="none")
    assert (forward_single(loaded, ids, chunk=3) - ref).abs().max().item() < 1e-4
    path = tmp_path / "nope" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_local_experts": 4}))
    with pytest.raises(ModelFormatError, match="num_local_experts"):
        load_model(tmp_path / "nope", "float32")


def test_a_gguf_is_refused_with_the_reason(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "hybrid.gguf"
    w = GGUFWriter(path, "granitehybrid")
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_tensor("token_embd.weight", np.zeros((320, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="granitehybrid GGUF files are not read"):
        load_model(path, "float32")
