"""all-MiniLM-L6-v2 (`tessera pull all-minilm-l6-v2`) against sentence-transformers' own `encode`,
and a real `tessera serve smollm2-135m all-minilm-l6-v2` driven by the official openai and ollama
clients."""
from __future__ import annotations

from typing import Iterator

import httpx
import numpy as np
import openai
import pytest
from server_process import ServerProcess, running_server

from tessera.llm import LLM

pytestmark = pytest.mark.model

MODEL = "all-minilm-l6-v2"
_BASE = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome",
    "The cat sits outside",
    "How do I reset my password?",
    "Paris is the capital of France.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, count(*) FROM users GROUP BY name HAVING count(*) > 1;",
    "Grüße aus München! Ça va? ¿Qué tal? 東京は大きな都市です。",
    "🙂🚀 emoji-only messages 🎉",
    "3.14159 2.71828 1.41421 and 42",
    "URGENT!!! Click here: https://example.com/?a=1&b=2",
    "the",
    "Retrieval-augmented generation finds passages and gives them to a language model as context.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "I can't believe it's not butter.",
    "    leading and trailing whitespace    ",
    "UPPER CASE TEXT SHOULD BE LOWERED BY THE TOKENIZER",
    "naïve café résumé coöperate",
    "line one\nline two\n\nline four",
]
_LONG = ("Continuous batching lets an inference server add new requests to a running batch at every "
         "step, so short requests do not wait behind long ones, and the KV cache is paged in blocks. ")
TEXTS = (_BASE
         + [f"{t} {u}" for t, u in zip(_BASE[:10], _BASE[10:])]  # pairs
         + [_LONG * k for k in (1, 2, 4, 8, 16)]  # 37 .. 590 tokens: the longer ones cut at 256
         + [" ".join(_BASE) * 3, "word " * 1000, "x" * 3000]
         + [f"query {i}: which document mentions item number {i * 7}?" for i in range(12)])
assert len(TEXTS) == 50


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    model_path(MODEL)
    return LLM(MODEL)  # dtype auto: bfloat16 on AVX512-BF16 hosts


@pytest.fixture(scope="module")
def reference(model_path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_path(MODEL)), device="cpu")
    assert st.max_seq_length == 256
    return st.encode(TEXTS, batch_size=16)


def vectors(outputs) -> np.ndarray:
    return np.array([o.embedding for o in outputs], dtype=np.float32)


def test_matches_sentence_transformers(llm, reference):
    outs = llm.embed(TEXTS)
    ours = vectors(outs)
    cos = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cos.min() >= 0.999, (cos.min(), int(cos.argmin()))
    assert max(len(o.prompt_token_ids) for o in outs) == 256  # the long texts were truncated, as ST does
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-4)


def test_batching_invariance(llm):
    text = TEXTS[13]
    alone = vectors(llm.embed([text]))[0]
    batch = TEXTS[:31] + [text]
    together = vectors(llm.embed(batch))[31]
    assert float(alone @ together) >= 0.9995 and np.abs(alone - together).max() < 0.01


# ------------------------------------------------------------------------------ a real server

@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path) -> Iterator[ServerProcess]:
    """`tessera serve smollm2-135m all-minilm-l6-v2`: a chat model and an embedding model in one server."""
    model_path(MODEL)
    with running_server(tmp_path_factory.mktemp("embed-serve") / "server.log", "--kv-cache-memory", "256MiB",
                        model=f"smollm2-135m {MODEL}") as proc:
        yield proc


def test_openai_client_against_the_server(server, reference):
    import base64

    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    r = c.embeddings.create(model=MODEL, input=TEXTS[:8], encoding_format="float")
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert r.model == MODEL and got.shape == (8, 384) and r.usage.prompt_tokens > 0
    assert ((got * reference[:8]).sum(1)).min() >= 0.999
    raw = c.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64").data[0].embedding
    assert np.dot(np.frombuffer(base64.b64decode(raw), dtype="<f4"), reference[0]) >= 0.999
    decoded = c.embeddings.create(model=MODEL, input=[TEXTS[1]])  # the client's default: base64, decoded
    assert np.dot(np.array(decoded.data[0].embedding), reference[1]) >= 0.999
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
        c.embeddings.create(model="smollm2-135m", input="hi")
    chat = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4)
    assert chat.usage.completion_tokens > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'tessera:endpoint_requests_total{{endpoint="/v1/embeddings",model_name="{MODEL}"}}' in metrics


def test_ollama_client_embed(server, reference):
    import ollama

    c = ollama.Client(host=server.url, timeout=300)
    r = c.embed(model=MODEL, input=TEXTS[:3])
    got = np.array(r.embeddings, dtype=np.float32)
    assert r.model == MODEL and got.shape == (3, 384) and r.prompt_eval_count > 0 and r.total_duration > 0
    assert ((got * reference[:3]).sum(1)).min() >= 0.999
    one = c.embeddings(model=MODEL, prompt=TEXTS[0])
    v = np.array(one.embedding)
    assert np.dot(v / np.linalg.norm(v), reference[0]) >= 0.999
    with pytest.raises(ollama.ResponseError) as err:
        c.embed(model="smollm2-135m", input="hi")
    assert err.value.status_code == 400


def test_hostile_bodies_on_the_real_server(server):
    for body in ({"model": MODEL, "input": ""}, {"model": MODEL, "input": ["x"] * 10_000},
                 {"model": MODEL, "input": [[1, 2], [30522]]}, {"model": MODEL, "input": [{"a": 1}]},
                 {"model": MODEL, "input": [-5]}):
        r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text
