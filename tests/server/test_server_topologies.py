"""`tessera serve` end to end in each topology, on a tiny random GGUF model: the engine in the
server process (stepped on its main thread), in an engine process, as replicas, and as
prefill/decode replicas. All of them take the same serve() path; each must answer, say where its
engine runs, and exit cleanly on SIGTERM.

The tokenizer is converted once here, so the replicas' front ends, started on parallel threads,
only read its cache (as with the packaged models after their first start)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx
import pytest
from tiny_gguf import write_tiny_gguf
from server_process import running_server

from tessera.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path, _ = write_tiny_gguf("llama", tmp_path_factory.mktemp("tiny"), quantized=False)
    Tokenizer.from_gguf(path)
    return path


def _maps_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def _in_server(core: dict, api_pid: int) -> None:
    assert core == {"engine_process": False, "pid": None}


def _without_torch(api_pid: int) -> None:
    """Engines elsewhere: the API process tokenizes, routes and streams, and never loads torch
    (~140 MiB resident for the server's life)."""
    if Path(f"/proc/{api_pid}/maps").exists():
        assert not _maps_torch(api_pid)


def _in_process(core: dict, api_pid: int) -> None:
    assert core["engine_process"] and core["alive"] and core["pid"] is not None and core["restarts"] == 0
    _without_torch(api_pid)
    if Path(f"/proc/{core['pid']}/maps").exists():
        assert _maps_torch(core["pid"])  # the check above can fail


def _replicas(core: dict, api_pid: int) -> None:
    assert [(r["replica"], r["healthy"], r["engine_process"]) for r in core["replicas"]] == [(0, True, True),
                                                                                            (1, True, True)]
    _without_torch(api_pid)


def _pd(core: dict, api_pid: int) -> None:
    assert [r["role"] for r in core["replicas"]] == ["prefill", "decode"]
    assert (core["pd"]["prefill"], core["pd"]["decode"]) == (1, 1)
    _without_torch(api_pid)


@pytest.mark.parametrize("flags, check", [
    (["--no-engine-process"], _in_server),
    ([], _in_process),
    (["--replicas", "2"], _replicas),
    (["--pd", "prefill=1,decode=1"], _pd),
], ids=["in-server", "engine-process", "replicas", "pd"])
@pytest.mark.slow
def test_each_topology_serves_and_stops_cleanly(tiny: Path, tmp_path: Path, flags: list[str],
                                                check: Callable[[dict, int], None]):
    with running_server(tmp_path / "server.log", "--kv-cache-memory", "16MiB", "--dtype", "float32",
                        "--num-threads", "1", "--no-ui", *flags, model=str(tiny)) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny-llama" and r.json()["usage"]["prompt_tokens"] > 0
        stats = server.stats()
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and "[DONE]" in r.text, r.text
        check(stats["engine_core"], server.proc.pid)
        assert [m["id"] for m in stats["models"]] == ["tiny-llama"] and stats["models"][0]["status"] == "ready"
        assert "tiny-llama: queue of up to" in server.log()
    assert server.proc.returncode == 0, server.log()[-3000:]
    assert "Traceback" not in server.log(), server.log()[-3000:]
