"""Builds an engine's parts from its config: load, size, calibrate (engine/calibration.py), make
proposers and the disk tier.

Everything that happens once, before the first step, lives here, so the step loop
(engine/llm_engine.py) holds no loading, sizing or calibration code. `build_engine`
returns `EngineParts`, the finished pieces the loop drives.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from tessera.attention import AttentionBackend, get_backend
from tessera.attention.kv_groups import KVCacheGroups
from tessera.config import EngineConfig, ModelConfig
from tessera.engine.calibration import calibrate_cost_model
from tessera.engine.core.cost_calibration import StoredCalibration
from tessera.engine.core.cost_model import StepCostModel
from tessera.engine.core.kv_cache_manager import KVCacheManager
from tessera.engine.core.kv_offload import DiskKVTier
from tessera.engine.core.scheduler import Scheduler
from tessera.engine.core.spec_acceptance import AcceptanceModel, AdaptiveDraftLength
from tessera.engine.input_processor import InputLimits, InputProcessor
from tessera.engine.lora_manager import LoRAManager
from tessera.engine.spec_decode import (
    DraftModelProposer, LayerSkipProposer, Proposer, SpeculationPolicy, build_lookup, default_draft_layers,
)
from tessera.engine.worker.runner import ModelRunner, ModelRunnerBase
from tessera.engine.worker.sampler import Sampler
from tessera.engine.core.structured_output import StructuredOutputManager
from tessera.errors import TesseraError
from tessera.hostinfo import available_memory
from tessera.kernels import isa, library
from tessera.kernels.library import KernelUnavailable
from tessera.models.adapters import read_adapter
from tessera.models.lora_weights import load_lora_weights
from tessera.sampling_params import InvalidRequestError
from tessera.sizing import activation_bytes, default_kv_cache_memory, state_rows
from tessera.tokenizer import Tokenizer

logger = logging.getLogger("tessera")

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass
class EngineParts:
    """A built engine: the pieces the step loop drives, and what callers ask about them."""

    config: EngineConfig  # resolved: max_model_len and kv_cache_memory filled in
    loaded: object  # models.loader.LoadedModel: the weights, tokenizer and quantization
    model_config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    kv_groups: KVCacheGroups
    attn_backend: AttentionBackend
    kv: KVCacheManager
    runner: ModelRunnerBase
    structured: StructuredOutputManager
    inputs: InputProcessor
    cost_model: StepCostModel
    stored_calibration: StoredCalibration  # deleted by the loop once real steps show the model wrong
    scheduler: Scheduler
    offload: Optional[DiskKVTier]
    proposer: Optional[Proposer]
    spec_policy: Optional[SpeculationPolicy]
    kv_capacity_tokens: int  # the longest sequence the cache holds
    kv_tokens_per_gib: float  # at max_model_len
    lora: Optional[LoRAManager] = None  # the served LoRA adapters, with --enable-lora

    @property
    def kv_cache_format(self) -> str:
        """"int8" or the cache's float dtype ("bfloat16", "float32")."""
        return str(self.attn_backend.kv_cache_dtype(self.dtype)).removeprefix("torch.")

    def kv_cache_info(self) -> dict:
        """The KV cache's format, capacity and disk tier, for /v1/engine/stats."""
        c, kv, offload = self.config, self.kv, self.offload
        return {"dtype": self.kv_cache_format, "block_size": c.block_size, "num_blocks": kv.num_blocks,
                "tokens": kv.num_blocks * c.block_size, "max_sequence_tokens": self.kv_capacity_tokens,
                "groups": self.kv_groups.describe(), "bytes": c.kv_cache_memory,
                "tokens_per_gib": round(self.kv_tokens_per_gib, 1), "swap_blocks": kv.num_host_blocks,
                "offload": None if offload is None else {
                    "dir": str(offload.dir), "blocks": offload.num_blocks,
                    "bytes": offload.disk_bytes, "max_bytes": offload.max_bytes,
                    "hit_tokens": kv.offload_hits, "bytes_read": offload.stats.bytes_read,
                    "bytes_written": offload.stats.bytes_written,
                    "files_refused": offload.stats.misses_rejected,
                    "writes_dropped": offload.stats.write_queue_dropped}}


def build_engine(config: EngineConfig, loaded=None) -> EngineParts:
    """Load the model (unless `loaded` is given), size the KV cache, make the runner, calibrate
    the step-cost model, and make the scheduler, disk tier and proposer; raises
    InvalidRequestError for settings that cannot work with this model."""
    from tessera.models.loader import load_model
    from tessera.models.registry import resolve_model

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    if device.type == "cpu" and config.cpu_isa is not None:
        _cap_cpu_isa(config.cpu_isa)
    if loaded is None:
        if device.type == "cpu":
            _refuse_what_cannot_fit(config)
        loaded = load_model(resolve_model(config.model), **_load_options(config, config.quantization))
    if device.type != "cpu":
        loaded.model.to(device)
    mc, dtype = loaded.config, loaded.dtype
    max_model_len = config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > mc.max_position_embeddings:
        raise InvalidRequestError(
            f"--max-model-len {max_model_len} exceeds the model's limit of {mc.max_position_embeddings}")
    loaded.model.fit_context(max_model_len)
    groups = KVCacheGroups.for_engine(mc, config)
    if any(mc.layer_windows()) and not groups.hybrid:
        logger.info("sliding-window layers keep every block of the context (%s)",
                    "--disable-hybrid-kv-cache-manager" if config.disable_hybrid_kv_cache_manager
                    else "--kv-offload-dir stores whole-context blocks")
    try:
        backend = get_backend(config.attention_backend, config.kv_cache_dtype, device)
        bytes_per_block = backend.bytes_per_block(groups.num_slots, mc.num_kv_heads, mc.head_dim,
                                                  config.block_size, dtype)
    except (ValueError, KernelUnavailable) as exc:
        raise InvalidRequestError(str(exc)) from None
    if not mc.is_causal:
        return _build_encoder(config, loaded, max_model_len, groups, backend)
    spec = config.speculative_config
    state_bytes = _state_bytes(config, mc, dtype)
    if state_bytes and config.enable_lora:
        raise InvalidRequestError("--enable-lora: LoRA adapters are not served on models with recurrent layers "
                                  "(short convolutions, Mamba-2)")
    if state_bytes and spec is not None:
        raise InvalidRequestError(
            "--speculative-config: this model has recurrent layers (short convolutions, Mamba-2), whose per-request "
            "state a rejected proposal would leave advanced past the accepted tokens; serve it without speculation")
    if spec is not None and spec.method not in ("ngram", "suffix") and device.type != "cpu":
        raise InvalidRequestError(f"--speculative-config: {spec.method} speculation runs on the CPU only; "
                                  "on a GPU use ngram or suffix")
    draft = _load_draft(config, loaded) if spec is not None and spec.method == "draft_model" else None
    if draft is not None:  # its cache shares the target's block ids, so every block holds both
        dc = draft.config
        bytes_per_block += backend.bytes_per_block(dc.num_layers, dc.num_kv_heads, dc.head_dim,
                                                   config.block_size, draft.dtype)
    kv_memory = _kv_cache_memory(config, loaded, groups, bytes_per_block, max_model_len, device, state_bytes)
    num_blocks = max(0, kv_memory - state_bytes) // bytes_per_block
    kv_capacity_tokens = groups.max_tokens(num_blocks, config.block_size, config.max_num_batched_tokens)
    if kv_capacity_tokens < 1:
        raise InvalidRequestError(
            f"--kv-cache-memory {kv_memory} bytes holds no sequence in blocks of {bytes_per_block} bytes")
    num_host_blocks = config.swap_space // bytes_per_block if config.preemption_mode == "swap" else 0
    if state_bytes:
        config = _without_block_reuse(config, state_bytes)
        num_host_blocks = 0
    config = replace(config, max_model_len=max_model_len, kv_cache_memory=num_blocks * bytes_per_block + state_bytes)

    slots, snapshots = state_rows(config) if state_bytes else (0, 0)
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                        num_host_blocks, hash_extra=str(config.model), groups=groups,
                        num_state_slots=slots, num_state_snapshots=snapshots)
    structured = StructuredOutputManager(loaded.tokenizer, mc.vocab_size)
    inputs = InputProcessor(loaded.tokenizer, InputLimits.for_engine(mc, config, kv_capacity_tokens))
    runner = ModelRunner(loaded.model, mc, config, backend, num_blocks, num_host_blocks, dtype, groups,
                         num_state_rows=slots + snapshots)
    lora = _build_lora(config, mc, dtype, runner) if config.enable_lora else None
    logger.info("%s", config.profile_summary())
    kv_format = str(backend.kv_cache_dtype(dtype)).removeprefix("torch.")
    cost_model, stored = calibrate_cost_model(config, loaded, backend, kv_format, kv, runner)
    logger.info("step-cost model: %s", cost_model.summary())
    acceptance = AcceptanceModel() if spec is not None and spec.adaptive else None
    scheduler = Scheduler(config, kv, max_model_len, cost_model, structured, acceptance)
    offload = _build_offload(config, loaded, kv_format, runner)
    kv.offload = offload  # only now: calibration's synthetic blocks are not written
    proposer, policy = None, None
    if spec is not None:
        proposer = _build_proposer(config, loaded, draft, backend, groups, runner, num_blocks)
        adaptive = AdaptiveDraftLength(cost_model, acceptance) if acceptance is not None else None
        policy = SpeculationPolicy(spec.num_speculative_tokens, spec.disable_by_batch_size, adaptive)
        logger.info("speculative decoding: %s, %s%d tokens, off above %d running request(s) or with a queue",
                    spec.method, "adaptive, up to " if adaptive else "", spec.num_speculative_tokens,
                    spec.disable_by_batch_size)
    tokens_per_gib = _log_kv_cache(config, groups, num_blocks, bytes_per_block, kv_format)
    if device.type == "cuda":
        _log_gpu_memory(config, device)
    else:
        _log_memory(config, runner.kv_slots)
    return EngineParts(config=config, loaded=loaded, model_config=mc, tokenizer=loaded.tokenizer, dtype=dtype,
                       kv_groups=groups, attn_backend=backend, kv=kv, runner=runner, structured=structured,
                       inputs=inputs, cost_model=cost_model, stored_calibration=stored, scheduler=scheduler,
                       offload=offload, proposer=proposer, spec_policy=policy, kv_capacity_tokens=kv_capacity_tokens,
                       kv_tokens_per_gib=tokens_per_gib, lora=lora)


def _cap_cpu_isa(name: str) -> None:
    """--cpu-isa of an engine built where the command line did not set it (the Python API): the C
    kernels switch to that level's variant; PyTorch keeps what it chose at import (isa.apply_cap warns)."""
    if isa.requested() == name:
        return
    try:
        isa.apply_cap(name)
    except isa.CpuIsaError as exc:
        raise InvalidRequestError(str(exc)) from None
    library.reset()


def _build_lora(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, runner: ModelRunner) -> LoRAManager:
    """The adapters' store and the model's slots; the --lora-modules adapters are checked now (a
    bad one stops the start with its reason) and loaded when first asked for."""
    device = str(runner.device)
    lora_dtype = torch.bfloat16 if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
    manager = LoRAManager(config.lora_cache_size, lambda spec: load_lora_weights(spec, mc, lora_dtype, device))
    runner.enable_lora(manager.weights, lora_dtype)
    for m in config.lora_modules:
        manager.add(read_adapter(m.name, m.path, mc, config.max_lora_rank))
    logger.info("LoRA: up to %d adapter(s) a step, rank <= %d, %s, %d kept in memory; serving %s",
                config.max_loras, config.max_lora_rank, str(lora_dtype).removeprefix("torch."), config.lora_cache_size,
                ", ".join(m.name for m in config.lora_modules) or "none yet (/v1/load_lora_adapter)")
    return manager


def _refuse_what_cannot_fit(config: EngineConfig) -> None:
    """Refuse, before reading any weight, a model whose weights as they will be stored, one
    sequence's KV cache at max_model_len (or --kv-cache-memory) and the largest step's activations
    exceed the memory available: loading a 13 GB mixture of experts into 10 GB would otherwise
    end in the kernel's OOM killer, minutes later and without a word (tessera/sizing.py's figures)."""
    from tessera.sizing import estimate

    try:
        e = estimate(config, engine_process=False)
    except (TesseraError, InvalidRequestError, ValueError, OSError) as exc:  # the loader reports bad files itself
        logger.debug("no memory check before loading: %s", exc)
        return
    kv = config.kv_cache_memory if config.kv_cache_memory is not None else int(e.kv_bytes_per_token * e.max_model_len)
    need, free = e.weights_bytes + kv + e.activation_bytes, available_memory()
    if need > free:
        raise InvalidRequestError(
            f"{e.model} needs {need / 2**30:.1f} GiB ({e.weights_bytes / 2**30:.1f} GiB of weights as stored, "
            f"{kv / 2**30:.2f} GiB of KV cache for one sequence of {e.max_model_len} tokens, "
            f"{e.activation_bytes / 2**30:.2f} GiB of activations) but {free / 2**30:.1f} GiB is available; "
            "a smaller --quantization, --max-model-len or another model would fit (`tessera size` shows the terms)")


def _state_bytes(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the recurrent layers' states: a slot per sequence run at once and the prefix
    cache's snapshots (tessera/sizing.py's state_rows; 0 without such layers)."""
    return sum(state_rows(config)) * mc.state_bytes(dtype.itemsize)


def _without_block_reuse(config: EngineConfig, state_bytes: int) -> EngineConfig:
    """A model with recurrent layers: its prefix cache keeps state snapshots at block boundaries
    (a hit ends only where one was kept), but no disk tier (its blocks would come without their
    states); preemption recomputes (the states are not swapped). Says so in the log, as the
    resolved settings do in /v1/engine/stats."""
    slots, snapshots = state_rows(config)
    logger.info("recurrent layers: %d state slots and %d prefix-cache snapshots (%.1f MiB of the cache)", slots,
                snapshots, state_bytes / 2**20)
    if config.kv_offload_dir:
        logger.info("--kv-offload-dir is off: its blocks would come without the recurrent layers' states")
    if config.preemption_mode == "swap":
        logger.info("preemption recomputes: the recurrent layers' states are not swapped")
    return replace(config, kv_offload_dir=None, preemption_mode="recompute")


def _kv_cache_memory(config: EngineConfig, loaded, groups: KVCacheGroups, bytes_per_block: int,
                     max_model_len: int, device: torch.device, state_bytes: int = 0) -> int:
    """Bytes for the KV cache, the recurrent layers' state slots included (`state_bytes`):
    --kv-cache-memory, else on a GPU what its memory leaves, else what the sequences need at
    full length within free memory (tessera/sizing.py)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    mc, dtype = loaded.config, loaded.dtype
    if device.type == "cuda":
        return _gpu_kv_cache_memory(config, mc, dtype, device)
    swap = config.swap_space if config.preemption_mode == "swap" else 0
    others = swap + activation_bytes(mc, config, dtype, loaded.quant.dense_copy)
    blocks_needed = config.max_num_seqs * groups.blocks_per_sequence(max_model_len, config.block_size)
    return default_kv_cache_memory(blocks_needed * bytes_per_block + state_bytes, available_memory(), others)


def _log_kv_cache(config: EngineConfig, groups: KVCacheGroups, num_blocks: int, bytes_per_block: int,
                  kv_format: str) -> float:
    """Log the cache's size and what it holds; returns its tokens per GiB at max_model_len (per
    sequence of max_model_len tokens: sliding-window groups hold less of a long one)."""
    max_model_len = config.max_model_len
    per_sequence = groups.blocks_per_sequence(max_model_len, config.block_size)
    tokens_per_gib = max_model_len * 2**30 / (per_sequence * bytes_per_block)
    logger.info(
        "KV cache: %d blocks of %d tokens (%.0f MiB, %s, %s, %.0f tokens per GiB at max_model_len); "
        "max concurrency at max_model_len %d: %.1f", num_blocks, config.block_size,
        num_blocks * bytes_per_block / 2**20, kv_format, groups.describe(), tokens_per_gib,
        max_model_len, (num_blocks - (1 if groups.hybrid else 0)) / per_sequence)
    return tokens_per_gib


def _build_encoder(config: EngineConfig, loaded, max_model_len: int, groups: KVCacheGroups,
                   backend: AttentionBackend) -> EngineParts:
    """The parts of an encoder's engine (BERT): the same scheduler, runner and loop, but no KV
    cache. Its requests are all pooling ones, computed whole in one step and finished in it, so
    its blocks are bookkeeping only (admission counts them against max_num_seqs sequences of
    max_model_len tokens) and no tensor backs them; nothing to swap, offload or speculate."""
    mc, dtype = loaded.config, loaded.dtype
    for flag, given in (("--kv-offload-dir", config.kv_offload_dir is not None),
                        ("--speculative-config", config.speculative_config is not None),
                        ("--enable-lora", config.enable_lora)):
        if given:
            raise InvalidRequestError(f"{flag} does not apply to {config.model!r}: an encoder keeps no KV cache and "
                                      "generates nothing")
    pooler = config.pooler_for(mc)
    if pooler is None:
        raise InvalidRequestError(f"{config.model!r} is an encoder without a sentence-transformers pooling "
                                  "configuration (modules.json, 1_Pooling); pass --pooling mean|cls|last")
    config = config.for_encoder()
    num_blocks = config.max_num_seqs * groups.blocks_per_sequence(max_model_len, config.block_size) + 1
    kv_capacity_tokens = groups.max_tokens(num_blocks, config.block_size, config.max_num_batched_tokens)
    config = replace(config, max_model_len=max_model_len, kv_cache_memory=0)
    kv = KVCacheManager(num_blocks, config.block_size, False, 0, hash_extra=str(config.model), groups=groups)
    structured = StructuredOutputManager(loaded.tokenizer, mc.vocab_size)
    inputs = InputProcessor(loaded.tokenizer, InputLimits.for_engine(mc, config, kv_capacity_tokens))
    runner = ModelRunner(loaded.model, mc, config, backend, num_blocks, 0, dtype, groups)
    logger.info("%s", config.profile_summary())
    logger.info("encoder (%s): no KV cache; embeddings by %s pooling%s, inputs truncated at %s tokens, at most %d "
                "tokens a step", mc.architecture, pooler.pooling, ", normalised" if pooler.normalize else "",
                pooler.max_seq_length or max_model_len, config.max_num_batched_tokens)
    kv_format = str(backend.kv_cache_dtype(dtype)).removeprefix("torch.")
    cost_model, stored = calibrate_cost_model(config, loaded, backend, kv_format, kv, runner)
    logger.info("step-cost model: %s", cost_model.summary())
    scheduler = Scheduler(config, kv, max_model_len, cost_model, structured)
    return EngineParts(config=config, loaded=loaded, model_config=mc, tokenizer=loaded.tokenizer, dtype=dtype,
                       kv_groups=groups, attn_backend=backend, kv=kv, runner=runner, structured=structured,
                       inputs=inputs, cost_model=cost_model, stored_calibration=stored, scheduler=scheduler,
                       offload=None, proposer=None,
                       spec_policy=None, kv_capacity_tokens=kv_capacity_tokens, kv_tokens_per_gib=0.0)


def _load_options(config: EngineConfig, quantization: str) -> dict:
    """load_model's settings for this config's device. A GPU takes dense weights in the compute
    dtype (bfloat16 for auto; the CPU's quantized layouts and their packed-weight cache are made
    for its C kernels), moved there after loading."""
    if config.device == "cpu":
        return dict(dtype=config.dtype, quantization=quantization, dense_copy=config.dense_copy,
                    weight_cache=config.weight_cache, int8_activations=config.int8_activations)
    if quantization not in ("auto", "none"):
        raise InvalidRequestError(f"--quantization {quantization} runs on the CPU's kernels; on a GPU weights "
                                  "are dense (--quantization auto or none)")
    return dict(dtype="bfloat16" if config.dtype == "auto" else config.dtype, quantization="none",
                dense_copy=False, weight_cache=False, int8_activations=False)


def _gpu_kv_cache_memory(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """The KV cache on a GPU, as vLLM sizes it: --gpu-memory-utilization of the device's memory,
    less what is in use once the weights are there (this process's and any other's) and the
    largest step's activations (tessera/sizing.py's bound)."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_bytes(mc, config, dtype, True)
    if budget <= 0:
        raise InvalidRequestError(
            f"--gpu-memory-utilization {config.gpu_memory_utilization:g} of {total / 2**30:.1f} GiB leaves no room for "
            f"a KV cache: {(total - free) / 2**30:.1f} GiB is in use with the weights loaded; raise it")
    return budget


def _log_gpu_memory(config: EngineConfig, device: torch.device) -> None:
    """What the GPU holds after start-up, beside the share the engine was given."""
    free, total = torch.cuda.mem_get_info(device)
    logger.info("GPU memory (%s): %.1f GiB of %.1f GiB in use (this engine: %.1f GiB allocated, %.1f GiB of it the "
                "KV cache); --gpu-memory-utilization %g", torch.cuda.get_device_name(device), (total - free) / 2**30,
                total / 2**30, torch.cuda.memory_allocated(device) / 2**30, config.kv_cache_memory / 2**30,
                config.gpu_memory_utilization)


def _log_memory(config: EngineConfig, kv_slots: list) -> None:
    """Resident memory now, next to `tessera size`'s prediction for this process: reserved (the
    KV cache full) and at start-up (its pages mapped only as tokens are written, so a server holds
    what it caches, not what it could). `tessera size` prints the whole server by default,
    front-end process included; this line compares like with like (this process) and names the
    difference, so the two figures a user sees do not look contradictory."""
    from tessera.hostinfo import resident_bytes, resident_tensor_bytes
    from tessera.sizing import estimate

    try:
        e = estimate(config, engine_process=True)
    except Exception as exc:  # noqa: BLE001 - a log line must not stop a start (e.g. an unregistered path)
        logger.debug("no memory prediction: %s", exc)
        return
    kv_resident = resident_tensor_bytes(kv_slots)
    kv_text = (f"; KV cache {kv_resident / 2**20:.0f} MiB resident of {config.kv_cache_memory / 2**20:.0f} MiB "
               "reserved" if kv_resident is not None else "")
    front = e.frontend_bytes
    logger.info("memory: %.0f MiB resident at start-up in this process%s; `tessera size` predicts %.0f MiB at "
                "start-up and %.0f MiB reserved (the KV cache full) for it, %.0f / %.0f MiB for the server with "
                "its front-end process (`--no-engine-process` drops that)", resident_bytes() / 2**20, kv_text,
                (e.startup_bytes - front) / 2**20, (e.total_bytes - front) / 2**20, e.startup_bytes / 2**20,
                e.total_bytes / 2**20)


def _build_offload(config: EngineConfig, loaded, kv_format: str, runner: ModelRunnerBase) -> Optional[DiskKVTier]:
    """The disk tier of the prefix cache, if configured; its files are keyed by everything that
    changes a block's bytes, so a file from another model or layout is refused, never loaded."""
    if config.kv_offload_dir is None:
        return None
    from tessera.models.registry import model_digest

    mc = loaded.config
    fields = {"model_sha256": model_digest(loaded.path), "dtype": str(loaded.dtype),
              "kv_cache": kv_format, "block_size": config.block_size, "layers": mc.num_layers,
              "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "hash_extra": str(config.model),
              "format": 3}  # 3: int8 keys less their key bias's exact share (attention/base.py KeyBias)
    return DiskKVTier(Path(config.kv_offload_dir).expanduser(), config.kv_offload_size, fields,
                      runner.block_bytes())


# -- speculative decoding -----------------------------------------------------------
def _load_draft(config: EngineConfig, target):
    """The draft model of `draft_model` speculation, checked against the target's tokenizer."""
    from tessera.models.loader import load_model
    from tessera.models.registry import resolve_model

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    options = _load_options(config, spec.quantization or config.quantization)
    draft = load_model(resolve_model(spec.model), **{**options, "dtype": target.dtype})
    probe = "def add(a, b):\n    return a + b  # Grüße, 你好 🙂"
    tok = target.tokenizer
    same = (draft.tokenizer.encode(probe, add_special_tokens=False) == tok.encode(probe, add_special_tokens=False)
            and set(draft.tokenizer.eos_token_ids) <= set(tok.eos_token_ids))
    if not same:
        raise InvalidRequestError(
            f"--speculative-config: draft model {spec.model!r} does not share the tokenizer of "
            f"{config.model!r}; a draft model must tokenize exactly as the target does")
    return draft


def _build_proposer(config: EngineConfig, loaded, draft, backend: AttentionBackend, groups: KVCacheGroups,
                    runner: ModelRunner, num_blocks: int) -> Proposer:
    spec = config.speculative_config
    assert spec is not None
    if spec.method in ("ngram", "suffix"):
        return build_lookup(spec)
    sampler = Sampler(config.seed + 1)
    mc = loaded.config
    if spec.method == "layer_skip":
        n = mc.num_layers
        layers = spec.draft_layers or default_draft_layers(n)
        if layers[-1] >= n:
            raise InvalidRequestError(f"--speculative-config: draft_layers must be below {n}, the number "
                                      f"of layers of {config.model!r}")
        logger.info("layer-skip drafting with layers %s of %d", _ranges(layers), n)
        return LayerSkipProposer(loaded.model, runner.kv_caches, backend, config.block_size, layers, sampler, groups)
    assert draft is not None
    dc = draft.config
    caches = backend.allocate(dc.num_layers, num_blocks, config.block_size, dc.num_kv_heads, dc.head_dim, draft.dtype)
    logger.info("draft model %s: %d layers, its KV cache in the same %d blocks", draft.path.name,
                dc.num_layers, num_blocks)
    return DraftModelProposer(draft.model, caches, backend, config.block_size, mc.vocab_size, sampler,
                              config.max_num_batched_tokens, config.enforce_eager)


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
