"""Two packaged models behind one `tessera serve --config`, each engine in its own process, driven
with the official openai client: routing, lazy load and keep_alive unload, fallback under load,
and a killed engine process failing only its own requests before it is restarted."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import openai
import pytest

from server_process import ServerProcess, running_server

pytestmark = pytest.mark.model

CONFIG = """
[[model]]
name = "smollm2-135m"
model = "smollm2-135m"
aliases = ["small"]
preload = true
fallback = "gemma3-270m"
when = ["queue_full", "unavailable"]
max_num_queued_requests = 1
[model.engine]
max_num_seqs = 1

[[model]]
name = "gemma3-270m"
model = "gemma3-270m"
keep_alive = "4s"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("multi")
    (folder / "models.toml").write_text(CONFIG)
    with running_server(folder / "server.log", "--config", str(folder / "models.toml"),
                        "--kv-cache-memory", "256MiB") as proc:
        yield proc


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def statuses(server: ServerProcess) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}


def wait_status(server: ServerProcess, model: str, status: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while statuses(server)[model] != status:
        if time.monotonic() > deadline:
            raise AssertionError(f"{model} not {status} after {timeout}s: {statuses(server)}\n{server.log()[-3000:]}")
        time.sleep(0.2)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def core_pid(server: ServerProcess, model: str) -> int:
    return httpx.get(f"{server.url}/v1/engine/stats", params={"model": model}).json()["engine_core"]["pid"]


def test_routing_lazy_load_and_keep_alive(server):
    c = client(server)
    assert statuses(server) == {"smollm2-135m": "ready", "small": "ready", "gemma3-270m": "unloaded"}
    for name in ("smollm2-135m", "small"):
        out = c.completions.create(model=name, prompt="The capital of France is", max_tokens=6, temperature=0)
        assert out.model == name and out.choices[0].text
    # gemma loads on its first request, in its own process.
    raw = c.completions.with_raw_response.create(model="gemma3-270m", prompt="The capital of France is",
                                                 max_tokens=6, temperature=0)
    assert raw.headers["x-tessera-model"] == "gemma3-270m" and raw.parse().model == "gemma3-270m"
    pid = core_pid(server, "gemma3-270m")
    assert pid != core_pid(server, "smollm2-135m") and pid != server.proc.pid
    # Idle past its keep_alive (4 s): unloaded, its process gone; the next request loads it again.
    wait_status(server, "gemma3-270m", "unloaded", timeout=30)
    deadline = time.monotonic() + 30
    while process_exists(pid):
        assert time.monotonic() < deadline, f"engine process {pid} still there after unloading"
        time.sleep(0.2)
    assert c.completions.create(model="gemma3-270m", prompt="Hello", max_tokens=3).choices[0].text is not None
    assert statuses(server)["gemma3-270m"] == "ready"


def test_saturated_model_degrades_to_the_fallback(server):
    def ask(i: int) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", timeout=300, json={
            "model": "smollm2-135m", "prompt": f"Request {i}: once upon a time", "max_tokens": 24,
            "ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(ask, range(8)))
    codes = [r.status_code for r in responses]
    answered = [r.headers.get("x-tessera-model") for r in responses]
    assert codes == [200] * 8, codes  # no 429: what smollm2 cannot take, gemma answers
    assert answered.count("gemma3-270m") >= 1 and answered.count("smollm2-135m") >= 1, answered
    for r in responses:
        if r.headers["x-tessera-model"] == "gemma3-270m":
            assert r.json()["model"] == "gemma3-270m"
            assert r.headers["x-tessera-fallback-from"] == "smollm2-135m"
            assert r.headers["x-tessera-fallback-cause"] in ("queue_full", "unavailable")
    text = httpx.get(f"{server.url}/metrics").text
    degraded = [line for line in text.splitlines() if line.startswith("tessera:degraded_requests_total{")
                and 'model_name="smollm2-135m"' in line and 'fallback="gemma3-270m"' in line]
    assert degraded and sum(float(line.split()[-1]) for line in degraded) >= answered.count("gemma3-270m")
    assert 'tessera:generation_tokens_total{model_name="gemma3-270m"}' in text
    assert 'tessera:generation_tokens_total{model_name="smollm2-135m"}' in text


def test_killed_engine_fails_only_its_requests_and_restarts(server):
    c = client(server)
    c.completions.create(model="gemma3-270m", prompt="Warm", max_tokens=2)  # loaded (keep_alive may have expired)
    pid = core_pid(server, "gemma3-270m")
    errors: list[BaseException] = []
    got_text = threading.Event()

    def long_stream() -> None:
        try:
            stream = c.completions.create(model="gemma3-270m", prompt="Tell a long story:", max_tokens=2000,
                                          stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    got_text.set()
        except Exception as exc:  # noqa: BLE001 - what the client sees when the engine dies
            errors.append(exc)

    t = threading.Thread(target=long_stream)
    t.start()
    assert got_text.wait(60)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive() and errors, "the stream of the killed engine should end with an error"
    # The other model serves throughout.
    out = c.completions.create(model="smollm2-135m", prompt="Still here?", max_tokens=4, temperature=0)
    assert out.choices[0].text
    # gemma's engine comes back: /health for it turns 200 again, a new process answers.
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/health", params={"model": "gemma3-270m"}).status_code != 200:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.5)
    out = c.completions.create(model="gemma3-270m", prompt="Back again", max_tokens=4)
    assert out.model == "gemma3-270m"
    core = httpx.get(f"{server.url}/v1/engine/stats", params={"model": "gemma3-270m"}).json()["engine_core"]
    assert core["pid"] != pid and core["restarts"] == 1
    assert "engine-core process of gemma3-270m exited" in server.log()
