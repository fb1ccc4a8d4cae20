"""A batch survives its server being killed (SIGKILL) mid-way: after a restart over the same
store it resumes, and every request is answered exactly once (the lines answered before the kill
are not run again). Needs the packaged smollm2-135m model, hence @pytest.mark.model."""
from __future__ import annotations

import io
import json
import sqlite3
import time

import openai
import pytest
from server_process import MODEL, ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.slow]
NUM_LINES = 24


def answered(store) -> dict[str, str]:
    """custom_id -> the id of its recorded answer, read from the store as the runner wrote it."""
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT custom_id, result FROM lines WHERE result IS NOT NULL").fetchall()
    return {cid: json.loads(result)["id"] for cid, result in rows}


def test_a_killed_batch_resumes_with_each_request_answered_once(tmp_path):
    store = tmp_path / "batches.sqlite3"
    flags = ("--batch-store", str(store), "--scheduling-policy", "priority")
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say a word about {i}."}],
                       "max_tokens": 12, "temperature": 0}} for i in range(NUM_LINES)]
    data = ("\n".join(json.dumps(x) for x in lines) + "\n").encode()
    proc = ServerProcess(tmp_path / "first.log", *flags)
    try:
        proc.wait_healthy()
        c = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=60)
        file_id = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
        batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while c.batches.retrieve(batch.id).request_counts.completed < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.proc.kill()  # SIGKILL: no drain, no shutdown hook
        proc.proc.wait()
        proc._log.close()
    before = answered(store)
    assert 3 <= len(before) < NUM_LINES, "the kill should land mid-batch"

    proc = ServerProcess(tmp_path / "second.log", *flags)
    try:
        proc.wait_healthy()
        c = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 300
        while (b := c.batches.retrieve(batch.id)).status != "completed":
            assert b.status == "in_progress" and time.monotonic() < deadline, b
            time.sleep(0.2)
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (NUM_LINES, NUM_LINES, 0)
        out = [json.loads(line) for line in c.files.content(b.output_file_id).text.splitlines()]
    finally:
        proc.stop()
    assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)  # each exactly once
    kept = {o["custom_id"]: o["id"] for o in out}
    assert all(kept[cid] == rid for cid, rid in before.items())  # answered before the kill: not run again
    assert all(o["response"]["status_code"] == 200 for o in out)
