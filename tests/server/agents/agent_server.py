"""What the agent API tests share: the tiny model's engine, the tools they declare, and checks on
the server's state. The server and its clients are fixtures (conftest.py)."""
from __future__ import annotations

import time

import httpx

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine

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
