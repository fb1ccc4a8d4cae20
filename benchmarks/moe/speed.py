"""MoE speed and memory, Tessera against llama.cpp server on the same random-weight GGUF files of
published MoE shapes (gpt-oss-20b in MXFP4, Qwen3-30B-A3B in Q4_K_M; written by
benchmarks/moe/make_gguf.py).

Per file, one server at a time, both at the same context length (4,096 tokens of KV cache: Tessera
`--max-model-len 4096 --kv-cache-memory` of 4,096 tokens; llama.cpp `-c 4096 -np 8 -kvu`, one
shared pool that each slot may fill), prompt caching off (Tessera `--no-enable-prefix-caching`;
llama.cpp `--no-cache-prompt` and `cache_prompt: false`), 2 threads, llama.cpp's defaults otherwise
(flash attention auto, `--no-jinja`), measured with the same client:
  (i)   one user's decode: `tessera bench serve`, 4 requests one after another (prompts of 50-80
        words, 96-128 output tokens with ignore_eos), output tok/s and ITL p50;
  (ii)  prefill: time to first token of a 1,024-token prompt (repository source, a different slice
        each time), a non-streamed completion of one token, median of 3 (`--prefill-runs`);
  (iii) 8 concurrent streams: `tessera bench serve --concurrency 8`, 16 requests
        (`--concurrent-prompts`), output tok/s;
  (iv)  the server's whole resident memory (RSS and PSS of its process tree, Tessera's engine
        process included) after load and after the runs.
A server that does not load the file (a model Tessera does not support yet) is recorded as
"refused" with its log's tail, not a crash. One JSON per file in --out with the ratios
Tessera / llama.cpp and the host's CPU; `--table` prints them as markdown.

    python benchmarks/moe/make_gguf.py --out /work/models-bench
    python benchmarks/moe/speed.py --models-dir /work/models-bench                 # both servers
    python benchmarks/moe/speed.py --models-dir /work/models-bench --only llama.cpp
    python benchmarks/moe/speed.py --table
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from families.speed import run_summary  # noqa: E402
from moe.make_gguf import FILES, PUBLISHED, qwen_file  # noqa: E402

SERVERS = ("tessera", "llama.cpp")
CONTEXT = 4096
LENGTHS = ["--prompt-words", "50:80", "--max-tokens", "96:128"]
PREFILL_TOKENS = 1024


def gguf_info(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def num(key):
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])

    return {"file": str(path), "gguf_bytes": path.stat().st_size, "arch": arch, "shape": PUBLISHED[arch],
            "layers": num("block_count"), "experts": num("expert_count"), "experts_used": num("expert_used_count"),
            "kv_bytes_per_token": num("block_count") * 2 * num("attention.head_count_kv")
            * num("attention.key_length") * 2}


def server_command(kind: str, gguf: Path, label: str, port: int, threads: int, kv_bytes_per_token: int,
                   llama_cpp: Path) -> list[str]:
    if kind == "tessera":
        return [sys.executable, "-m", "tessera", "serve", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", label, "--max-model-len", str(CONTEXT), "--max-num-seqs", "8",
                "--kv-cache-memory", f"{CONTEXT * kv_bytes_per_token / 2**20:.1f}MiB", "--no-enable-prefix-caching",
                "--num-threads", str(threads), "--no-ui", "--disable-log-stats", "--log-level", "warning"]
    return [str(llama_cpp / "build/bin/llama-server"), "-m", str(gguf), "--alias", label, "--host", "127.0.0.1",
            "--port", str(port), "-c", str(CONTEXT), "-np", "8", "-kvu", "-t", str(threads), "-tb", str(threads),
            "--no-jinja", "--no-cache-prompt", "--no-webui"]


def prefill_prompts(n: int, tokens: int) -> list[str]:
    """`n` distinct prompts of `tokens` tokens of the repository's source (qwen2.5-coder's tokenizer,
    which both files carry)."""
    from tessera.models.registry import ensure_model
    from tessera.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(str(ensure_model("qwen2.5-coder-1.5b", progress=False)))
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "tessera").rglob("*.py")))
    ids = tok.encode(text, add_special_tokens=False)
    return [tok.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(n)]


def prefill(url: str, label: str, kind: str, prompts: list[str]) -> dict:
    runs = []
    for text in prompts:
        body = {"model": label, "prompt": text, "max_tokens": 1, "temperature": 0}
        if kind == "llama.cpp":
            body["cache_prompt"] = False
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=1800)
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        runs.append({"ttft_s": seconds, "prompt_tokens": r.json()["usage"]["prompt_tokens"]})
    ttft = statistics.median(r["ttft_s"] for r in runs)
    return {"ttft_median_s": ttft, "prompt_tokens_per_s": statistics.median(r["prompt_tokens"] for r in runs) / ttft,
            "runs": runs}


def bench(url: str, label: str, kind: str, load: list[str], result: Path) -> dict:
    with tempfile.TemporaryDirectory() as plots:  # the JSON is the result; the plots are not kept
        subprocess.run([sys.executable, "-m", "tessera", "bench", "serve", "--base-url", url, "--model", label,
                        "--label", kind, "--warmup", "1", "--no-progress", "--output", str(result),
                        "--plot-dir", plots, *load], check=True, capture_output=True, text=True)
    return run_summary(result)


def memory(pid: int) -> dict:
    from tessera.hostinfo import process_tree, tree_proportional_bytes, tree_resident_bytes

    return {"rss_bytes": tree_resident_bytes(pid), "pss_bytes": tree_proportional_bytes(pid),
            "processes": len(process_tree(pid))}


def run_server(kind: str, gguf: Path, info: dict, args: argparse.Namespace, label: str) -> dict:
    """Every measurement on one server; a server that does not come up is 'refused', a step that fails
    is recorded with its error and the rest still run."""
    from tessera.bench.client import wait_for_health

    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{label}-{kind}.log"
    cmd = server_command(kind, gguf, label, args.port, args.threads, info["kv_bytes_per_token"], args.llama_cpp)
    entry: dict = {"command": " ".join(cmd), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        t0 = time.monotonic()
        try:
            wait_for_health(url, proc, str(log), timeout=args.load_timeout)
        except RuntimeError as e:
            entry.update(status="refused", error=str(e), log_tail=log.read_text(errors="replace")[-3000:])
            return entry
        entry["load_s"] = time.monotonic() - t0
        entry["status"] = "ok"
        entry["memory_after_load"] = memory(proc.pid)
        decode = ["--concurrency", "1", "--num-prompts", str(args.decode_prompts), *LENGTHS]
        concurrent = ["--concurrency", "8", "--num-prompts", str(args.concurrent_prompts), *LENGTHS]
        steps = {"decode_1_user": lambda: bench(url, label, kind, decode, logs / f"{label}-{kind}-decode.json"),
                 "prefill_1024": lambda: prefill(url, label, kind, prefill_prompts(args.prefill_runs, PREFILL_TOKENS)),
                 "concurrent_8": lambda: bench(url, label, kind, concurrent, logs / f"{label}-{kind}-c8.json")}
        for step, measure in steps.items():
            try:
                entry[step] = measure()
            except (subprocess.CalledProcessError, httpx.HTTPError, KeyError, OSError) as e:
                detail = getattr(e, "stderr", None) or ""
                entry[step] = {"error": f"{type(e).__name__}: {e}", "detail": detail[-2000:]}
                entry["status"] = "failed steps"
            print(f"  {label} {kind} {step}: {entry[step]}", flush=True)
            if proc.poll() is not None:
                entry.update(status="exited during the runs", log_tail=log.read_text(errors="replace")[-3000:])
                return entry
        entry["memory_after_runs"] = memory(proc.pid)
        return entry
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def figures(entry: dict | None) -> dict:
    """The headline figures of one server's entry (None where not measured)."""
    def get(*keys):
        v = entry
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    return {"decode_tok_s": get("decode_1_user", "output_tokens_per_s"), "prefill_ttft_s": get("prefill_1024",
            "ttft_median_s"), "concurrent_8_tok_s": get("concurrent_8", "output_tokens_per_s"),
            "rss_after_load_bytes": get("memory_after_load", "rss_bytes"),
            "rss_after_runs_bytes": get("memory_after_runs", "rss_bytes")}


def ratios(result: dict) -> dict:
    t, ll = figures(result["servers"].get("tessera")), figures(result["servers"].get("llama.cpp"))
    return {k: t[k] / ll[k] if t[k] and ll[k] else None for k in t}


def table(out: Path) -> str:
    rows = ["| model | server | status | decode tok/s (1 user) | 1,024-token TTFT s | 8 streams tok/s | "
            "RSS after load GiB | RSS after runs GiB |", "|---|---|---|---|---|---|---|---|"]

    def cell(v, scale=1.0, fmt="{:.2f}"):
        return "" if v is None else fmt.format(v / scale)

    for path in sorted(out.glob("*.json")):
        result = json.loads(path.read_text())
        if "servers" not in result:
            continue
        name = f"{result['model']['shape'].split(' ')[0]} ({result['model']['layers']} layers)"
        for kind in SERVERS:
            e = result["servers"].get(kind)
            if e is None:
                continue
            f = figures(e)
            rows.append(f"| {name} | {kind} | {e['status']} | {cell(f['decode_tok_s'])} | "
                        f"{cell(f['prefill_ttft_s'])} | {cell(f['concurrent_8_tok_s'])} | "
                        f"{cell(f['rss_after_load_bytes'], 2**30)} | {cell(f['rss_after_runs_bytes'], 2**30)} |")
        r = result.get("ratio_tessera_vs_llamacpp") or {}
        if any(v is not None for v in r.values()):
            rows.append(f"| {name} | Tessera / llama.cpp | | {cell(r['decode_tok_s'])}x | {cell(r['prefill_ttft_s'])}x "
                        f"| {cell(r['concurrent_8_tok_s'])}x | {cell(r['rss_after_load_bytes'])}x | "
                        f"{cell(r['rss_after_runs_bytes'])}x |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=Path("/work/models-bench"))
    ap.add_argument("--models", nargs="*", choices=list(FILES), default=list(FILES))
    ap.add_argument("--qwen-layers", type=int, default=48, help="which Qwen3-30B-A3B file make_gguf.py wrote")
    ap.add_argument("--only", choices=SERVERS, help="run one server (keeps the other's figures in the JSON)")
    ap.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("PEERS_DIR", "/work/peers")) / "llama.cpp")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/moe")
    ap.add_argument("--port", type=int, default=8132)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-timeout", type=float, default=1200)
    ap.add_argument("--decode-prompts", type=int, default=4, help="one user's requests, one after another")
    ap.add_argument("--prefill-runs", type=int, default=3, help="1,024-token prompts; the median TTFT is kept")
    ap.add_argument("--concurrent-prompts", type=int, default=16, help="requests of the 8-stream run")
    ap.add_argument("--table", action="store_true", help="only print the markdown table of the JSONs in --out")
    args = ap.parse_args()
    if args.table:
        print(table(args.out))
        return
    from tessera.hostinfo import cpu_model_name

    args.out.mkdir(parents=True, exist_ok=True)
    for arch in args.models:
        gguf = args.models_dir / (FILES[arch] if arch == "gpt-oss" else qwen_file(args.qwen_layers))
        if not gguf.is_file():
            raise SystemExit(f"no {gguf}: run benchmarks/moe/make_gguf.py --out {args.models_dir}")
        info = gguf_info(gguf)
        label = gguf.stem
        path = args.out / f"{label}.json"
        result = json.loads(path.read_text()) if path.is_file() else {"servers": {}}
        result.update(model=info, context=CONTEXT, threads=args.threads, host=cpu_model_name(), cores=os.cpu_count())
        if info["layers"] != (48 if arch == "qwen3moe" else 24):
            result["note"] = f"{info['layers']} layers instead of the published shape's: to fit in this host's memory"
        for kind in ([args.only] if args.only else SERVERS):
            print(f"{label}: {kind}", flush=True)
            result.setdefault("workloads", {})[kind] = {
                "decode_1_user": f"{args.decode_prompts} requests, concurrency 1, {' '.join(LENGTHS)}",
                "prefill": f"{PREFILL_TOKENS} tokens, median of {args.prefill_runs}",
                "concurrent_8": f"{args.concurrent_prompts} requests, concurrency 8, {' '.join(LENGTHS)}"}
            result["servers"][kind] = run_server(kind, gguf, info, args, label)
            result["ratio_tessera_vs_llamacpp"] = ratios(result)
            result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
            path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(args.out))


if __name__ == "__main__":
    main()
