"""AsyncLLMEngine's hand-over of a step's outputs to the callers' event loop (fake core)."""
from __future__ import annotations

import asyncio

from fakes import fake_engine

from tessera.engine.frontend import async_engine
from tessera.sampling_params import SamplingParams


def test_a_steps_outputs_reach_the_callers_loop_in_one_wake_up(monkeypatch):
    """Each call_soon_threadsafe writes to the loop's self-pipe and wakes it: a step's outputs for
    six streams on one loop go in one call, and every stream still gets all its tokens."""
    engine = fake_engine(max_num_seqs=8)
    calls: list[int] = []
    put_all = async_engine._put_all
    monkeypatch.setattr(async_engine, "_put_all", lambda puts: (calls.append(len(puts)), put_all(puts)))

    async def one(i: int) -> int:
        last = None
        async for out in engine.generate(f"prompt {i}", SamplingParams(max_tokens=12, ignore_eos=True), f"r{i}"):
            last = out
        return len(last.outputs[0].token_ids)

    async def main() -> list[int]:
        return list(await asyncio.gather(*(one(i) for i in range(6))))

    try:
        assert asyncio.run(main()) == [12] * 6
    finally:
        engine.shutdown()
    assert sum(calls) >= 6 * 12 and max(calls) == 6
    assert len(calls) <= engine.engine.num_steps
