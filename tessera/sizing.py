"""How much memory a model needs to serve, worked out before loading it (`tessera size`).

The usual serving-memory formula, term by term, with Tessera's own storage rules:

    resident = runtime + weights (as stored: int4 / int8 / dense, dense copies)
             + KV cache (bytes per token x tokens) + swap space (when preemption swaps)
             + activations of the largest step

The KV cache (on a CPU) and the swap pool are allocated untouched, so their pages become resident only
as tokens are cached and requests swapped out: the total is the reserved peak, reached once both are
full; `startup_bytes` is what a server holds before its first request.

Weights come from the checkpoint's tensor table alone (GGUF header or safetensors headers) run
through the same rule the loader uses (`QuantConfig.storage_for`) and the bytes each method keeps
(`storage_bytes`), so the figure follows the code rather than a parameter count. The KV cache is
whatever `--kv-cache-memory` says, or by default what `max_num_seqs` sequences of `max_model_len`
tokens need, capped by the memory left after everything else and a safety margin: filling memory to
the brim turns length variance into cascades of preemption. The engine builder (engine/build.py)
decides its default `--kv-cache-memory` with `default_kv_cache_memory` below.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from tessera.config import DEFAULT_MEMORY_MARGIN, EngineConfig, ModelConfig

# Resident memory of a server process with no model and no tokenizer: the interpreter, torch,
# FastAPI/uvicorn and the C kernels (330 MiB measured with `tessera serve` on smollm2-135m,
# benchmarks/sizing.py, of which its tokenizer ~67 MiB).
RUNTIME_BYTES = 263 << 20
# A loaded tokenizer (Hugging Face tokenizers 0.23): 40 MiB plus 7.8 bytes per byte of its
# tokenizer.json, fitted on the packaged models' (3.5 MB: 67 MiB, 11.4 MB: 143 MiB, 33.4 MB:
# 300 MiB, within 14 MiB). Each process holds one: the engine and the server's front-end.
TOKENIZER_BASE_BYTES = 40 << 20
TOKENIZER_BYTES_PER_JSON_BYTE = 7.8
# The server's front-end process beside an engine process, without its tokenizer: the
# interpreter, FastAPI/uvicorn, zmq and numpy, no torch (133 MiB resident with smollm2-135m's
# tokenizer, 210 MiB with qwen2.5-coder-1.5b's, after a few streamed requests: 66-67 MiB besides).
FRONTEND_RUNTIME_BYTES = 67 << 20


def tokenizer_bytes(json_bytes: int) -> int:
    return TOKENIZER_BASE_BYTES + int(TOKENIZER_BYTES_PER_JSON_BYTE * json_bytes)

# A float32 logits row goes through a few full-vocabulary temporaries in the sampler
# (log-softmax, scaled copy, probabilities, cumulative sum).
LOGIT_COPIES = 4


@dataclass
class SizeEstimate:
    model: str
    dtype: str
    weights_bytes: int  # as stored, dense copies included
    dense_copy_bytes: int  # of which dense copies of quantized weights
    storage: dict[str, int]  # parameters by storage kind (dense, int8, int4)
    kv_bytes_per_token: float  # of a max_model_len sequence: its blocks' bytes (scales included) / its tokens
    kv_cache_groups: str  # how layers share blocks (sliding-window layers keep only their window's)
    kv_cache_dtype: str
    kv_cache_bytes: int
    kv_cache_tokens: int
    swap_bytes: int
    activation_bytes: int
    runtime_bytes: int  # the engine's process without weights, KV or activations, its tokenizer included
    tokenizer_bytes: int  # of which its tokenizer
    frontend_bytes: int  # the server's own process when the engine runs in another (the default)
    max_model_len: int
    max_num_seqs: int
    margin: float
    # Of kv_cache_bytes, the recurrent layers' per-request states (a slot per sequence, and the prefix
    # cache's snapshots; 0 without them).
    state_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.runtime_bytes + self.frontend_bytes + self.weights_bytes + self.kv_cache_bytes
                + self.swap_bytes + self.activation_bytes)

    @property
    def startup_bytes(self) -> int:
        """Resident before any token is cached: the KV cache and swap pool are reserved address
        space whose pages the OS maps on first write, so they join the resident set block by block
        as requests use them, up to `total_bytes`."""
        return self.total_bytes - self.kv_cache_bytes - self.swap_bytes

    @property
    def concurrency_at_max_len(self) -> float:
        """Sequences of max_model_len tokens the KV cache holds at once."""
        return self.kv_cache_tokens / self.max_model_len

    def fits(self, memory: int) -> int:
        """Sequences of max_model_len tokens whose KV fits in `memory` beside the rest (with the margin)."""
        room = memory * (1 - self.margin) - (self.total_bytes - self.kv_cache_bytes)
        if not self.kv_bytes_per_token:  # an encoder: no KV cache, only the step's activations
            return self.max_num_seqs if room >= 0 else 0
        per_sequence = self.kv_bytes_per_token * self.max_model_len + self.state_bytes / max(1, self.max_num_seqs)
        return max(0, int(room // per_sequence))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(total_bytes=self.total_bytes, startup_bytes=self.startup_bytes,
                 concurrency_at_max_len=self.concurrency_at_max_len)
        return d


def checkpoint_tensors(path: Path) -> tuple[ModelConfig, list[tuple[str, tuple[int, ...], Optional[int]]]]:
    """The model's config and (parameter name, shape, GGUF type or None for float) of each tensor."""
    if path.is_dir():
        from tessera.models.safetensors_loader import config_from_hf, read_hf_config, safetensors_shapes

        config = config_from_hf(read_hf_config(path), name=path.name)
        return config, [_mxfp4_blocks(name, shape) for name, shape in safetensors_shapes(path)
                        if not name.endswith("_scales")]
    from tessera.layers.weights import FLOAT_TYPES
    from tessera.models.gguf_file import read_gguf
    from tessera.models.gguf_loader import config_from_gguf, hf_name

    gf = read_gguf(path)
    try:
        config = config_from_gguf(gf, name=path.stem)
        tensors = []
        for info in gf.tensors.values():
            name = hf_name(info.name, config.architecture)
            if name is not None:
                tensors.append((name, info.shape, None if info.ggml_type in FLOAT_TYPES else int(info.ggml_type)))
        return config, tensors
    finally:
        gf.close()


def _mxfp4_blocks(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], Optional[int]]:
    """A safetensors tensor as the loader keeps it: gpt-oss's MXFP4 `*_blocks` [..., rows, K/32, 16]
    (their `*_scales` counted in) as MXFP4 matrices of their rows, anything else a float tensor."""
    from gguf import GGMLQuantizationType

    if not name.endswith("_blocks") or len(shape) < 3:
        return name, shape, None
    rows = int(torch.Size(shape[:-2]).numel())
    return name.removesuffix("_blocks") + ".weight", (rows, shape[-2] * 32), int(GGMLQuantizationType.MXFP4)


@dataclass
class WeightStorage:
    bytes: int  # as the loader stores them, dense copies included
    dense_copy_bytes: int
    params: dict[str, int]  # parameters by storage kind


def weight_storage(config: ModelConfig, tensors, quant) -> WeightStorage:
    """What the loader would store for these checkpoint tensors under `quant`."""
    from tessera.layers.quantization import METHODS
    from tessera.models.weights import PACKED_MODULES

    groups: dict[str, list[tuple[tuple[int, ...], Optional[int]]]] = {}
    small = 0
    for name, shape, ggml_type in tensors:
        if config.tie_word_embeddings and name.startswith("lm_head."):
            continue  # one table serves both
        if len(shape) < 2 or name.endswith(("bias", "sinks")):  # norms, biases: in the compute dtype
            small += int(torch.Size(shape).numel()) * quant.dtype.itemsize
            continue
        if len(shape) == 3:  # a stack of experts' matrices, [E, out, in]: their rows in turn
            shape = (shape[0] * shape[1], shape[2])
        module, _, _ = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in PACKED_MODULES:
            module = f"{parent}.{PACKED_MODULES[leaf][0]}"
        groups.setdefault(module, []).append((shape, ggml_type))
    total, dense_copies = small, 0
    params = {kind: 0 for kind in METHODS}
    for pieces in groups.values():
        rows, cols = sum(s[0] for s, _ in pieces), pieces[0][0][1]
        kind = quant.storage_for([t for _, t in pieces], cols)
        total += METHODS[kind].storage_bytes(rows, cols, quant, [t for _, t in pieces])
        params[kind] += rows * cols
        if kind != "dense" and quant.dense_copy:
            dense_copies += rows * cols * quant.dtype.itemsize
    return WeightStorage(total, dense_copies, params)


def activation_bytes(config: ModelConfig, engine: EngineConfig, dtype: torch.dtype, dense_copy: bool) -> int:
    """Transient memory of the largest step: the packed batch's per-layer tensors, a layer's
    weight dequantized for the call when no dense copy is kept (large steps), and
    full-vocabulary logits rows."""
    from tessera.models.dtype import layer_linear_shapes

    c = config
    largest_linear = max(o * i for o, i in layer_linear_shapes(c))
    tokens = int(engine.max_num_batched_tokens)
    per_token = (4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 3 * c.intermediate_size)
    sampled = int(engine.max_num_seqs)
    spec = engine.speculative_config
    if spec is not None:
        sampled *= 1 + spec.num_speculative_tokens
    logits = sampled * c.vocab_size * 4 * LOGIT_COPIES
    dequantized = 0 if dense_copy else largest_linear * dtype.itemsize
    return tokens * per_token * dtype.itemsize + logits + dequantized


# Prefix-cache snapshots of recurrent layers' states (engine/core/state_slots.py) kept per sequence
# the engine runs at once: each finished or running prompt leaves one, so twice the sequences keep
# the recent prompts' hits (the state, unlike K/V blocks, is whole per snapshot).
STATE_SNAPSHOTS_PER_SEQUENCE = 2


def state_rows(engine: EngineConfig) -> tuple[int, int]:
    """(request slots, prefix-cache snapshots) of a model with recurrent layers under `engine`."""
    slots = int(engine.max_num_seqs)
    return slots, (STATE_SNAPSHOTS_PER_SEQUENCE * slots if engine.enable_prefix_caching else 0)


def default_kv_cache_memory(needed: int, available: int, others: int, margin: float = DEFAULT_MEMORY_MARGIN) -> int:
    """The KV cache a server takes by default: what its sequences need at full length (`needed`),
    but no more than the memory available once `others` (activations, swap space) and the
    margin are set aside."""
    return max(0, min(needed, int(available * (1 - margin)) - others))


def estimate(engine: EngineConfig, memory: Optional[int] = None, margin: float = DEFAULT_MEMORY_MARGIN,
             engine_process: bool = True) -> SizeEstimate:
    """Predict resident memory for serving `engine.model` with these settings; `memory` (bytes,
    default: available now) is what the default KV cache may use. `engine_process`: the server
    runs the engine in a process of its own (`tessera serve`'s default), whose front-end is one
    more interpreter (without torch), the server and a second copy of the tokenizer."""
    from tessera.attention import get_backend
    from tessera.attention.kv_groups import KVCacheGroups
    from tessera.hostinfo import available_memory
    from tessera.layers.quantization import QuantConfig, resolve_dense_copy
    from tessera.models.dtype import linear_param_count, resolve_dtype
    from tessera.models.registry import resolve_model
    from tessera.tokenizer import serialized_bytes

    path = Path(resolve_model(engine.model))
    config, tensors = checkpoint_tensors(path)
    if not config.is_causal:  # an encoder's engine: its own step size, and no KV cache or swap below
        engine = engine.for_encoder()
    dtype = resolve_dtype(engine.dtype, config)
    tokenizer = tokenizer_bytes(serialized_bytes(path))
    runtime = RUNTIME_BYTES + tokenizer
    budget = memory if memory is not None else available_memory() + runtime
    dense_copy = resolve_dense_copy(engine.dense_copy, linear_param_count(config), dtype, budget)
    quant = QuantConfig(engine.quantization, dtype, dense_copy, engine.int8_activations)
    stored = weight_storage(config, tensors, quant)
    weights = stored.bytes

    max_model_len = engine.max_model_len or min(config.max_position_embeddings, 4096)
    backend = get_backend(engine.attention_backend, engine.kv_cache_dtype)
    groups = KVCacheGroups.for_engine(config, engine)
    per_block = backend.bytes_per_block(groups.num_slots, config.num_kv_heads, config.head_dim, engine.block_size,
                                        dtype)
    per_sequence = groups.blocks_per_sequence(max_model_len, engine.block_size) * per_block
    state = sum(state_rows(engine)) * config.state_bytes(dtype.itemsize)  # as engine/build.py sizes it
    acts = activation_bytes(config, engine, dtype, dense_copy)
    swap = engine.swap_space if engine.preemption_mode == "swap" else 0
    if engine.kv_cache_memory is not None:
        kv = engine.kv_cache_memory
    else:
        needed = int(engine.max_num_seqs) * per_sequence + state
        kv = default_kv_cache_memory(needed, budget - runtime - weights, acts + swap, margin)
    if not config.is_causal:
        kv = swap = per_sequence = 0
    if state:
        swap = 0  # preemption recomputes a model with recurrent layers
    blocks = max(0, kv - state) // per_block
    swap = (swap // per_block) * per_block
    usable = (blocks - (1 if groups.hybrid else 0)) * per_block  # less the reserved NULL_BLOCK
    return SizeEstimate(
        model=path.name, dtype=str(dtype).removeprefix("torch."), weights_bytes=weights,
        dense_copy_bytes=stored.dense_copy_bytes, storage=stored.params,
        kv_bytes_per_token=per_sequence / max_model_len, kv_cache_groups=groups.describe(),
        kv_cache_dtype=str(backend.kv_cache_dtype(dtype)).removeprefix("torch."),
        kv_cache_bytes=blocks * per_block + state, state_bytes=state,
        kv_cache_tokens=int(max(0, usable) * max_model_len // per_sequence) if per_sequence else 0,
        swap_bytes=swap,
        activation_bytes=acts, runtime_bytes=runtime, tokenizer_bytes=tokenizer,
        frontend_bytes=FRONTEND_RUNTIME_BYTES + tokenizer if engine_process else 0,
        max_model_len=max_model_len,
        max_num_seqs=int(engine.max_num_seqs), margin=margin)


def format_estimate(e: SizeEstimate, memory: Optional[int]) -> str:
    def gib(n: float) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"

    kinds = ", ".join(f"{k} {v / 1e6:.0f}M" for k, v in e.storage.items() if v)
    lines = [
        f"{e.model} ({e.dtype})",
        f"  weights        {gib(e.weights_bytes):>10}   ({kinds} parameters"
        + (f"; dense copies {gib(e.dense_copy_bytes)}" if e.dense_copy_bytes else "") + ")",
        f"  KV cache       {gib(e.kv_cache_bytes):>10}   ({e.kv_cache_dtype}, "
        f"{e.kv_bytes_per_token / 1024:.2f} KiB per token x "
        f"{e.kv_cache_tokens} tokens = {e.concurrency_at_max_len:.1f} sequences of {e.max_model_len})"
        if e.kv_bytes_per_token else f"  KV cache       {gib(0):>10}   (an encoder keeps none: each input is computed whole)",
    ]
    if e.state_bytes:
        lines.append(f"{'':30}(of which {e.state_bytes / 2**20:.2f} MiB: recurrent layers' states, one per "
                     f"sequence x {e.max_num_seqs} and the prefix cache's snapshots)")
    if "hybrid" in e.kv_cache_groups:
        lines.append(f"                              ({e.kv_cache_groups})")
    if e.swap_bytes:
        lines.append(f"  swap space     {gib(e.swap_bytes):>10}   (host copies of preempted sequences, resident once used)")
    lines += [
        f"  activations    {gib(e.activation_bytes):>10}   (largest step)",
        f"  runtime        {gib(e.runtime_bytes):>10}   (interpreter, torch, server; tokenizer {gib(e.tokenizer_bytes)})",
        *([f"  front-end      {gib(e.frontend_bytes):>10}   (the server's process beside the engine's)"]
          if e.frontend_bytes else []),
        f"  total          {gib(e.total_bytes):>10}   reserved: resident, predicted, once the KV cache is full",
        f"  at start-up    {gib(e.startup_bytes):>10}   resident, predicted: the KV cache's pages are mapped as "
        + (f"tokens are written ({e.kv_bytes_per_token / 1024:.2f} KiB each)" if e.kv_bytes_per_token else "used"),
    ]
    if memory is not None:
        lines.append(f"  in {gib(memory)} (keeping {e.margin:.0%} free): {e.fits(memory)} sequences of "
                     f"{e.max_model_len} tokens at once (asked for {e.max_num_seqs})")
    return "\n".join(lines)
