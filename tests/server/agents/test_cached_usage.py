"""Prefix-cache hits in every API's usage, through the real server (uvicorn over the tiny model's
engine) and the official clients: the same prompt sent twice reports nothing cached the first
time and, the second, its full KV blocks but the one holding its last token (which is always
recomputed), in each protocol's own field, whole and streamed:

- OpenAI chat and completions: `usage.prompt_tokens_details.cached_tokens` (in the stream, the
  usage chunk that `stream_options.include_usage` asks for), within `prompt_tokens`;
- Responses: `usage.input_tokens_details.cached_tokens`, in the response and in
  `response.completed`;
- Messages: `usage.cache_read_input_tokens` beside `input_tokens`, the rest of the prompt
  (Anthropic's split), in the message, `message_start` and `message_delta`;
- Ollama: `prompt_eval_cached_count` beside `prompt_eval_count`, the whole prompt (read over
  HTTP: the `ollama` client's models drop the field it does not know).

Each test starts its prompt with its own word, so its first call shares no block with another
test's prompts (the chat template's opening is shorter than a block).
"""
from __future__ import annotations

import json
import re
from typing import Iterator

import httpx
import pytest
from agent_server import NAME, anthropic_client, openai_client, tiny_engine, wait_idle
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.metrics import MetricFamilies, PrometheusStatLogger
from tessera.server.app import create_app
from tessera.server.openai.response_models import UsageInfo

BLOCK = EngineConfig.block_size  # the tiny server's engine keeps the default
TEXT = " prefix caching reuses the blocks of shared prompts." * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """agent_server's tiny server, its engine's stats also going to /metrics."""
    families = MetricFamilies()
    engine = tiny_engine(make_tiny_model(tmp_path_factory.mktemp("tiny-usage") / "llama", max_positions=1024))
    engine.stat_loggers.append(PrometheusStatLogger(NAME, families=families))
    try:
        with serve_in_thread(create_app(engine, [NAME], metrics=families)) as url:
            yield url
    finally:
        engine.shutdown()


oai = pytest.fixture(scope="module", name="oai")(openai_client)
claude = pytest.fixture(scope="module", name="claude")(anthropic_client)


def hit(prompt_tokens: int) -> int:
    """What a repeated prompt finds: the full blocks before its last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def twice(send, server):
    """`send()`'s (prompt tokens, cached tokens) on a cold and then a warm prefix cache."""
    cold, warm = send(), send()
    wait_idle(server)
    assert cold[0] == warm[0] > 2 * BLOCK
    assert cold[1] == 0
    assert warm[1] == hit(warm[0]) > 0 and warm[1] % BLOCK == 0
    return cold, warm


# ----------------------------------------------------------------------------- OpenAI


def test_chat_completions(server, oai):
    def send():
        r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "alpha" + TEXT}],
                                        max_tokens=4, temperature=0)
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
    twice(send, server)


def test_chat_completions_stream(server, oai):
    def send():
        chunks = list(oai.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "bravo" + TEXT}], max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        assert all(c.usage is None for c in chunks[:-1])
        return chunks[-1].usage.prompt_tokens, chunks[-1].usage.prompt_tokens_details.cached_tokens
    twice(send, server)


def test_completions_whole_and_streamed(server, oai):
    def whole():
        r = oai.completions.create(model=NAME, prompt="charlie" + TEXT, max_tokens=4, temperature=0)
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    def streamed():
        chunks = list(oai.completions.create(model=NAME, prompt="delta" + TEXT, max_tokens=4, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
        return chunks[-1].usage.prompt_tokens, chunks[-1].usage.prompt_tokens_details.cached_tokens
    twice(whole, server)
    twice(streamed, server)


def test_usage_without_details_leaves_them_out():
    """An embedding's usage (no cache consulted) stays OpenAI's two counts."""
    assert UsageInfo(prompt_tokens=3, total_tokens=3).model_dump() == \
        {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


# ----------------------------------------------------------------------------- Responses


def test_responses_whole_and_streamed(server, oai):
    def whole():
        r = oai.responses.create(model=NAME, input="foxtrot" + TEXT, max_output_tokens=4, temperature=0)
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        return r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens

    def streamed():
        events = list(oai.responses.create(model=NAME, input="golf" + TEXT, max_output_tokens=4, temperature=0,
                                           stream=True))
        final = events[-1]
        assert final.type in ("response.completed", "response.incomplete")
        return final.response.usage.input_tokens, final.response.usage.input_tokens_details.cached_tokens
    twice(whole, server)
    twice(streamed, server)


# ----------------------------------------------------------------------------- Messages


def test_messages(server, claude):
    def send():
        m = claude.messages.create(model=NAME, max_tokens=4,
                                   messages=[{"role": "user", "content": "hotel" + TEXT}])
        u = m.usage
        assert u.cache_creation_input_tokens == 0
        return u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens
    (prompt, _), _ = twice(send, server)
    counted = claude.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": "hotel" + TEXT}])
    assert counted.input_tokens == prompt  # the whole prompt, whatever the cache holds


def test_messages_stream(server, claude):
    """message_start already splits the prompt (its first token came before the stream started);
    message_delta says the same, and the client's accumulated message agrees."""
    def send():
        events = list(claude.messages.create(model=NAME, max_tokens=4, stream=True,
                                             messages=[{"role": "user", "content": "india" + TEXT}]))
        start, delta = events[0], [e for e in events if e.type == "message_delta"][-1]
        assert start.type == "message_start"
        s, d = start.message.usage, delta.usage
        assert (s.input_tokens, s.cache_read_input_tokens, s.cache_creation_input_tokens) == \
            (d.input_tokens, d.cache_read_input_tokens, d.cache_creation_input_tokens)
        assert d.cache_creation_input_tokens == 0
        return d.input_tokens + d.cache_read_input_tokens, d.cache_read_input_tokens
    twice(send, server)
    with claude.messages.stream(model=NAME, max_tokens=4,
                                messages=[{"role": "user", "content": "india" + TEXT}]) as stream:
        usage = stream.get_final_message().usage
    assert usage.cache_read_input_tokens == hit(usage.input_tokens + usage.cache_read_input_tokens) > 0


# ----------------------------------------------------------------------------- Ollama


@pytest.mark.parametrize("kind", ["chat", "generate"])
@pytest.mark.parametrize("stream", [False, True])
def test_ollama(server, kind, stream):
    word = f"{kind}{'stream' if stream else 'whole'}"
    body = {"model": NAME, "stream": stream, "options": {"temperature": 0, "num_predict": 4}}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": word + TEXT}]
    else:
        body["prompt"] = word + TEXT

    def send():
        r = httpx.post(f"{server}/api/{kind}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        final = [json.loads(line) for line in r.text.splitlines() if line.strip()][-1]
        assert final["done"] is True
        return final["prompt_eval_count"], final["prompt_eval_cached_count"]
    twice(send, server)


def test_ollama_client_still_reads_the_whole_prompt(server):
    """The `ollama` client sees `prompt_eval_count` as the whole prompt on a cache hit too."""
    import ollama

    client = ollama.Client(host=server, timeout=60)
    counts = [client.generate(model=NAME, prompt="juliett" + TEXT, options={"temperature": 0, "num_predict": 2})
              .prompt_eval_count for _ in range(2)]
    assert counts[0] == counts[1] > 2 * BLOCK


# ----------------------------------------------------------------------------- metrics


def test_metrics_count_the_hits(server, oai):
    """tessera:prefix_cache_hits_total grows by what a request's usage says it found."""
    def hits() -> float:
        text = httpx.get(f"{server}/metrics").text
        return sum(float(m.group(1)) for m in re.finditer(r"^tessera:prefix_cache_hits_total\{[^}]*\} (\S+)$",
                                                           text, re.M))
    prompt = "kilo" + TEXT
    oai.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    wait_idle(server)
    before = hits()
    r = oai.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    wait_idle(server)
    assert hits() - before == r.usage.prompt_tokens_details.cached_tokens == hit(r.usage.prompt_tokens)
