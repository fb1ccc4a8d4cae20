"""The agent API tests' server (uvicorn over an AsyncLLMEngine on a tiny random model, one per
module) and the official `openai` and `anthropic` clients pointed at it; a module that defines
its own `server` gets the clients on that one."""
from __future__ import annotations

from typing import Iterator

import anthropic
import openai
import pytest
from agent_server import NAME, STORE_SIZE, tiny_engine
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.metrics import MetricFamilies
from tessera.server.app import create_app


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    engine = tiny_engine(make_tiny_model(tmp_path_factory.mktemp("tiny-agents") / "llama", max_positions=1024))
    try:
        with serve_in_thread(create_app(engine, [NAME], metrics=MetricFamilies(),
                                        max_stored_responses=STORE_SIZE)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60)
