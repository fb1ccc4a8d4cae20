"""Mixture-of-experts blocks: routing, grouping tokens by expert, configs from both file formats,
sizing of stacked experts, and the memory check before loading. Greedy tokens against
transformers for every MoE family are in test_model_families.py."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.config import MoEConfig
from tessera.errors import ModelFormatError
from tessera.layers import Linear, QuantConfig
from tessera.layers.moe import SparseMoE
from tessera.models.safetensors_loader import config_from_hf
from tiny_gguf import write_tiny_gguf


def _moe(experts=8, top_k=2, renormalize=True, activation="silu", bias=False, hidden=32, ffn=16, seed=0):
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=experts, top_k=top_k, expert_ffn=ffn, renormalize=renormalize,
                    router_bias=bias, expert_bias=bias, activation=activation, swiglu_limit=0.5)
    layer = SparseMoE(hidden, cfg, QuantConfig("none", torch.float32), "mlp")
    weights = [("mlp.gate.weight", torch.randn(experts, hidden))]
    if bias:
        weights.append(("mlp.gate.bias", torch.randn(experts)))
    for e in range(experts):
        for name, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))):
            weights.append((f"mlp.experts.{e}.{name}_proj.weight", 0.2 * torch.randn(shape)))
            if bias:
                weights.append((f"mlp.experts.{e}.{name}_proj.bias", 0.1 * torch.randn(shape[0])))
    from tessera.models.weights import load_named_weights

    holder = torch.nn.Module()
    holder.mlp = layer
    load_named_weights(holder, weights, "test")
    return layer, dict(weights)


def _reference(x, w, experts, top_k, renormalize, activation, bias):
    """Token by token, the formula: softmax routing, the top k experts' outputs weighted."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ w["mlp.gate.weight"].T + (w["mlp.gate.bias"] if bias else 0)
        probs = torch.softmax(logits, -1)
        top = torch.topk(probs, top_k)
        weights = top.values / top.values.sum() if renormalize else top.values
        for p, e in zip(weights, top.indices.tolist()):
            def proj(name, v):
                y = v @ w[f"mlp.experts.{e}.{name}_proj.weight"].T
                return y + w[f"mlp.experts.{e}.{name}_proj.bias"] if bias else y
            g, u = proj("gate", x[t]), proj("up", x[t])
            if activation == "silu":
                h = torch.nn.functional.silu(g) * u
            else:
                g = g.clamp(max=0.5)
                h = g * torch.sigmoid(1.702 * g) * (u.clamp(-0.5, 0.5) + 1)
            out[t] += p * proj("down", h)
    return out


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(1, 40), top_k=st.integers(1, 4), renormalize=st.booleans(),
       gpt_oss=st.booleans(), seed=st.integers(0, 1000))
def test_grouped_experts_equal_the_per_token_formula(tokens, top_k, renormalize, gpt_oss, seed):
    activation = "swiglu_clamped" if gpt_oss else "silu"
    layer, w = _moe(top_k=top_k, renormalize=renormalize, activation=activation, bias=gpt_oss, seed=seed)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(seed))
    want = _reference(x, w, 8, top_k, renormalize, activation, gpt_oss)
    assert torch.allclose(layer(x), want, atol=1e-5, rtol=1e-4)


def test_only_the_chosen_experts_run_each_once_per_step():
    layer, _ = _moe(experts=16, top_k=2)
    calls: list[tuple[int, int]] = []
    for e, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda m, args, out, e=e: calls.append((e, args[0].shape[0])))
    x = torch.randn(5, 32)
    _, ids = layer.route(x)
    layer(x)
    chosen = sorted(set(ids.flatten().tolist()))
    assert sorted(e for e, _ in calls) == chosen  # each chosen expert once, no other
    assert sum(n for _, n in calls) == 5 * 2  # over exactly the tokens routed to it
    assert layer.last_active == len(chosen)
    calls.clear()
    layer(x[:1])  # one token: its two experts
    assert sorted(e for e, _ in calls) == sorted(layer.route(x[:1])[1][0].tolist())


def test_moe_configs_from_hf_and_gguf(family_model_moe):
    from tessera.models.gguf_file import read_gguf
    from tessera.models.gguf_loader import config_from_gguf

    for kind, experts, top_k, ffn, sparse in (("qwen3_moe", 8, 2, 64, [True, False, True]),
                                              ("mixtral", 8, 2, 128, None), ("gpt_oss", 4, 2, 64, None)):
        folder, gguf = family_model_moe(kind)
        gf = read_gguf(gguf)
        try:
            configs = [config_from_hf(json.loads((folder / "config.json").read_text())), config_from_gguf(gf)]
        finally:
            gf.close()
        for cfg in configs:
            moe = cfg.moe
            assert (moe.num_experts, moe.top_k, moe.expert_ffn, moe.sparse_layers) == (experts, top_k, ffn, sparse)
            assert moe.renormalize
            if kind == "gpt_oss":
                assert moe.router_bias and moe.expert_bias and moe.activation == "swiglu_clamped"
                assert cfg.attention_sinks and cfg.attention_output_bias and cfg.attention_bias
                assert cfg.layer_windows() == [6, None, 6]
                assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
        if kind == "gpt_oss":
            assert (configs[0].moe.swiglu_limit, configs[1].moe.swiglu_limit) == (0.5, 7.0)


def test_bad_moe_configs_are_clear_errors(family_model_moe):
    folder, _ = family_model_moe("qwen3_moe")
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(ModelFormatError, match="2 experts per token out of 1"):
        config_from_hf({**hf, "num_experts": 1, "num_local_experts": 1})
    del hf["num_experts_per_tok"]
    with pytest.raises(ModelFormatError, match="lacks 'num_experts_per_tok'"):
        config_from_hf(hf)
    folder, _ = family_model_moe("mixtral")
    hf = json.loads((folder / "config.json").read_text())
    del hf["num_local_experts"]
    with pytest.raises(ModelFormatError, match="lacks 'num_local_experts'"):
        config_from_hf(hf)


def test_stacked_experts_are_sized_as_stored(tmp_path):
    """`tessera size` counts a GGUF's expert stacks ([E, out, in], quantized) at the bytes the
    loaded model keeps for them, not as float tensors."""
    from tessera.models.loader import load_model
    from tessera.sizing import checkpoint_tensors, weight_storage

    path, _ = write_tiny_gguf("qwen3_moe", tmp_path, quantized=True)
    loaded = load_model(path, "float32")
    config, tensors = checkpoint_tensors(path)
    stored = weight_storage(config, tensors, loaded.quant)
    predicted = stored.bytes - stored.dense_copy_bytes  # nbytes below leaves dense copies out
    experts = [t for t in tensors if "experts" in t[0]]
    assert experts and all(len(shape) == 3 for _, shape, _ in experts)
    linear = sum(m.quant_method.nbytes(m) for m in loaded.model.modules() if hasattr(m, "quant_method")
                 and m.quant_method is not None)
    assert abs(predicted - linear) / linear < 0.05


def test_a_model_larger_than_free_memory_is_refused_before_loading(tmp_path, monkeypatch):
    import tessera.engine.build as build
    from tessera.llm import LLM
    from tessera.sampling_params import InvalidRequestError

    path, _ = write_tiny_gguf("mixtral", tmp_path, quantized=False)
    monkeypatch.setattr(build, "available_memory", lambda: 1 << 20)

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr("tessera.models.loader.load_model", no_loading)
    with pytest.raises(InvalidRequestError, match=r"GiB of weights as stored.*but 0.0 GiB is available"):
        LLM(str(path), dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def family_model_moe(tmp_path_factory):
    """kind -> (HF folder, F32 GGUF path)."""
    made: dict = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(f"moe-{kind}")
            path, _ = write_tiny_gguf(kind, folder, quantized=False)
            made[kind] = (folder / "hf", path)
        return made[kind]

    return make


def test_mxfp4_experts_keep_the_files_blocks(tmp_path):
    """gpt-oss's experts as MXFP4 in GGUF: each expert's projections keep the file's blocks
    (MXFP4Method, 17 bytes per 32 weights) and the model follows transformers holding the same
    dequantized weights (the kernel rounds activations to int8, as llama.cpp does)."""
    from gguf import GGMLQuantizationType as Q

    from tessera.layers.quantization import MXFP4Method
    from tessera.models.loader import forward_single, load_model

    qtypes = {"ffn_gate_exps": Q.MXFP4, "ffn_up_exps": Q.MXFP4, "ffn_down_exps": Q.MXFP4}
    path, model = write_tiny_gguf("gpt_oss", tmp_path, quantized=True, qtypes=qtypes)
    loaded = load_model(path, "float32")
    experts = [m for name, m in loaded.model.named_modules() if ".experts." in name and hasattr(m, "quant_method")]
    assert experts and all(isinstance(m.quant_method, MXFP4Method) for m in experts)
    assert all(m.quant_method.nbytes(m) == m.output_size * m.input_size // 32 * 17 for m in experts)
    tokens = [5, 17, 42, 99, 3, 250, 7, 7, 120, 64, 33, 8, 301, 19, 77, 150]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = forward_single(loaded, tokens)
    assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_linear_parameter_count_includes_every_expert(family_model_moe):
    """The dense-copy decision and the sizing read it: a mixture of experts counted as its dense
    MLP would look 1/E its size and get dense copies of every expert."""
    from tessera.models.dtype import linear_param_count
    from tessera.models.loader import load_model

    for kind in ("qwen3_moe", "gpt_oss"):
        folder, _ = family_model_moe(kind)
        loaded = load_model(folder, "float32")
        linears = {id(m): m for m in loaded.model.modules() if isinstance(m, Linear)}  # a tied head once
        params = sum(m.input_size * m.output_size for m in linears.values())
        assert linear_param_count(loaded.config) == params
