"""The engine core's step loop: propose, schedule, execute, update.

`LLMEngine` drives the parts `build_engine` made (engine/build.py): each `step()`
lets the proposer guess tokens, asks the scheduler for the step's plain-data
chunks, has the runner execute them, and gives the sampled tokens back to the
scheduler. Input processing (tokenize, check, compile a grammar) happens before a
request enters, output processing (text, stop strings, n > 1, deltas;
engine/output_processor.py) after its tokens come back; the server and the
offline `LLM` share both.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Union

import torch

from tessera.config import EngineConfig
from tessera.engine.build import EngineParts, build_engine
from tessera.engine.core.request import Request, RequestStatus
from tessera.engine.core.scheduler_output import SchedulerOutput
from tessera.engine.errors import StepFailedError
from tessera.engine.input_processor import PreparedRequest
from tessera.engine.output_processor import OutputProcessor
from tessera.engine.outputs import KVTransfer, RequestOutput
from tessera.engine.spec_decode import propose_all
from tessera.engine.stats import IterationStats, LoadSnapshot, SchedulerStats
from tessera.errors import AdapterError
from tessera.models.adapters import AdapterSpec
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.vision import ImageInput

logger = logging.getLogger("tessera")


class LLMEngine:
    """One model's engine in this process; `EngineCore` (engine/frontend/async_engine.py) is its interface."""

    def __init__(self, config: EngineConfig, loaded=None) -> None:
        self.parts: EngineParts = build_engine(config, loaded)
        p = self.parts
        self.config, self.loaded, self.model_config = p.config, p.loaded, p.model_config
        self.tokenizer, self.dtype = p.tokenizer, p.dtype
        self.kv_groups, self.kv, self.runner, self.scheduler = p.kv_groups, p.kv, p.runner, p.scheduler
        self.structured, self.inputs, self.cost_model, self.offload = p.structured, p.inputs, p.cost_model, p.offload
        self.proposer, self.spec_policy = p.proposer, p.spec_policy
        self.kv_capacity_tokens = p.kv_capacity_tokens
        self.lora = p.lora
        self.outputs = OutputProcessor(self.tokenizer, stop=self._stop_string_hit, export=self._export_kv)
        self._offload_seen = (0, 0)  # the tier's bytes read and written, as last reported
        self._aborted: list[str] = []  # parents aborted since the last step, to report
        self._step_touched: Optional[list[str]] = None  # requests the running step works on
        self._gpu_total = torch.cuda.get_device_properties(0).total_memory if self.config.device == "cuda" else 0

    @property
    def kv_cache_format(self) -> str:
        return self.parts.kv_cache_format

    def warm_up(self) -> None:
        """Pay first-request costs now: the chat template's compilation, here, and the grammar
        compiler's reading of the vocabulary (~1 s for Qwen's), in a background thread."""
        self.tokenizer.warm_up()
        if not self.model_config.is_causal:
            return  # an encoder only embeds: no grammar will ever be compiled
        threading.Thread(target=self.structured.warm_up, name="tessera-grammar-warm-up", daemon=True).start()

    def close(self) -> None:
        """Finish writing what the disk tier was handed (at shutdown; the engine stays usable)."""
        if self.offload is not None:
            self.offload.flush()
        self.structured.close()
        if self.lora is not None:
            self.lora.close()

    # -- LoRA adapters --------------------------------------------------------------
    def add_lora(self, spec: AdapterSpec) -> None:
        """Serve the adapter (checked by models.adapters.read_adapter); it loads off the loop."""
        if self.lora is None:
            raise AdapterError(f"{self.config.model} was started without LoRA support; restart with --enable-lora")
        if spec.rank > self.config.max_lora_rank:
            raise AdapterError(f"LoRA adapter {spec.name!r} has rank {spec.rank}, above --max-lora-rank "
                               f"{self.config.max_lora_rank}")
        self.lora.add(spec)

    def remove_lora(self, name: str) -> None:
        if self.lora is not None:
            self.lora.remove(name)

    def lora_adapters(self) -> list[AdapterSpec]:
        return [] if self.lora is None else list(self.lora.specs.values())

    def _sync_adapters(self) -> None:
        """Before scheduling: start loading what waiting requests need, tell the scheduler what is
        loaded, and refuse the waiting requests whose adapter failed to load."""
        assert self.lora is not None
        sched = self.scheduler
        in_use = {r.lora_name for r in sched.running if r.lora_name is not None}
        wanted = {r.lora_name for r in sched.waiting if r.lora_name is not None}
        self.lora.want(wanted, in_use | wanted)
        sched.lora_ready = self.lora.ready()
        broken = [r.request_id for r in sched.waiting if r.lora_name in self.lora.failed]
        if broken:
            self._step_touched = broken
            name = next(r.lora_name for r in sched.waiting if r.lora_name in self.lora.failed)
            raise AdapterError(f"LoRA adapter {name!r} could not be loaded: {self.lora.failed[name]}")

    # -- admission ------------------------------------------------------------
    def prepare_request(
        self,
        request_id: str,
        prompt: Union[str, list[int]],
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        add_special_tokens: bool = True,
        pooling: Optional[PoolingParams] = None,
        images: Optional[list[ImageInput]] = None,
    ) -> PreparedRequest:
        """Tokenize and check a request (an embedding one with `pooling`, one holding `images` in
        the order of its image tokens), compile its constraint; raises InvalidRequestError if it
        can never run."""
        prepared = self.inputs.process(request_id, prompt, params, arrival_time, add_special_tokens, pooling,
                                       images)
        if params.structured_outputs is not None:
            t0 = time.perf_counter()
            prepared.grammar = self.structured.compile(params.structured_outputs)
            prepared.grammar_compile_time = time.perf_counter() - t0
        return prepared

    def add_prepared(self, p: PreparedRequest) -> None:
        """Enter a prepared request: n sequences, the later ones waiting for the first's prompt
        blocks when prefix caching can share them."""
        if p.request_id in self.outputs:
            raise InvalidRequestError(f"request id {p.request_id!r} is already in use")
        children: list[Request] = []
        for i in range(p.params.n):
            gen = None
            if p.params.seed is not None:
                gen = torch.Generator().manual_seed(hash((p.params.seed, i)) & 0x7FFF_FFFF_FFFF_FFFF)
            child_id = p.request_id if p.params.n == 1 else f"{p.request_id}#{i}"
            first = children[0] if children and self.config.enable_prefix_caching else None
            req = Request(child_id, p.prompt_token_ids, p.params, p.max_tokens,
                          self.tokenizer.eos_token_ids, p.arrival_time, gen, wait_for=first, pooling=p.pooling)
            if not children and p.kv_import is not None:  # the others wait for its blocks
                self.kv.import_blocks(req, p.kv_import.blocks())
            if p.grammar is not None:
                assert p.params.structured_outputs is not None
                req.grammar = self.structured.new_state(p.grammar, p.params.structured_outputs.kind)
                req.metrics.grammar_compile_time = p.grammar_compile_time
            if p.lora_name is not None:
                req.lora_name, req.lora_salt = p.lora_name, self._adapter_salt(p.lora_name)
            req.images = p.images
            children.append(req)
        self.outputs.add(p, children)
        for req in children:
            self.scheduler.add_request(req)

    def _adapter_salt(self, name: str) -> str:
        if self.lora is None or name not in self.lora.specs:
            raise InvalidRequestError(f"The model `{name}` does not exist: no LoRA adapter of that name is served")
        return self.lora.salt(name)

    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time))

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final output says 'abort'."""
        reqs = self.outputs.requests_of(request_id)
        if not reqs:
            return
        for req in reqs:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self.outputs) > 0

    @property
    def alive(self) -> bool:
        """An in-process core lives as long as the process (a process core can die on its own)."""
        return True

    def restart(self) -> None:
        raise RuntimeError("an in-process engine core does not restart; only an engine-core process can")

    def in_flight(self) -> list[str]:
        """The (parent) requests the core holds."""
        return list(self.outputs.parents)

    def describe(self) -> dict:
        """Where the engine runs, for /v1/engine/stats."""
        return {"engine_process": False, "pid": None}

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, _ = self.step_with_stats()
        return outputs

    def step_with_stats(self) -> tuple[list[RequestOutput], IterationStats]:
        """One step. If it raises (a fault in the model, the kernels or the sampler), the requests
        it was running are ended and their blocks freed, and StepFailedError names them: one bad
        step costs its own requests, not the server."""
        self._step_touched = None
        try:
            return self._step()
        except Exception as exc:
            touched = self._step_touched if self._step_touched is not None else \
                [r.request_id for r in self.scheduler.running]
            failed = self._fail_requests(touched)
            logger.exception("engine step failed; ended %d request(s): %s", len(failed), ", ".join(failed))
            raise StepFailedError(failed, exc) from exc

    def _fail_requests(self, child_ids: list[str]) -> list[str]:
        """End the parents of these sequences now (blocks freed, no further output); returns their ids."""
        parent_ids = [pid for pid in dict.fromkeys(self.outputs.parent_of(c) for c in child_ids) if pid is not None]
        for pid in parent_ids:
            for req in self.outputs.drop(pid):
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return parent_ids

    def _step(self) -> tuple[list[RequestOutput], IterationStats]:
        t0 = time.perf_counter()
        if self.proposer is not None and self.spec_policy is not None:
            self.scheduler.set_proposals(propose_all(self.proposer, self.spec_policy, self.scheduler.running,
                                                     len(self.scheduler.waiting), self.config.max_model_len, self.kv))
        t_step = time.perf_counter()  # drafting is not part of the step the cost model predicts
        if self.lora is not None:
            self._sync_adapters()
        sched = self.scheduler.schedule()
        if sched.is_empty and self.lora is not None and self.lora.loading:
            time.sleep(0.002)  # only adapters' loads to wait for: leave their thread the interpreter
        # What a failure from here on touched: the scheduled requests and any swapped this step.
        self._step_touched = [s.request_id for s in sched.scheduled] + sched.preempted
        t_exec = time.perf_counter()
        result = self.runner.execute(sched)
        load_s = time.perf_counter() - t_exec if sched.kv_loads else 0.0
        self._count_proposals(result.spec_results)  # before the update may finish their requests
        appended = self.scheduler.update_after_step(sched, result.sampled)
        now = time.time()
        stats = IterationStats(
            timestamp=now,
            num_prompt_tokens=result.num_prompt_tokens,
            num_generation_tokens=sum(len(t) for t in appended.values()),
            num_preemptions=len(sched.preempted),
            prefix_cache_queries=sched.num_prefix_queries,
            prefix_cache_hits=sched.num_prefix_hits,
            spec_results=list(result.spec_results.values()),
            structured_mask_time=None if sched.grammar is None else sched.grammar.fill_s + (result.mask_time or 0.0),
        )
        if self.offload is not None:
            self._offload_step(sched, stats, load_s)
        elif sched.kv_loads:  # blocks a prefill replica computed (--pd)
            stats.external_prefix_cache_hits = len(sched.kv_loads) * self.config.block_size
        touched = set(self._aborted)
        self._aborted.clear()
        outputs = self.outputs.process(appended, result.logprobs, now, stats, touched, result.pooled)
        end = time.perf_counter()
        if sched.scheduled and not (sched.swap_in or sched.swap_out):  # block copies are not in the model
            self.cost_model.observe(sched.shape, end - t_step)
            self.parts.stored_calibration.review(self.cost_model)
            if self.spec_policy is not None and self.spec_policy.adaptive is not None:
                self.spec_policy.adaptive.observe_step(sched.shape, end - t_step)
        stats.step_time = end - t0
        return outputs, stats

    def _count_proposals(self, spec_results: dict[str, tuple[int, int]]) -> None:
        """Verified proposals per request, into its metrics (acceptance rate per request)."""
        for request_id, (proposed, accepted) in spec_results.items():
            metrics = self.scheduler.requests[request_id].metrics
            metrics.spec_draft_tokens += proposed
            metrics.spec_accepted_tokens += accepted

    def _stop_string_hit(self, req: Request) -> None:
        self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)

    # -- the disk tier and KV transfers ------------------------------------------
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

    def _export_kv(self, req: Request) -> KVTransfer:
        """The request's full prompt blocks still in the prefix cache, as a decode replica loads
        them (--pd)."""
        if self.kv_groups.hybrid:  # a payload holds a plain block's every layer; these hold a group's
            return KVTransfer([], b"")
        hashes, ids = self.kv.export_blocks(req, req.num_prompt_tokens)
        return KVTransfer(hashes, self.runner.read_blocks(ids) if ids else b"")

    # -- what callers ask ------------------------------------------------------------
    def get_scheduler_stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.config.device == "cuda":  # the allocator's own counters: no sync, no driver call
            stats.gpu_memory_allocated_bytes = torch.cuda.memory_allocated()
            stats.gpu_memory_total_bytes = self._gpu_total
        return stats

    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting()

    def predict_wait(self, snapshot: LoadSnapshot, prompt_tokens: int, priority: int = 0) -> Optional[float]:
        """Forecast, for a newcomer, of the time until its prompt is computed (thread-safe)."""
        return self.scheduler.predict_wait(snapshot, prompt_tokens, priority)

    def predict_prompt(self, prompt_tokens: int) -> Optional[float]:
        """Forecast of a prompt's own computation: the wait on an engine with nothing to run."""
        idle = LoadSnapshot(free_seq_slots=self.config.max_num_seqs)
        return self.scheduler.predict_wait(idle, prompt_tokens)

    def load_snapshot(self) -> LoadSnapshot:
        return self.scheduler.load_snapshot()

    def cost_model_stats(self) -> dict:
        stored = self.parts.stored_calibration
        return {**self.cost_model.describe(), "stored_calibration": str(stored.path),
                "stored_calibration_removed": stored.removed}

    def kv_cache_info(self) -> dict:
        """The KV cache's format and capacity, for /v1/engine/stats."""
        return self.parts.kv_cache_info()
