"""The sizing calculator (`tessera size`): weights as stored, the default KV cache, the CLI."""
from __future__ import annotations

import json

import pytest
import torch

from tessera.config import EngineConfig
from tessera.sizing import FRONTEND_RUNTIME_BYTES, RUNTIME_BYTES, default_kv_cache_memory, estimate, tokenizer_bytes

from tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen", arch="qwen2")


def _stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight tensor the loaded model holds (shared storage counted once;
    the rotary tables are not weights)."""
    seen, total = set(), 0
    biases = [(f"{n}.bias", m.bias) for n, m in model.named_modules() if getattr(m, "bias", None) is not None]
    for name, t in list(model.named_parameters()) + list(model.named_buffers()) + biases:
        if "rotary" in name or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("dense", ["on", "off"])
def test_weights_as_the_loader_stores_them(folder, quantization, dense):
    from tessera.models.loader import load_model

    dtype = "bfloat16" if quantization == "int4" else "float32"  # int4 runs in bfloat16
    config = EngineConfig(model=str(folder), dtype=dtype, quantization=quantization, dense_weight_copy=dense)
    predicted = estimate(config, memory=8 << 30)
    loaded = load_model(folder, dtype, quantization=quantization, dense_copy=config.dense_copy)
    assert predicted.weights_bytes == _stored_bytes(loaded.model)
    assert (predicted.dense_copy_bytes > 0) == (dense == "on" and quantization != "none")


def test_kv_terms_and_what_fits(folder):
    e = estimate(EngineConfig(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=4,
                              preemption_mode="recompute"), memory=8 << 30)
    assert e.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V x layers x KV heads x head dim x float32
    assert e.kv_cache_tokens == 4 * 256 and e.swap_bytes == 0  # the default: the sequences at full length
    assert e.fits(8 << 30) > 1000 and e.fits(e.total_bytes - e.kv_cache_bytes) == 0
    fixed = estimate(EngineConfig(model=str(folder), dtype="float32", kv_cache_memory=1 << 20,
                                  preemption_mode="swap", swap_space=1 << 20))
    assert fixed.kv_cache_bytes == 1 << 20 and fixed.swap_bytes == 1 << 20
    int8 = estimate(EngineConfig(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=4,
                                 preemption_mode="recompute", kv_cache_dtype="int8"), memory=8 << 30)
    assert int8.kv_cache_dtype == "int8" and int8.kv_cache_tokens == 4 * 256
    assert int8.kv_bytes_per_token == 2 * 2 * 2 * (16 * 16 + 4) / 16  # int8 rows + a float32 scale per block


def test_default_kv_cache_keeps_the_margin():
    assert default_kv_cache_memory(1 << 30, available=8 << 30, others=0) == 1 << 30  # what is needed
    assert default_kv_cache_memory(8 << 30, available=4 << 30, others=1 << 30, margin=0.25) == 2 << 30
    assert default_kv_cache_memory(8 << 30, available=1 << 30, others=2 << 30) == 0


def test_engine_default_is_the_calculators(folder):
    from tessera.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=128, max_num_seqs=3)
    engine = LLMEngine(config)
    assert engine.kv.num_blocks * config.block_size == 3 * 128
    assert estimate(config).kv_cache_tokens == 3 * 128


def test_size_command(folder, capsys):
    from tessera.cli import main

    assert main(["size", str(folder), "--dtype", "float32", "--max-model-len", "256", "--memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "weights" in text and "KV cache" in text and "sequences of 256 tokens at once" in text
    assert "reserved" in text and "at start-up" in text
    assert main(["size", str(folder), "--dtype", "float32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_bytes"] == sum(data[k] for k in ("runtime_bytes", "frontend_bytes", "weights_bytes",
                                                        "kv_cache_bytes", "swap_bytes", "activation_bytes"))
    # the KV cache and swap pool are mapped as written: a fresh server holds neither
    assert data["startup_bytes"] == data["total_bytes"] - data["kv_cache_bytes"] - data["swap_bytes"]
    # serve's default: the engine in its own process, beside a front-end without torch
    assert data["frontend_bytes"] == FRONTEND_RUNTIME_BYTES + data["tokenizer_bytes"] < data["runtime_bytes"]
    # each process holds a tokenizer, sized by its tokenizer.json
    assert data["tokenizer_bytes"] == tokenizer_bytes((folder / "tokenizer.json").stat().st_size) > 40 << 20
    assert data["runtime_bytes"] == RUNTIME_BYTES + data["tokenizer_bytes"]
    assert main(["size", str(folder), "--dtype", "float32", "--json", "--no-engine-process"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["frontend_bytes"] == 0 and one["total_bytes"] == data["total_bytes"] - data["frontend_bytes"]
    assert main(["size", str(folder), "--margin", "1.5"]) != 0
