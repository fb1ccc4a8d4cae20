"""Checks every model with recurrent layers (LFM2, Granite 4.0-H) is held to: transformers' logits
in one pass and token by token (each pass reading the states the earlier ones left), no one-call C
decode step, and every state slot and block free once its requests are done."""
from __future__ import annotations

import torch

from tessera.llm import LLM
from tessera.models.base import ExecutionPath
from tessera.models.loader import forward_single
from tessera.sampling_params import SamplingParams


def assert_logits_match(model, loaded, ids: list[int], atol: float = 1e-4) -> None:
    """`model`: transformers' (float32); `loaded`: Tessera's of the same file."""
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (forward_single(loaded, ids) - ref).abs().max().item() < atol
    assert (forward_single(loaded, ids, chunk=1) - ref).abs().max().item() < atol
    assert ExecutionPath.C_DECODE not in loaded.model.execution_paths()
    assert loaded.model.decode_step_limits() == ["recurrent layers"]
    assert loaded.model.family.decode_step() == "no: recurrent layers"


def generate_all_free(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's tokens; afterwards every state slot and KV block is free again."""
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.scheduler.stats()
    assert stats.num_state_slots_total > 0 and stats.num_state_slots_used == 0
    assert stats.num_blocks_free == stats.num_blocks_total
    return tokens
