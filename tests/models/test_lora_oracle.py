"""LoRA adapters against transformers + PEFT as the oracle.

Random-weight PEFT adapters (rank 8 and 64, plain and rsLoRA scaling, every projection or a few)
are made by PEFT itself on the oracle model (the packaged SmolLM2 GGUF dequantized, or a tiny
random qwen2, float32) and saved as PEFT saves them; Tessera serves the same file beside the same
weights. The greedy tokens of each adapter must be the oracle's with that adapter applied, and a
batch mixing the base and three adapters must give every request the tokens it gets alone. The
oracle's tokens are kept by a digest of the model file, the adapter's saved files and the prompts
(tests/oracle_store.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oracle_store import OracleStore, adapter_digest, load_oracle
from test_models_oracle import _greedy_oracle
from tiny_model import make_tiny_model
from tessera.llm import LLM
from tessera.sampling_params import SamplingParams

pytestmark = pytest.mark.model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, rsLoRA, targets)
    "r8": (8, 16, False, ALL),
    "r64": (64, 32, True, ALL),
    "attn": (16, 8, False, ["q_proj", "v_proj"]),
}
PROMPTS = ["def fibonacci(n):\n    ", "The capital of France is", "Translate to German: Good morning",
           # longer than the kernel's row limit: its prompt's updates go through PyTorch's products
           " ".join(f"Step {i}: add {i * 3} to the total." for i in range(14)) + " The total is"]
TOKENS = 32


def _make_adapters(oracle, folder: Path, prompts_ids, store: OracleStore):
    """Save each adapter as PEFT does and return {name: [greedy tokens per prompt]} from the oracle
    with it applied (and "base" without)."""
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(0)
    expected = {"base": store.tokens("greedy", [prompts_ids, TOKENS],
                                     lambda: [_greedy_oracle(oracle, ids, TOKENS) for ids in prompts_ids])}
    for name, (rank, alpha, rs, targets) in ADAPTERS.items():
        model = get_peft_model(oracle, LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rs, target_modules=targets,
                                                  lora_dropout=0.0))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_A" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif "lora_B" in pname:  # each module's update ~0.3x its input's scale: text-like output,
                    scale = alpha / (rank ** 0.5 if rs else rank)  # not noise full of near-ties
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.3 / (scale * rank ** 0.5)))
        model.save_pretrained(str(folder / name))
        model.eval()
        expected[name] = store.tokens("lora-greedy", [prompts_ids, TOKENS, adapter_digest(folder / name)],
                                      lambda: [_greedy_oracle(model, ids, TOKENS) for ids in prompts_ids])
        oracle = model.unload()  # the base again, for the next adapter
    return oracle, expected


@pytest.fixture(scope="module", params=["smollm2-135m", "tiny-qwen2"])
def served(request, model_path, tmp_path_factory):
    """The packaged SmolLM2 (llama) and, for qwen2's biased attention projections, a tiny random
    qwen2 written by transformers (the real qwen2.5-coder-0.5b took 4.5 minutes of the suite)."""
    folder = tmp_path_factory.mktemp(f"lora-{request.param}")
    if request.param.startswith("tiny-"):
        from transformers import AutoModelForCausalLM

        path = make_tiny_model(folder / "model", arch="qwen2", max_positions=1024, std=0.1)
        oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        store = OracleStore(path / "model.safetensors")
    else:
        path = model_path(request.param)
        oracle = load_oracle(path)
        store = OracleStore(path)
    llm = LLM(str(path), dtype="float32", quantization="none", enable_lora=True, max_loras=4, max_lora_rank=64,
              lora_dtype="float32", enable_prefix_caching=True)
    prompts_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    _, expected = _make_adapters(oracle, folder, prompts_ids, store)
    del oracle
    for name in ADAPTERS:  # served from now on, as /v1/load_lora_adapter does
        llm.add_lora(name, str(folder / name))
    yield llm, prompts_ids, expected
    llm.engine.close()


def _greedy(llm, prompts_ids, adapters):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outs = llm.generate(prompts_ids, params, lora=adapters)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_each_adapter_alone_matches_peft(served):
    llm, prompts_ids, expected = served
    for name in ADAPTERS:
        assert expected[name] != expected["base"], f"adapter {name} changes nothing: the test could not fail"
        got = _greedy(llm, prompts_ids, [name] * len(prompts_ids))
        assert got == expected[name], name
    assert _greedy(llm, prompts_ids, [None] * len(prompts_ids)) == expected["base"]


def test_mixed_batch_gives_each_request_its_own_tokens(served):
    llm, prompts_ids, expected = served
    names = ["base", *ADAPTERS]
    batch_ids = [ids for ids in prompts_ids for _ in names]
    adapters = [None if n == "base" else n for _ in prompts_ids for n in names]
    got = _greedy(llm, batch_ids, adapters)
    want = [expected[n][i] for i in range(len(prompts_ids)) for n in names]
    assert got == want
    assert llm.engine.kv.usage() == 0.0  # nothing held once all finished
