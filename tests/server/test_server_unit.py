"""The HTTP server against a scripted engine core: completions and chat, their formats exactly, in seconds.

The real AsyncLLMEngine (its thread, queue bound and abort path) runs over a
small fake LLMEngine whose "model" writes a fixed reply byte by byte, so the
expected text of every request is known exactly. A real uvicorn server runs
in a background thread, so client disconnects are real socket closes (`srv`, http_checks.py).
Error paths are in test_server_errors.py, the other endpoints in test_server_endpoints.py, load,
deadlines and disconnects in test_server_overload.py.
"""
from __future__ import annotations

import time

import pytest
from fakes import MODEL, REPLY
from http_checks import post, scripted_server, sse_events

srv = pytest.fixture(scope="module", name="srv")(scripted_server)  # one server per module


# ----------------------------------------------------------------------------- completions


def test_completion_text_usage_and_ids(srv):
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "Say hi", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and abs(body["created"] - time.time()) < 60
    assert body["choices"] == [{"index": 0, "text": REPLY[:5], "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # the fake engine caches nothing


def test_completion_defaults_to_16_tokens_and_any_served_name(srv):
    body = post(srv, "/v1/completions", {"model": "alias", "prompt": "x", "temperature": 0}).json()
    assert body["choices"][0]["text"] == REPLY[:16] and body["model"] == "alias"
    body = post(srv, "/v1/completions", {"prompt": "x", "temperature": 0, "max_tokens": 100}).json()
    assert body["choices"][0]["text"] == REPLY and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(REPLY) + 1  # the EOS counts


def test_completion_prompt_forms_and_n(srv):
    ids = list(b"abc")
    for prompt, num_prompts, prompt_tokens in [("abc", 1, 3), (["ab", "abcd"], 2, 6), (ids, 1, 3),
                                               ([ids, ids[:1]], 2, 4)]:
        body = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0, "n": 2}).json()
        assert [c["index"] for c in body["choices"]] == list(range(2 * num_prompts))
        assert all(c["text"] == REPLY[:3] for c in body["choices"])
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6 * num_prompts,
                                 "total_tokens": prompt_tokens + 6 * num_prompts,
                                 "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_stop_ignore_eos_and_echo(srv):
    body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 50, "temperature": 0,
                                         "stop": ["fake", "zzz"]}).json()
    assert body["choices"][0]["text"] == "Hello from the "
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", "fake")
    body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 40, "temperature": 0,
                                         "ignore_eos": True}).json()
    assert body["choices"][0]["text"].startswith(REPLY + " ") and body["usage"]["completion_tokens"] == 40
    body = post(srv, "/v1/completions", {"prompt": "Q:", "max_tokens": 2, "temperature": 0, "echo": True}).json()
    assert body["choices"][0]["text"] == "Q:He"


def test_completion_seeded_sampling_is_deterministic(srv):
    req = {"prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3}
    a = [c["text"] for c in post(srv, "/v1/completions", req).json()["choices"]]
    b = [c["text"] for c in post(srv, "/v1/completions", req).json()["choices"]]
    assert a == b and len(set(a)) == 3  # the same per index, different across the n samples


def test_completion_logprobs_format(srv):
    body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e", "l"] and lp["token_logprobs"] == [-1.0, -1.0, -1.0]
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"][0] == {"H": -1.0, "a": -2.0}
    body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1, "temperature": 0, "logprobs": 0}).json()
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"H": -1.0}]  # the sampled token is always there


def test_completion_stream_sse_format(srv):
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0, "stream": True, "n": 2,
                                      "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and "usage" in c for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == REPLY[:4]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_key(srv):
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True,
                                      "logprobs": 1})
    chunks = sse_events(r)[:-1]
    assert all("usage" not in c for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == ["H", "e", "l"] and offsets == [0, 1, 2]


# ----------------------------------------------------------------------------- chat


def test_chat_completion(srv):
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_completion_tokens": 5,
                                           "max_tokens": 1,
                                           "messages": [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY[:5]}
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["logprobs"] is None
    prompt = len("<|system|>Be brief.\n<|user|>Hi\n<|assistant|>")
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_without_max_tokens_runs_to_eos(srv):
    body = post(srv, "/v1/chat/completions", {"temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
    assert body.json()["choices"][0]["message"]["content"] == REPLY


def test_chat_logprobs_format(srv):
    body = post(srv, "/v1/chat/completions", {"temperature": 0, "max_tokens": 2, "logprobs": True,
                                              "top_logprobs": 2, "messages": [{"role": "user", "content": "Hi"}]})
    content = body.json()["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "H", "logprob": -1.0, "bytes": [72],
                          "top_logprobs": [{"token": "H", "logprob": -1.0, "bytes": [72]},
                                           {"token": "a", "logprob": -2.0, "bytes": [97]}]}
    assert [c["token"] for c in content] == ["H", "e"]
    body = post(srv, "/v1/chat/completions", {"temperature": 0, "max_tokens": 1, "logprobs": True,
                                              "messages": [{"role": "user", "content": "Hi"}]})
    assert body.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_chat_stream_role_first_then_content_then_finish(srv):
    r = post(srv, "/v1/chat/completions", {"temperature": 0, "max_tokens": 3, "stream": True, "n": 2,
                                           "stream_options": {"include_usage": True},
                                           "messages": [{"role": "user", "content": "Hi"}]})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert [c["delta"] for c in mine[1:-1]] == [{"content": ch} for ch in REPLY[:3]]
        assert all(c["finish_reason"] is None for c in mine[:-1])
