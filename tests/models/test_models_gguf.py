"""GGUF loading on tiny files written here with gguf.GGUFWriter, the way llama.cpp's converter writes them.

Checks the plumbing the real files rely on -- metadata keys, tensor offsets,
quantized types, llama.cpp's Q/K row permutation, Gemma's stored (1 + w) norms --
against transformers running the same (quantize-dequantized) weights, plus every
way a file can be unusable.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from tessera.errors import ModelFormatError
from tessera.models import gguf_file, gguf_loader
from tessera.models.gguf_file import read_gguf
from tessera.models.gguf_loader import config_from_gguf
from tessera.models.loader import forward_single, load_model
from tessera.tokenizer import Tokenizer
from tiny_gguf import write_tiny_gguf

TOKENS = [5, 17, 42, 99, 3, 250, 7, 7, 120, 64, 33, 8, 301, 19, 77, 150]
F32_ATOL = 1e-5  # same weights, same precision: only summation order differs

@pytest.fixture()
def tessera_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_gguf_logits_match_transformers(kind, tmp_path, tessera_home, monkeypatch):
    path, ref_model = write_tiny_gguf(kind, tmp_path)
    monkeypatch.setattr(gguf_file, "_DEQUANT_CHUNK", 100)  # exercise row-chunked dequantization
    loaded = load_model(path, "float32", quantization="none")
    with torch.no_grad():
        ref = ref_model(torch.tensor([TOKENS])).logits[0]
    ours = forward_single(loaded, TOKENS)
    assert (ours - ref).abs().max().item() < F32_ATOL


def test_gguf_without_unpermute_would_differ(tmp_path, tessera_home, monkeypatch):
    """The Q/K permutation matters: skipping its reversal changes the logits."""
    path, ref_model = write_tiny_gguf("llama", tmp_path)
    monkeypatch.setattr(gguf_loader, "_unpermute_qk", lambda w, n_head: w)
    ours = forward_single(load_model(path, "float32", quantization="none"), TOKENS)
    with torch.no_grad():
        ref = ref_model(torch.tensor([TOKENS])).logits[0]
    assert (ours - ref).abs().max().item() > 1e-2


def test_gguf_config_and_tokenizer(tmp_path, tessera_home, monkeypatch):
    path, _ = write_tiny_gguf("gemma3", tmp_path)
    gf = read_gguf(path)
    cfg = config_from_gguf(gf)
    gf.close()
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("gemma3", 3, 4, 1, 32)
    assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.rope_local_base_freq) == (6, 3, 10000.0)
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 32

    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = load_model(path, "float32", quantization="none").tokenizer
    for text in ["Hello world!", "def add(a, b):\n    return a + b", "Grüße 東京 🙂"]:
        assert tok.encode(text) == hf_tok.encode(text)
        assert tok.decode(tok.encode(text)) == hf_tok.decode(hf_tok.encode(text), skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True)
    assert 2 in tok.eos_token_ids  # <|im_end|>: the file's eos, also the template's end of turn

    # the converted tokenizer is cached: a second load never converts again
    assert any(tessera_home.joinpath("tokenizers").iterdir())
    import tessera.tokenizer as tokenizer_module

    def no_conversion(_path):
        raise AssertionError("tokenizer converted again instead of read from the cache")

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", no_conversion)
    again = Tokenizer.from_gguf(path)
    assert again.encode("Hello world!") == tok.encode("Hello world!")
    assert again.eos_token_ids == Tokenizer.from_gguf(path).eos_token_ids


# -- unusable files ------------------------------------------------------------


@pytest.fixture()
def tiny_gguf(tmp_path) -> Path:
    path, _ = write_tiny_gguf("llama", tmp_path, quantized=False)
    return path


def test_truncated_file(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-1000])
    with pytest.raises(ModelFormatError, match="cut.gguf is truncated.*re-download"):
        read_gguf(cut)
    cut.write_bytes(data[:5000])  # inside the metadata
    with pytest.raises(ModelFormatError, match="corrupt or truncated GGUF header"):
        read_gguf(cut)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        load_model(bad)
    bad.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="cannot read"):
        load_model(bad)


def test_corrupt_header_counts(tiny_gguf, tmp_path):
    data = bytearray(tiny_gguf.read_bytes())
    data[16:24] = (2**40).to_bytes(8, "little")  # absurd metadata count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="corrupt"):
        read_gguf(bad)


def _minimal_gguf(path: Path, arch: str, tensor_type: Q = Q.F32) -> Path:
    w = GGUFWriter(path, arch)
    w.add_embedding_length(256)
    w.add_block_count(1)
    w.add_head_count(1)
    w.add_feed_forward_length(256)
    if tensor_type == Q.F32:
        w.add_tensor("token_embd.weight", np.zeros((4, 256), dtype=np.float32))
    else:
        block, size = gguf_file.GGML_QUANT_SIZES[tensor_type]
        raw = np.zeros((4, 256 // block * size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture(tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(ModelFormatError, match="architecture .mamba. is not supported.*llama, qwen2, qwen3, gemma2, gemma3, phi3"):
        load_model(path)


def test_unsupported_tensor_type(tmp_path):
    path = _minimal_gguf(tmp_path / "iq.gguf", "llama", Q.IQ2_XXS)
    with pytest.raises(ModelFormatError, match="token_embd.weight has type IQ2_XXS.*use a file quantized as"):
        load_model(path)


def test_missing_tensors(tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf", "llama")
    with pytest.raises(ModelFormatError, match="tensor blk.0.attn_q.weight is missing"):
        load_model(path, "float32", quantization="none")


def test_rope_scaling_metadata(tmp_path):
    w = GGUFWriter(tmp_path / "r.gguf", "qwen2")
    for add, value in ((w.add_embedding_length, 64), (w.add_block_count, 1), (w.add_head_count, 4),
                       (w.add_feed_forward_length, 128)):
        add(value)
    w.add_string("qwen2.rope.scaling.type", "yarn")
    w.add_float32("qwen2.rope.scaling.factor", 4.0)
    w.add_uint32("qwen2.rope.scaling.original_context_length", 32768)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    for name, shape in (("attn_q", (64, 64)), ("attn_k", (64, 64)), ("ffn_up", (128, 64))):
        w.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = config_from_gguf(read_gguf(tmp_path / "r.gguf"))
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_metadata_that_disagrees_with_the_tensors_is_refused(tiny_gguf, tmp_path):
    """A header claiming absurd sizes must not turn into an absurd allocation."""
    gf = read_gguf(tiny_gguf)
    gf.metadata[f"{gf.architecture}.embedding_length"] = 10**9
    with pytest.raises(ModelFormatError, match="token_embd.weight has shape"):
        config_from_gguf(gf)
    gf = read_gguf(tiny_gguf)
    gf.metadata[f"{gf.architecture}.block_count"] = 10**6
    with pytest.raises(ModelFormatError, match="missing .*metadata says 1000000 layers"):
        config_from_gguf(gf)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_are_refused_cleanly(tiny_gguf, data):
    """Random byte flips and cuts in the header and tensor table: the file parses to a config
    that agrees with its tensors, or is refused with ModelFormatError; nothing else escapes."""
    raw = bytearray(tiny_gguf.read_bytes())
    header_end = 4096
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(4, header_end))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    path = tiny_gguf.with_name("fuzzed.gguf")
    path.write_bytes(bytes(raw))
    try:
        config_from_gguf(read_gguf(path))
    except ModelFormatError:
        pass


def test_packed_weight_cache_maps_identical_weights(tiny_gguf, tessera_home, caplog):
    """The second load maps what the first packed: same outputs, tensors backed by the cache file;
    a damaged cache file is ignored (and rewritten)."""
    import logging

    caplog.set_level(logging.INFO)
    first = load_model(tiny_gguf, "float32", weight_cache=True)
    files = list((tessera_home / "packed").glob("*.pt"))
    assert len(files) == 1
    assert "just written" in caplog.text
    second = load_model(tiny_gguf, "float32", weight_cache=True)
    ids = [1, 5, 9, 2, 7]
    assert torch.equal(forward_single(first, ids), forward_single(second, ids))

    def mapped(loaded) -> bool:
        ptr = next(iter(loaded.model.model.layers[0].self_attn.qkv_proj.buffers())).data_ptr()
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-"))
                 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(files[0]))]
        return any(lo <= ptr < hi for lo, hi in spans)

    # both mapped from the file, not copies: the first load serves from the file it wrote
    assert mapped(first) and mapped(second)
    files[0].unlink()  # a new file, as anything but an in-place write leaves the mapped one intact
    files[0].write_bytes(b"not a torch file")
    caplog.clear()
    third = load_model(tiny_gguf, "float32", weight_cache=True)
    assert "ignoring the packed-weight cache" in caplog.text
    assert torch.equal(forward_single(first, ids), forward_single(third, ids))


def test_packed_weight_cache_keeps_a_models_most_recently_used_settings(tiny_gguf, tessera_home):
    """Each setting gets its own file; beyond KEEP_PER_MODEL the least recently used (written or
    mapped) is removed."""
    from tessera.models.weight_cache import KEEP_PER_MODEL

    def files() -> set[Path]:
        return set((tessera_home / "packed").glob("*.pt"))

    quantizations = ["auto", "int8", "none", "int4"]
    written = []
    for quantization in quantizations[:KEEP_PER_MODEL]:
        load_model(tiny_gguf, "float32", quantization=quantization, weight_cache=True)
        (new,) = files() - set(written)
        written.append(new)
    assert files() == set(written)
    time.sleep(0.05)
    load_model(tiny_gguf, "float32", quantization=quantizations[0], weight_cache=True)  # mapped: now the most recent
    time.sleep(0.05)
    load_model(tiny_gguf, "float32", quantization=quantizations[KEEP_PER_MODEL], weight_cache=True)
    now = files()
    assert len(now) == KEEP_PER_MODEL and written[0] in now and written[1] not in now


def test_packed_weight_cache_restores_int8_layers(tiny_gguf, tessera_home):
    """A restored int8 layer has every buffer and attribute loading gave it (its scales, and its
    zeros, kept as None for symmetric groups), and computes the same one-row step."""
    first = load_model(tiny_gguf, "float32", quantization="int8", weight_cache=True)
    second = load_model(tiny_gguf, "float32", quantization="int8", weight_cache=True)

    def names(model):
        return {(m, n) for m, mod in model.named_modules() for n, _ in mod.named_buffers(recurse=False,
                                                                                           remove_duplicate=False)}

    assert any(n == "scales" for _, n in names(first.model)) and names(second.model) == names(first.model)
    int8 = [m for m in second.model.modules() if type(getattr(m, "quant_method", None)).__name__ == "Int8Method"]
    assert int8 and all(m.zeros is None and isinstance(m.use_kernels, bool) for m in int8)
    assert torch.equal(forward_single(first, [3]), forward_single(second, [3]))  # one row: the kernel's path


def test_tokenizer_size_for_the_sizing_calculator(tiny_gguf, tessera_home):
    """A GGUF model's tokenizer is sized by its converted tokenizer.json, converted on demand when
    no load has done it yet (what `tessera size` does for a model never served)."""
    from tessera.tokenizer import default_cache_dir, serialized_bytes

    assert not (tessera_home / "tokenizers").exists()
    size = serialized_bytes(tiny_gguf)
    files = list(default_cache_dir().glob("*/tokenizer.json"))
    assert len(files) == 1 and size == files[0].stat().st_size > 0
    assert serialized_bytes(tiny_gguf) == size  # the cached one, read again


def test_mxfp4_model_keeps_the_blocks_and_the_packed_cache_restores_them(tmp_path, tessera_home):
    """A GGUF whose projections are MXFP4 loads them as MXFP4Method under `auto` (the file's bytes),
    matches transformers on the file's values within what the kernel's int8 activations allow, and
    the packed-weight cache maps the blocks back with the method (identical logits)."""
    from tessera.layers.quantization import MXFP4Method

    mx = {name: Q.MXFP4 for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    path, ref_model = write_tiny_gguf("llama", tmp_path, qtypes=mx)
    first = load_model(path, "float32", weight_cache=True)
    second = load_model(path, "float32", weight_cache=True)

    def mxfp4_layers(loaded):
        return [m for m in loaded.model.modules() if isinstance(getattr(m, "quant_method", None), MXFP4Method)]

    assert len(mxfp4_layers(first)) == len(mxfp4_layers(second)) == 2 * 4  # qkv, o, gate_up, down per layer
    layer = mxfp4_layers(second)[0]
    assert layer.quant_method.nbytes(layer) == layer.blocks.numel()  # bytes as stored, 17 per 32 weights
    with torch.no_grad():
        ref = ref_model(torch.tensor([TOKENS])).logits[0]
    ours = forward_single(first, TOKENS)
    assert torch.equal(forward_single(second, TOKENS), ours)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.02
