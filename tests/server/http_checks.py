"""The HTTP server over a scripted engine core (tests/fakes.py), which each module makes its `srv`
fixture of, requests to it, and strict checks of its answers: the SSE framing and the error shape."""
from __future__ import annotations

import json
from typing import Iterator, Optional

import httpx
from fakes import Server, live_server


def scripted_server() -> Iterator[Server]:
    with live_server() as s:
        yield s


def post(srv: Server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=10, **kw)


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body strictly: only `data: ...` events separated by blank lines; [DONE] stays a str."""
    text = response.text
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(r: httpx.Response, status: int, *needles: str, param: Optional[str] = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle.lower() in err["message"].lower(), err
    if param is not None:
        assert err["param"] == param, err
    return err
