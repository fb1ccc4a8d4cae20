"""A model served as several replicas (tessera/deploy/replicas.py), with in-process fake engines:
routing, moving a request off a dead or full replica before its first token, scaling without
dropping requests, and the HTTP surface (/v1/engine/stats, POST /v1/engine/replicas).
The same behaviour on a real two-node Ray cluster: tests/deploy/test_ray_replicas.py."""
from __future__ import annotations

import asyncio
import time
from typing import Optional

import httpx
import pytest
from fakes import FakeCore, serve_in_thread

from tessera.deploy.replicas import NoReplicaError, ReplicaSet
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.frontend.protocols import ServingEngine
from tessera.sampling_params import SamplingParams
from tessera.server.app import create_app
from tessera.server.model_router import ModelRouter
from tessera.server.served_model import ModelSpec, ServedModel


def fake(step_s: float = 0.002, fail_after_steps: Optional[int] = None, queue: Optional[int] = None) -> AsyncLLMEngine:
    core = FakeCore(step_s=step_s, fail_after_steps=fail_after_steps)
    return AsyncLLMEngine(core.config, engine=core, max_num_queued_requests=queue)


async def run(rs: ReplicaSet, prompt: str, rid: str, max_tokens: int = 4) -> str:
    text = ""
    async for out in rs.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), rid):
        text = out.outputs[0].text
    return text


def test_requests_spread_and_stats_add_up():
    built: list[int] = []

    def build(i: int) -> AsyncLLMEngine:
        built.append(i)
        return fake()

    rs = ReplicaSet(build, 3, "round-robin")
    try:
        assert sorted(built) == [0, 1, 2]

        async def many():
            return await asyncio.gather(*(run(rs, "hello", f"r{i}") for i in range(9)))

        assert all(t for t in asyncio.run(many()))
        assert [r.routed for r in rs.replicas] == [3, 3, 3]
        assert rs.get_scheduler_stats().num_blocks_total == 3 * 64
        info = rs.core_info()
        assert info["router_policy"] == "round-robin" and len(info["replicas"]) == 3
        assert rs.num_active() == 0 and all(r.active == 0 for r in rs.replicas)
        assert isinstance(rs, ServingEngine) and isinstance(rs.replicas[0].engine, ServingEngine)
    finally:
        rs.shutdown()


def test_a_dead_replica_leaves_rotation_and_its_unstarted_request_moves():
    engines = {0: fake(fail_after_steps=1), 1: fake()}
    rs = ReplicaSet(lambda i: engines[i], 2, "round-robin")
    try:
        assert asyncio.run(run(rs, "hello", "a")) and asyncio.run(run(rs, "hello", "b"))
        dead = rs.replicas[0]
        assert not dead.healthy() and dead.retried_away == 1 and rs.retries == 1
        rs.check_health()  # one replica still serves
        for i in range(4):  # only the live one gets requests now
            asyncio.run(run(rs, "hello", f"c{i}"))
        assert rs.replicas[1].routed == 1 + 1 + 4 and dead.routed == 1
    finally:
        rs.shutdown()


def test_no_healthy_replica_is_a_clear_error():
    rs = ReplicaSet(lambda i: fake(fail_after_steps=1), 2, "least-loaded")
    try:
        with pytest.raises(Exception, match="engine loop died|simulated"):
            asyncio.run(run(rs, "hello", "a"))  # both replicas die under it: moved once, then failed
        with pytest.raises(NoReplicaError):
            rs.check_health()
        with pytest.raises(NoReplicaError):
            asyncio.run(run(rs, "hello", "b"))
    finally:
        rs.shutdown()


def test_a_full_replica_hands_the_request_to_another_before_a_429():
    engines = {0: fake(queue=0), 1: fake()}
    rejected: list[int] = []
    rs = ReplicaSet(lambda i: engines[i], 2, "round-robin", on_rejection=rejected.append)
    try:
        for i in range(4):
            assert asyncio.run(run(rs, "hello", f"q{i}"))
        assert rs.replicas[0].retried_away == 2 and rejected == []
    finally:
        rs.shutdown()
    engines = {0: fake(queue=0), 1: fake(queue=0)}
    rs = ReplicaSet(lambda i: engines[i], 2, "round-robin", on_rejection=rejected.append)
    try:
        from tessera.engine.errors import QueueFullError

        with pytest.raises(QueueFullError):
            asyncio.run(run(rs, "hello", "full"))
        assert len(rejected) == 1  # counted once, by the replica that refused last
    finally:
        rs.shutdown()


def test_scaling_down_drains_without_dropping_running_requests():
    closed: list[int] = []
    rs = ReplicaSet(lambda i: fake(step_s=0.01), 2, "round-robin", close=lambda i, e: closed.append(i))

    async def scenario():
        long = [asyncio.create_task(run(rs, "hello", f"long{i}", max_tokens=60)) for i in range(4)]
        await asyncio.sleep(0.1)  # both replicas are decoding
        assert rs.scale(1)["draining"]
        assert len(rs.in_rotation()) == 1
        texts = await asyncio.gather(*long)  # every running request completes
        assert all(len(t) == 60 for t in texts)
        return await run(rs, "hello", "after")

    try:
        assert asyncio.run(scenario())
        deadline = time.monotonic() + 5
        while not closed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(closed) == 1 and len(rs.replicas) == 1
        rs.scale(3)
        deadline = time.monotonic() + 5
        while len(rs.in_rotation()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [r.replica_id for r in rs.in_rotation()] == sorted(r.replica_id for r in rs.in_rotation())
        assert len(rs.in_rotation()) == 3 and max(r.replica_id for r in rs.replicas) == 3  # ids never reused
    finally:
        rs.shutdown()


def test_replicas_over_http():
    rs = ReplicaSet(lambda i: fake(), 2, "prefix-aware")
    router = ModelRouter([ServedModel(ModelSpec("m", "m"), rs)])  # type: ignore[arg-type]
    try:
        with serve_in_thread(create_app(router=router)) as url:
            for i in range(4):
                r = httpx.post(f"{url}/v1/completions", json={"prompt": "the same prompt " * 8, "max_tokens": 3})
                assert r.status_code == 200, r.text
            stats = httpx.get(f"{url}/v1/engine/stats").json()
            routed = sorted(r["routed"] for r in stats["engine_core"]["replicas"])
            assert routed == [0, 4]  # one prompt head: one replica (prefix-aware)
            r = httpx.post(f"{url}/v1/engine/replicas", json={"replicas": 3})
            assert r.status_code == 200 and r.json()["starting"] == [2]
            for bad in ({"replicas": 0}, {"replicas": "2"}, {"replicas": True}, [], {"replicas": 2, "model": 5}):
                r = httpx.post(f"{url}/v1/engine/replicas", json=bad)
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            r = httpx.post(f"{url}/v1/engine/replicas", json={"replicas": 2, "model": "nope"})
            assert r.status_code == 404
    finally:
        rs.shutdown()


def test_a_replica_dying_mid_decode_reruns_only_what_was_not_streamed():
    async def final(rs: ReplicaSet, rid: str, restartable: bool) -> tuple[int, str]:
        seen, text = 0, ""
        async for out in rs.generate("hello", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), rid,
                                     restartable=restartable):
            seen, text = seen + 1, out.outputs[0].text
        return seen, text

    engines = {0: fake(fail_after_steps=4), 1: fake()}
    rs = ReplicaSet(lambda i: engines[i], 2, "round-robin")
    try:
        seen, text = asyncio.run(final(rs, "whole", restartable=True))  # a non-streaming request
        assert len(text) == 10 and seen > 10  # outputs of the dead run, then the whole rerun
        assert rs.replicas[0].retried_away == 1
    finally:
        rs.shutdown()
    engines = {0: fake(fail_after_steps=4), 1: fake()}
    rs = ReplicaSet(lambda i: engines[i], 2, "round-robin")
    try:
        with pytest.raises(Exception, match="engine loop died"):
            asyncio.run(final(rs, "streamed", restartable=False))  # tokens already reached the client
    finally:
        rs.shutdown()


def test_pd_flag_parsing_and_roles():
    from tessera.errors import TesseraError
    from tessera.server.config import parse_pd

    assert parse_pd("prefill=1,decode=2") == (1, 2) and parse_pd(" decode=1 , prefill=3") == (3, 1)
    for bad in ("prefill=1", "prefill=0,decode=1", "prefill=1,decode=x", "p=1,d=1", "prefill=1,prefill=1,decode=1",
                "prefill=1;decode=1"):
        with pytest.raises(TesseraError, match="--pd"):
            parse_pd(bad)
    rs = ReplicaSet(lambda i: fake(), 5, "least-loaded", pd=(1, 2))  # `replicas` is ignored with pd
    try:
        assert [r.role for r in rs.replicas] == ["prefill", "decode", "decode"]
        for i in range(4):  # a fake core returns no KV: the decode replica computes the prompt itself
            assert asyncio.run(run(rs, "a prompt longer than sixteen bytes", f"pd{i}"))
        assert rs.replicas[0].routed == 4 and rs.replicas[1].routed + rs.replicas[2].routed == 4
        assert rs.core_info()["pd"]["kv_transfers"] == 0
        with pytest.raises(ValueError, match="cannot be rescaled"):
            rs.scale(4)
    finally:
        rs.shutdown()


def test_a_replica_drained_while_it_loads_never_enters_rotation():
    import threading

    gate = threading.Event()

    def build(i: int) -> AsyncLLMEngine:
        if i == 2:
            gate.wait(10)  # still loading when the set is scaled back down
        return fake()

    closed: list[int] = []
    rs = ReplicaSet(build, 2, "round-robin", close=lambda i, e: closed.append(i))
    try:
        assert rs.scale(3)["starting"] == [2]
        assert rs.scale(2)["draining"] == [2]  # the one not ready yet goes first
        gate.set()
        seen_in_rotation = False
        deadline = time.monotonic() + 5
        while closed != [2] and time.monotonic() < deadline:
            seen_in_rotation |= any(r.replica_id == 2 for r in rs.in_rotation())
            time.sleep(0.002)
        assert closed == [2] and [r.replica_id for r in rs.replicas] == [0, 1]
        assert not seen_in_rotation
    finally:
        rs.shutdown()
