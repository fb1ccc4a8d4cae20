"""Engine flags shared by every command that builds an engine (serve, generate, chat, bench)."""
from __future__ import annotations

import argparse
import re
from dataclasses import fields
from typing import Any, Mapping

from tessera.config import EngineConfig
from tessera.config_choices import (ATTENTION_BACKENDS, CPU_ISAS, DENSE_WEIGHT_COPIES, DEVICES, DTYPES, KV_CACHE_DTYPES,
                                    PREEMPTION_MODES, QUANTIZATIONS, SCHEDULER_POLICIES, SCHEDULING_POLICIES)
from tessera.pooling_params import POOLING_TYPES
from tessera.profiles import DEFAULT_PROFILE, PROFILE_SETTINGS, PROFILES


def parse_size(text: str) -> int:
    """Parse '2GiB', '512MiB', '1.5G' or a plain byte count into bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB or 512MiB)")
    value, unit = float(m.group(1)), m.group(2).upper()
    return int(value * (1 << (10 * " KMGT".index(unit or " "))))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags every command shares, in one help group: where the model runs and how its
    weights are kept, the KV cache, scheduling, then speculation, pooling and threads."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    _weight_args(g, d)
    _kv_cache_args(g, d)
    _scheduling_args(g, d)
    _lora_args(g, d)
    _other_args(g, d)


def _weight_args(g: Any, d: EngineConfig) -> None:
    g.add_argument("--device", default="auto", choices=DEVICES,
                   help="where the model runs: cpu, or cuda (an NVIDIA GPU: bfloat16 weights, the triton attention "
                        "backend); auto: cuda when PyTorch sees a GPU (default: %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="share of the GPU's memory the engine may use, weights and activations included; the KV "
                        "cache takes the rest of it (--device cuda; default: %(default)s)")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                   help="compute dtype; auto: bfloat16 where the CPU computes it natively, else measured "
                        "(default: %(default)s)")
    g.add_argument("--cpu-isa", default=None, choices=CPU_ISAS,
                   help="instruction-set level of the CPU kernels, PyTorch's included: auto is the best this "
                        "CPU runs; a lower level runs (and measures) that level here, a higher one is refused "
                        "(default: $TESSERA_CPU_ISA, else auto)")
    g.add_argument("--quantization", "-q", default=d.quantization, choices=QUANTIZATIONS,
                   help="weight storage of linear layers: auto keeps the file's precision (a Q4 GGUF runs "
                        "int4, Q5-Q8 tensors int8, float files dense); none dequantizes (default: %(default)s)")
    g.add_argument("--dense-weight-copy", default=d.dense_weight_copy, choices=DENSE_WEIGHT_COPIES,
                   help="keep a dense copy of quantized weights for prefill-sized steps (faster, more memory); "
                        "auto: when the copy is under 1 GiB and 1/8 of free RAM (default: %(default)s)")
    g.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=d.int8_activations,
                   help="Q6_K and Q4_K tensors keep the file's blocks and decode-sized products multiply "
                        "int8-quantized activations (fewer bytes per step than int8 groups or int4 tiles); "
                        "--no-int8-activations stores them int8/int4 times unrounded activations (default: on)")
    g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="run every step through the model's modules, without the one-call C decode step "
                        "(slower; for comparison or to rule it out)")
    g.add_argument("--weight-cache", action=argparse.BooleanOptionalAction, default=d.weight_cache,
                   help="keep the weights as the kernels use them in $TESSERA_HOME/packed and map that file on "
                        "later starts: seconds instead of tens of seconds, pages shared by every server of the "
                        "model (default: on)")


def _kv_cache_args(g: Any, d: EngineConfig) -> None:
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV cache element format: auto (the compute dtype), bfloat16, float32, or int8 (one "
                        "scale per block and head: twice the tokens in the same memory) (default: %(default)s)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="memory for the KV cache, e.g. 2GiB (default: from model size and free RAM)")
    g.add_argument("--kv-offload-dir", default=None, metavar="PATH",
                   help="second tier of the prefix cache on disk: full KV blocks are written there (in the "
                        "background) and a prompt whose head is there loads it instead of recomputing it, "
                        "across restarts of the same model and settings (default: off)")
    g.add_argument("--kv-offload-size", type=parse_size, default=d.kv_offload_size,
                   help="most the disk tier may hold; least recently used blocks go first (default: 8GiB)")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every layer's KV blocks for the whole context, sliding-window layers (Gemma 3) "
                        "included; by default those keep only their window's blocks, a long sequence then "
                        "holding about a fifth of the cache (off by itself with --kv-offload-dir, which stores "
                        "whole-context blocks)")


def _scheduling_args(g: Any, d: EngineConfig) -> None:
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt+output in tokens (default: min(model limit, 4096))")
    g.add_argument("--profile", choices=PROFILES, default=d.profile,
                   help="deployment preset setting the flags below marked (profile): "
                        + "; ".join(f"{name}: {p.description} (max-num-seqs {p.max_num_seqs}, "
                                    f"target-itl-ms {p.target_itl_ms:g})" for name, p in PROFILE_SETTINGS.items())
                        + f"; auto: {DEFAULT_PROFILE} (chat uses chat-solo). Explicit flags override it "
                          "(default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step, a hard limit (default: profile)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one step (default: profile)")
    g.add_argument("--target-itl-ms", type=float, default=None,
                   help="step time aimed at while requests are decoding: prefill chunks are sized by the "
                        "measured step-cost model to stay under it, or take the whole budget where it cannot "
                        "be held or more requests wait for their prompt than decode; 0 = no target, the "
                        "token budget alone (default: profile)")
    g.add_argument("--min-prefill-chunk", type=int, default=None,
                   help="the least prompt chunk worth sizing a step to the latency target for; where the "
                        "decodes leave room for fewer tokens, the step's prompts take the whole token budget "
                        "instead of crawling (default: profile)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse KV blocks of shared prompt heads (default: profile)")
    g.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=None,
                   help="what to do with a preempted request's KV (default: profile)")
    g.add_argument("--swap-space", type=parse_size, default=d.swap_space,
                   help="host memory for swapped-out KV blocks (default: 1GiB)")
    g.add_argument("--scheduler-policy", choices=SCHEDULER_POLICIES, default=d.scheduler_policy,
                   help="continuous batching, or the naive static baseline (default: %(default)s)")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d.scheduling_policy,
                   help="who goes first: fcfs, or each request's `priority` (lower first) for admission, the "
                        "token budget and preemption, with the queue bound and wait forecast per priority "
                        "(default: %(default)s)")
    g.add_argument("--background-priority", type=int, default=d.background_priority,
                   help="under --scheduling-policy priority, requests of this priority or past it (batches "
                        "run at it) get only the room the latency target leaves in each step "
                        "(default: %(default)s)")
    g.add_argument("--background-step-slack", type=float, default=d.background_step_slack,
                   help="how much longer background work may make a step carrying other requests, as a "
                        "share of its predicted time (default: %(default)s)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
                   help="attention implementation: paged (C kernel reading the paged cache in place), sdpa (PyTorch operators), "
                        "reference (a plain loop, for checking), triton (the GPU's kernel reading the paged cache in "
                        "place); auto: triton on a GPU, else paged where its kernel builds (default: %(default)s)")


def _lora_args(g: Any, d: EngineConfig) -> None:
    g.add_argument("--enable-lora", action="store_true", default=d.enable_lora,
                   help="serve LoRA adapters of this model: requests name one as their model; adapters load at "
                        "run time through /v1/load_lora_adapter (implied by --lora-modules)")
    g.add_argument("--lora-modules", nargs="+", default=list(d.lora_modules), metavar="NAME=PATH",
                   help="adapters served from start-up: name=path (a PEFT folder with adapter_config.json and "
                        "adapter_model.safetensors, or a llama.cpp LoRA GGUF), or JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="most different adapters in one step (default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the largest adapter rank accepted (default: %(default)s)")
    g.add_argument("--lora-dtype", choices=DTYPES, default=d.lora_dtype,
                   help="the adapters' weights: auto = bfloat16 (half the bytes a step reads for them); float32 "
                        "for results equal to a float32 reference (default: %(default)s)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in memory; others are read from their files again when asked for "
                        "(default: --max-loras)")


def _other_args(g: Any, d: EngineConfig) -> None:
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, as vLLM: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4}' (prompt lookup), '{\"method\": \"suffix\", "
                        "\"num_speculative_tokens\": 8}' (suffix decoding: the request's own tokens and earlier "
                        "requests' outputs; vLLM's suffix_decoding_* fields), '{\"model\": \"qwen2.5-coder-0.5b\", "
                        "\"num_speculative_tokens\": 4}' (a draft model with the same tokenizer) or "
                        "'{\"method\": \"layer_skip\", \"draft_layers\": [0, 1, 2]}' (a subset of the target's own layers "
                        "draft; default the first half and every other one after); also prompt_lookup_min and disable_by_batch_size (no "
                        "speculation above that many running requests; default 1: measured here, verification "
                        "already cost more than it saved at 4) and adaptive (default true: each step each request "
                        "verifies as many proposals as pay, from its acceptance and the step-cost model, none where "
                        "none pays). Requests opt out with \"speculative\": false "
                        "(default: off)")
    g.add_argument("--pooling", choices=POOLING_TYPES, default=None,
                   help="embeddings (/v1/embeddings) from this model by mean, cls or last-token pooling of its "
                        "hidden states, L2-normalised; a sentence-transformers folder brings its own (default: "
                        "the model's own, else it does not embed)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--seed", type=int, default=d.seed, help="engine seed for unseeded sampling (default: %(default)s)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags of a parsed command line, by EngineConfig field name: what a server keeps
    (not an EngineConfig) so that each model's own overrides still pass through the profile."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name != "model" and hasattr(args, f.name)}


def config_from_options(options: Mapping[str, Any], model: str, auto_profile: str = DEFAULT_PROFILE) -> EngineConfig:
    """The EngineConfig of `model` from engine options (see `engine_options`); `auto_profile` is
    what `--profile auto` means for this command (chat-solo for `tessera chat`)."""
    values = {**options, "model": model}
    if values.get("profile") == "auto":
        values["profile"] = auto_profile
    return EngineConfig(**values)


def config_from_args(args: argparse.Namespace, model: str, auto_profile: str = DEFAULT_PROFILE) -> EngineConfig:
    return config_from_options(engine_options(args), model, auto_profile)
