"""Agent-sized prompts: time to first token of a long prompt on Tessera and llama.cpp server (same
GGUF, same client), and of an agent's second session, whose system prompt and tools the prefix
cache already holds, before and after a restart with --kv-offload-dir.

    python benchmarks/agent_prompts.py --model qwen2.5-coder-1.5b --prompt-tokens 16384

One server at a time, each started fresh (`tessera serve MODEL --max-model-len 32768
--kv-offload-dir DIR`, `llama-server -m GGUF -c 32768 -np 1`). TTFT is the latency of a
non-streamed request for one token (the prompt's prefill and one step), measured by the same
httpx client for both servers. Steps:
- long: a chat completion whose user message is `--prompt-tokens` tokens of this repository's
  source (cold, nothing cached), on each server;
- agent sessions on Tessera: the captured requests of Claude Code (Messages) and Codex
  (Responses) in tests/fixtures/agents, first as captured (cold, session 1), then as a new session
  of the same agent in the same folder (the same system prompt, tools and context, another user
  prompt: session 2), then again after a restart of the server with the same --kv-offload-dir
  (session 3, yet another prompt).
Writes a JSON of the figures and the host's CPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from tessera.bench.client import wait_for_health
from tessera.hostinfo import cpu_model_name
from tessera.models.registry import resolve_model

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "agents"
LLAMA_SERVER = Path("/work/peers/llama.cpp/build/bin/llama-server")
CONTEXT = 32768
PROMPTS = ["List the Python files in this folder.", "What does the Makefile's test target run?",
           "Explain the README's first section in one sentence."]


def source_text(tokens: int, tokenizer: Any) -> str:
    """`tokens` tokens of the repository's Python source, as one user message would carry it."""
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "tessera").rglob("*.py")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < tokens:
        raise SystemExit(f"only {len(ids)} tokens of source")
    return "Summarise what this code does.\n\n" + tokenizer.decode(ids[:tokens])


class Server:
    """One server process, started fresh, stopped on exit."""

    def __init__(self, command: list[str], log: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT)
        wait_for_health(self.url, self.proc, str(log))

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def timed(post: Callable[[], httpx.Response]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = post()
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"{r.status_code}: {r.text[:500]}")
    return elapsed, r.json()


def long_prompt(client: httpx.Client, url: str, model: str, text: str) -> dict[str, Any]:
    seconds, body = timed(lambda: client.post(f"{url}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}))
    return {"ttft_s": seconds, "prompt_tokens": body["usage"]["prompt_tokens"]}


def agent_request(name: str, model: str, prompt: str | None) -> tuple[str, dict[str, Any]]:
    """A captured first request of `name` (claude_code_1 or codex_1) for one token, its user's
    prompt replaced by `prompt` (a new session of the same agent in the same folder)."""
    capture = json.loads((FIXTURES / f"{name}.json").read_text())
    body = copy.deepcopy(capture["body"])
    body["model"], body["stream"] = model, False
    turns = body.get("messages") or body.get("input")
    if prompt is not None:
        last_user = [t for t in turns if t.get("role") == "user"][-1]
        content = last_user["content"]
        if isinstance(content, str):
            last_user["content"] = prompt
        else:
            content[-1]["text"] = prompt
    if "messages" in body:
        body["max_tokens"] = 1
    else:
        body["max_output_tokens"] = 1
    return capture["path"].split("?")[0] + ("?beta=true" if "?beta=true" in capture["path"] else ""), body


def agent_ttft(client: httpx.Client, url: str, name: str, model: str, prompt: str | None) -> dict[str, Any]:
    path, body = agent_request(name, model, prompt)
    seconds, reply = timed(lambda: client.post(f"{url}{path}", json=body))
    usage = reply.get("usage") or {}
    return {"ttft_s": seconds, "prompt_tokens": usage.get("input_tokens")}


def tessera_command(model: str, port: int, offload: Path, threads: int) -> list[str]:
    return [sys.executable, "-m", "tessera", "serve", model, "--port", str(port), "--no-ui", "--log-level",
            "warning", "--max-model-len", str(CONTEXT), "--kv-offload-dir", str(offload),
            "--num-threads", str(threads)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/agent_prompts/agent_prompts.json")
    args = ap.parse_args()
    from tessera.tokenizer import Tokenizer

    gguf = str(resolve_model(args.model))
    text = source_text(args.prompt_tokens, Tokenizer.from_gguf(gguf))
    logs = args.out.parent / "logs"
    result: dict[str, Any] = {"model": args.model, "host": cpu_model_name(), "prompt_tokens": args.prompt_tokens,
                              "context": CONTEXT, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    client = httpx.Client(timeout=3600)
    offload = Path(tempfile.mkdtemp(prefix="tessera-kv-offload-"))
    try:
        with Server(tessera_command(args.model, args.port, offload, args.threads),
                    logs / f"{args.model}_tessera.log", args.port) as s:
            result["tessera_long"] = long_prompt(client, s.url, args.model, text)
            print("tessera long", result["tessera_long"], flush=True)
            for agent in ("claude_code_1", "codex_1"):
                result[f"{agent}_session1"] = agent_ttft(client, s.url, agent, args.model, None)
                result[f"{agent}_session2"] = agent_ttft(client, s.url, agent, args.model, PROMPTS[0])
                print(agent, result[f"{agent}_session1"], result[f"{agent}_session2"], flush=True)
            time.sleep(5)  # the disk tier's writer finishes the blocks just written
        with Server(tessera_command(args.model, args.port, offload, args.threads),
                    logs / f"{args.model}_tessera_restarted.log", args.port) as s:
            for agent in ("claude_code_1", "codex_1"):
                result[f"{agent}_after_restart"] = agent_ttft(client, s.url, agent, args.model, PROMPTS[1])
                print(agent, "after restart", result[f"{agent}_after_restart"], flush=True)
        if not args.skip_llamacpp:
            if not LLAMA_SERVER.exists():
                raise SystemExit(f"no {LLAMA_SERVER}: run benchmarks/peers/setup_peers.sh llama")
            command = [str(LLAMA_SERVER), "-m", gguf, "--alias", args.model, "--port", str(args.port), "-c",
                       str(CONTEXT), "-np", "1", "-t", str(args.threads), "-tb", str(args.threads), "--jinja"]
            with Server(command, logs / f"{args.model}_llamacpp.log", args.port) as s:
                result["llamacpp_long"] = long_prompt(client, s.url, args.model, text)
                print("llama.cpp long", result["llamacpp_long"], flush=True)
            result["long_ttft_ratio"] = result["tessera_long"]["ttft_s"] / result["llamacpp_long"]["ttft_s"]
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
