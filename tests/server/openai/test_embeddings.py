"""Embeddings on tiny random models: a BERT in sentence-transformers' layout (sentence-transformers
itself is the oracle) and a llama decoder embedding with --pooling; the engine path (pooling
requests scheduled whole, no KV kept), and /v1/embeddings, /api/embed and /api/embeddings over
a two-model router, including hostile bodies."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
from fakes import serve_in_thread
from tiny_model import make_tiny_bert, make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.metrics import MetricFamilies, PrometheusStatLogger
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.server.app import create_app
from tessera.server.model_router import ModelRouter
from tessera.server.served_model import ModelSpec, ServedModel

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "paged attention stores keys and values in blocks " * 6,  # past max_seq_length (24): truncated
    "café naïve über",
    "continuous batching serves many requests at once",
    "a",
]


def embed_all(engine: LLMEngine, inputs, pooling: PoolingParams = PoolingParams()) -> list[list[float]]:
    for i, x in enumerate(inputs):
        engine.add_prepared(engine.prepare_request(f"e{i}", x, SamplingParams(), pooling=pooling))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.scheduler.kv.usage() == 0  # nothing kept after the requests
    return [done[f"e{i}"].embedding for i in range(len(inputs))]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "bert")


@pytest.fixture(scope="module")
def bert(bert_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(bert_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64))


def cosines(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32),
                                                 torch.as_tensor(b, dtype=torch.float32))


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_bert_matches_sentence_transformers(tmp_path, pooling):
    from sentence_transformers import SentenceTransformer

    folder = make_tiny_bert(tmp_path / pooling, pooling=pooling)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64))
    ours = embed_all(engine, TEXTS)
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    assert cosines(ours, ref).min() > 0.99999
    assert np.allclose(np.linalg.norm(np.array(ours), axis=1), 1.0, atol=1e-5)
    # Truncated at sentence_bert_config's max_seq_length, [SEP] kept, as sentence-transformers does.
    ids = engine.inputs.process("x", TEXTS[2], SamplingParams(), pooling=PoolingParams()).prompt_token_ids
    assert len(ids) == 24 and ids[-1] == engine.tokenizer.backend.token_to_id("[SEP]")


def test_bfloat16_encoder(bert_dir):
    """bfloat16 (the fused oneDNN products: bias, GELU, residual add) stays with sentence-transformers'
    float32, and a mixed-length batch agrees with each input alone."""
    from sentence_transformers import SentenceTransformer

    engine = LLMEngine(EngineConfig(model=str(bert_dir), dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=64))
    together = embed_all(engine, TEXTS)
    ref = SentenceTransformer(str(bert_dir), device="cpu").encode(TEXTS)
    assert cosines(together, ref).min() > 0.999
    alone = [embed_all(engine, [t])[0] for t in TEXTS]
    assert cosines(together, alone).min() > 0.999


def test_batch_invariance_and_token_ids(bert):
    alone = embed_all(bert, [TEXTS[0]])[0]
    batch = embed_all(bert, [TEXTS[0]] + TEXTS * 2)  # 13 inputs: several steps of 64 tokens
    assert all(cosines([alone], [batch[i]]).item() > 0.99999 for i in (0, 1, 7))
    ids = bert.tokenizer.encode(TEXTS[0])
    assert cosines(embed_all(bert, [ids]), [alone]).item() > 0.99999


def test_pooling_requests_are_never_chunked(tmp_path):
    """An input is computed whole in one step; one over the step's token budget is refused with
    the budget named, never split."""
    folder = make_tiny_bert(tmp_path / "long", max_seq_length=128)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64))
    steps = []
    execute = engine.runner.execute

    def recording(out):
        steps.append([(c.request_id, c.start, c.num_new_tokens, c.samples) for c in out.scheduled])
        return execute(out)

    engine.runner.execute = recording
    embed_all(engine, [[5] * 30, [5] * 60, [5] * 20])
    assert steps == [[("e0", 0, 30, False)], [("e1", 0, 60, False)], [("e2", 0, 20, False)]]
    with pytest.raises(InvalidRequestError, match="max-num-batched-tokens"):
        engine.prepare_request("c", [5] * 65, SamplingParams(), pooling=PoolingParams())


def test_task_checks(bert, tiny_llama):
    with pytest.raises(InvalidRequestError, match="is an embedding model"):
        bert.prepare_request("g", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="does not serve embeddings"):
        tiny_llama.prepare_request("e", "hello", SamplingParams(), pooling=PoolingParams())
    with pytest.raises(InvalidRequestError, match="matryoshka"):
        bert.prepare_request("d", "hello", SamplingParams(), pooling=PoolingParams(dimensions=8))
    # Token ids are not truncated: past max_seq_length (24) they are refused, as is a text with truncate off.
    with pytest.raises(InvalidRequestError, match=r"is 24 tokens \(the model's maximum input length\)"):
        bert.prepare_request("t", [5] * 30, SamplingParams(), pooling=PoolingParams())
    with pytest.raises(InvalidRequestError, match="maximum input length"):
        bert.prepare_request("u", TEXTS[2], SamplingParams(), pooling=PoolingParams(truncate=False))


def test_matryoshka_dimensions(tmp_path):
    folder = make_tiny_bert(tmp_path / "m", matryoshka=True)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64))
    full, short = embed_all(engine, [TEXTS[0]])[0], embed_all(engine, [TEXTS[0]], PoolingParams(dimensions=16))[0]
    assert len(short) == 16 and abs(np.linalg.norm(short) - 1) < 1e-5
    assert cosines([short], [full[:16]]).item() > 0.99999  # the prefix, renormalised


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "llama")


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, max_num_seqs=4,
                                  kv_cache_memory=1 << 20))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_embeds_with_pooling(tiny_llama_dir, pooling):
    """A decoder with --pooling: its final (normed) hidden states pooled, as Hugging Face's model
    gives them; it still generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, max_num_seqs=4,
                                    kv_cache_memory=1 << 20, pooling=pooling))
    ours = embed_all(engine, TEXTS[:3])
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    refs = []
    for text in TEXTS[:3]:
        with torch.no_grad():
            h = hf(**tok(text, return_tensors="pt"), output_hidden_states=True).hidden_states[-1][0]
        refs.append(torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0))
    assert cosines(ours, torch.stack(refs)).min() > 0.9999
    engine.add_request("g", "hello", SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[0].outputs[0].token_ids) == 3


# ---------------------------------------------------------------------------------------- the API

class Served:
    def __init__(self, url: str, app) -> None:
        self.url = url
        self.state = app.state.tessera
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    def post(self, path: str, body) -> httpx.Response:
        kwargs = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
        return httpx.post(f"{self.url}{path}", timeout=60, **kwargs)


@pytest.fixture(scope="module")
def served(bert_dir, tiny_llama_dir) -> Iterator[Served]:
    from tessera.models.loader import load_model

    engines = []
    families = MetricFamilies()
    models = []
    for name, folder, extra in (("bert", bert_dir, dict(max_num_batched_tokens=64)),
                                ("llama", tiny_llama_dir, dict(max_model_len=256, kv_cache_memory=1 << 20))):
        config = EngineConfig(model=str(folder), dtype="float32", max_num_seqs=8, **extra)
        engine = AsyncLLMEngine(config, engine=LLMEngine(config, loaded=load_model(folder, "float32")),
                                max_num_queued_requests=16)
        engines.append(engine)
        model = ServedModel(ModelSpec(name, str(folder)), engine)
        model.metrics = PrometheusStatLogger(name, families=families)
        models.append(model)
    try:
        app = create_app(router=ModelRouter(models), metrics=families)
        with serve_in_thread(app) as url:
            yield Served(url, app)
    finally:
        for engine in engines:
            engine.shutdown()


def test_openai_client_float_and_base64(served, bert):
    ref = embed_all(bert, TEXTS[:3])
    for fmt in ("float", "base64", None):  # None: the client asks for base64 and decodes it itself
        kw = {} if fmt is None else {"encoding_format": fmt}
        r = served.client.embeddings.create(model="bert", input=TEXTS[:3], **kw)
        assert [d.index for d in r.data] == [0, 1, 2] and r.model == "bert"
        got = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() if fmt == "base64"
               else d.embedding for d in r.data]
        assert cosines(got, ref).min() > 0.99999
        assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    raw = served.post("/v1/embeddings", {"model": "bert", "input": "hello world", "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding" and vector.shape == (64,)
    ids = served.client.embeddings.create(model="bert", input=[bert.tokenizer.encode(TEXTS[0])])
    assert cosines([ids.data[0].embedding], ref[:1]).item() > 0.99999


def test_task_errors_are_400(served):
    chat = served.post("/v1/chat/completions", {"model": "bert", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "embedding model" in chat.json()["error"]["message"]
    emb = served.post("/v1/embeddings", {"model": "llama", "input": "hi"})
    assert emb.status_code == 400 and "--pooling" in emb.json()["error"]["message"]
    done = served.client.completions.create(model="llama", prompt="hello", max_tokens=2)  # the other still generates
    assert done.usage.completion_tokens == 2


@pytest.mark.parametrize("body", [
    {"model": "bert", "input": ""},
    {"model": "bert", "input": []},
    {"model": "bert", "input": [[]]},
    {"model": "bert", "input": ["ok", ""]},
    {"model": "bert", "input": ["x"] * 10_000},
    {"model": "bert", "input": 5},
    {"model": "bert", "input": {"text": "x"}},
    {"model": "bert", "input": [1, "a"]},
    {"model": "bert", "input": [1.5]},
    {"model": "bert", "input": [True]},
    {"model": "bert", "input": [-1]},
    {"model": "bert", "input": [10**9]},
    {"model": "bert", "input": [2**70]},
    {"model": "bert", "input": [[1, 2], [10**6]]},
    {"model": "bert", "input": "x", "encoding_format": "hex"},
    {"model": "bert", "input": "x", "dimensions": 8},
    {"model": "bert", "input": "x", "dimensions": "8"},
    {"model": "bert", "input": [5] * 500},
    {"input": None},
    "not json",
    "[1, 2]",
])
def test_hostile_bodies_are_4xx_in_openai_shape(served, body):
    r = served.post("/v1/embeddings", body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"


def test_unknown_model_is_404(served):
    r = served.post("/v1/embeddings", {"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_queue_bound_is_checked_once_per_request(served):
    """A batch larger than the queue bound (16) is one API request: admitted while the queue has room."""
    r = served.post("/v1/embeddings", {"model": "bert", "input": TEXTS * 10})
    assert r.status_code == 200 and len(r.json()["data"]) == 60


def test_full_queue_is_429_and_deadline_applies(served):
    engine = served.state.router.resolve("bert").engine
    engine.max_num_queued_requests = 0  # the queue counts as full
    try:
        r = served.post("/v1/embeddings", {"model": "bert", "input": "hello"})
        assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
        old = served.post("/api/embed", {"model": "bert", "input": "hello"})
        assert old.status_code == 429 and set(old.json()) == {"error"}
    finally:
        engine.max_num_queued_requests = 16
    served.state.request_timeout = 1e-6  # past before the engine can answer: refused by forecast, or timed out
    try:
        r = served.post("/v1/embeddings", {"model": "bert", "input": "hello"})
        assert r.status_code in (429, 504) and r.json()["error"]["message"], r.text
    finally:
        served.state.request_timeout = None


def test_ollama_routes(served, bert):
    ref = embed_all(bert, TEXTS[:2])
    r = served.post("/api/embed", {"model": "bert", "input": TEXTS[:2]})
    body = r.json()
    assert r.status_code == 200 and body["model"] == "bert" and len(body["embeddings"]) == 2
    assert cosines(body["embeddings"], ref).min() > 0.99999
    assert body["prompt_eval_count"] > 0 and body["total_duration"] > 0 and "load_duration" in body
    one = served.post("/api/embed", {"model": "bert", "input": TEXTS[0]}).json()
    assert len(one["embeddings"]) == 1
    old = served.post("/api/embeddings", {"model": "bert", "prompt": TEXTS[0]}).json()
    assert cosines([old["embedding"]], ref[:1]).item() > 0.99999  # not normalised, same direction
    assert served.post("/api/embeddings", {"model": "bert", "prompt": ""}).json() == {"embedding": []}
    long = served.post("/api/embed", {"model": "bert", "input": TEXTS[2], "truncate": False})
    assert long.status_code == 400 and "error" in long.json()
    for bad, status in (({"model": "bert", "input": 5}, 400), ({"model": "nope", "input": "x"}, 404),
                        ({"model": "llama", "input": "x"}, 400), ({"input": "x"}, 400), ("{", 400)):
        r = served.post("/api/embed", bad)
        assert r.status_code == status and set(r.json()) == {"error"}, r.text


def test_metrics_have_the_endpoint(served):
    served.post("/api/embed", {"model": "bert", "input": "hello"})
    served.post("/v1/embeddings", {"model": "bert", "input": "hello"})
    text = httpx.get(f"{served.url}/metrics").text
    assert 'tessera:endpoint_requests_total{endpoint="/v1/embeddings",model_name="bert"}' in text
    assert 'tessera:endpoint_requests_total{endpoint="/api/embed",model_name="bert"}' in text
