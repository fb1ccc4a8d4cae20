"""int8 KV cache against the bfloat16 one: perplexity, tokens of capacity, decode step time at long context.

    flock /tmp/tessera-bench.lock python benchmarks/kv_cache_dtype.py \\
        --out benchmarks/results/kv_cache_dtype.json

For each model, loaded as `tessera serve` loads it (dtype auto, quantization auto):
- perplexity of tests/data/gfdl-1.3-head.txt (--tokens tokens) with each cache format. The text
  goes through in chunks laid out as decode rows over the paged cache (each row attends to its
  prefix, as speculative verification does), so every score is computed by the serving decode
  kernel reading the stored keys and values: for int8, every attention read is dequantized;
- tokens of capacity per GiB (the backend's bytes per block, scales included);
- the median time of a whole decode step (model forward + logits) for --batch requests each
  holding --context tokens, the formats timed in alternation (A B A B ...) in one process.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from tessera.engine.worker.model_executor import ModelExecutor

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gfdl-1.3-head.txt"


def decode_rows_forward(loaded, executor: ModelExecutor, backend, caches, ids: list[int], table: list[int],
                        start: int, block_size: int) -> torch.Tensor:
    """Feed ids at positions start.. as decode rows of growing length, through the path the engine's
    runner would take (the C decode step where it applies); log-probs [n, vocab] float32."""
    n = len(ids)
    meta = backend.build_metadata([1] * n, list(range(start + 1, start + n + 1)), [table] * n, block_size)
    hidden = executor.forward(torch.tensor(ids), torch.arange(start, start + n), caches, meta)
    return torch.log_softmax(loaded.model.compute_logits(hidden).float(), dim=-1)


def perplexity(loaded, backend, ids: list[int], block_size: int, chunk: int) -> float:
    c = loaded.config
    nblocks = -(-len(ids) // block_size)
    caches = backend.allocate(c.num_layers, nblocks, block_size, c.num_kv_heads, c.head_dim, loaded.dtype)
    table = list(range(nblocks))
    executor = ModelExecutor(loaded.model)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:min(start + chunk, len(ids) - 1)]
            lp = decode_rows_forward(loaded, executor, backend, caches, piece, table, start, block_size)
            target = torch.tensor(ids[start + 1:start + 1 + len(piece)])
            total -= lp.gather(1, target.unsqueeze(1)).sum().item()
            count += len(piece)
    return math.exp(total / count)


class DecodeBench:
    """`batch` requests of `context` tokens each (copies of one prefilled context) in one format."""

    def __init__(self, loaded, backend, ids: list[int], batch: int, block_size: int) -> None:
        c = loaded.config
        per = -(-(len(ids) + 1) // block_size)
        self.loaded, self.backend, self.block_size = loaded, backend, block_size
        self.executor = ModelExecutor(loaded.model)  # decode steps as the engine's runner runs them
        self.caches = backend.allocate(c.num_layers, per * batch, block_size, c.num_kv_heads, c.head_dim,
                                       loaded.dtype)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
        self.context = len(ids)
        with torch.inference_mode():
            meta = backend.build_metadata([len(ids)], [len(ids)], [self.tables[0]], block_size)
            loaded.model(torch.tensor(ids), torch.arange(len(ids)), self.caches, meta)
            src = torch.tensor(self.tables[0])
            for table in self.tables[1:]:
                backend.copy_blocks(self.caches, self.caches, src, torch.tensor(table))
        self.next_ids = torch.tensor([ids[-1]] * batch)

    def step(self) -> float:
        b = len(self.tables)
        with torch.inference_mode():
            t0 = time.perf_counter()
            meta = self.backend.build_metadata([1] * b, [self.context + 1] * b, self.tables, self.block_size)
            hidden = self.executor.forward(self.next_ids, torch.full((b,), self.context), self.caches, meta)
            self.loaded.model.compute_logits(hidden)
            return time.perf_counter() - t0


def main() -> None:
    from tessera.attention import get_backend
    from tessera.models.loader import load_model
    from tessera.models.registry import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+",
                   default=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"])
    p.add_argument("--formats", nargs="+", default=["auto", "int8"])
    p.add_argument("--tokens", type=int, default=2048, help="perplexity text length")
    p.add_argument("--chunk", type=int, default=64, help="decode rows per perplexity forward")
    p.add_argument("--context", type=int, default=2000, help="tokens each request holds in the decode timing")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=15, help="timed decode steps per format and batch")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = []
    for name in args.models:
        loaded = load_model(resolve_model(name), "auto")
        c = loaded.config
        text_ids = loaded.tokenizer.encode(TEXT.read_text())
        ids = text_ids[:args.tokens]
        ctx_ids = (text_ids * (1 + args.context // len(text_ids)))[:args.context]
        backends = {f: get_backend("auto", f) for f in args.formats}
        row: dict = {"model": name, "dtype": str(loaded.dtype).removeprefix("torch."), "tokens": len(ids),
                     "context": args.context, "formats": {}}
        for f, backend in backends.items():
            per_block = backend.bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, args.block_size,
                                                loaded.dtype)
            ppl = perplexity(loaded, backend, ids, args.block_size, args.chunk)
            row["formats"][f] = {"ppl": ppl, "bytes_per_token": per_block / args.block_size,
                                 "tokens_per_gib": args.block_size * 2**30 / per_block, "decode_step_ms": {}}
            print(f"{name:20s} {f:5s} ppl {ppl:8.4f}  {args.block_size * 2**30 / per_block:9.0f} tokens/GiB",
                  flush=True)
        for b in args.batch:
            benches = {f: DecodeBench(loaded, backend, ctx_ids, b, args.block_size) for f, backend in backends.items()}
            times: dict[str, list[float]] = {f: [] for f in benches}
            for bench in benches.values():
                bench.step()  # warm-up
            for _ in range(args.steps):
                for f, bench in benches.items():  # alternate formats: drift hits both alike
                    times[f].append(bench.step())
            for f in benches:
                row["formats"][f]["decode_step_ms"][str(b)] = 1e3 * statistics.median(times[f])
            del benches
            print(f"{name:20s} batch {b}: " + ", ".join(
                f"{f} {row['formats'][f]['decode_step_ms'][str(b)]:.1f} ms" for f in backends), flush=True)
        base = row["formats"].get("auto")
        if base is not None:
            for f, r in row["formats"].items():
                r["ppl_ratio"] = r["ppl"] / base["ppl"]
                r["capacity_ratio"] = r["tokens_per_gib"] / base["tokens_per_gib"]
                r["decode_step_ratio"] = {b: r["decode_step_ms"][b] / base["decode_step_ms"][b]
                                          for b in r["decode_step_ms"]}
        results.append(row)
        del loaded
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


def machine() -> dict:
    from tessera.hostinfo import cpu_model_name

    return {"cpu": cpu_model_name(), "threads": torch.get_num_threads(), "torch": torch.__version__}


if __name__ == "__main__":
    main()
