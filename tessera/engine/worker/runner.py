"""Executes one scheduled step: pack tokens, run the model once, sample.

All scheduled tokens of a step go through each layer as one packed batch
without padding; attention alone looks at request boundaries (AttentionMetadata).
The runner reads only the scheduler's plain output (engine/core/scheduler_output.py) and
owns the KV cache's tensors; `ModelRunnerBase` is what the engine core asks of any
runner, so one for another device or process is a new class beside this one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from tessera.attention import AttentionBackend
from tessera.attention.kv_groups import KVCacheGroups
from tessera.config import EngineConfig, ModelConfig
from tessera.engine.core.scheduler_output import ScheduledChunk, SchedulerOutput
from tessera.engine.worker.image_cache import ImageEmbeddings
from tessera.engine.worker.model_executor import ModelExecutor
from tessera.engine.worker.penalty_history import PenaltyHistories
from tessera.engine.worker.sampler import Sampler
from tessera.engine.worker.structured_output import apply_grammar_bitmask
from tessera.models.base import ModelBase
from tessera.models.lora_weights import LoRAModel, LoRAWeights


@dataclass
class RunnerOutput:
    # request id -> tokens emitted this step: one, or a verified run of proposals plus one
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]]  # aligned with `sampled`
    num_prompt_tokens: int  # tokens computed that were not a decode of the last sampled token
    # request id -> (proposed, accepted), for each request that verified proposals this step
    spec_results: dict[str, tuple[int, int]] = field(default_factory=dict)
    mask_time: Optional[float] = None  # seconds spent applying structured-output masks this step, if any
    # request id -> its embedding (float32 values), for each pooling chunk of the step
    pooled: dict[str, list[float]] = field(default_factory=dict)


class ModelRunnerBase(ABC):
    """What the engine core needs of a runner: execute a step, and read and write whole KV
    blocks (the disk tier, KV transfers between replicas)."""

    # The sampler whose generator unseeded requests draw from (calibration saves and restores
    # its state so timing steps never shift seeded output).
    sampler: Sampler

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Copy blocks as asked, run the model over the scheduled chunks, sample."""

    @abstractmethod
    def block_bytes(self) -> int:
        """Bytes of one pool block, all its slots (what `read_blocks` returns per block)."""

    @abstractmethod
    def read_blocks(self, block_ids: list[int]) -> bytes:
        """The blocks' contents, one block after the other."""

    @abstractmethod
    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Fill blocks from `read_blocks`-shaped payloads."""


class ModelRunner(ModelRunnerBase):
    """The PyTorch runner: the model and its paged KV cache on one device, the attention
    backend's (host memory, or a GPU's with the triton backend: inputs are copied there once a
    step and only the sampled ids come back). Which execution path each step's forward takes
    is the runner's choice (`ModelExecutor`), from what the model offers."""

    def __init__(self, model: ModelBase, model_config: ModelConfig, config: EngineConfig,
                 backend: AttentionBackend, num_blocks: int, num_host_blocks: int, dtype: torch.dtype,
                 groups: KVCacheGroups, num_state_rows: int = 0) -> None:
        """`num_state_rows`: rows of each recurrent layer's state tensors (the request slots, then
        the prefix cache's snapshots); 0: one per sequence."""
        self.model = model
        self.config = config
        self.backend = backend
        self.executor = ModelExecutor(model, enforce_eager=config.enforce_eager)
        self.block_size = config.block_size
        self.groups = groups
        self.device = backend.device
        mc = model_config
        if not mc.is_causal:
            # An encoder keeps no KV (its attention is bidirectional over each whole input, see
            # AttentionBackend.forward_bidirectional): the blocks are the scheduler's bookkeeping only.
            self.kv_slots, self.host_slots = [], []
            self.kv_caches: list = [None] * mc.num_layers
            self.state_caches: list[list[torch.Tensor]] = []
        else:
            # One tensor per slot of a pool block (every layer's own without sliding-window groups);
            # each layer reads its slot's (attention/kv_groups.py).
            self.kv_slots = backend.allocate(groups.num_slots, num_blocks, config.block_size, mc.num_kv_heads,
                                             mc.head_dim, dtype)
            self.kv_caches = groups.layer_caches(self.kv_slots)
            # Recurrent layers keep a state per request instead: a layer's tensors (a convolution's
            # inputs; Mamba-2's SSM state too), a row per state slot (the scheduler's; one per
            # sequence the engine runs at once).
            rows = num_state_rows or config.max_num_seqs
            self.state_caches = [[torch.zeros(rows, *shape, dtype=torch.float32 if f32 else dtype,
                                              device=self.device) for shape, f32 in mc.state_shapes(i)]
                                 for i in mc.state_layers()]
            self.kv_caches = interleave_layers(self.kv_caches, self.state_caches, mc.state_layers())
            # Host copies for swapped-out requests (untouched until used; pinned beside a GPU cache).
            self.host_slots = backend.allocate(groups.num_slots, num_host_blocks, config.block_size,
                                               mc.num_kv_heads, mc.head_dim, dtype,
                                               host=True) if num_host_blocks > 0 else []
        self.sampler = Sampler(config.seed)
        self.histories = PenaltyHistories()  # the tokens penalties read, for the requests that use them
        self.lora: Optional[LoRASlotMap] = None  # set by enable_lora
        # A vision-language model's encoder outputs (None for a text model).
        self.images = (ImageEmbeddings(model.encode_images, self.device)
                       if getattr(model_config, "vision", None) is not None else None)

    def enable_lora(self, weights_of: Callable[[str], LoRAWeights], dtype: torch.dtype) -> None:
        """Serve LoRA adapters (weights in `dtype`): the model's projections get slots, and a step's
        adapters are put in them by name, their weights read from `weights_of` (the engine's store)."""
        self.lora = LoRASlotMap(LoRAModel(self.model, self.config.max_loras, self.config.max_lora_rank,
                                          str(self.device), dtype), weights_of)

    def _copy_blocks(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        src, dst = (self.kv_slots, self.host_slots) if to_host else (self.host_slots, self.kv_slots)
        self.backend.copy_blocks(src, dst, src_ids, dst_ids)

    def block_bytes(self) -> int:
        """Bytes of one pool block, all its slots (what `read_blocks` returns per block)."""
        return sum(c[:, :, 0].numel() * c.element_size() for c in self.kv_slots)

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> bytes:
        """The blocks' contents, all slots, one block after the other (for the disk tier)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        parts = [c[:, :, idx].movedim(2, 0).reshape(len(block_ids), -1).view(torch.uint8) for c in self.kv_slots]
        return torch.cat(parts, dim=1).cpu().numpy().tobytes()

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Fill blocks from `read_blocks`-shaped payloads."""
        n = len(block_ids)
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(n, -1).to(self.device)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        at = 0
        for c in self.kv_slots:
            shape = c[:, :, 0].shape
            size = c[:, :, 0].numel() * c.element_size()
            chunk = data[:, at:at + size].contiguous().view(c.dtype).view(n, *shape)
            c[:, :, idx] = chunk.movedim(0, 2)
            at += size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._copy_blocks(out.swap_out, to_host=True)
        self._copy_blocks(out.swap_in, to_host=False)
        for src, dst in out.state_copies:  # saved into snapshot rows, restored into slots, in order
            for layer in self.state_caches:
                for t in layer:
                    t[dst] = t[src]
        self.histories.drop(out.finished)
        self.histories.drop(out.preempted)
        if self.images is not None:
            self.images.forget(out.finished)
        self.histories.start(out.scheduled)
        if out.kv_loads:
            self.write_blocks([b for b, _ in out.kv_loads], [p for _, p in out.kv_loads])
        if out.is_empty:
            return RunnerOutput({}, {}, 0)
        # Decode rows first, as the attention metadata wants; a verified run of proposals joins
        # them as one decode row per position (below). With adapters, each adapter's rows together
        # within both (its updates are then products over row ranges, layers/lora.py).
        slot_of = self.lora.place(out.scheduled) if self.lora is not None else {}
        order = sorted(out.scheduled, key=lambda s: (s.num_new_tokens - s.num_spec_tokens != 1,
                                                     slot_of.get(s.lora_name, -1) if slot_of else 0))
        input_ids: list[int] = []
        positions: list[int] = []
        qlens, seqlens, tables = [], [], []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        spec_rows: list[int] = []
        spec_chunks: list[ScheduledChunk] = []
        pool_chunks: list[tuple[int, ScheduledChunk]] = []  # (first row, chunk) of each pooling chunk
        num_prompt = 0
        row_slots: list[int] = []
        image_chunks: list[tuple[int, ScheduledChunk]] = []  # (first row, chunk) of chunks over images
        for s in order:
            if s.images:
                image_chunks.append((len(input_ids), s))
            if slot_of:
                row_slots.extend([slot_of.get(s.lora_name, -1)] * s.num_new_tokens)
            start, n, k = s.start, s.num_new_tokens, s.num_spec_tokens
            if s.pooling is not None:
                pool_chunks.append((len(input_ids), s))
            input_ids.extend(s.token_ids)
            positions.extend(range(start, start + n))
            if k:
                spec_rows.extend(range(len(input_ids) - n, len(input_ids)))
                spec_chunks.append(s)
                # Position i of the run attends to the first start + i + 1 tokens: as decode rows of
                # growing length over the same blocks, causal by construction, it goes through the
                # paged decode kernel instead of the gathered-context prefill path (2x cheaper here).
                qlens.extend([1] * n)
                seqlens.extend(range(start + 1, start + n + 1))
                tables.extend([s.block_tables] * n)
            else:
                qlens.append(n)
                seqlens.append(start + n)
                tables.append(s.block_tables)
            if not s.is_decode:
                num_prompt += n  # prefill (or recompute) rather than a decode step
            if s.samples and not k:
                sample_rows.append(len(input_ids) - 1)
                sample_chunks.append(s)
        meta = self.groups.build_metadata(self.backend, qlens, seqlens, tables, self.block_size)
        embeds = self.images.rows(image_chunks) if image_chunks and self.images is not None else None
        if self.state_caches:
            state_of(meta, order)
        if slot_of:
            self.lora.model.slots.begin_step(row_slots)
        try:
            hidden = self.executor.forward(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                                           torch.tensor(positions, dtype=torch.long, device=self.device),
                                           self.kv_caches, meta,
                                           lora=self.lora.model.slots if slot_of else None, embeds=embeds)
        finally:
            if slot_of:
                self.lora.model.slots.begin_step(None)
        pooled = pool(hidden, pool_chunks) if pool_chunks else {}
        rows = sample_rows + spec_rows
        if not rows:
            return RunnerOutput({}, {}, num_prompt, pooled=pooled)
        if rows != list(range(hidden.shape[0])):  # a subset, or plain rows not all ahead of the runs
            hidden = hidden.index_select(0, torch.tensor(rows, device=self.device))
        logits = self.model.compute_logits(hidden)
        mask_time = None
        if out.grammar is not None:
            logits = logits.float()
            mask_time = apply_grammar_bitmask(logits, out.grammar, sample_chunks, spec_chunks)
        sampled, logprobs, spec_results = self._sample(logits, sample_chunks, spec_chunks)
        return RunnerOutput(sampled, logprobs, num_prompt, spec_results, mask_time, pooled)

    def _sample(self, logits: torch.Tensor, sample_chunks: list[ScheduledChunk], spec_chunks: list[ScheduledChunk]):
        """Sample the plain rows (the first len(sample_chunks) of `logits`) and verify the runs
        (the rest); the emitted tokens extend the penalty histories the runner keeps."""
        n = len(sample_chunks)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] = {}
        if sample_chunks:
            result = self.sampler(logits[:n], self.histories.rows(sample_chunks))
            for c, t in zip(sample_chunks, result.token_ids):
                sampled[c.request_id] = [t]
            if result.logprobs is not None:
                logprobs.update({c.request_id: [lp] for c, lp in zip(sample_chunks, result.logprobs)
                                 if lp is not None})
        spec_results: dict[str, tuple[int, int]] = {}
        if spec_chunks:
            proposals = [c.proposal for c in spec_chunks]
            spec = self.sampler.speculative(logits[n:], self.histories.rows(spec_chunks), proposals,
                                            [c.draft_probs for c in spec_chunks])
            for c, tokens, proposal, accepted in zip(spec_chunks, spec.token_ids, proposals, spec.num_accepted):
                sampled[c.request_id] = tokens
                spec_results[c.request_id] = (len(proposal), accepted)
            if spec.logprobs is not None:
                logprobs.update({c.request_id: lp for c, lp in zip(spec_chunks, spec.logprobs) if lp is not None})
        if len(self.histories):
            self.histories.append(sampled)
        return sampled, logprobs, spec_results


class LoRASlotMap:
    """Which adapter each of the model's LoRA slots holds, kept across steps: a step's adapters
    get slots (the least recently used one not needed this step is given up first) and only an
    adapter entering a slot costs anything (its tensors' addresses written, no copy). The
    scheduler never puts more than max_loras adapters in one step."""

    def __init__(self, model: LoRAModel, weights_of: Callable[[str], LoRAWeights]) -> None:
        self.model = model
        self.weights_of = weights_of
        self.held: OrderedDict[int, tuple[str, LoRAWeights]] = OrderedDict()  # slot -> (name, weights), LRU first

    def place(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """Slots for the chunks' adapters (empty when none has one)."""
        names = list(dict.fromkeys(c.lora_name for c in chunks if c.lora_name is not None))
        if not names:
            return {}
        if len(names) > self.model.slots.max_loras:
            raise RuntimeError(f"{len(names)} adapters in one step, above --max-loras {self.model.slots.max_loras}")
        slot_of: dict[str, int] = {}
        for name in names:
            weights = self.weights_of(name)
            for slot, (held_name, held) in self.held.items():
                if held_name == name and held is weights:
                    slot_of[name] = slot
                    self.held.move_to_end(slot)
                    break
        for name in names:
            if name in slot_of:
                continue
            used = set(slot_of.values())
            free = [s for s in range(self.model.slots.max_loras) if s not in self.held]
            slot = free[0] if free else next(s for s in self.held if s not in used)
            weights = self.weights_of(name)
            self.model.assign(slot, weights)
            self.held.pop(slot, None)
            self.held[slot] = (name, weights)
            slot_of[name] = slot
        return slot_of


def interleave_layers(attention: list[torch.Tensor], state: list[list[torch.Tensor]],
                      state_layers: list[int]) -> list:
    """Every layer's cache in layer order: the attention layers' K/V (in their order) with each
    recurrent layer's state tensors at its own index."""
    at, st = iter(attention), iter(state)
    marks = set(state_layers)
    return [next(st) if i in marks else next(at) for i in range(len(attention) + len(state))]


def state_of(meta, chunks: list[ScheduledChunk]) -> None:
    """The step's state slots, per request in the packed order (a model with recurrent layers
    verifies no proposals, so each chunk is one request of the metadata)."""
    if any(s.state_slot is None or s.num_spec_tokens for s in chunks):
        raise RuntimeError("a chunk of a model with recurrent layers came without a state slot, or with proposals")
    meta.state_slots = [s.state_slot for s in chunks]
    meta.state_continues = [s.start > 0 for s in chunks]


def pool(hidden: torch.Tensor, chunks: list[tuple[int, ScheduledChunk]]) -> dict[str, list[float]]:
    """Each pooling chunk's embedding from its rows of the step's final hidden states: the mean
    of its tokens, its first ([CLS]) or its last, in float32; then cut to the dimensions asked
    and L2-normalised where the pooling says (sentence-transformers' Normalize module), as
    vLLM's pooler does. One index_add for every mean of the step, not one per request."""
    hidden = hidden.float().cpu()  # embeddings go back as lists: the few rows pooled, on the host
    starts = torch.tensor([row for row, _ in chunks])
    lens = torch.tensor([c.num_new_tokens for _, c in chunks])
    kinds = [c.pooling.pooling for _, c in chunks]
    vectors = torch.empty(len(chunks), hidden.shape[1])
    if "mean" in kinds:
        owner = torch.repeat_interleave(torch.arange(len(chunks)), lens)
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())])
        sums = torch.zeros_like(vectors).index_add_(0, owner, hidden.index_select(0, rows))
        means = sums / lens.unsqueeze(1)
    for i, kind in enumerate(kinds):
        vectors[i] = means[i] if kind == "mean" else hidden[starts[i] if kind == "cls" else starts[i] + lens[i] - 1]
    params = [c.pooling for _, c in chunks]
    if all(p.dimensions is None and p.normalize for p in params):  # the usual case: one call for all
        return dict(zip((c.request_id for _, c in chunks), F.normalize(vectors, dim=1).tolist()))
    out: dict[str, list[float]] = {}
    for i, (_, c) in enumerate(chunks):
        p = c.pooling
        v = vectors[i] if p.dimensions is None else vectors[i, :p.dimensions]
        out[c.request_id] = (F.normalize(v, dim=0) if p.normalize else v).tolist()
    return out
