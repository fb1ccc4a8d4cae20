"""Embedding throughput: Tessera's engine beside sentence-transformers, on the same host, in one run.

    flock /tmp/tessera-bench.lock python benchmarks/embeddings.py --out benchmarks/results/embeddings/run.json

all-MiniLM-L6-v2 (`tessera pull all-minilm-l6-v2`) embeds batches of 1, 32 and 256 texts of
exactly 64 tokens ([CLS] and [SEP] included) with Tessera's offline engine (`LLM.embed`: the
scheduler, runner and pooling the server uses, no HTTP) and with sentence-transformers'
`encode(batch, batch_size=len(batch))`, its defaults otherwise (float32). The two alternate
within each round (which goes first alternates too), so a neighbour's load on the CPU hits
both alike; the figure that matters is the ratio, taken per round, and the report is the median
of the rounds. Each measurement repeats the batch for at least `--seconds` after one warm-up.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Callable

from tessera.bench.machine import machine_info

MODEL = "all-minilm-l6-v2"
BATCHES = (1, 32, 256)
TOKENS = 64


def texts_of(tokenizer, n: int, tokens: int, seed: int = 0) -> list[str]:
    """`n` different texts of exactly `tokens` tokens each (whole words of the vocabulary, so one
    word is one token)."""
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.backend.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    out = []
    while len(out) < n:
        text = " ".join(rng.choice(words) for _ in range(tokens - 2))
        if len(tokenizer.encode(text)) == tokens:
            out.append(text)
    return out


def measure(run: Callable[[list[str]], object], batch: list[str], seconds: float) -> float:
    """Seconds per call of `run(batch)`: the mean over calls for at least `seconds`, after a warm-up."""
    run(batch)
    calls, t0 = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - t0 < seconds:
        run(batch)
        calls += 1
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="time per measurement (default: %(default)s)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="Tessera's step budget (default: profile)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="Tessera's inputs per step (default: profile)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from tessera.llm import LLM
    from tessera.models.registry import ensure_model

    path = ensure_model(MODEL)
    engine_options = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                        ("max_num_seqs", args.max_num_seqs)) if v is not None}
    llm = LLM(MODEL, dtype=args.dtype, **engine_options)
    st = SentenceTransformer(str(path), device="cpu")
    texts = texts_of(llm.tokenizer, max(BATCHES), TOKENS)
    systems: dict[str, Callable[[list[str]], object]] = {
        "tessera": llm.embed,
        "sentence_transformers": lambda batch: st.encode(batch, batch_size=len(batch)),
    }
    rounds = []
    for r in range(args.rounds):
        row = {}
        for batch_size in BATCHES:
            batch = texts[:batch_size]
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            secs = {name: measure(systems[name], batch, args.seconds) for name in order}
            row[str(batch_size)] = {name: {"texts_per_s": batch_size / s, "tokens_per_s": batch_size * TOKENS / s}
                                    for name, s in secs.items()}
            row[str(batch_size)]["ratio"] = secs["sentence_transformers"] / secs["tessera"]
            print(f"round {r + 1} batch {batch_size:3d}: tessera {batch_size / secs['tessera']:8.1f} texts/s, "
                  f"sentence-transformers {batch_size / secs['sentence_transformers']:8.1f} texts/s, "
                  f"ratio {row[str(batch_size)]['ratio']:.2f}x", flush=True)
        rounds.append(row)
    medians = {}
    for b in map(str, BATCHES):
        medians[b] = {name: {k: statistics.median(rr[b][name][k] for rr in rounds) for k in ("texts_per_s", "tokens_per_s")}
                      for name in systems}
        medians[b]["ratio"] = statistics.median(rr[b]["ratio"] for rr in rounds)
    result = {
        "benchmark": "embeddings", "model": MODEL, "tokens_per_text": TOKENS, "batches": list(BATCHES),
        "tessera": {"dtype": str(llm.engine.dtype).removeprefix("torch."),
                    "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
                    "max_num_seqs": llm.engine.config.max_num_seqs},
        "sentence_transformers": {"dtype": str(next(st.parameters()).dtype).removeprefix("torch."),
                                  "version": __import__("sentence_transformers").__version__},
        "torch_threads": torch.get_num_threads(), "seconds_per_measurement": args.seconds,
        "rounds": rounds, "median": medians, "machine": machine_info("tessera vs sentence-transformers"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for b in map(str, BATCHES):
        m = medians[b]
        print(f"median batch {b:>3}: tessera {m['tessera']['texts_per_s']:.1f} texts/s "
              f"({m['tessera']['tokens_per_s']:.0f} tok/s), sentence-transformers "
              f"{m['sentence_transformers']['texts_per_s']:.1f} texts/s, ratio {m['ratio']:.2f}x")


if __name__ == "__main__":
    main()
