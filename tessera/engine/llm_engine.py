"""The synchronous engine: scheduler decides, KV manager owns blocks, runner executes.

`step()` runs one iteration of the loop and returns what each request gained.
Everything user-facing (validation, detokenization, stop strings, n > 1
fan-out) lives here too, so the server and the offline `LLM` share it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Union

import torch

from tessera.attention import get_backend
from tessera.attention.kv_groups import KVCacheGroups
from tessera.config import EngineConfig
from tessera.engine.errors import StepFailedError
from tessera.engine.cost_model import StepCostModel, calibrate, load_cached, save_cached
from tessera.engine.kv_cache_manager import KVCacheManager
from tessera.engine.input_processor import InputLimits, InputProcessor, PreparedRequest
from tessera.engine.kv_offload import DiskKVTier
from tessera.engine.outputs import CompletionOutput, KVTransfer, RequestOutput, TokenLogprob
from tessera.engine.request import Request, RequestStatus
from tessera.engine.runner import ModelRunner
from tessera.engine.sampler import Sampler
from tessera.engine.scheduler import LoadSnapshot, ScheduledRequest, Scheduler, SchedulerOutput
from tessera.engine.spec_decode import (
    DraftModelProposer, LayerSkipProposer, Proposer, SpeculationPolicy, build_ngram, default_draft_layers,
    propose_all,
)
from tessera.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from tessera.engine.structured_output import StructuredOutputManager
from tessera.hostinfo import available_memory, cpu_model_name, source_digest
from tessera.kernels import KernelUnavailable
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.sizing import activation_bytes, default_kv_cache_memory

logger = logging.getLogger("tessera")

DEFAULT_MAX_MODEL_LEN = 4096
CALIBRATION_BUDGET_S = 3.0  # start-up time the step-cost calibration may take; online refinement does the rest


@dataclass
class _Child:
    req: Request
    detok: object
    out: CompletionOutput
    emitted: int = 0  # characters of out.text already handed out as deltas
    tokens_sent: int = 0
    logprobs_sent: int = 0


@dataclass
class _Parent:
    prepared: PreparedRequest
    children: list[_Child] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.out.finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None) -> None:
        from tessera.models.loader import load_model
        from tessera.models.registry import resolve_model

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if loaded is None:
            path = resolve_model(config.model)
            loaded = load_model(path, config.dtype, quantization=config.quantization,
                                dense_copy=config.dense_copy, weight_cache=config.weight_cache)
        self.loaded = loaded
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype
        mc = self.model_config

        max_model_len = config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > mc.max_position_embeddings:
            raise InvalidRequestError(
                f"--max-model-len {max_model_len} exceeds the model's limit of {mc.max_position_embeddings}")
        self.kv_groups = KVCacheGroups.for_engine(mc, config)
        groups = self.kv_groups
        if any(mc.layer_windows()) and not groups.hybrid:
            logger.info("sliding-window layers keep every block of the context (%s)",
                        "--disable-hybrid-kv-cache-manager" if config.disable_hybrid_kv_cache_manager
                        else "--kv-offload-dir stores whole-context blocks")
        try:
            self.attn_backend = get_backend(config.attention_backend, config.kv_cache_dtype)
            bytes_per_block = self.attn_backend.bytes_per_block(groups.num_slots, mc.num_kv_heads, mc.head_dim,
                                                                config.block_size, self.dtype)
        except (ValueError, KernelUnavailable) as exc:
            raise InvalidRequestError(str(exc)) from None
        spec = config.speculative_config
        self.draft = self._load_draft(config) if spec is not None and spec.method == "draft_model" else None
        if self.draft is not None:  # its cache shares the target's block ids, so every block holds both
            dc = self.draft.config
            bytes_per_block += self.attn_backend.bytes_per_block(dc.num_layers, dc.num_kv_heads, dc.head_dim,
                                                                 config.block_size, self.draft.dtype)
        kv_memory = config.kv_cache_memory
        if kv_memory is None:  # what the sequences need at full length, within free memory (tessera/sizing.py)
            swap = config.swap_space if config.preemption_mode == "swap" else 0
            others = swap + activation_bytes(mc, config, self.dtype, loaded.quant.dense_copy)
            blocks_needed = config.max_num_seqs * groups.blocks_per_sequence(max_model_len, config.block_size)
            kv_memory = default_kv_cache_memory(blocks_needed * bytes_per_block, available_memory(), others)
        num_blocks = kv_memory // bytes_per_block
        self.kv_capacity_tokens = groups.max_tokens(num_blocks, config.block_size, config.max_num_batched_tokens)
        if self.kv_capacity_tokens < 1:
            raise InvalidRequestError(
                f"--kv-cache-memory {kv_memory} bytes holds no sequence in blocks of {bytes_per_block} bytes")
        num_host_blocks = config.swap_space // bytes_per_block if config.preemption_mode == "swap" else 0
        self.config = replace(config, max_model_len=max_model_len, kv_cache_memory=num_blocks * bytes_per_block)

        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 num_host_blocks, hash_extra=str(config.model), groups=groups)
        self.structured = StructuredOutputManager(self.tokenizer, mc.vocab_size)
        self.inputs = InputProcessor(self.tokenizer, InputLimits(mc.vocab_size, max_model_len,
                                                                 self.kv_capacity_tokens))
        self.runner = ModelRunner(loaded.model, mc, self.config, self.attn_backend, num_blocks, num_host_blocks,
                                  self.dtype, groups, self.structured)
        logger.info("%s", self.config.profile_summary())
        self.cost_model = self._calibrate_cost_model()
        logger.info("step-cost model: %s", self.cost_model.summary())
        self.scheduler = Scheduler(self.config, self.kv, max_model_len, self.cost_model)
        self.offload = self._build_offload()
        self._offload_seen = (0, 0)  # the tier's bytes read and written, as last reported
        self.kv.offload = self.offload  # only now: calibration's synthetic blocks are not written
        self.proposer = self._build_proposer(num_blocks) if spec is not None else None
        self.spec_policy = SpeculationPolicy(spec.num_speculative_tokens, spec.disable_by_batch_size) \
            if spec is not None else None
        if spec is not None:
            logger.info("speculative decoding: %s, %d tokens, off above %d running request(s) or with a queue",
                        spec.method, spec.num_speculative_tokens, spec.disable_by_batch_size)
        self.parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, str] = {}
        self._aborted: list[str] = []  # parents aborted since the last step, to report
        self._step_touched: Optional[list[Request]] = None  # requests the running step works on
        # Per sequence of max_model_len tokens (sliding-window groups hold less of a long one).
        per_sequence = groups.blocks_per_sequence(max_model_len, config.block_size)
        self.kv_tokens_per_gib = max_model_len * 2**30 / (per_sequence * bytes_per_block)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.0f MiB, %s, %s, %.0f tokens per GiB at max_model_len); "
            "max concurrency at max_model_len %d: %.1f", num_blocks, config.block_size,
            num_blocks * bytes_per_block / 2**20, self.kv_cache_format, groups.describe(), self.kv_tokens_per_gib,
            max_model_len, (num_blocks - (1 if groups.hybrid else 0)) / per_sequence)
        self._log_memory()

    def _log_memory(self) -> None:
        """Resident memory now, next to `tessera size`'s prediction for this process (the KV
        cache's pages count once requests have touched them, so start-up is below the prediction).
        `tessera size` prints the whole server by default, front-end process included; this line
        compares like with like (this process) and names the difference, so the two figures a user
        sees do not look contradictory."""
        from tessera.hostinfo import resident_bytes
        from tessera.sizing import estimate

        try:
            e = estimate(self.config, engine_process=True)
        except Exception as exc:  # noqa: BLE001 - a log line must not stop a start (e.g. an unregistered path)
            logger.debug("no memory prediction: %s", exc)
            return
        logger.info("memory: %.0f MiB resident at start-up in this process; `tessera size` predicts %.0f MiB for "
                    "it once the KV cache is in use (%.0f MiB for the server with its front-end process, "
                    "`--no-engine-process` drops that)", resident_bytes() / 2**20,
                    (e.total_bytes - e.frontend_bytes) / 2**20, e.total_bytes / 2**20)

    # -- disk tier of the prefix cache ----------------------------------------------
    def _build_offload(self) -> Optional[DiskKVTier]:
        c, mc = self.config, self.model_config
        if c.kv_offload_dir is None:
            return None
        from tessera.models.registry import model_digest

        fields = {"model_sha256": model_digest(self.loaded.path), "dtype": str(self.dtype),
                  "kv_cache": self.kv_cache_format, "block_size": c.block_size, "layers": mc.num_layers,
                  "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "hash_extra": str(c.model),
                  "format": 3}  # 3: int8 keys less their key bias's exact share (attention/base.py KeyBias)
        return DiskKVTier(Path(c.kv_offload_dir).expanduser(), c.kv_offload_size, fields, self.runner.block_bytes())

    def _offload_step(self, sched: SchedulerOutput, stats: IterationStats, load_s: float) -> None:
        """Write the blocks that entered the RAM prefix cache this step (copied now, written by the
        tier's thread) and account for what the step loaded."""
        assert self.offload is not None
        tier = self.offload
        fresh = [(b, h) for b, h in self.kv.take_offload() if not tier.contains(h)]
        if fresh:
            tier.submit([h for _, h in fresh], self.runner.read_blocks([b for b, _ in fresh]))
        read, written = tier.stats.bytes_read, tier.stats.bytes_written
        stats.kv_offload_bytes_read, stats.kv_offload_bytes_written = read - self._offload_seen[0], \
            written - self._offload_seen[1]
        self._offload_seen = (read, written)
        if sched.kv_loads:
            stats.external_prefix_cache_hits = len(sched.kv_loads) * self.config.block_size
            stats.kv_offload_saved_seconds = self.cost_model.predict(sched.kv_loaded_shape) - load_s

    def warm_up(self) -> None:
        """Pay first-request costs now: the chat template's compilation, here, and the grammar
        compiler's reading of the vocabulary (~1 s for Qwen's), in a background thread."""
        self.tokenizer.warm_up()
        threading.Thread(target=self.structured.warm_up, name="tessera-grammar-warm-up", daemon=True).start()

    def close(self) -> None:
        """Finish writing what the disk tier was handed (at shutdown; the engine stays usable)."""
        if self.offload is not None:
            self.offload.flush()
        self.structured.close()

    # -- speculative decoding -----------------------------------------------------
    def _load_draft(self, config: EngineConfig):
        """The draft model of `draft_model` speculation, checked against the target's tokenizer."""
        from tessera.models.loader import load_model
        from tessera.models.registry import resolve_model

        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        draft = load_model(resolve_model(spec.model), self.dtype, quantization=spec.quantization or config.quantization,
                           dense_copy=config.dense_copy, weight_cache=config.weight_cache)
        probe = "def add(a, b):\n    return a + b  # Grüße, 你好 🙂"
        same = (draft.tokenizer.encode(probe, add_special_tokens=False)
                == self.tokenizer.encode(probe, add_special_tokens=False)
                and set(draft.tokenizer.eos_token_ids) <= set(self.tokenizer.eos_token_ids))
        if not same:
            raise InvalidRequestError(
                f"--speculative-config: draft model {spec.model!r} does not share the tokenizer of "
                f"{config.model!r}; a draft model must tokenize exactly as the target does")
        return draft

    def _build_proposer(self, num_blocks: int) -> Proposer:
        spec = self.config.speculative_config
        assert spec is not None
        if spec.method == "ngram":
            return build_ngram(spec)
        sampler = Sampler(self.config.seed + 1)
        if spec.method == "layer_skip":
            n = self.model_config.num_layers
            layers = spec.draft_layers or default_draft_layers(n)
            if layers[-1] >= n:
                raise InvalidRequestError(f"--speculative-config: draft_layers must be below {n}, the number "
                                          f"of layers of {self.config.model!r}")
            logger.info("layer-skip drafting with layers %s of %d", _ranges(layers), n)
            return LayerSkipProposer(self.loaded.model, self.runner.kv_caches, self.attn_backend,
                                     self.config.block_size, layers, sampler, self.kv_groups)
        assert self.draft is not None
        dc = self.draft.config
        caches = self.attn_backend.allocate(dc.num_layers, num_blocks, self.config.block_size, dc.num_kv_heads,
                                            dc.head_dim, self.draft.dtype)
        logger.info("draft model %s: %d layers, its KV cache in the same %d blocks", self.draft.path.name,
                    dc.num_layers, num_blocks)
        return DraftModelProposer(self.draft.model, caches, self.attn_backend, self.config.block_size,
                                  self.model_config.vocab_size, sampler, self.config.max_num_batched_tokens)

    # -- step-cost model --------------------------------------------------------
    def _calibrate_cost_model(self) -> StepCostModel:
        """Time synthetic steps on free KV blocks (nothing is cached or running yet) and fit the model.

        The fit is kept in $TESSERA_HOME/cost_models under a key of everything that changes step
        times (model, dtype, weights' storage, step limits, threads, CPU, Tessera's source), so a
        restart skips the ~3 s; online correction absorbs what differs today.
        """
        from tessera.models.registry import tessera_home

        c = self.config
        path = tessera_home() / "cost_models" / f"{self._cost_model_key()}.json"
        cached = load_cached(path)
        if cached is not None:
            logger.info("step-cost model: calibration reused from %s", path)
            return cached
        state = self.runner.sampler.generator.get_state()  # calibration must not shift seeded output
        try:
            model = calibrate(self._synthetic_step, max_tokens=c.max_num_batched_tokens, max_rows=c.max_num_seqs,
                              max_context=c.max_model_len, budget_s=CALIBRATION_BUDGET_S)
        finally:
            self.runner.sampler.generator.set_state(state)
        save_cached(path, model)
        return model

    def _cost_model_key(self) -> str:
        c = self.config
        parts = {
            "model": dataclasses.asdict(self.model_config), "path": str(self.loaded.path),
            "dtype": str(self.dtype), "quant": repr(self.loaded.quant), "backend": type(self.attn_backend).__name__,
            "kv_cache": self.kv_cache_format,
            "limits": [c.block_size, c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len],
            "threads": torch.get_num_threads(), "cpu": cpu_model_name(), "source": source_digest(),
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]

    def _synthetic_step(self, chunks: list[tuple[int, int, bool]]) -> bool:
        """Run one step of (start, tokens, samples) chunks on scratch blocks; False if they do not fit."""
        vocab = self.model_config.vocab_size
        params = SamplingParams(max_tokens=1, temperature=1.0)
        sched = SchedulerOutput()
        reqs: list[Request] = []
        try:
            for i, (start, n, samples) in enumerate(chunks):
                length = start + n + (0 if samples else 1)
                ids = [(7919 * (i + 1) + 104729 * t) % vocab for t in range(length)]
                req = Request(f"calibration-{i}", ids, params, 1, [], generator=torch.Generator().manual_seed(i))
                if not self.kv.allocate_slots(req, start + n):
                    return False
                req.num_computed_tokens = start
                reqs.append(req)
                sched.scheduled.append(ScheduledRequest(req, n))
            self.runner.execute(sched)
            return True
        finally:
            for req in reqs:
                self.kv.free(req)

    def predict_wait(self, snapshot: LoadSnapshot, prompt_tokens: int) -> Optional[float]:
        """Forecast, for a newcomer, of the time until its prompt is computed (thread-safe)."""
        return self.scheduler.predict_wait(snapshot, prompt_tokens)

    def load_snapshot(self) -> LoadSnapshot:
        return self.scheduler.load_snapshot()

    def cost_model_stats(self) -> dict:
        return self.cost_model.describe()

    def kv_cache_info(self) -> dict:
        """The KV cache's format and capacity, for /v1/engine/stats."""
        c = self.config
        return {"dtype": self.kv_cache_format, "block_size": c.block_size, "num_blocks": self.kv.num_blocks,
                "tokens": self.kv.num_blocks * c.block_size, "max_sequence_tokens": self.kv_capacity_tokens,
                "groups": self.kv_groups.describe(), "bytes": c.kv_cache_memory,
                "tokens_per_gib": round(self.kv_tokens_per_gib, 1),
                "swap_blocks": self.kv.num_host_blocks,
                "offload": None if self.offload is None else {
                    "dir": str(self.offload.dir), "blocks": self.offload.num_blocks,
                    "bytes": self.offload.disk_bytes, "max_bytes": self.offload.max_bytes,
                    "hit_tokens": self.kv.offload_hits, "bytes_read": self.offload.stats.bytes_read,
                    "bytes_written": self.offload.stats.bytes_written,
                    "files_refused": self.offload.stats.misses_rejected,
                    "writes_dropped": self.offload.stats.write_queue_dropped}}

    @property
    def kv_cache_format(self) -> str:
        """"int8" or the cache's float dtype ("bfloat16", "float32")."""
        return str(self.attn_backend.kv_cache_dtype(self.dtype)).removeprefix("torch.")

    # -- admission ------------------------------------------------------------
    def prepare_request(
        self,
        request_id: str,
        prompt: Union[str, list[int]],
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        add_special_tokens: bool = True,
    ) -> PreparedRequest:
        """Tokenize and check a request, compile its constraint; raises InvalidRequestError if it
        can never run."""
        prepared = self.inputs.process(request_id, prompt, params, arrival_time, add_special_tokens)
        if params.structured_outputs is not None:
            t0 = time.perf_counter()
            prepared.grammar = self.structured.compile(params.structured_outputs)
            prepared.grammar_compile_time = time.perf_counter() - t0
        return prepared

    def add_prepared(self, p: PreparedRequest) -> None:
        if p.request_id in self.parents:
            raise InvalidRequestError(f"request id {p.request_id!r} is already in use")
        from tessera.tokenizer import IncrementalDetokenizer

        parent = _Parent(p)
        first: Optional[Request] = None
        for i in range(p.params.n):
            gen = None
            if p.params.seed is not None:
                gen = torch.Generator().manual_seed(hash((p.params.seed, i)) & 0x7FFF_FFFF_FFFF_FFFF)
            child_id = p.request_id if p.params.n == 1 else f"{p.request_id}#{i}"
            req = Request(child_id, p.prompt_token_ids, p.params, p.max_tokens,
                          self.tokenizer.eos_token_ids, p.arrival_time, gen,
                          wait_for=first if self.config.enable_prefix_caching else None)
            if first is None and p.kv_import is not None:  # the others wait for its blocks
                req.offload_payloads = p.kv_import.blocks()
            first = first or req
            if p.grammar is not None:
                assert p.params.structured_outputs is not None
                req.grammar = self.structured.new_state(p.grammar, p.params.structured_outputs.kind)
                req.metrics.grammar_compile_time = p.grammar_compile_time
            detok = IncrementalDetokenizer(self.tokenizer, p.prompt_token_ids, p.params.skip_special_tokens)
            out = CompletionOutput(index=i, logprobs=[] if p.params.logprobs is not None else None)
            parent.children.append(_Child(req, detok, out))
            self._child_parent[child_id] = p.request_id
        self.parents[p.request_id] = parent
        for c in parent.children:
            self.scheduler.add_request(c.req)

    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time))

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final output says 'abort'."""
        parent = self.parents.get(request_id)
        if parent is None:
            return
        for c in parent.children:
            self.scheduler.finish_request(c.req, RequestStatus.FINISHED_ABORTED)
        self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    @property
    def alive(self) -> bool:
        """An in-process core lives as long as the process (a process core can die on its own)."""
        return True

    def restart(self) -> None:
        raise RuntimeError("an in-process engine core does not restart; only an engine-core process can")

    def in_flight(self) -> list[str]:
        """The (parent) requests the core holds."""
        return list(self.parents)

    def describe(self) -> dict:
        """Where the engine runs, for /v1/engine/stats."""
        return {"engine_process": False, "pid": None}

    def get_scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting()

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, _ = self.step_with_stats()
        return outputs

    def step_with_stats(self) -> tuple[list[RequestOutput], IterationStats]:
        """One step. If it raises (a fault in the model, the kernels or the sampler), the requests
        it was running are ended and their blocks freed, and StepFailedError names them: one bad
        step costs its own requests, not the server."""
        self._step_touched: Optional[list[Request]] = None
        try:
            return self._step_with_stats()
        except Exception as exc:
            touched = self._step_touched if self._step_touched is not None else list(self.scheduler.running)
            failed = self._fail_requests(touched)
            logger.exception("engine step failed; ended %d request(s): %s", len(failed), ", ".join(failed))
            raise StepFailedError(failed, exc) from exc

    def _fail_requests(self, reqs: list[Request]) -> list[str]:
        """End the parents of `reqs` now (blocks freed, no further output); returns their ids."""
        parent_ids = list(dict.fromkeys(self._child_parent[r.request_id] for r in reqs
                                        if r.request_id in self._child_parent))
        for pid in parent_ids:
            parent = self.parents.pop(pid)
            for c in parent.children:
                self.scheduler.finish_request(c.req, RequestStatus.FINISHED_ABORTED)
                self._child_parent.pop(c.req.request_id, None)
        return parent_ids

    def _step_with_stats(self) -> tuple[list[RequestOutput], IterationStats]:
        t0 = time.perf_counter()
        if self.proposer is not None and self.spec_policy is not None:
            propose_all(self.proposer, self.spec_policy, self.scheduler.running, len(self.scheduler.waiting),
                        self.config.max_model_len, self.kv)
        t_step = time.perf_counter()  # drafting is not part of the step the cost model predicts
        sched = self.scheduler.schedule()
        # What a failure from here on touched: the scheduled requests and any swapped this step.
        self._step_touched = [s.request for s in sched.scheduled] + [
            self.scheduler.requests[rid] for rid in sched.preempted if rid in self.scheduler.requests]
        t_exec = time.perf_counter()
        result = self.runner.execute(sched)
        load_s = time.perf_counter() - t_exec if sched.kv_loads else 0.0
        appended = self.scheduler.update_after_step(sched, result.sampled)
        for s in sched.scheduled:
            if s.request.grammar is not None and s.request.request_id in appended:
                s.request.grammar.advance(appended[s.request.request_id])
        now = time.time()
        stats = IterationStats(
            timestamp=now,
            num_prompt_tokens=result.num_prompt_tokens,
            num_generation_tokens=sum(len(t) for t in appended.values()),
            num_preemptions=len(sched.preempted),
            prefix_cache_queries=sched.num_prefix_queries,
            prefix_cache_hits=sched.num_prefix_hits,
            spec_results=list(result.spec_results.values()),
            structured_mask_time=result.mask_time,
        )
        if self.offload is not None:
            self._offload_step(sched, stats, load_s)
        elif sched.kv_loads:  # blocks a prefill replica computed (--pd)
            stats.external_prefix_cache_hits = len(sched.kv_loads) * self.config.block_size
        for s in sched.scheduled:
            if s.request.request_id in result.spec_results:
                proposed, accepted = result.spec_results[s.request.request_id]
                s.request.metrics.spec_draft_tokens += proposed
                s.request.metrics.spec_accepted_tokens += accepted
        touched: set[str] = set(self._aborted)
        self._aborted.clear()
        for child_id, tokens in appended.items():
            parent_id = self._child_parent.get(child_id)
            if parent_id is None:
                continue
            touched.add(parent_id)
            child = self._find_child(parent_id, child_id)
            logprobs = result.logprobs.get(child_id)
            for i, token in enumerate(tokens):
                if child.out.finished:  # a stop string ended it inside a run of accepted tokens
                    break
                self._on_token(child, token, logprobs[i] if logprobs else None, now, stats,
                               first_of_step=i == 0, last_of_step=i == len(tokens) - 1)
        outputs = []
        for parent_id in touched:
            parent = self.parents.get(parent_id)
            if parent is None:
                continue
            outputs.append(self._make_output(parent, stats))
        end = time.perf_counter()
        if sched.scheduled and not (sched.swap_in or sched.swap_out):  # block copies are not in the model
            self.cost_model.observe(sched.shape, end - t_step)
        stats.step_time = end - t0
        return outputs, stats

    def _find_child(self, parent_id: str, child_id: str) -> _Child:
        for c in self.parents[parent_id].children:
            if c.req.request_id == child_id:
                return c
        raise KeyError(child_id)

    def _on_token(self, child: _Child, token: int, logprob, now: float, stats: IterationStats,
                  first_of_step: bool = True, last_of_step: bool = True) -> None:
        """One emitted token; a step may emit several for a request (verified proposals), and
        latency is recorded once per step, the request's state (stop, length) at its last one."""
        req, out = child.req, child.out
        m = req.metrics
        if first_of_step:
            if m.first_token_time is None:
                m.first_token_time = now
                stats.time_to_first_tokens.append(now - m.arrival_time)
            else:
                stats.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
        out.token_ids.append(token)
        status = req.status if last_of_step else RequestStatus.RUNNING
        is_eos_stop = status == RequestStatus.FINISHED_STOPPED and req.stop_reason == token
        prev_len = len(out.text)
        if not is_eos_stop or not req.params.skip_special_tokens:
            out.text += child.detok.add(token)
        if logprob is not None and out.logprobs is not None:
            lp, top = logprob
            text = self.tokenizer.token_text
            out.logprobs.append(TokenLogprob(token, text(token), lp, [(t, text(t), v) for t, v in top]))
        if status == RequestStatus.FINISHED_STOPPED:
            out.finish_reason = "stop"
            out.stop_reason = req.stop_reason
        elif status == RequestStatus.FINISHED_LENGTH:
            out.finish_reason = "length"
            out.text += child.detok.flush()  # a last incomplete character, if any
        stops = req.params.stop
        if stops and not out.finished:
            tail_start = max(0, prev_len - max(len(s) for s in stops) + 1)
            hits = [(out.text.find(s, tail_start), s) for s in stops]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                out.text = out.text[:pos]
                out.finish_reason = "stop"
                out.stop_reason = s
                self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)

    def _make_output(self, parent: _Parent, stats: IterationStats) -> RequestOutput:
        p = parent.prepared
        holdback = max((len(s) for s in p.params.stop), default=1) - 1
        for c in parent.children:
            out = c.out
            if c.req.status == RequestStatus.FINISHED_ABORTED and out.finish_reason is None:
                out.finish_reason = "abort"
            end = len(out.text) if out.finished else max(c.emitted, len(out.text) - holdback)
            out.delta_text = out.text[c.emitted:end]
            c.emitted = end
            out.delta_token_ids = out.token_ids[c.tokens_sent:]
            c.tokens_sent = len(out.token_ids)
            if out.logprobs is not None:
                out.delta_logprobs = out.logprobs[c.logprobs_sent:]
                c.logprobs_sent = len(out.logprobs)
        finished = parent.finished
        first = parent.children[0].req
        transfer = self._export_kv(first) if finished and p.kv_export else None
        if finished:
            del self.parents[p.request_id]
            for c in parent.children:
                self._child_parent.pop(c.req.request_id, None)
                stats.finished.append(FinishedRequestStats(
                    request_id=c.req.request_id, finish_reason=c.out.finish_reason or "abort",
                    num_prompt_tokens=c.req.num_prompt_tokens,
                    num_generation_tokens=len(c.out.token_ids),
                    num_cached_tokens=c.req.num_cached_tokens, metrics=c.req.metrics, params=p.params))
        return RequestOutput(
            request_id=p.request_id, prompt=p.prompt, prompt_token_ids=p.prompt_token_ids,
            outputs=[replace(c.out, token_ids=list(c.out.token_ids),
                             logprobs=list(c.out.logprobs) if c.out.logprobs is not None else None)
                     for c in parent.children],
            finished=finished, num_cached_tokens=first.num_cached_tokens, metrics=first.metrics,
            kv_transfer=transfer)

    def _export_kv(self, req: Request) -> KVTransfer:
        """The request's full prompt blocks still in the prefix cache (all of them, just after it
        finished, unless caching is off), as a decode replica loads them (--pd)."""
        if self.kv_groups.hybrid:  # a payload holds a plain block's every layer; these hold a group's
            return KVTransfer([], b"")
        hashes = req.block_hashes[:req.num_prompt_tokens // self.config.block_size]
        ids: list[int] = []
        for h in hashes:
            block = self.kv.pool.lookup(h)
            if block is None:
                break
            ids.append(block.block_id)
        return KVTransfer(hashes[:len(ids)], self.runner.read_blocks(ids) if ids else b"")


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2,5-6' for logs."""
    parts, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)
