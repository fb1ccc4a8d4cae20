"""The step-cost model's start-up calibration (engine/build.py calls it once, before the first
step): synthetic steps timed on free KV blocks and fit, checked against the host's roofline and
load, stored for the next start; then the warm-up steps the first requests would otherwise pay for.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Optional

import torch

from tessera.attention import AttentionBackend
from tessera.config import EngineConfig, ModelConfig
from tessera.engine.core.cost_calibration import (CalibrationChecks, StoredCalibration, calibrate_checked, load_cached,
                                                  save_cached)
from tessera.engine.core.cost_model import Roofline, StepCostModel
from tessera.engine.core.kv_cache_manager import KVCacheManager
from tessera.engine.core.request import Request
from tessera.engine.core.scheduler_output import SchedulerOutput, make_chunk
from tessera.engine.worker.runner import ModelRunnerBase
from tessera.hostinfo import cpu_model_name, host_rates, others_cpu_seconds, source_digest
from tessera.sampling_params import SamplingParams

logger = logging.getLogger("tessera")

CALIBRATION_BUDGET_S = 3.0  # start-up time the step-cost calibration may take; online refinement does the rest
CALIBRATION_CHECKS = CalibrationChecks()


def calibrate_cost_model(config: EngineConfig, loaded, backend: AttentionBackend, kv_format: str,
                         kv: KVCacheManager, runner: ModelRunnerBase) -> tuple[StepCostModel, StoredCalibration]:
    """Time synthetic steps on free KV blocks (nothing is cached or running yet) and fit the model,
    checked (cost_calibration.calibrate_checked) against the host's roofline and load; then run the
    steps the first requests would otherwise pay for.

    A trusted fit is kept in $TESSERA_HOME/cost_models under a key of everything that changes step
    times (model, dtype, weights' storage, step limits, threads, CPU, Tessera's source), so a
    restart skips the ~3 s; online correction absorbs what differs today.
    """
    from tessera.models.registry import tessera_home

    path = tessera_home() / "cost_models" / f"{_cost_model_key(config, loaded, backend, kv_format)}.json"
    vocab = loaded.config.vocab_size

    def synthetic_step(chunks: list[tuple[int, int, bool]]) -> bool:
        """Run one step of (start, tokens, samples) chunks on scratch blocks; False if they do not fit."""
        params = SamplingParams(max_tokens=1, temperature=1.0)
        sched = SchedulerOutput()
        reqs: list[Request] = []
        try:
            for i, (start, n, samples) in enumerate(chunks):
                length = start + n + (0 if samples else 1)
                ids = [(7919 * (i + 1) + 104729 * t) % vocab for t in range(length)]
                req = Request(f"calibration-{i}", ids, params, 1, [], generator=torch.Generator().manual_seed(i))
                reqs.append(req)
                if not kv.allocate_slots(req, start + n):
                    return False
                req.num_computed_tokens = start
                sched.scheduled.append(make_chunk(req, n, kv.block_tables(req.request_id),
                                                  state_slot=kv.state_slot(req.request_id)))
            runner.execute(sched)
            return True
        finally:
            for req in reqs:
                kv.free(req)

    state = runner.sampler.generator.get_state()  # calibration must not shift seeded output
    try:
        model = load_cached(path)
        if model is not None:
            logger.info("step-cost model: calibration reused from %s", path)
        else:
            roofline = _roofline(config, loaded)
            model = calibrate_checked(
                synthetic_step, max_tokens=config.max_num_batched_tokens, max_rows=config.max_num_seqs,
                max_context=config.max_model_len, budget_s=CALIBRATION_BUDGET_S,
                prefill_only=not loaded.config.is_causal, experts=_experts(loaded.config),
                checks=CALIBRATION_CHECKS, roofline=roofline, host_load=others_cpu_seconds,
                spare_cores=_spare_cores())
            save_cached(path, model)
        for chunks in _warm_up_steps(config, loaded.config.is_causal):
            synthetic_step(chunks)
    finally:
        runner.sampler.generator.set_state(state)
    return model, StoredCalibration(path)


def _spare_cores() -> float:
    """Cores this process's threads leave free: what others may take without disturbing its steps."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return float(max(0, usable - torch.get_num_threads()))


def _warm_up_steps(config: EngineConfig, causal: bool) -> list[list[tuple[int, int, bool]]]:
    """Steps of the shapes first requests bring (a prompt chunk, decodes alone, decodes beside a
    chunk), run before the engine reports ready whether or not the calibration was reused: a
    reused one runs no step, and the first requests would pay for the thread pool's start,
    oneDNN's kernels for their row counts and first-touch allocations (encoders: whole inputs)."""
    chunk = max(1, min(64, config.max_num_batched_tokens - 4, config.max_model_len - 2))
    if not causal:
        return [[(0, chunk, False)], [(0, chunk, False)] * max(1, min(4, config.max_num_seqs))]
    context = min(64, config.max_model_len - 2)
    rows = max(1, min(4, config.max_num_seqs - 1))
    return [[(0, chunk, False)], [(context, 1, True)], [(context, 1, True)] * rows,
            [(context, 1, True)] * rows + [(0, chunk, False)]]


def _roofline(config: EngineConfig, loaded) -> Optional[Roofline]:
    """The host's roofline for this model's steps on the CPU (None on a GPU: the host's rates say
    nothing of it): every Linear's weights as stored read once, two FLOPs per parameter per token;
    a mixture of experts' experts count by the share a token chooses. The LM head is left out (its
    cost is the sampled rows', not the tokens'), so both bounds stay lenient."""
    from tessera.layers.linear import Linear, VocabEmbedding
    from tessera.models.registry import tessera_home

    if config.device != "cpu":
        return None
    moe = loaded.config.moe
    share = 1.0 if moe is None else moe.top_k / moe.num_experts
    weight_bytes, params = 0.0, 0.0
    for name, module in loaded.model.named_modules():
        if isinstance(module, Linear) and not isinstance(module, VocabEmbedding):
            part = share if ".experts." in f".{name}." else 1.0
            weight_bytes += part * module.quant_method.nbytes(module)
            params += part * module.input_size * module.output_size
    dtype = str(loaded.dtype).removeprefix("torch.")
    rates = host_rates(dtype if dtype in ("float32", "bfloat16", "float16") else "float32", tessera_home() / "host",
                       CALIBRATION_CHECKS.max_other_cores)
    return Roofline(weight_bytes, 2 * params, rates.bandwidth, rates.flops,
                    dispatch_s=0.02 + 0.002 * loaded.config.num_layers)


def _experts(mc: ModelConfig) -> Optional[tuple[int, int]]:
    """(experts, experts per token) of a mixture of experts, for the step-cost model."""
    return None if mc.moe is None else (mc.moe.num_experts, mc.moe.top_k)


def _cost_model_key(config: EngineConfig, loaded, backend: AttentionBackend, kv_format: str) -> str:
    c = config
    parts = {
        "model": dataclasses.asdict(loaded.config), "path": str(loaded.path),
        "dtype": str(loaded.dtype), "quant": repr(loaded.quant), "backend": type(backend).__name__,
        "kv_cache": kv_format,
        "limits": [c.block_size, c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len],
        "threads": torch.get_num_threads(), "cpu": cpu_model_name(), "source": source_digest(),
        "device": torch.cuda.get_device_name(c.device) if c.device == "cuda" else "cpu",
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
