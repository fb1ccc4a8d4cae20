"""LoRA adapters in the engine, on a tiny random model: files checked, slots, scheduling, KV keys.

The oracle tests (tests/models/test_lora_oracle.py) hold the values to transformers + PEFT on
real models; here: what the engine decides around them.
"""
from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tessera.errors import AdapterError
from tessera.layers import lora as lora_layer
from tessera.layers.lora import LoRASlots, LoRATable
from tessera.llm import LLM
from tessera.models.adapters import read_adapter
from tessera.sampling_params import SamplingParams

from tiny_model import make_tiny_model, write_peft

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tessera.models.loader import load_model

    root = tmp_path_factory.mktemp("lora")
    loaded = load_model(make_tiny_model(root / "llama"), "float32")
    adapters = {f"a{i}": write_peft(root / f"a{i}", loaded.config, 4 + 4 * i, seed=i) for i in range(3)}
    return loaded, adapters, root


def make_llm(loaded, adapters, **opts) -> LLM:
    opts.setdefault("max_model_len", 256)
    return LLM(str(loaded.path), loaded=loaded, enable_lora=True, max_lora_rank=16,
               lora_modules=[f"{n}={p}" for n, p in adapters.items()], **opts)


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


PROMPTS = [[5, 17, 99, 120, 44, 3, 250], [7, 7, 8, 9, 200, 31, 64, 65, 66, 12, 13, 14, 90, 91, 92, 93, 94, 95]]


def test_adapters_change_output_and_one_slot_serves_all_in_turn(setup):
    """max_loras=1: requests for three adapters and the base, sent together, each get what they get
    alone (the scheduler lets one adapter run at a time, the others wait), and nothing is held after."""
    loaded, adapters, _ = setup
    llm = make_llm(loaded, adapters, max_loras=1, max_cpu_loras=1)
    names = [None, *adapters]
    alone = {n: tokens(llm.generate(PROMPTS, GREEDY, lora=n)) for n in names}
    assert len({str(v) for v in alone.values()}) == len(names), "every adapter must change the output"
    batch = [p for p in PROMPTS for _ in names]
    mixed = tokens(llm.generate(batch, GREEDY, lora=[n for _ in PROMPTS for n in names]))
    assert mixed == [alone[n][i] for i in range(len(PROMPTS)) for n in names]
    assert llm.engine.kv.usage() == 0.0
    assert len(llm.engine.lora.loaded) <= 1  # --max-cpu-loras 1: the others were dropped and read again


def test_prefix_cache_never_shares_kv_across_adapters(setup):
    loaded, adapters, _ = setup
    llm = make_llm(loaded, adapters, max_loras=2, enable_prefix_caching=True)
    prompt = list(range(3, 3 + 64))  # four full blocks
    first = llm.generate([prompt], GREEDY, lora="a0")[0]
    again = llm.generate([prompt], GREEDY, lora="a0")[0]
    other = llm.generate([prompt], GREEDY, lora="a1")[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_unknown_and_removed_adapters_are_refused_and_running_ones_finish(setup):
    loaded, adapters, _ = setup
    llm = make_llm(loaded, adapters, max_loras=2)
    engine = llm.engine
    with pytest.raises(Exception, match="does not exist"):
        llm.generate([PROMPTS[0]], GREEDY, lora="nope")
    want = tokens(llm.generate([PROMPTS[0]], GREEDY, lora="a2"))
    p = engine.prepare_request("r1", PROMPTS[0], GREEDY)
    p.lora_name = "a2"
    engine.add_prepared(p)
    engine.step()
    engine.step()
    engine.remove_lora("a2")  # mid-request: it finishes with the adapter it started with
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done["r1"].outputs[0].token_ids) == want[0]
    with pytest.raises(Exception, match="does not exist"):
        llm.generate([PROMPTS[0]], GREEDY, lora="a2")
    engine.step()
    assert "a2" not in engine.lora.loaded and engine.kv.usage() == 0.0


def test_bad_adapter_files_are_clear_errors(setup, tmp_path):
    loaded, adapters, root = setup
    cfg = loaded.config
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter("x", str(tmp_path / "missing"), cfg, 16)
    with pytest.raises(AdapterError, match="above --max-lora-rank"):
        read_adapter("x", adapters["a2"], cfg, 8)
    other = cfg.__class__(**{**cfg.__dict__, "hidden_size": cfg.hidden_size * 2, "intermediate_size": 8})
    with pytest.raises(AdapterError, match="another model"):
        read_adapter("x", adapters["a0"], other, 16)
    dora = write_peft(tmp_path / "dora", cfg, 4, seed=0, use_dora=True)
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter("x", dora, cfg, 16)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="cannot read"):
        read_adapter("x", str(tmp_path / "junk"), cfg, 16)


def test_rank_pattern_and_partial_targets_match_dense_reference(setup, tmp_path):
    """Attention-only adapter (q, v): the update is what B (A x) * alpha / r gives per module."""
    loaded, _, _ = setup
    cfg = loaded.config
    path = write_peft(tmp_path / "qv", cfg, 4, seed=7, kinds=("q", "v"), use_rslora=True)
    spec = read_adapter("qv", path, cfg, 16)
    assert spec.targets == ("q", "v") and spec.modules[0].scale == pytest.approx(4 / 4 ** 0.5)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), parts=st.sampled_from([[24], [16, 8, 8], [300, 40], [20, 260, 20]]),
       ranks=st.lists(st.sampled_from([0, 1, 4, 8]), min_size=3, max_size=3), seed=st.integers(0, 99),
       bf16=st.booleans(), weights_bf16=st.booleans())
def test_lora_kernel_matches_grouped_reference(rows, parts, ranks, seed, bf16, weights_bf16):
    """kernels/lora.c against the per-slot PyTorch path, for any mix of rows, slots, ranks, parts
    (tiles of 256 outputs crossing part boundaries), activations' and weights' dtypes."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    wdtype = torch.bfloat16 if weights_bf16 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    slots = LoRASlots(3, 8, dtype=wdtype)
    table = LoRATable(slots, parts)
    k, n = 32, sum(parts)
    for s, r in enumerate(ranks):
        if r:
            table.put(s, (torch.randn(k, len(parts) * r, generator=gen).to(wdtype),
                          torch.randn(r, n, generator=gen).to(wdtype)))
            slots.ranks[s] = r
    slots.begin_step([int(v) for v in torch.randint(-1, 3, (rows,), generator=gen)])
    if slots.row_slots is None:
        return
    x = torch.randn(rows, k, generator=gen).to(dtype)
    y0 = torch.randn(rows, n, generator=gen).to(dtype)
    native, ref = y0.clone(), y0.clone()
    with mock.patch.object(lora_layer, "NATIVE_MAX_ROWS", 10**6):  # the kernel at every row count
        table.add_to(x, native)
    table._add_grouped(x, ref)
    tol = 0.5 if bf16 else 1e-4
    torch.testing.assert_close(native.float(), ref.float(), atol=tol, rtol=0.02 if bf16 else 1e-5)


def _permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (its LoRA converter applies it to B)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_lora_gives_the_peft_adapters_tokens(setup, tmp_path):
    """The same adapter written as llama.cpp's convert_lora_to_gguf writes it (B of Q and K permuted
    as the base's rows are, alpha in adapter.lora.alpha) serves the PEFT folder's tokens."""
    import gguf
    from safetensors.torch import load_file

    loaded, adapters, _ = setup
    cfg = loaded.config
    tensors = load_file(adapters["a1"] + "/adapter_model.safetensors")
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(tmp_path / "a1.gguf"), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    rank = json.loads((Path(adapters["a1"]) / "adapter_config.json").read_text())["r"]
    writer.add_float32("adapter.lora.alpha", float(rank))
    for key, value in sorted(tensors.items()):
        parts = key.split(".")
        layer, module, ab = int(parts[4]), parts[6], parts[7]
        w = value.numpy()
        if ab == "lora_B" and module in ("q_proj", "k_proj"):
            w = _permute(w, cfg.num_heads if module == "q_proj" else cfg.num_kv_heads)
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{ab[-1].lower()}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    spec = read_adapter("g", str(tmp_path / "a1.gguf"), cfg, 16)
    assert spec.format == "gguf" and spec.gguf_permuted_qk and spec.rank == rank
    llm = make_llm(loaded, {"a1": adapters["a1"], "g": str(tmp_path / "a1.gguf")}, max_loras=2)
    assert tokens(llm.generate(PROMPTS, GREEDY, lora="g")) == tokens(llm.generate(PROMPTS, GREEDY, lora="a1"))
