"""The engine in its own process (ProcessEngineCore): same outputs as in process, errors that
cross over, and a killed core failing only its requests before a new one takes over."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Iterator

import pytest
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.errors import EngineDeadError
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.outputs import RequestOutput
from tessera.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams

PROMPTS = [[1, 2, 3, 4, 5], "the quick brown fox", [7] * 40]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return EngineConfig(model=str(path), kv_cache_memory=64 << 20, num_threads=1, max_num_seqs=8)


@pytest.fixture(scope="module")
def remote(config) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(config, engine_process=True)
    try:
        yield engine
    finally:
        engine.shutdown()


async def final(engine: AsyncLLMEngine, prompt, params: SamplingParams, rid: str) -> RequestOutput:
    out = None
    async for out in engine.generate(prompt, params, rid):
        pass
    assert out is not None and out.finished
    return out


def wait_idle(engine: AsyncLLMEngine, timeout: float = 10) -> None:
    """Every block free in the core (its last step's stats arrive just after the final outputs)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.get_scheduler_stats()
        if stats.num_running == 0 and stats.num_blocks_free == stats.num_blocks_total:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


def run_all(engine: AsyncLLMEngine, params: SamplingParams, tag: str) -> list[RequestOutput]:
    async def go():
        return await asyncio.gather(*[final(engine, p, params, f"{tag}-{i}") for i, p in enumerate(PROMPTS)])
    return asyncio.run(go())


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=10, temperature=0.9, seed=3, n=2, logprobs=2),
    SamplingParams(max_tokens=16, temperature=0.0, stop=["e"], ignore_eos=True),
], ids=["greedy", "seeded-n2-logprobs", "stop-string"])
@pytest.mark.slow
def test_same_outputs_as_in_process(config, remote, params):
    local = AsyncLLMEngine(config)
    try:
        expected = run_all(local, params, "local")
    finally:
        local.shutdown()
    got = run_all(remote, params, "remote")
    for e, g in zip(expected, got):
        assert g.prompt_token_ids == e.prompt_token_ids
        for ce, cg in zip(e.outputs, g.outputs):
            assert (cg.token_ids, cg.text, cg.finish_reason, cg.stop_reason) == \
                   (ce.token_ids, ce.text, ce.finish_reason, ce.stop_reason)
            if ce.logprobs is not None:
                assert [(lp.token_id, round(lp.logprob, 4)) for lp in cg.logprobs] == \
                       [(lp.token_id, round(lp.logprob, 4)) for lp in ce.logprobs]
    wait_idle(remote)
    assert remote.kv_cache_info()["num_blocks"] == remote.get_scheduler_stats().num_blocks_total
    assert remote.core_info()["engine_process"] and remote.core_info()["pid"] != os.getpid()


def test_streamed_deltas_add_up(remote):
    async def go():
        pieces, last = [], None
        async for out in remote.generate("the lazy dog", SamplingParams(max_tokens=20, temperature=0.0), "stream"):
            pieces.append(out.outputs[0].delta_text)
            last = out
        return pieces, last
    pieces, last = asyncio.run(go())
    assert len(pieces) > 1 and "".join(pieces) == last.outputs[0].text


def test_checks_and_refusals_cross_over(remote):
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        asyncio.run(final(remote, [1] * 10, SamplingParams(max_tokens=100000), "too-long"))
    # An unsatisfiable constraint is compiled and refused in the core: a 400 for the caller.
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(InvalidRequestError):
        asyncio.run(final(remote, "x", params, "bad-regex"))
    out = asyncio.run(final(remote, "x", SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), "choice"))
    assert out.outputs[0].text in ("yes", "no")


def test_abort_frees_the_request_in_the_core(remote):
    async def go():
        stream = remote.generate("abc", SamplingParams(max_tokens=200, ignore_eos=True), "to-abort")
        async for _ in stream:
            break
        await stream.aclose()
    asyncio.run(go())
    # The core ends it and frees its blocks; its next result says so.
    asyncio.run(final(remote, "z", SamplingParams(max_tokens=1), "poke"))
    wait_idle(remote)
    assert not remote.engine.has_unfinished_requests()


@pytest.mark.slow
def test_killed_core_fails_its_requests_then_restarts(config):
    engine = AsyncLLMEngine(config, engine_process=True)
    try:
        pid = engine.core_info()["pid"]

        async def go():
            stream = engine.generate("abc", SamplingParams(max_tokens=240, ignore_eos=True), "doomed")
            async for _ in stream:
                os.kill(pid, signal.SIGKILL)
            return None
        with pytest.raises(EngineDeadError, match="exited"):
            asyncio.run(go())
        deadline = time.monotonic() + 120
        while True:
            try:
                engine.check_health()
                break
            except EngineDeadError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        out = asyncio.run(final(engine, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), "after"))
        assert len(out.outputs[0].token_ids) == 4
        info = engine.core_info()
        assert info["restarts"] == 1 and info["pid"] not in (pid, None)
    finally:
        engine.shutdown()


def test_values_msgpack_cannot_carry_are_refused_not_crashed(remote):
    """Found by the soak: a seed of 2**70 was a 500 once requests crossed to the engine process."""
    with pytest.raises(InvalidRequestError, match="64 bits"):
        SamplingParams(seed=2**70)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**70])
    with pytest.raises(InvalidRequestError, match="cannot be passed to the engine"):
        asyncio.run(final(remote, "x", SamplingParams(max_tokens=2, stop=["\ud800"]), "surrogate"))
    out = asyncio.run(final(remote, "x", SamplingParams(max_tokens=2, seed=2**63 - 1), "big-seed"))
    assert len(out.outputs[0].token_ids) == 2


def test_lora_adapter_added_at_run_time_serves_across_the_process(config, tmp_path):
    """An adapter checked in this process crosses over as a spec; requests naming it get the
    tokens the in-process engine gives, and an unknown adapter is a 400-class refusal."""
    import dataclasses

    from tiny_model import write_peft

    from tessera.llm import LLM
    from tessera.models.adapters import read_adapter

    lora_config = dataclasses.replace(config, enable_lora=True, max_lora_rank=16)
    engine = AsyncLLMEngine(lora_config, engine_process=True)
    try:
        path = write_peft(tmp_path / "a", engine.model_config, 8, seed=3)
        engine.add_lora(read_adapter("a", path, engine.model_config, 16))
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

        async def go(name):
            out = None
            async for out in engine.generate([1, 2, 3, 4, 5], params, f"lora-{name}", lora_name=name):
                pass
            return out
        got = asyncio.run(go("a"))
        with pytest.raises(InvalidRequestError, match="does not exist"):
            asyncio.run(go("missing"))
        wait_idle(engine)
    finally:
        engine.shutdown()
    llm = LLM(**{**lora_config.__dict__, "lora_modules": [f"a={path}"]})
    want = llm.generate([[1, 2, 3, 4, 5]], params, lora="a")[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
