"""Access control on the real engine (tiny random model): schemathesis fuzzing of the OpenAPI schema
with an API key (the schema itself needs one), positive and negative: 0 5xx, and never a 401 or 403
for the key (tests/server/test_access.py walks the routes without one). The fast variant of benchmarks/reliability.sh's schemathesis run, authenticated."""
from __future__ import annotations

from typing import Iterator

import httpx
import pytest
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.server.app import create_app
from tessera.server.api_keys import ADMIN, AccessSettings, ApiKey, digest_of

NAME = "tiny"
SECRET = "sk-fuzz-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {SECRET}"}


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    from tessera.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-access") / "llama", max_positions=512)
    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=512, max_num_seqs=8,
                          kv_cache_memory=2 * 2**20)
    engine = AsyncLLMEngine(config, engine=LLMEngine(config, loaded=load_model(folder, "float32")),
                            max_num_queued_requests=64, step_timeout=30.0)
    access = AccessSettings(keys=(ApiKey("fuzzer", digest_of(SECRET), frozenset({ADMIN}), rpm=100000),))
    try:
        with serve_in_thread(create_app(engine, [NAME], access=access)) as base:
            yield base
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_schemathesis_authenticated_no_5xx(url):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    assert httpx.get(f"{url}/openapi.json").status_code == 401
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=HEADERS)
    fuzzed, statuses = 0, set()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case) -> None:
                nonlocal fuzzed
                if isinstance(case.body, dict):  # short generations: the point is parsing, not decoding
                    case.body.setdefault("max_tokens", 4)
                    if isinstance(case.body.get("max_tokens"), int) and case.body["max_tokens"] > 16:
                        case.body["max_tokens"] = 16
                r = case.call(base_url=url, timeout=60, headers=HEADERS)
                fuzzed += 1
                statuses.add(r.status_code)
                assert r.status_code < 500, (case.method, case.path, case.body, r.text[:300])
                assert r.status_code not in (401, 403), (case.path, r.text[:300])
                if r.status_code >= 400:  # in the error shape of the route's API
                    err = r.json()["error"]
                    if case.path.startswith("/api/"):  # Ollama's: {"error": "message"}
                        assert isinstance(err, str) and err
                    else:  # OpenAI's and Anthropic's: {"error": {"message": ..., "type": ...}}
                        assert isinstance(err["message"], str) and err["type"]
            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (a GET without parameters)
                assert mode == GenerationMode.NEGATIVE
    assert fuzzed >= 60 and 200 in statuses and 400 in statuses
