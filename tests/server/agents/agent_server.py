"""What the agent API tests share: the tiny model's engine and a server over it (uvicorn over an
AsyncLLMEngine) with the official `openai` and `anthropic` clients pointed at it, which each
module makes its fixtures of; the tools they declare, and checks on the server's state."""
from __future__ import annotations

import time
from typing import Iterator

import anthropic
import httpx
import openai
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.metrics import MetricFamilies
from tessera.server.app import create_app

NAME = "tiny"
LIGHT = {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
         "required": ["room", "on"], "additionalProperties": False}
RESPONSES_TOOLS = [{"type": "function", "name": "set_light", "description": "Switch a light", "parameters": LIGHT}]
ANTHROPIC_TOOLS = [{"name": "set_light", "description": "Switch a light", "input_schema": LIGHT}]
STORE_SIZE = 8
USER = [{"role": "user", "content": "hi"}]


def tiny_engine(folder, max_model_len: int = 1024) -> AsyncLLMEngine:
    from tessera.models.loader import load_model

    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=max_model_len, max_num_seqs=8,
                          kv_cache_memory=max(4, max_model_len // 256) * 2**20)
    return AsyncLLMEngine(config, engine=LLMEngine(config, loaded=load_model(folder, "float32")))


def serve_tiny(tmp_path_factory) -> Iterator[str]:
    engine = tiny_engine(make_tiny_model(tmp_path_factory.mktemp("tiny-agents") / "llama", max_positions=1024))
    try:
        with serve_in_thread(create_app(engine, [NAME], metrics=MetricFamilies(),
                                        max_stored_responses=STORE_SIZE)) as url:
            yield url
    finally:
        engine.shutdown()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60)


def wait_idle(url: str) -> None:
    """Every request's KV blocks back in the pool (nothing leaked, nothing still running)."""
    deadline = time.monotonic() + 20
    while True:
        s = httpx.get(f"{url}/v1/engine/stats").json()["scheduler"]
        if s["num_running"] == s["num_waiting"] == 0 and s["kv_cache_usage"] == 0:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def without_ids(value):
    """A response with the parts that differ between two runs (ids, times) blanked."""
    if isinstance(value, dict):
        return {k: "*" if k in ("id", "call_id", "created_at", "item_id") else without_ids(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def prompt_tokens(usage) -> int:
    """A Messages usage's whole prompt: Anthropic's `input_tokens` leaves out what the prefix cache served."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def merged_cache(reply) -> dict:
    """A message's or response's dump with its usage's cache split undone (the whole prompt in
    `input_tokens`, no cached count): a request sent twice finds its prompt cached the second time."""
    dump = reply.model_dump()
    usage = dict(dump["usage"])
    usage["input_tokens"] += (usage.pop("cache_read_input_tokens", 0) or 0) + \
        (usage.pop("cache_creation_input_tokens", 0) or 0)
    usage.pop("input_tokens_details", None)
    return {**dump, "usage": usage}
