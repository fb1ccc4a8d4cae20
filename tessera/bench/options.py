"""Command-line options shared by `tessera bench serve` and `tessera bench capacity`."""
from __future__ import annotations

import argparse
import math
import os
import random
from typing import Any

from tessera.bench.datasets import CHAT_DATASETS, DATASETS, Session, build_workload
from tessera.bench.metrics import SLO
from tessera.bench.runner import Target
from tessera.errors import TesseraError


def int_range(text: str) -> tuple[int, int]:
    """'16:256' → (16, 256); '128' → (128, 128)."""
    try:
        parts = [int(p) for p in text.replace("-", ":").split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a range: {text!r} (try 16:256 or 128)") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError(f"not a range: {text!r} (need 1 <= MIN <= MAX, as in 16:256)")
    return parts[0], parts[1]


def int_list(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r} (try 1,4,16,32)") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers, as in 1,4,16,32; got {text!r}")
    return values


def rate_list(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r} (try 0.5,1,2,inf)") from None
    if not values or any(not (v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"rates must be positive (inf allowed); got {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (v > 0) or math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def model_mix(text: str) -> list[tuple[str, float]]:
    """'big' -> [('big', 1.0)]; 'big=3,small=1' -> [('big', 0.75), ('small', 0.25)]: the share of
    sessions that ask for each model (weights need not sum to one)."""
    mix: list[tuple[str, float]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, weight = part.rpartition("=") if "=" in part else (part, "", "1")
        try:
            w = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"model mix: weight of {name!r} is not a number: {weight!r}") from None
        if not name.strip() or not (w > 0) or math.isinf(w):
            raise argparse.ArgumentTypeError(f"model mix: need NAME or NAME=WEIGHT with a positive weight, got {part!r}")
        if any(n == name.strip() for n, _ in mix):
            raise argparse.ArgumentTypeError(f"model mix: {name.strip()!r} given twice")
        mix.append((name.strip(), w))
    if not mix:
        raise argparse.ArgumentTypeError(f"no model in {text!r}")
    total = sum(w for _, w in mix)
    return [(n, w / total) for n, w in mix]


def mix_models(args: argparse.Namespace) -> list[str]:
    """The models `--model` names, in order (one, or a mix's)."""
    return [name for name, _ in model_mix(args.model)]


def _model_arg(text: str) -> str:
    model_mix(text)  # validated here, parsed where used
    return text


def add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True,
                   help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument("--model", required=True, type=_model_arg, metavar="NAME[=WEIGHT][,NAME=WEIGHT...]",
                   help="model name to put in each request, or a mix: each session (request or conversation) "
                        "asks for one model drawn with these weights, e.g. qwen2.5-coder-1.5b=3,smollm2-135m=1; "
                        "results are then broken down by model asked for and model that answered")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="API for single-turn workloads; multi-turn always uses chat (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY if set)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: greedy)")
    g.add_argument("--request-timeout", type=positive_float, default=600.0,
                   help="seconds before one request counts as failed (default: %(default)s)")
    g.add_argument("--label", default="", help="server label recorded with the results, e.g. tessera or vllm")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random mixed lengths, shared-prefix (RAG-like), multi-turn chat, chat (multi-turn behind a few "
                        "long shared system prompts), code-edit or json-schema "
                        "(structured output: each request with its own response_format) (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals (default: 0)")
    g.add_argument("--prompt-words", type=int_range, default=(50, 400), metavar="MIN:MAX",
                   help="prompt length in words for the random dataset (default: 50:400)")
    g.add_argument("--max-tokens", type=int_range, default=(16, 256), metavar="MIN:MAX",
                   help="output length per request, drawn uniformly; sent with ignore_eos (default: 16:256)")
    g.add_argument("--prefix-words", type=int, default=800,
                   help="shared-prefix: length of the shared head in words (default: %(default)s)")
    g.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: number of distinct heads (default: %(default)s)")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation (default: %(default)s)")
    g.add_argument("--no-constraint", dest="constrained", action="store_false",
                   help="json-schema: send the same prompts without response_format (the baseline)")
    g.add_argument("--slo-ttft", type=positive_float, default=1.0,
                   help="TTFT objective in seconds (default: %(default)s)")
    g.add_argument("--slo-itl", type=positive_float, default=0.05,
                   help="inter-token latency objective in seconds (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=1,
                   help="requests sent (with other prompts) before measuring, not counted (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def uses_chat(args: argparse.Namespace) -> bool:
    """Whether the workload's requests go to the chat API (chat datasets always do)."""
    return args.endpoint == "chat" or args.dataset in CHAT_DATASETS


def target_from_args(args: argparse.Namespace) -> Target:
    """The server; its `model` is the mix's first, the one warm-ups and single-model runs use."""
    return Target(base_url=args.base_url, model=model_mix(args.model)[0][0], endpoint=args.endpoint,
                  temperature=args.temperature, api_key=args.api_key, request_timeout=args.request_timeout)


def slo_from_args(args: argparse.Namespace) -> SLO:
    return SLO(ttft=args.slo_ttft, itl=args.slo_itl)


def workload_from_args(args: argparse.Namespace, num_prompts: int, seed: int) -> list[Session]:
    try:
        sessions = build_workload(args.dataset, num_prompts, seed, input_words=args.prompt_words,
                              output_tokens=args.max_tokens, prefix_words=args.prefix_words,
                              num_prefixes=args.num_prefixes, turns=args.turns,
                              constrained=args.constrained)
    except ValueError as exc:
        raise TesseraError(f"workload: {exc}") from None
    assign_models(sessions, model_mix(args.model), seed)
    return sessions


def assign_models(sessions: list[Session], mix: list[tuple[str, float]], seed: int) -> None:
    """Give each session a model drawn from `mix` (seeded: the same sessions ask for the same
    models on every server compared); a one-model mix leaves them on the target's model."""
    if len(mix) < 2:
        return
    rng = random.Random(seed + 424_242)
    names = [n for n, _ in mix]
    weights = [w for _, w in mix]
    for s in sessions:
        s.model = rng.choices(names, weights)[0]


def workload_config(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("dataset", "seed", "prompt_words", "max_tokens", "prefix_words", "num_prefixes", "turns", "constrained",
            "endpoint", "temperature", "warmup", "slo_ttft", "slo_itl", "base_url", "model", "label")
    return {k: getattr(args, k) for k in keys if hasattr(args, k)}
