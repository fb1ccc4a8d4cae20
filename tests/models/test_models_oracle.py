"""The packaged models against Hugging Face transformers as an oracle.

transformers loads the same GGUF file (dequantized, computing in float32) and
must agree with Tessera on the last-position logits of several prompts, and on
32 greedy tokens. Tessera decodes incrementally through its paged KV cache, so
the cache path is checked too, not just one full forward.

Tolerances (max |difference| of last-position logits, logits range about +-30):
- float32: 1e-3. Same weights and precision; measured differences are 2e-5..3e-5
  (up to 1.2e-4 on other prompts), from summation order alone.
- bfloat16: 1.0 (and the top-1 token must be among the oracle's top 5). Weights and
  activations keep 8 mantissa bits; measured differences are 0.19..0.40.
A 700-token prompt checks positions past Gemma's 512-token sliding window, whose
layer pattern and local RoPE base a GGUF file does not record.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from oracle_store import OracleStore, load_oracle
from tessera.attention import get_backend
from tessera.models.loader import LoadedModel, forward_single, load_model

pytestmark = pytest.mark.model

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "Translate to German: Good morning, how are you?",
]
F32_ATOL = 1e-3
BF16_ATOL = 1.0
GREEDY_TOKENS = 32


@pytest.fixture(scope="module", params=MODELS)
def models(request, model_path):
    path = model_path(request.param)
    yield (request.param, OracleModel(path), load_model(path, "float32", quantization="none"),
           load_model(path, "bfloat16", quantization="none"))


class OracleModel:
    """The oracle of one model file, with what it computed kept (tests/oracle_store.py): the
    float32 and bfloat16 tests ask for the same prompts' logits, the float32 and file-weights tests
    for the same greedy continuations, and later runs for all of them again. transformers' model is
    loaded only when something is not kept yet."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.store = OracleStore(path)
        self._model = None

    @property
    def model(self):
        if self._model is None:
            self._model = load_oracle(self.path)
        return self._model

    def last_logits(self, ids: list[int]) -> torch.Tensor:
        def compute() -> torch.Tensor:
            with torch.no_grad():
                return self.model(torch.tensor([ids])).logits[0, -1].float()
        return self.store.tensor("last-logits", ids, compute)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        return self.store.tokens("greedy", [[ids], n], lambda: [_greedy_oracle(self.model, ids, n)])[0]


LONG_PROMPT = " ".join(
    f"Item {i}: the {['red', 'green', 'blue', 'old', 'new'][i % 5]} box holds {i * 7 % 13} coins." for i in range(60)
) + " The box with the most coins is"


def test_last_logits_float32(models):
    name, oracle, f32, _ = models
    worst = 0.0
    for prompt in PROMPTS:
        ids = f32.tokenizer.encode(prompt)
        ref = oracle.last_logits(ids)
        ours = forward_single(f32, ids)[-1]
        worst = max(worst, (ours - ref).abs().max().item())
        assert ours.argmax() == ref.argmax()
    print(f"\n{name} float32 max |logit diff| = {worst:.2e}")
    assert worst < F32_ATOL


def test_last_logits_bfloat16(models):
    name, oracle, _, bf16 = models
    worst = 0.0
    for prompt in PROMPTS:
        ids = bf16.tokenizer.encode(prompt)
        ref = oracle.last_logits(ids)
        ours = forward_single(bf16, ids)[-1]
        worst = max(worst, (ours - ref).abs().max().item())
        assert ours.argmax().item() in ref.topk(5).indices.tolist()
    print(f"\n{name} bfloat16 max |logit diff| = {worst:.2e}")
    assert worst < BF16_ATOL


def test_long_prompt_float32(models):
    name, oracle, f32, _ = models
    ids = f32.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 600
    diff = (forward_single(f32, ids)[-1] - oracle.last_logits(ids)).abs().max().item()
    print(f"\n{name} float32 {len(ids)}-token prompt max |logit diff| = {diff:.2e}")
    assert diff < F32_ATOL


def _greedy_oracle(oracle, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        result = oracle(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = oracle(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return out


@torch.inference_mode()
def _greedy_tessera(loaded: LoadedModel, ids: list[int], n: int, block_size: int = 16) -> list[int]:
    """Prefill, then one decode step per token through the paged KV cache."""
    c = loaded.config
    num_blocks = math.ceil((len(ids) + n) / block_size)
    backend = get_backend("sdpa")
    caches = backend.allocate(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, loaded.dtype)
    blocks = list(reversed(range(num_blocks)))  # non-contiguous order on purpose
    tokens, out = list(ids), []
    meta = backend.build_metadata([len(ids)], [len(ids)], [blocks], block_size)
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
    for _ in range(n):
        token = int(loaded.model.compute_logits(hidden[-1:]).argmax())
        out.append(token)
        tokens.append(token)
        pos = len(tokens) - 1
        meta = backend.build_metadata([1], [len(tokens)], [blocks], block_size)
        hidden = loaded.model(torch.tensor([token]), torch.tensor([pos]), caches, meta)
    return out


def test_greedy_continuation_float32(models):
    name, oracle, f32, _ = models
    for prompt in PROMPTS[:2]:
        ids = f32.tokenizer.encode(prompt)
        ours = _greedy_tessera(f32, ids, GREEDY_TOKENS)
        assert ours == oracle.greedy(ids, GREEDY_TOKENS), f"{name}: {f32.tokenizer.decode(ours)!r}"


def test_the_files_quantized_weights_are_the_oracles(models, model_path):
    """--quantization auto keeps the file's weights (int4 and int8 groups taken over, nothing
    rounded twice), so in float32 without int8 activations (which round what K-quant weights
    multiply) it is the dequantized model: same greedy tokens as the oracle."""
    name, oracle, _, _ = models
    auto = load_model(model_path(name), "float32", quantization="auto", int8_activations=False)
    for prompt in PROMPTS:
        ids = auto.tokenizer.encode(prompt)
        ours = _greedy_tessera(auto, ids, 24)
        assert ours == oracle.greedy(ids, 24), f"{name}: {auto.tokenizer.decode(ours)!r}"
