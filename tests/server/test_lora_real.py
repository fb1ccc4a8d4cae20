"""LoRA adapters through a real `tessera serve` of smollm2-135m and the official openai client:
an adapter served from start-up, one loaded and unloaded at run time, the answers each gives,
and the lora_requests_info gauge. The adapters are PEFT folders written here for the model's
shapes: one whose B is zero (the base's answer exactly) and one random (another answer)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

from server_process import MODEL, running_server
from tessera.models.info import load_model_info
from tessera.models.registry import ensure_model

pytestmark = pytest.mark.model

PROMPT = [{"role": "user", "content": "Name three colours."}]


def write_adapter(folder: Path, hidden: int, q_out: int, v_out: int, layers: int, scale: float, seed: int) -> Path:
    """A PEFT folder adapting every layer's q_proj and v_proj; `scale` 0 makes B zero."""
    folder.mkdir(parents=True)
    rank, rng = 8, np.random.default_rng(seed)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    tensors = {}
    for layer in range(layers):
        for proj, out in (("q_proj", q_out), ("v_proj", v_out)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) / hidden ** 0.5).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, rank)) * scale).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    config, _ = load_model_info(ensure_model(MODEL))
    root = tmp_path_factory.mktemp("adapters")
    shapes = dict(hidden=config.hidden_size, q_out=config.num_heads * config.head_dim,
                  v_out=config.num_kv_heads * config.head_dim, layers=config.num_layers)
    return {"zero": write_adapter(root / "zero", scale=0.0, seed=1, **shapes),
            "loud": write_adapter(root / "loud", scale=0.5, seed=2, **shapes)}


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    # Unrounded activations: rounded to int8, a last-bit difference between the adapter rows' path
    # and the base rows' moves a code, and 16 greedy tokens of the zero adapter drift from the base's
    # (seen on an AVX2-only host).
    with running_server(log, "--lora-modules", f"zero={adapters['zero']}", "--max-loras", "2",
                        "--no-int8-activations") as proc:
        yield proc.url


def answer(client: openai.OpenAI, model: str) -> tuple[str, str]:
    r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=16, temperature=0)
    return r.model, r.choices[0].message.content


def test_adapters_answer_through_every_route_of_a_real_server(server, adapters):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    base = answer(client, MODEL)[1]
    assert answer(client, "zero") == ("zero", base)  # B = 0: the base's answer, through the adapter path
    assert {m.id: getattr(m, "parent", None) for m in client.models.list().data}["zero"] == MODEL

    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "loud", "lora_path": str(adapters["loud"])})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'loud' added successfully.")
    model, loud = answer(client, "loud")
    assert model == "loud" and loud != base
    assert answer(client, "zero")[1] == base and answer(client, MODEL)[1] == base  # nothing leaked between them
    metrics = httpx.get(f"{server}/metrics").text
    assert 'tessera:lora_requests_info{' in metrics and 'max_lora="2"' in metrics

    assert httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "loud"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        answer(client, "loud")
