"""`tessera size` against measured resident memory: each packaged model, two settings.

For each (model, setting) the prediction is computed (the same code as `tessera size`), a real
`tessera serve` is started with the same flags, a load that reaches the largest step is sent
(max_num_seqs concurrent requests, prompts long enough to fill the token budget, then decodes),
and the server's resident memory is read from /proc, summed over its processes (front-end and
engine core): VmRSS at start and after the load, and VmHWM, each process's peak over its whole life
(loading included). The KV cache's pages are mapped as tokens are written, so the prediction after
the load is `tessera size`'s start-up figure plus the blocks the load's requests held. Writes a JSON file and prints a Markdown table.

    python benchmarks/sizing.py --out benchmarks/results/sizing/sizing.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tessera.bench.client import stop_server, wait_for_health
from tessera.hostinfo import cpu_model_name

SETTINGS = {
    "short": ["--max-model-len", "1024", "--max-num-seqs", "4", "--preemption-mode", "recompute"],
    "long": ["--max-model-len", "4096", "--max-num-seqs", "16", "--preemption-mode", "swap"],
}
MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM summed over the server and its child processes (the engine core runs in
    its own process: the front-end's figures alone miss the model)."""
    import psutil

    out = {"VmRSS": 0, "VmHWM": 0, "by_process": {}}
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            lines = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        except OSError:
            continue
        mine = {}
        for line in lines:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                mine[key] = int(value.split()[0]) * 1024
                out[key] += mine[key]
        name = "front-end" if proc.pid == pid else f"child {proc.pid}"
        out["by_process"][name] = mine  # which term of the prediction each process holds
    return out


def predict(model: str, flags: list[str]) -> dict:
    from tessera.cli import build_parser
    from tessera.engine.args import config_from_args
    from tessera.sizing import estimate

    args = build_parser(with_bench=False).parse_args(["size", model, *flags])
    return estimate(config_from_args(args, model)).to_dict()


def load(url: str, num: int, prompt_words: int) -> list[int]:
    """`num` concurrent completions: prompts that fill the step budget, then a few decodes.
    Returns each request's tokens (prompt and output), which its KV blocks hold."""
    def one(i: int) -> int:
        words = " ".join(f"word{(i * 7919 + j) % 5000}" for j in range(prompt_words))
        r = httpx.post(f"{url}/v1/completions", json={"prompt": words, "max_tokens": 24, "temperature": 0.0,
                                                      "ignore_eos": True}, timeout=900)
        r.raise_for_status()
        return r.json()["usage"]["total_tokens"]
    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        return list(pool.map(one, range(num)))


def measure(model: str, flags: list[str], port: int, prompt_words: int, log: Path) -> dict:
    cmd = [sys.executable, "-m", "tessera", "serve", model, "--port", str(port), "--num-threads", "2", *flags]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, str(log))
        started = proc_status(proc.pid)
        num = int(flags[flags.index("--max-num-seqs") + 1])
        tokens = load(url, num, prompt_words)
        after = proc_status(proc.pid)
        return {"rss_started": started["VmRSS"], "rss_after_load": after["VmRSS"], "hwm": after["VmHWM"],
                "by_process_after_load": after["by_process"], "tokens_per_request": tokens}
    finally:
        stop_server(proc, 60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--prompt-words", type=int, default=150)
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sizing/sizing.json"))
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        for name in args.settings:
            flags = SETTINGS[name]
            pred = predict(model, flags)
            got = measure(model, flags, args.port, args.prompt_words, args.out.with_suffix(f".{model}.{name}.log"))
            # The KV cache and the swap pool are mapped as they are written: resident is the start-up
            # figure plus the blocks the load's requests held (all at once: they run concurrently).
            block = 16
            written = sum(-(-t // block) * block for t in got["tokens_per_request"]) * pred["kv_bytes_per_token"]
            resident = pred["startup_bytes"] + min(int(written), pred["kv_cache_bytes"])
            row = {"model": model, "setting": name, "flags": " ".join(flags), "predicted": pred, **got,
                   "predicted_resident": resident, "predicted_startup": pred["startup_bytes"],
                   "error_started": pred["startup_bytes"] / got["rss_started"] - 1,
                   "error_vs_rss": resident / got["rss_after_load"] - 1,
                   "error_vs_hwm": resident / got["hwm"] - 1}
            rows.append(row)
            print(f"{model} {name}: predicted {resident / 2**20:.0f} MiB, RSS {got['rss_after_load'] / 2**20:.0f}"
                  f" MiB ({row['error_vs_rss']:+.1%}), peak {got['hwm'] / 2**20:.0f} MiB ({row['error_vs_hwm']:+.1%})",
                  flush=True)
    meta = {"machine": cpu_model_name() or platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("\n| model | setting | predicted MiB | RSS after load MiB | error | peak (VmHWM) MiB | error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['flags']} | {r['predicted_resident'] / 2**20:.0f} | "
              f"{r['rss_after_load'] / 2**20:.0f} | {r['error_vs_rss']:+.1%} | {r['hwm'] / 2**20:.0f} | "
              f"{r['error_vs_hwm']:+.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
