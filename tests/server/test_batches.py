"""OpenAI's Files and Batch API over the real engine on a tiny random model, through the official
openai client: the round trip, bad input refused at validation with line numbers, a bad body in
the error file while the other lines run, cancellation, and batches kept per API key."""
from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.live_stats import LiveStats
from tessera.server.app import create_app
from tessera.server.api_keys import AccessSettings, ApiKey
from tessera.server.batches.protocol import BatchLimits
from tessera.server.batches.store import BatchStore

NAME = "tiny"
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
ADMIN = "sk-ops-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    from tessera.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    loaded = load_model(folder, "float32")
    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=8,
                          kv_cache_memory=256 * 2 * 2 * 2 * 16 * 4 * 16, scheduling_policy="priority")
    live = LiveStats(NAME)
    engine = AsyncLLMEngine(config, engine=LLMEngine(config, loaded=loaded), max_num_queued_requests=24,
                            stat_loggers=[live])
    store = tmp_path_factory.mktemp("batches") / "batches.sqlite3"
    access = AccessSettings(keys=(*(ApiKey.from_secret(name, secret, ["inference"]) for name, secret in KEYS.items()),
                                  ApiKey.from_secret("ops", ADMIN)))
    app = create_app(engine, [NAME], access=access, batch_store=store, live=live,
                     batch_limits=BatchLimits(max_lines=50, max_file_bytes=64 * 1024, concurrency=4))
    try:
        with serve_in_thread(app) as url:
            yield url, store
    finally:
        engine.shutdown()


def client(url: str, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[who], max_retries=0, timeout=60)


def chat_line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": NAME, "messages": [{"role": "user", "content": f"item {i}"}], "max_tokens": 4,
                     "temperature": 0, **body}}


def upload(c: openai.OpenAI, lines: list) -> str:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return c.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def wait_done(c: openai.OpenAI, batch_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.1)


def jsonl(c: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in c.files.content(file_id).text.splitlines()]


def test_round_trip_with_a_bad_body_in_the_error_file(server):
    url, _ = server
    c = client(url)
    lines = [chat_line(i) for i in range(6)]
    lines[3]["body"].pop("messages")  # invalid for the endpoint: its own error entry
    file_id = upload(c, lines)
    batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"job": "test"})
    assert batch.id.startswith("batch_") and batch.status == "in_progress" and batch.metadata == {"job": "test"}
    done = wait_done(c, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 5, 1)
    assert done.completed_at and done.finalizing_at and done.in_progress_at
    out = jsonl(c, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == [f"req-{i}" for i in (0, 1, 2, 4, 5)]
    for o in out:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert o["response"]["body"]["object"] == "chat.completion"
    errors = jsonl(c, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["req-3"]
    assert errors[0]["response"]["status_code"] == 400 and "error" in errors[0]["response"]["body"]
    assert c.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in c.batches.list()]


def test_completions_and_embeddings_endpoints_run(server):
    url, _ = server
    c = client(url)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": NAME, "prompt": f"count {i}", "max_tokens": 3}} for i in range(3)]
    done = wait_done(c, c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/completions",
                                         completion_window="24h").id)
    assert done.request_counts.completed == 3
    assert all(o["response"]["body"]["object"] == "text_completion" for o in jsonl(c, done.output_file_id))
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": NAME, "input": f"word {i}", "max_output_tokens": 3, "store": False}} for i in range(2)]
    done = wait_done(c, c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/responses",
                                         completion_window="24h").id)
    assert done.request_counts.completed == 2
    assert all(o["response"]["body"]["object"] == "response" for o in jsonl(c, done.output_file_id))


@pytest.mark.parametrize("lines,code,line", [
    (["not json"], "invalid_json_line", 1),
    ([chat_line(0), {**chat_line(1), "url": "/v1/embeddings"}], "mismatched_endpoint", 2),
    ([chat_line(0), chat_line(0)], "duplicate_custom_id", 2),
    ([chat_line(i) for i in range(51)], "too_many_requests", 51),
])
def test_bad_input_fails_validation_with_line_numbers(server, lines, code, line):
    url, _ = server
    c = client(url)
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors.data[0].code == code and batch.errors.data[0].line == line
    assert batch.request_counts.total == 0


def test_bad_requests_get_openai_errors(server):
    url, _ = server
    c = client(url)
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=upload(c, [chat_line(0)]), endpoint="/v1/moderations",
                         completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=upload(c, [chat_line(0)]), endpoint="/v1/chat/completions",
                         completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as err:
        c.files.create(file=("x.jsonl", io.BytesIO(b"x" * 70_000)), purpose="batch")
    assert err.value.status_code == 413


def test_batches_and_files_belong_to_their_key(server):
    url, _ = server
    alice, bob = client(url, "alice"), client(url, "bob")
    file_id = upload(alice, [chat_line(0)])
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.id not in [b.id for b in bob.batches.list()]
    wait_done(alice, batch.id)


def test_cancel_keeps_what_was_answered(server):
    url, store = server
    c = client(url)
    lines = [chat_line(i, max_tokens=40, ignore_eos=True) for i in range(40)]
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/chat/completions", completion_window="24h")
    cancelled = c.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = wait_done(c, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts.completed < 40
    assert c.batches.cancel(batch.id).status == "cancelled"  # again: no change
    # Nothing of it is left running in the engine: a later batch completes.
    after = c.batches.create(input_file_id=upload(c, [chat_line(0)]), endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert wait_done(c, after.id).status == "completed"


def test_dashboard_shows_batch_progress_and_priority_classes(server):
    url, _ = server
    c = client(url)
    lines = [chat_line(i, max_tokens=30, ignore_eos=True) for i in range(12)]
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/chat/completions", completion_window="24h")
    live = httpx.get(f"{url}/v1/engine/live", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    shown = {b["id"]: b for b in live["batches"]}
    assert shown[batch.id]["total"] == 12 and shown[batch.id]["owner"] == "alice"
    assert isinstance(live["models"][0]["current"]["by_priority"], list)
    c.batches.cancel(batch.id)
    wait_done(c, batch.id)
    live = httpx.get(f"{url}/v1/engine/live", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert batch.id not in {b["id"] for b in live["batches"]}


def test_store_records_a_line_once(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    from tessera.server.batches.protocol import BatchLine

    row = store.create_batch("", "/v1/completions", "file-x", "24h", None,
                             [BatchLine(1, "a", {}), BatchLine(2, "b", {})], [])
    store.record(row["id"], 1, {"first": True}, failed=False)
    store.record(row["id"], 1, {"first": False}, failed=True)  # a rerun after a restart loses
    assert store.counts(row["id"]) == (2, 1, 0)
    assert [r["line"] for r in store.pending_lines(row["id"], set(), 10)] == [2]
    store.close()
    again = BatchStore(tmp_path / "b.sqlite3")  # reopened, as after a restart
    assert [b["id"] for b in again.active_batches()] == [row["id"]]
