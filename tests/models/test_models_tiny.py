"""Tiny random HF models (llama, qwen2, gemma3) loaded by Tessera agree with transformers.

Fast: each model has a few layers of width 64, written once per session.
"""
from __future__ import annotations

import json

import pytest
import torch

from tessera.config import ModelConfig
from tessera.attention import get_backend
from tessera.errors import ModelFormatError, ModelNotFoundError, TesseraError
from tessera.models.dtype import measure_linear_speed, resolve_dtype
from tessera.models.loader import forward_single, load_model

KINDS = ["llama", "llama3-rope", "llama-linear-rope", "qwen2", "gemma3"]
TOKENS = [5, 17, 42, 99, 3, 250, 7, 7, 120, 64, 33, 8, 301, 19, 77, 150, 11, 200, 45]  # 19 > sliding window 6

# float32: same math in the same precision, only summation order differs.
F32_ATOL = 1e-5
# bfloat16 weights and activations (8 bits of mantissa) against a float32 reference.
BF16_ATOL = 0.1


def hf_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", KINDS)
def test_float32_logits_match_transformers(tiny_model_dir, kind):
    folder = tiny_model_dir(kind)
    loaded = load_model(folder, "float32")
    assert loaded.dtype == torch.float32
    ref = hf_logits(folder, TOKENS)
    ours = forward_single(loaded, TOKENS)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < F32_ATOL


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_sequence_in_chunks_has_the_logits_of_one_pass(tiny_model_dir, kind):
    """forward_single's chunked passes (decode-sized row counts over the KV cache of the earlier
    tokens, what benchmarks/perplexity.py --chunk scores) are the one-pass forward."""
    loaded = load_model(tiny_model_dir(kind), "float32")
    whole = forward_single(loaded, TOKENS)
    for chunk in (1, 3, len(TOKENS)):
        assert (forward_single(loaded, TOKENS, chunk=chunk) - whole).abs().max().item() < F32_ATOL


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_bfloat16_logits_close_to_transformers(tiny_model_dir, kind):
    folder = tiny_model_dir(kind)
    loaded = load_model(folder, "bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    ref = hf_logits(folder, TOKENS)
    ours = forward_single(loaded, TOKENS)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < BF16_ATOL


def _step(model, caches, reqs, block_size, backend):
    """Run one packed step. reqs: (all_tokens, num_computed, num_new, block_ids); decodes first."""
    ids, pos, qlens, seqlens, tables = [], [], [], [], []
    for tokens, done, new, blocks in reqs:
        ids += tokens[done:done + new]
        pos += list(range(done, done + new))
        qlens.append(new)
        seqlens.append(done + new)
        tables.append(blocks)
    meta = get_backend(backend).build_metadata(qlens, seqlens, tables, block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("backend", ["paged", "sdpa", "reference"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_packed_batch_with_cache_matches_single_sequences(tiny_model_dir, kind, backend):
    """Decodes, chunked prefill over cached context and fresh prompts in one step give the same logits."""
    loaded = load_model(tiny_model_dir(kind), "float32")
    c = loaded.config
    bs = 4
    caches = get_backend(backend).allocate(c.num_layers, 24, bs, c.num_kv_heads, c.head_dim, torch.float32)
    a, b, d = TOKENS[:9], TOKENS[:4] + TOKENS[10:19], TOKENS[3:11]
    blocks_a, blocks_b, blocks_d = [3, 0, 7], [1, 2, 5, 9], [4, 6]
    ref = {name: forward_single(loaded, seq) for name, seq in (("a", a), ("b", b), ("d", d))}
    # step 1: two fresh prefills (a: 8 of 9 tokens, b: first 6)
    out = _step(loaded.model, caches, [(a, 0, 8, blocks_a), (b, 0, 6, blocks_b)], bs, backend)
    torch.testing.assert_close(out[:8], ref["a"][:8], atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(out[8:], ref["b"][:6], atol=F32_ATOL, rtol=0)
    # step 2: a decodes its last token; b continues (7 tokens over 6 cached); d starts fresh
    out = _step(loaded.model, caches, [(a, 8, 1, blocks_a), (b, 6, 7, blocks_b), (d, 0, 8, blocks_d)], bs, backend)
    torch.testing.assert_close(out[0], ref["a"][8], atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(out[1:8], ref["b"][6:13], atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(out[8:], ref["d"], atol=F32_ATOL, rtol=0)


def test_loaded_model_metadata(tiny_model_dir):
    loaded = load_model(tiny_model_dir("qwen2"), "float32")
    c = loaded.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("qwen2", 2, 4, 1, 16)
    assert c.attention_bias and c.tie_word_embeddings
    assert 2 in loaded.tokenizer.eos_token_ids and loaded.tokenizer.eos_token_ids == c.eos_token_ids
    gemma = load_model(tiny_model_dir("gemma3"), "float32").config
    assert (gemma.sliding_window, gemma.sliding_window_pattern, gemma.rope_local_base_freq) == (6, 3, 10000.0)
    assert gemma.query_pre_attn_scalar == 24


def test_missing_weights_is_a_format_error(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelFormatError, match="missing 1 weight.*layers.1.mlp.up_proj"):
        load_model(tmp_path, "float32")


def test_unsupported_or_broken_folders(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ModelFormatError, match="model type 'mamba' is not supported"):
        load_model(tmp_path, "float32")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        load_model(tmp_path, "float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="corrupt or truncated"):
        load_model(tmp_path, "float32")
    with pytest.raises(ModelNotFoundError):
        load_model(tmp_path / "nope.gguf")


def _config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)


def test_resolve_dtype_names_and_errors():
    assert resolve_dtype("float32", _config()) == torch.float32
    assert resolve_dtype("bfloat16", _config()) == torch.bfloat16
    assert resolve_dtype(torch.bfloat16, _config()) == torch.bfloat16
    with pytest.raises(TesseraError, match="unknown dtype"):
        resolve_dtype("float8", _config())
    with pytest.raises(TesseraError, match="not supported"):
        resolve_dtype(torch.float16, _config())


def test_auto_dtype_is_float32_by_rule_where_the_kernels_compute_it(caplog, monkeypatch):
    monkeypatch.setattr("tessera.kernels.isa.level_at_least", lambda name: False)  # e.g. --cpu-isa avx512
    monkeypatch.setattr("tessera.kernels.library.available", lambda: None)
    monkeypatch.setattr("tessera.models.dtype.measure_linear_speed",
                        lambda *a, **k: pytest.fail("the C kernels' float32 needs no timing"))
    with caplog.at_level("INFO", logger="tessera.models.dtype"):
        assert resolve_dtype("auto", _config()) == torch.float32
    assert "the C kernels compute in float32 here" in caplog.text


def test_auto_dtype_measures_both_without_native_bf16_or_kernels(caplog, monkeypatch):
    monkeypatch.setattr("tessera.kernels.isa.level_at_least", lambda name: False)
    monkeypatch.setattr("tessera.kernels.library.available", lambda: "no C compiler")
    timings = measure_linear_speed(_config(), budget_s=0.01)
    assert set(timings) == {torch.float32, torch.bfloat16}
    assert all(t > 0 for per_batch in timings.values() for t in per_batch.values())
    with caplog.at_level("INFO", logger="tessera.models.dtype"):
        chosen = resolve_dtype("auto", _config())
    assert chosen in (torch.float32, torch.bfloat16)
    assert "no native bfloat16" in caplog.text and "using" in caplog.text


def test_auto_dtype_is_bf16_by_rule_on_native_bf16_cpus(caplog, monkeypatch):
    monkeypatch.setattr("tessera.kernels.isa.level_at_least", lambda name: name == "avx512_bf16")
    monkeypatch.setattr("tessera.models.dtype.measure_linear_speed",
                        lambda *a, **k: pytest.fail("a CPU with native bf16 needs no timing"))
    with caplog.at_level("INFO", logger="tessera.models.dtype"):
        assert resolve_dtype("auto", _config()) == torch.bfloat16
    assert "natively at level" in caplog.text
