"""LoRA adapters' cost: the base model against requests spread over adapters, one server, one run.

    flock /tmp/tessera-bench.lock python benchmarks/lora.py --out benchmarks/results/lora/run.json

Writes `--adapters` random-weight PEFT adapters (every q/k/v/o and gate/up/down projection, rank
`--rank`) for the model, starts one `tessera serve MODEL --lora-modules ... --max-loras N`, and runs
closed-loop streams of completions (distinct prompts of ~`--prompt-words` words, `--max-tokens`
output tokens, ignore_eos) in four arms, alternating within each round:

- base x16: 16 streams naming the base model;
- lora x16: 16 streams, stream i naming adapter i mod N (a step holds every adapter);
- base x1, lora x1: one stream, the base or one adapter.

Output tokens per second of wall time per arm; the figure is the ratio lora/base per round, and
the report is the median over rounds. Same server, same prompts' shapes: only the adapters differ.

Then `churn`: streams over the adapters keep running while a new adapter is loaded through
/v1/load_lora_adapter (one more than --max-loras: slots and memory change hands) and sent
requests, and one adapter is unloaded mid-way. Every request must succeed, except those sent to
the unloaded adapter after the unload, which must be 404s; then no request runs and no KV block
is held (/v1/engine/stats).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from safetensors.torch import save_file

from tessera.bench.client import completion_body, launch_server, stop_server, stream_request
from tessera.bench.machine import machine_info
from tessera.models.adapters import TARGETS, expected_shapes
from tessera.models.info import load_model_info
from tessera.models.registry import resolve_model

HF = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
      "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def write_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A PEFT folder with random A and B (small B: the output stays text-like, not that it matters)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for kind, module in HF.items():
            out, inp = expected_shapes(config, kind)
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in HF.values()],
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False}))


def prompt(rng: random.Random, words: int) -> str:
    return "Continue this list: " + ", ".join(f"item {rng.randrange(10**6)}" for _ in range(words // 2))


async def run_arm(url: str, models: list[str], streams: int, per_stream: int, max_tokens: int, words: int,
                  seed: int) -> dict:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def stream(i: int) -> list:
            out = []
            for _ in range(per_stream):
                body = completion_body(models[i % len(models)], prompt(rng, words), max_tokens, 0.0)
                out.append(await stream_request(http, url + "/v1/completions", body, chat=False))
            return out
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(stream(i) for i in range(streams))) for r in rs]
        wall = time.perf_counter() - t0
    failed = [r.error for r in results if not r.ok]
    tokens = sum(r.output_tokens for r in results)
    ttfts = sorted(r.ttft for r in results if r.ok)
    return {"streams": streams, "models": models, "requests": len(results), "failed": len(failed),
            "errors": failed[:3], "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2), "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None}


async def churn(url: str, names: list[str], extra: Path, max_tokens: int, words: int, seed: int) -> dict:
    """Load `extra` as `lora_new` and unload names[-1] while streams run; see the module docstring."""
    rng = random.Random(seed)
    gone = names[-1]
    unloaded_at: list[float] = []
    results: list[tuple[str, float, object]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def stream(model: str, count: int, delay: float = 0.0) -> None:
            await asyncio.sleep(delay)
            for _ in range(count):
                t = time.monotonic()
                r = await stream_request(http, url + "/v1/completions",
                                         completion_body(model, prompt(rng, words), max_tokens, 0.0), chat=False)
                results.append((model, t, r))

        async def admin() -> dict:
            await asyncio.sleep(3.0)
            async with http.post(url + "/v1/load_lora_adapter",
                                 json={"lora_name": "lora_new", "lora_path": str(extra)}) as resp:
                load = (resp.status, await resp.text())
            await asyncio.sleep(3.0)
            unloaded_at.append(time.monotonic())
            async with http.post(url + "/v1/unload_lora_adapter", json={"lora_name": gone}) as resp:
                unload = (resp.status, await resp.text())
            return {"load": load, "unload": unload}

        tasks = [stream(n, 6) for n in names for _ in range(2)] + [stream("lora_new", 4, delay=4.0)]
        answers = (await asyncio.gather(admin(), *tasks))[0]
        await asyncio.sleep(1.0)
        async with http.get(url + "/v1/engine/stats") as resp:
            stats = (await resp.json())["scheduler"]
    cut = unloaded_at[0] if unloaded_at else float("inf")
    bad, refused_after = [], 0
    for model, started, r in results:
        if model == gone and started > cut and r.status == 404:
            refused_after += 1
        elif not r.ok:
            bad.append(f"{model}: {r.error}")
    return {"admin": answers, "requests": len(results), "failed": len(bad), "errors": bad[:5],
            "unloaded_adapter_404s": refused_after, "num_running_after": stats["num_running"],
            "kv_cache_usage_after": stats["kv_cache_usage"],
            "ok": not bad and answers["load"][0] == 200 and answers["unload"][0] == 200
            and stats["num_running"] == 0 and stats["kv_cache_usage"] == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--per-stream", type=int, default=2, help="requests each stream sends per arm")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    config, _ = load_model_info(resolve_model(args.model))
    work = Path(tempfile.mkdtemp(prefix="tessera-lora-bench-"))
    names = [f"lora{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_adapter(work / name, config, args.rank, seed=i)
    write_adapter(work / "lora_new", config, args.rank, seed=len(names))
    assert set(HF) <= set(TARGETS)
    flags = ["--lora-modules", *[f"{n}={work / n}" for n in names], "--max-loras", str(args.adapters),
             "--max-lora-rank", str(max(16, args.rank))]
    log = work / "server.log"
    proc = launch_server(args.model, args.port, log, *flags)
    url = f"http://127.0.0.1:{args.port}"
    arms = {"base_x16": ([args.model], args.streams), "lora_x16": (names, args.streams),
            "base_x1": ([args.model], 1), "lora_x1": (names[:1], 1)}
    rounds = []
    try:
        asyncio.run(run_arm(url, [args.model, *names], 4, 1, 8, 20, seed=99))  # warm-up: every adapter loaded
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            results = {}
            for arm in order:
                models, streams = arms[arm]
                per = args.per_stream if streams > 1 else args.per_stream * 4
                results[arm] = asyncio.run(run_arm(url, models, streams, per, args.max_tokens, args.prompt_words,
                                                   seed=1000 * r + len(arm)))
                print(f"round {r} {arm}: {results[arm]['output_tok_s']} tok/s, failed {results[arm]['failed']}",
                      flush=True)
            results["ratio_x16"] = results["lora_x16"]["output_tok_s"] / results["base_x16"]["output_tok_s"]
            results["ratio_x1"] = results["lora_x1"]["output_tok_s"] / results["base_x1"]["output_tok_s"]
            rounds.append(results)
        churned = asyncio.run(churn(url, names, work / "lora_new", args.max_tokens, args.prompt_words, seed=7))
        print(f"churn: {json.dumps(churned)}", flush=True)
    finally:
        stop_server(proc)
    report = {"host": machine_info(), "model": args.model, "adapters": args.adapters, "rank": args.rank,
              "streams": args.streams, "max_tokens": args.max_tokens, "rounds": rounds,
              "median_ratio_x16": round(statistics.median(r["ratio_x16"] for r in rounds), 3),
              "median_ratio_x1": round(statistics.median(r["ratio_x1"] for r in rounds), 3),
              "failed_requests": sum(r[a]["failed"] for r in rounds for a in arms), "churn": churned}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("median_ratio_x16", "median_ratio_x1", "failed_requests")}
                     | {"churn_ok": churned["ok"]}))


if __name__ == "__main__":
    main()
