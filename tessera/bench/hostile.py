"""`tessera bench hostile`: throw malformed and abusive requests at a server, count what breaks.

A server that holds under load must also hold under bad input: every answer to a hostile body
is a 4xx in OpenAI's error shape (`{"error": {"message", "type", ...}}`), never a 5xx, a hang or
a dropped connection, and the server still serves a normal request afterwards. The corpus
covers what clients get wrong and what attackers try: absurd numbers (huge, negative, NaN,
infinite), wrong types, unknown fields, deep nesting, invalid UTF-8, empty and oversized bodies,
10 MB prompts, thousands of stop strings or messages, logit_bias abuse, n = 10,000, bad tool and
schema definitions, hostile images (bench/hostile_images.py). The tests run it against the
tiny model in CI; this command runs it against any server
(`tessera bench hostile --base-url http://127.0.0.1:8000 --model smollm2-135m`).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tessera.errors import TesseraError

_BIG = 10**12


@dataclass
class HostileCase:
    name: str
    path: str
    body: bytes
    method: str = "POST"
    content_type: str = "application/json"


@dataclass
class HostileResult:
    name: str
    status: int  # 0 = no HTTP answer (connection dropped or timed out)
    openai_error: bool  # a 4xx/5xx body in OpenAI's error shape
    seconds: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        """A 2xx, or a 4xx with an OpenAI-style body; never a 5xx or no answer."""
        return 200 <= self.status < 300 or (400 <= self.status < 500 and self.openai_error)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"


def hostile_cases(model: str) -> list[HostileCase]:
    """The corpus, for a server that serves `model`: bad values for completions, then for chat,
    then bodies that are not JSON objects and requests on the wrong method or path."""
    cases = _completion_cases(model) + _chat_cases(model) + _image_cases(model)
    return [HostileCase(name, path, _json(body)) for name, path, body in cases] + _raw_cases(model)


def _completion_cases(model: str) -> list[tuple[str, str, Any]]:
    cmpl = _COMPLETIONS
    base = {"model": model, "prompt": "hello", "max_tokens": 4}
    return [
        ("max_tokens huge", cmpl, {**base, "max_tokens": _BIG}),
        ("max_tokens negative", cmpl, {**base, "max_tokens": -5}),
        ("max_tokens zero", cmpl, {**base, "max_tokens": 0}),
        ("max_tokens string", cmpl, {**base, "max_tokens": "4"}),
        ("max_tokens float", cmpl, {**base, "max_tokens": 4.5}),
        ("max_tokens 2^70", cmpl, {**base, "max_tokens": 2**70}),
        ("temperature NaN", cmpl, {**base, "temperature": float("nan")}),
        ("temperature inf", cmpl, {**base, "temperature": float("inf")}),
        ("temperature -inf", cmpl, {**base, "temperature": float("-inf")}),
        ("temperature negative", cmpl, {**base, "temperature": -1}),
        ("temperature 1e308", cmpl, {**base, "temperature": 1e308}),
        ("top_p NaN", cmpl, {**base, "top_p": float("nan")}),
        ("top_p 2", cmpl, {**base, "top_p": 2}),
        ("top_k negative", cmpl, {**base, "top_k": -7}),
        ("min_p inf", cmpl, {**base, "min_p": float("inf")}),
        ("presence_penalty NaN", cmpl, {**base, "presence_penalty": float("nan")}),
        ("repetition_penalty zero", cmpl, {**base, "repetition_penalty": 0}),
        ("frequency_penalty 1e9", cmpl, {**base, "frequency_penalty": 1e9}),
        ("seed 2^70", cmpl, {**base, "seed": 2**70}),
        ("seed negative", cmpl, {**base, "seed": -(2**63)}),
        ("n 10000", cmpl, {**base, "n": 10000}),
        ("n zero", cmpl, {**base, "n": 0}),
        ("n negative", cmpl, {**base, "n": -1}),
        ("logprobs 1000", cmpl, {**base, "logprobs": 1000}),
        ("logprobs negative", cmpl, {**base, "logprobs": -1}),
        ("prompt empty", cmpl, {**base, "prompt": ""}),
        ("prompt empty list", cmpl, {**base, "prompt": []}),
        ("prompt object", cmpl, {**base, "prompt": {"a": 1}}),
        ("prompt null", cmpl, {**base, "prompt": None}),
        ("prompt 10 MB", cmpl, {**base, "prompt": "word " * 2_000_000}),
        ("prompt 10000 empty strings", cmpl, {**base, "prompt": [""] * 10000}),
        ("prompt 2000 strings", cmpl, {**base, "prompt": ["hi"] * 2000}),
        ("prompt ids out of range", cmpl, {**base, "prompt": [10**9, 1, 2]}),
        ("prompt ids negative", cmpl, {**base, "prompt": [-1, 2]}),
        ("prompt ids 2^70", cmpl, {**base, "prompt": [2**70]}),
        ("prompt ids mixed types", cmpl, {**base, "prompt": [1, "a", None]}),
        ("prompt lone surrogate", cmpl, {**base, "prompt": "\ud800 broken"}),
        ("stop 10000 strings", cmpl, {**base, "stop": [f"s{i}" for i in range(10000)]}),
        ("stop empty string", cmpl, {**base, "stop": [""]}),
        ("stop 1 MB string", cmpl, {**base, "stop": "x" * 2**20}),
        ("stop wrong type", cmpl, {**base, "stop": [1, 2]}),
        ("stop_token_ids 100000", cmpl, {**base, "stop_token_ids": list(range(100000))}),
        ("logit_bias abuse", cmpl, {**base, "logit_bias": {str(i): 100 for i in range(5000)}}),
        ("logit_bias wrong type", cmpl, {**base, "logit_bias": "all"}),
        ("stream string", cmpl, {**base, "stream": "yes"}),
        ("stream_options wrong", cmpl, {**base, "stream": True, "stream_options": {"include_usage": "x"}}),
        ("echo with logprobs", cmpl, {**base, "echo": True, "logprobs": 1}),
        ("unknown fields", cmpl, {**base, "frobnicate": True, "x" * 1000: [1] * 1000}),
        ("model unknown", cmpl, {**base, "model": "no-such-model"}),
        ("model wrong type", cmpl, {**base, "model": 5}),
    ]


def _chat_cases(model: str) -> list[tuple[str, str, Any]]:
    chat = _CHAT
    msgs = [{"role": "user", "content": "hello"}]
    cbase = {"model": model, "messages": msgs, "max_tokens": 4}
    return [
        ("messages empty", chat, {**cbase, "messages": []}),
        ("messages not a list", chat, {**cbase, "messages": "hello"}),
        ("message without role", chat, {**cbase, "messages": [{"content": "x"}]}),
        ("message unknown role", chat, {**cbase, "messages": [{"role": "wizard", "content": "x"}]}),
        ("message content number", chat, {**cbase, "messages": [{"role": "user", "content": 5}]}),
        ("message image part", chat, {**cbase, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
        ("message part without text", chat, {**cbase, "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        ("10000 messages", chat, {**cbase, "messages": msgs * 10000}),
        ("message 10 MB", chat, {**cbase, "messages": [{"role": "user", "content": "word " * 2_000_000}]}),
        ("top_logprobs without logprobs", chat, {**cbase, "top_logprobs": 3}),
        ("top_logprobs 100", chat, {**cbase, "logprobs": True, "top_logprobs": 100}),
        ("tools not a list", chat, {**cbase, "tools": {"a": 1}}),
        ("tool without function", chat, {**cbase, "tools": [{"type": "function"}]}),
        ("tool bad name", chat, {**cbase, "tools": [{"type": "function", "function": {"name": "a b c!"}}]}),
        ("tool_choice unknown function", chat, {**cbase, "tools": [
            {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                            "function": {"name": "g"}}}),
        ("tool_choice without tools", chat, {**cbase, "tool_choice": "required"}),
        ("tool parameters not an object", chat, {**cbase, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}),
        ("tool call arguments not JSON", chat, {**cbase, "messages": [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                 "function": {"name": "f", "arguments": "{oops"}}]}]}),
        ("response_format unknown type", chat, {**cbase, "response_format": {"type": "xml"}}),
        ("response_format schema missing", chat, {**cbase, "response_format": {"type": "json_schema"}}),
        ("response_format bad schema", chat, {**cbase, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}),
        ("response_format unsatisfiable", chat, {**cbase, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "minItems": 5, "maxItems": 1}}}}),
        ("guided_regex invalid", chat, {**cbase, "guided_regex": "(("}),
        ("guided_grammar matches nothing", chat, {**cbase, "guided_grammar": 'root ::= root "a"'}),
        ("two constraints", chat, {**cbase, "guided_regex": "a", "guided_choice": ["b"]}),
    ]


def _image_cases(model: str) -> list[tuple[str, str, Any]]:
    """Hostile images (tessera/bench/hostile_images.py) in chat messages, and too many of them; a
    text model refuses them all for taking no images, a vision model for what each one is."""
    from tessera.bench.hostile_images import hostile_image_urls, small_image, data_url

    def with_image(url: Any, role: str = "user") -> dict[str, Any]:
        return {"model": model, "max_tokens": 4, "messages": [{"role": role, "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this"}]}]}

    ok = data_url(small_image())
    many = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": ok}}] * 64}]}
    return [(name, _CHAT, with_image(url)) for name, url in hostile_image_urls()] + [
        ("image: 64 in one prompt", _CHAT, many),
        ("image: in an assistant message", _CHAT, with_image(ok, "assistant")),
        ("image: in a system message", _CHAT, with_image(ok, "system")),
        ("image: url not a string", _CHAT, with_image(5)),
        ("image: image_url without url", _CHAT, {**with_image(ok), "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {}}]}]}),
    ]


def _raw_cases(model: str) -> list[HostileCase]:
    cmpl, chat = _COMPLETIONS, _CHAT
    base = {"model": model, "prompt": "hello", "max_tokens": 4}
    raw: list[tuple[str, str, bytes]] = [
        ("empty body", cmpl, b""),
        ("not JSON", cmpl, b"hello there"),
        ("JSON array", cmpl, b"[1, 2, 3]"),
        ("JSON null", cmpl, b"null"),
        ("JSON string", chat, b'"hello"'),
        ("truncated JSON", cmpl, _json(base)[:-5]),
        ("invalid UTF-8", cmpl, b'{"model": "m", "prompt": "\xff\xfe\xfa", "max_tokens": 4}'),
        ("deeply nested arrays", cmpl, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("deeply nested objects", chat, b'{"messages": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}"),
        ("duplicate keys", cmpl, b'{"prompt": "a", "prompt": 5, "max_tokens": 2}'),
        ("NaN literal", cmpl, b'{"prompt": "a", "temperature": NaN}'),
        ("body 20 MB", cmpl, b'{"prompt": "' + b"a" * (20 * 2**20) + b'"}'),
    ]
    out = [HostileCase(name, path, body) for name, path, body in raw]
    out += [
        HostileCase("form content type", cmpl, _json(base), content_type="application/x-www-form-urlencoded"),
        HostileCase("GET on a POST endpoint", cmpl, b"", method="GET"),
        HostileCase("DELETE on models", "/v1/models", b"", method="DELETE"),
        HostileCase("unknown path", "/v1/nothing/here", _json(base)),
        HostileCase("path traversal", "/v1/../../etc/passwd", b"", method="GET"),
    ]
    return out


def run_hostile(base_url: str, model: str, timeout: float = 120.0) -> list[HostileResult]:
    """Send every case once, in order; then check the server still answers a normal request."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    results = []
    with httpx.Client(base_url=base_url, timeout=timeout) as client:
        for case in hostile_cases(model) + [HostileCase("normal request afterwards", "/v1/completions", _json(
                {"model": model, "prompt": "hello", "max_tokens": 2}))]:
            t0 = time.perf_counter()
            try:
                r = client.request(case.method, case.path, content=case.body,
                                   headers={"content-type": case.content_type})
                status, detail = r.status_code, r.text[:200]
                try:
                    err = r.json().get("error") if status >= 400 else None
                except (ValueError, AttributeError):
                    err = None
                shaped = isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err
            except httpx.HTTPError as exc:
                status, detail, shaped = 0, f"{type(exc).__name__}: {exc}", False
            results.append(HostileResult(case.name, status, shaped, time.perf_counter() - t0, detail))
    return results


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hostile", help="send malformed and abusive requests; count 5xx and non-OpenAI errors",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="a model the server serves")
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        results = run_hostile(args.base_url, args.model)
    except httpx.HTTPError as exc:
        raise TesseraError(f"cannot reach {args.base_url}: {exc}") from None
    bad = [r for r in results if not r.ok]
    for r in results:
        print(f"{'ok ' if r.ok else 'BAD'} {r.status:3d} {r.seconds:6.2f}s  {r.name}"
              + ("" if r.ok else f"  -- {r.detail}"))
    fivexx = sum(1 for r in results if r.status >= 500)
    print(f"{len(results)} requests, {fivexx} 5xx, {len(bad)} not answered with a 2xx or an OpenAI-style 4xx")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"kind": "hostile", "base_url": args.base_url, "model": args.model,
                                           "results": [asdict(r) for r in results]}, indent=1))
    return 1 if bad else 0

