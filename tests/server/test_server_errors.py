"""The HTTP server's error paths against a scripted engine core: malformed and mistyped bodies,
values out of range, unknown models, fields and routes, and an engine error: each a 4xx or 500 in
OpenAI's error shape, with the server still up."""
from __future__ import annotations

import httpx
import pytest
from http_checks import assert_error, post, scripted_server

srv = pytest.fixture(scope="module", name="srv")(scripted_server)  # one server per module


@pytest.mark.parametrize("content,needle", [(b"{not json", "not valid JSON"), (b"", "not valid JSON"),
                                            (b"[1, 2]", "JSON object"), (b'"text"', "JSON object")])
def test_malformed_body_is_400(srv, content, needle):
    r = httpx.post(f"{srv.url}/v1/completions", content=content, headers={"content-type": "application/json"})
    err = assert_error(r, 400, needle)
    assert err["type"] == "invalid_request_error"


def test_json_body_is_read_whatever_the_content_type(srv):
    r = httpx.post(f"{srv.url}/v1/completions", content=b'{"prompt": "x", "max_tokens": 2, "temperature": 0}',
                   headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "He"


@pytest.mark.parametrize("body,param", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "stream": "maybe"}, "stream"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options"),
    ({}, "prompt"),
])
def test_wrong_types_are_400_with_param(srv, body, param):
    assert_error(post(srv, "/v1/completions", body), 400, param=param)


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n must be"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": ["a", ""]}, "empty"),
    ({"prompt": [[]]}, "empty"),
    ({"prompt": [1, 99999]}, "token ids"),
    ({"prompt": "x", "max_tokens": 100000}, "context length"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
])
def test_out_of_range_values_are_400(srv, body, needle):
    err = assert_error(post(srv, "/v1/completions", body), 400, needle)
    assert err["type"] == "invalid_request_error"


def test_range_error_names_its_param(srv):
    assert_error(post(srv, "/v1/completions", {"prompt": "x", "top_p": 2}), 400, "top_p", param="top_p")


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "does not take images"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "'text' field"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "content must be"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "chat template"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"messages": [{"content": "hi"}]}, "role"),
])
def test_bad_chat_requests_are_400(srv, body, needle):
    assert_error(post(srv, "/v1/chat/completions", body), 400, needle)


def test_unknown_model_is_404(srv):
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        err = assert_error(post(srv, path, {**body, "model": "gpt-9"}), 404, param="model")
        assert err["message"] == "The model `gpt-9` does not exist." and err["code"] == "model_not_found"


def test_unknown_fields_are_ignored(srv):
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0, "best_of": 3,
                                      "logit_bias": {"1": 2}, "suffix": "?", "frobnicate": [1]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "He"


def test_unknown_route_and_method_are_openai_errors(srv):
    assert_error(httpx.get(f"{srv.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{srv.url}/v1/completions"), 405)


def test_unexpected_engine_error_is_500_and_server_stays_up(srv):
    err = assert_error(post(srv, "/v1/completions", {"prompt": "raise a bug"}), 500, "a bug in the engine")
    assert err["type"] == "server_error"
    r = post(srv, "/v1/completions", {"prompt": "raise a bug", "stream": True})
    assert_error(r, 500)
    assert post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200
