"""`tessera serve --ray --replicas 2` on a two-node Ray cluster these tests start themselves (a head
and a worker node on this machine, one CPU each, so Ray must place one replica per node), driven
with the official openai client: both replicas answer, metrics carry the replica label, and a
replica's process killed during a run costs no request a 5xx before Ray restarts it."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import openai
import pytest

from server_process import ServerProcess, running_server

pytestmark = pytest.mark.model

ray = pytest.importorskip("ray", reason="Ray is installed with the test extras (pip install -e .[test])")


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network here; the server inherits it
    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    c.add_node(**node)
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("ray") / "server.log", "--ray", "--ray-address", cluster.address,
                        "--replicas", "2", "--router-policy", "least-loaded", "--kv-cache-memory", "128MiB",
                        "--max-model-len", "1024", "--disable-log-stats") as proc:
        yield proc


def replicas(server: ServerProcess) -> list[dict]:
    return httpx.get(f"{server.url}/v1/engine/stats", timeout=30).json()["engine_core"]["replicas"]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_two_replicas_on_two_nodes_answer_alike(server):
    reps = replicas(server)
    assert [r["state"] for r in reps] == ["ready", "ready"] and all(r["healthy"] for r in reps)
    assert reps[0]["node_id"] != reps[1]["node_id"], "Ray placed both replicas on one node"
    c = client(server)
    texts = [c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12,
                                  temperature=0).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1] and texts[0].strip()
    assert sorted(r["routed"] for r in replicas(server)) == [1, 1]  # least-loaded spreads an idle set
    metrics = httpx.get(f"{server.url}/metrics").text
    for rid in ("0", "1"):
        assert f'tessera:generation_tokens_total{{model_name="smollm2-135m",replica="{rid}"}} 12.0' in metrics


def test_a_killed_replica_costs_no_5xx_and_comes_back(server):
    c = client(server)
    before = {r["replica"]: r for r in replicas(server)}
    victim = before[0]["pid"]

    def ask(i: int) -> str:
        return c.completions.create(model="smollm2-135m", prompt=f"Count from {i}:", max_tokens=24,
                                    temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(16)]
        time.sleep(2.0)  # requests are running on both replicas
        os.kill(victim, signal.SIGKILL)
        texts = [f.result() for f in futures]  # any 5xx raises here (openai.InternalServerError)
    assert all(t for t in texts)
    assert httpx.get(f"{server.url}/health").status_code == 200
    deadline = time.monotonic() + 300
    while True:
        now = {r["replica"]: r for r in replicas(server)}
        if now[0]["healthy"] and now[0]["restarts"] == 1:
            break
        assert time.monotonic() < deadline, f"replica 0 did not come back: {now}\n{server.log()[-3000:]}"
        time.sleep(1)
    assert now[0]["pid"] != victim and now[0]["node_id"] is not None
    routed = now[0]["routed"]
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(ask, range(8)))
    assert {r["replica"]: r for r in replicas(server)}[0]["routed"] > routed  # back in rotation
    assert "restarting" in server.log() or "exited" in server.log()


def test_scaling_down_and_up_at_run_time_drops_nothing(server):
    c = client(server)

    def ask(i: int) -> str:
        return c.completions.create(model="smollm2-135m", prompt=f"List {i} colours:", max_tokens=32,
                                    temperature=0).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, i) for i in range(12)]
        time.sleep(1.5)
        r = httpx.post(f"{server.url}/v1/engine/replicas", json={"replicas": 1}, timeout=30)
        assert r.status_code == 200 and len(r.json()["draining"]) == 1
        assert all(f.result() for f in futures)  # the drained replica finished what it had
    deadline = time.monotonic() + 120
    while len(replicas(server)) != 1:
        assert time.monotonic() < deadline, replicas(server)
        time.sleep(0.5)
    r = httpx.post(f"{server.url}/v1/engine/replicas", json={"replicas": 2}, timeout=30)
    assert r.status_code == 200 and len(r.json()["starting"]) == 1
    deadline = time.monotonic() + 300
    while sum(x["healthy"] for x in replicas(server)) < 2:  # Ray places it on the node just freed
        assert time.monotonic() < deadline, f"{replicas(server)}\n{server.log()[-3000:]}"
        time.sleep(1)
    nodes = {x["node_id"] for x in replicas(server)}
    assert len(nodes) == 2
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(ask, range(8)))
    assert all(x["routed"] > 0 for x in replicas(server))
