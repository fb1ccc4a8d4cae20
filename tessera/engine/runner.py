"""Executes one scheduled step: pack tokens, run the model once, sample.

All scheduled tokens of a step go through each layer as one packed batch
without padding; attention alone looks at request boundaries (AttentionMetadata).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.attention import AttentionBackend
from tessera.config import EngineConfig, ModelConfig
from tessera.engine.request import Request
from tessera.engine.sampler import Sampler
from tessera.engine.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token, for requests that reached their end
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    num_prompt_tokens: int  # tokens computed that were not a decode of the last sampled token


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 backend: AttentionBackend, num_blocks: int, num_host_blocks: int, dtype: torch.dtype) -> None:
        self.model = model
        self.config = config
        self.backend = backend
        self.block_size = config.block_size
        mc = model_config
        self.kv_caches = backend.allocate(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads,
                                          mc.head_dim, dtype)
        # Host copies for swapped-out requests (pinned memory would go here on a GPU).
        self.host_caches = backend.allocate(mc.num_layers, num_host_blocks, config.block_size, mc.num_kv_heads,
                                            mc.head_dim, dtype) if num_host_blocks > 0 else []
        self.sampler = Sampler(config.seed)

    def _copy_blocks(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        src, dst = (self.kv_caches, self.host_caches) if to_host else (self.host_caches, self.kv_caches)
        self.backend.copy_blocks(src, dst, src_ids, dst_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._copy_blocks(out.swap_out, to_host=True)
        self._copy_blocks(out.swap_in, to_host=False)
        if out.is_empty:
            return RunnerOutput({}, {}, 0)
        order = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        qlens, seqlens, tables = [], [], []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        num_prompt = 0
        for s in order:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            input_ids.extend(r.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            qlens.append(n)
            seqlens.append(start + n)
            tables.append(r.block_ids)
            if not (n == 1 and r.output_token_ids and start == r.num_tokens - 1):
                num_prompt += n  # prefill (or recompute) rather than a decode step
            if s.produces_token:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(r)
        meta = self.backend.build_metadata(qlens, seqlens, tables, self.block_size)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long),
                            torch.tensor(positions, dtype=torch.long), self.kv_caches, meta)
        if not sample_reqs:
            return RunnerOutput({}, {}, num_prompt)
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(sample_rows))
        logits = self.model.compute_logits(hidden)
        result = self.sampler(logits, sample_reqs)
        sampled = {r.request_id: t for r, t in zip(sample_reqs, result.token_ids)}
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {r.request_id: lp for r, lp in zip(sample_reqs, result.logprobs) if lp is not None}
        return RunnerOutput(sampled, logprobs, num_prompt)
