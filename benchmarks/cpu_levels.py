"""Tessera capped at an instruction-set level against llama.cpp server built for that same level, on
one host, in one run: for each level and workload, Tessera (`tessera serve MODEL --cpu-isa LEVEL`) and
then llama.cpp server from the folder that holds only that level's CPU backend, one server at a time,
same GGUF, same client (`tessera bench serve`), and the ratio Tessera / llama.cpp.

    python benchmarks/cpu_levels.py                                # every level this host runs, workloads a-c
    python benchmarks/cpu_levels.py --levels avx2,avx512 --long    # and d at the best level given
    python benchmarks/cpu_levels.py --levels native --workloads smollm2-1user --num-prompts 2   # a check
    python benchmarks/cpu_levels.py --dry-run                      # the plan and the commands, nothing run

Levels: avx2 (AVX2, FMA, F16C, BMI2), avx512 (AVX-512 F/BW/VL/DQ with VNNI and VBMI, no BF16: Ice
Lake's), avx512_bf16 (avx512 + AVX512-BF16: Zen 4/5's, Sapphire Rapids' without AMX), native (Tessera
uncapped, llama.cpp built with -march=native). Default: avx2, avx512 and avx512_bf16 where this host's
/proc/cpuinfo flags allow them. Tessera gets `--cpu-isa LEVEL` except at native. The llama.cpp servers
are benchmarks/peers/setup_peers.sh llama-levels' ($PEERS_DIR/llama.cpp/levels/LEVEL/llama-server,
each started in its folder, where ggml finds only that level's libggml-cpu-LEVEL.so). Before the runs,
each level's server start-up log (at -lv 4, no model) must name libggml-cpu-LEVEL.so as the CPU backend it
loaded (its system_info features are kept); during each run the server must have that module, and no
other, mapped (/proc/PID/maps). The run stops otherwise.

Workloads (the peer table's, benchmarks/peer_table.sh, at one user):
  qwen1.5b-code-edit   (a) qwen2.5-coder-1.5b Q4_K_M, code-edit prompts, 128-256 output tokens: output tok/s
  smollm2-1user        (b) smollm2-135m Q4_1, random prompts of 50-400 words, 16-256 output tokens: output tok/s
  qwen1.5b-prefill512  (c) qwen2.5-coder-1.5b, 510-word (~512-token) prompts, one output token: TTFT
  qwen0.5b-prefill16k  (d) qwen2.5-coder-0.5b, ~16k-token prompts, one output token: TTFT; only with --long
                           (or named in --workloads), at the best level given only, 32k context
Settings as compare.sh: Tessera --max-num-seqs 32 --max-model-len 2048, llama.cpp -np 32 -c 65536
(d: Tessera --max-model-len 32768, llama.cpp -c 32768 -np 1), --threads on both. Every server starts
fresh for its run (no prompt cache from an earlier one); each run sends --warmup short unrelated
requests first. Figures are medians over a run's requests: output tok/s per request (output tokens /
end-to-end time, what a user sees), decode tok/s (1 / TPOT) beside it, and TTFT; ratios are Tessera /
llama.cpp (tok/s above 1 is Tessera faster; TTFT below 1 is Tessera faster).

The timed part holds `flock` on --lock (/tmp/tessera-bench.lock) throughout. Writes
OUT/cpu_levels_<time>.json (host's lscpu model name and flags, per level per workload both servers'
medians, the ratio, the commands and the loaded llama.cpp backend) and OUT/<time>/ (each run's
`tessera bench serve` JSON and server logs).
"""
from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's tessera, as `-m tessera` from REPO gives the servers

from tessera.bench.client import stop_server, wait_for_health  # noqa: E402
from tessera.bench.machine import machine_info  # noqa: E402

PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/work/peers"))
LEVELS = ("avx2", "avx512", "avx512_bf16", "native")  # lowest first
_AVX2 = {"avx2", "fma", "f16c", "bmi2"}
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512vbmi"}
NEEDS = {"avx2": _AVX2, "avx512": _AVX512, "avx512_bf16": _AVX512 | {"avx512_bf16"}, "native": set()}
UNCAPPED = ("native", "auto")  # Tessera runs without --cpu-isa
# Variables that would cap Tessera or PyTorch, or load another ggml backend, behind the script's back.
CAP_ENV = ("TESSERA_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "GGML_BACKEND_PATH")


@dataclass(frozen=True)
class Workload:
    model: str
    dataset: str
    num_prompts: int
    client_args: tuple[str, ...]
    metric: str  # "output_tok_s" or "ttft_s"
    context: int = 2048
    long: bool = False  # opt-in, and at the best level only

    def tessera_args(self) -> list[str]:
        if self.context > 2048:
            return ["--max-model-len", str(self.context)]
        return ["--max-num-seqs", "32", "--max-model-len", "2048"]

    def llama_args(self) -> list[str]:
        if self.context > 2048:
            return ["-c", str(self.context), "-np", "1"]
        return ["-np", "32", "-c", "65536"]


WORKLOADS = {
    "qwen1.5b-code-edit": Workload("qwen2.5-coder-1.5b", "code-edit", 8, ("--max-tokens", "128:256"), "output_tok_s"),
    "smollm2-1user": Workload("smollm2-135m", "random", 16, ("--prompt-words", "50:400", "--max-tokens", "16:256"),
                              "output_tok_s"),
    "qwen1.5b-prefill512": Workload("qwen2.5-coder-1.5b", "random", 6, ("--prompt-words", "510:510",
                                                                        "--max-tokens", "1:1"), "ttft_s"),
    "qwen0.5b-prefill16k": Workload("qwen2.5-coder-0.5b", "random", 3, ("--prompt-words", "16340:16340",
                                                                        "--max-tokens", "1:1"), "ttft_s",
                                    context=32768, long=True),
}


def host_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_levels() -> list[str]:
    """The capped levels this host can run, lowest first (native is always runnable but not a default)."""
    flags = host_flags()
    return [lv for lv in LEVELS if lv != "native" and NEEDS[lv] <= flags]


def lscpu() -> dict[str, Any]:
    """The host's model name and full flag list as lscpu gives them (/proc/cpuinfo where it is absent)."""
    out: dict[str, Any] = {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                out["model_name"] = value.strip()
            elif key.strip() == "Flags":
                out["flags"] = value.split()
    except (OSError, subprocess.CalledProcessError):
        pass
    if "flags" not in out:
        out["flags"] = sorted(host_flags())
    if "model_name" not in out:
        out["model_name"] = machine_info()["cpu_model"]
    return out


def others_running() -> list[str]:
    """The busiest processes just before a run (what else shared the cores), as compare.sh notes them."""
    try:
        ps = subprocess.run(["ps", "-eo", "pid,ni,pcpu,rss,comm", "--sort=-pcpu"], capture_output=True, text=True)
        return ps.stdout.splitlines()[:6]
    except OSError:
        return []


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        r = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
        return r.stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in CAP_ENV:
        env.pop(k, None)
    return env


def model_path(name: str, fetch: bool) -> Optional[Path]:
    from tessera.models import registry

    if fetch:
        return Path(registry.ensure_model(name, progress=False))
    return registry.model_path(name) if registry.is_installed(name) else None  # a dry run downloads nothing


@dataclass
class Server:
    """One server process started fresh for one run; stopped with bench.client.stop_server."""

    command: list[str]
    log: Path
    port: int
    cwd: Optional[Path] = None
    proc: Optional[subprocess.Popen] = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.command, stdout=f, stderr=subprocess.STDOUT, cwd=self.cwd,
                                         env=clean_env())
        try:
            wait_for_health(self.url, self.proc, str(self.log), timeout=900)
        except BaseException:
            stop_server(self.proc)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_server(self.proc)


def tessera_command(level: str, w: Workload, gguf: Path, port: int, threads: int) -> list[str]:
    cmd = [sys.executable, "-m", "tessera", "serve", w.model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", w.model, "--num-threads", str(threads), *w.tessera_args()]
    if level not in UNCAPPED:
        cmd += ["--cpu-isa", level]
    return cmd


def llama_dir(levels_dir: Path, level: str) -> Path:
    return levels_dir / level


def llama_command(level: str, w: Workload, gguf: Path, port: int, threads: int, levels_dir: Path) -> list[str]:
    return [str(llama_dir(levels_dir, level) / "llama-server"), "-m", str(gguf), "--alias", w.model,
            "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads), *w.llama_args()]


def client_command(w: Workload, url: str, label: str, num_prompts: int, seed: int, warmup: int,
                   output: Path, plot_dir: str) -> list[str]:
    return [sys.executable, "-m", "tessera", "bench", "serve", "--base-url", url, "--model", w.model,
            "--label", label, "--dataset", w.dataset, "--seed", str(seed), "--concurrency", "1",
            "--num-prompts", str(num_prompts), "--warmup", str(warmup), *w.client_args, "--no-progress",
            "--output", str(output), "--plot-dir", plot_dir]


def llama_backend_probe(levels_dir: Path, level: str) -> dict[str, Any]:
    """What llama.cpp's start-up log says about its CPU backend, from its folder: the module ggml
    loaded (`load_backend: loaded CPU backend from ...`) and system_info's compiled-in features. The
    server prints both at log verbosity 4 before it loads a model, so it is started with none (it stops
    there); the timed runs keep the default verbosity and are checked by the modules they map."""
    d = llama_dir(levels_dir, level)
    r = subprocess.run([str(d / "llama-server"), "-lv", "4", "-m", "/nonexistent.gguf"], cwd=d, env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    info: dict[str, Any] = {"loaded": [], "system_info": ""}
    for line in (r.stdout + r.stderr).splitlines():
        if "loaded CPU backend from" in line:
            info["loaded"].append(line.split("loaded CPU backend from", 1)[1].strip())
        elif "system_info:" in line and not info["system_info"]:
            info["system_info"] = line.split("system_info:", 1)[1].strip()
    want = f"libggml-cpu-{level}.so"
    if [Path(p).name for p in info["loaded"]] != [want]:
        raise SystemExit(f"llama.cpp in {d} loads {info['loaded'] or 'no CPU backend'}, not {want}: "
                         "rerun benchmarks/peers/setup_peers.sh llama-levels")
    return info


def mapped_cpu_backends(pid: int) -> list[str]:
    """The libggml-cpu-*.so files a running llama-server has mapped (what it really runs)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return sorted({Path(ln.split()[-1]).name for ln in maps.splitlines()
                   if "libggml-cpu" in ln and ln.split()[-1].startswith("/")})


def tessera_isa_lines(log: Path) -> list[str]:
    """Tessera's start-up lines about its instruction-set level (kernel variant, --cpu-isa)."""
    keys = ("c kernels: variant", "cpu-isa", "dtype auto")
    return [ln.strip() for ln in log.read_text(errors="replace").splitlines()
            if any(k in ln.lower() for k in keys)][:6]


def medians(bench_json: Path) -> dict[str, Any]:
    doc = json.loads(bench_json.read_text())
    run = doc["runs"][0]
    ok = [r for r in run["requests"] if r["ok"]]
    s = run["summary"]

    def med(values: list[float]) -> Optional[float]:
        return statistics.median(values) if values else None

    return {
        "output_tok_s": med([r["output_tokens"] / r["e2e"] for r in ok if r["e2e"] > 0]),
        "decode_tok_s": med([1 / r["tpot"] for r in ok if r.get("tpot")]),
        "ttft_s": med([r["ttft"] for r in ok]),
        "prompt_tokens": med([r["prompt_tokens"] for r in ok]),
        "output_tokens": med([r["output_tokens"] for r in ok]),
        "requests": len(run["requests"]), "failed": s["failed"],
        "run_output_tok_s": s["output_tokens_per_s"],  # the run's total output tokens / its duration
    }


def run_one(kind: str, level: str, wname: str, w: Workload, gguf: Path, args: argparse.Namespace,
            raw: Path) -> dict[str, Any]:
    stem = f"{level}_{wname}_{kind}"
    log = raw / "logs" / f"{stem}.log"
    if kind == "tessera":
        server = Server(tessera_command(level, w, gguf, args.port, args.threads), log, args.port, cwd=REPO)
    else:
        d = llama_dir(args.llama_levels, level)
        # cwd = its folder: ggml also searches the working directory for libggml-cpu-*.so.
        server = Server(llama_command(level, w, gguf, args.port, args.threads, args.llama_levels), log, args.port,
                        cwd=d)
    entry: dict[str, Any] = {"server_command": shlex.join(server.command), "server_cwd": str(server.cwd),
                             "others_running": others_running(), "load_average": list(os.getloadavg())}
    out = raw / f"{stem}.json"
    t0 = time.monotonic()
    with server:
        entry["startup_s"] = round(time.monotonic() - t0, 2)
        if kind == "llamacpp":
            entry["cpu_backend_mapped"] = mapped = mapped_cpu_backends(server.proc.pid)
            if mapped != [f"libggml-cpu-{level}.so"]:
                raise SystemExit(f"llama.cpp {level}: maps {mapped or 'no CPU backend'}, not "
                                 f"libggml-cpu-{level}.so (see {log})")
        else:
            entry["isa_log"] = tessera_isa_lines(log)
        n = args.num_prompts or w.num_prompts
        with tempfile.TemporaryDirectory() as plots:  # the JSON is the result; its plots are not kept
            cmd = client_command(w, server.url, f"{kind}-{level}", n, args.seed, args.warmup, out, plots)
            entry["client_command"] = shlex.join(cmd)
            subprocess.run(cmd, check=True, cwd=REPO, env=clean_env())
    entry.update(medians(out))
    entry["result_file"] = str(out.relative_to(REPO) if out.is_relative_to(REPO) else out)
    entry["log"] = str(log.relative_to(REPO) if log.is_relative_to(REPO) else log)
    return entry


def ratio(t: Optional[float], l: Optional[float]) -> Optional[float]:
    return t / l if t and l else None


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(level, workload) pairs in run order: per level, its workloads; the long one at the best level."""
    best = args.long_level or args.levels[-1]
    pairs = []
    for level in args.levels:
        for wname in args.workloads:
            if WORKLOADS[wname].long and level != best:
                continue
            pairs.append((level, wname))
    if any(WORKLOADS[w].long for w in args.workloads) and best not in args.levels:
        pairs += [(best, w) for w in args.workloads if WORKLOADS[w].long]
    return pairs


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(
                                     __doc__.splitlines()[1:]))
    ap.add_argument("--levels", help=f"comma-separated, of {', '.join(LEVELS)} (default: the capped levels this "
                                     f"host runs: {','.join(host_levels()) or 'none'})")
    ap.add_argument("--workloads", help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all but "
                                        f"the long one)")
    ap.add_argument("--long", action="store_true", help="add qwen0.5b-prefill16k (a 16k-token prompt's TTFT)")
    ap.add_argument("--long-level", choices=LEVELS, help="the level of the long workload (default: the last level)")
    ap.add_argument("--num-prompts", type=int, help="requests per run, for every workload (default: each "
                                                    "workload's own: 8, 16, 6, 3)")
    ap.add_argument("--warmup", type=int, default=2, help="short unrelated requests before each run (default: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="threads of both servers (default: 2)")
    ap.add_argument("--port", type=int, default=8141)
    ap.add_argument("--llama-levels", type=Path, default=PEERS_DIR / "llama.cpp" / "levels",
                    help="setup_peers.sh llama-levels' folder of per-level servers (default: %(default)s)")
    ap.add_argument("--servers", default="tessera,llamacpp",
                    help="which of tessera,llamacpp to run (default: both; the ratio needs both)")
    ap.add_argument("--lock", type=Path, default=Path("/tmp/tessera-bench.lock"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/cpu_levels")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; start nothing")
    args = ap.parse_args(argv)
    args.levels = args.levels.split(",") if args.levels else host_levels()
    for lv in args.levels:
        if lv not in LEVELS:
            ap.error(f"unknown level {lv!r}: choose from {', '.join(LEVELS)}")
        missing = NEEDS[lv] - host_flags()
        if missing:
            ap.error(f"level {lv} is above this host: it lacks {', '.join(sorted(missing))}")
    if args.long_level and NEEDS[args.long_level] - host_flags():
        ap.error(f"--long-level {args.long_level} is above this host")
    args.levels = sorted(set(args.levels), key=LEVELS.index)
    if not args.levels:
        ap.error("no level to run (this host has none of avx2, avx512, avx512_bf16: try --levels native)")
    args.servers = args.servers.split(",")
    if not args.servers or set(args.servers) - {"tessera", "llamacpp"}:
        ap.error("--servers: tessera, llamacpp or both")
    args.workloads = (args.workloads.split(",") if args.workloads
                      else [w for w, spec in WORKLOADS.items() if not spec.long])
    if args.long and "qwen0.5b-prefill16k" not in args.workloads:
        args.workloads.append("qwen0.5b-prefill16k")
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}: choose from {', '.join(WORKLOADS)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    pairs = plan(args)
    models = sorted({WORKLOADS[w].model for _, w in pairs})
    if args.dry_run:
        print(f"host: {lscpu()['model_name']}; levels this host runs: {', '.join(host_levels())}")
        for m in models:
            print(f"model {m}: {model_path(m, fetch=False) or 'not installed (pulled at the start of a run)'}")
        for level, wname in pairs:
            w = WORKLOADS[wname]
            gguf = model_path(w.model, fetch=False) or Path(f"<{w.model}.gguf>")
            n = args.num_prompts or w.num_prompts
            d = llama_dir(args.llama_levels, level)
            print(f"\n== {level} / {wname} ({w.metric}, {n} requests)")
            print("  tessera:  " + shlex.join(tessera_command(level, w, gguf, args.port, args.threads)))
            print(f"  llama.cpp (cwd {d}{'' if (d / 'llama-server').exists() else ', MISSING'}): "
                  + shlex.join(llama_command(level, w, gguf, args.port, args.threads, args.llama_levels)))
            print("  client:   " + shlex.join(client_command(w, f"http://127.0.0.1:{args.port}", f"SERVER-{level}",
                                                             n, args.seed, args.warmup, Path("OUT.json"), "PLOTS")))
        return 0

    run_levels = sorted({lv for lv, _ in pairs}, key=LEVELS.index)
    probes = {}
    if "llamacpp" in args.servers:
        for level in run_levels:
            exe = llama_dir(args.llama_levels, level) / "llama-server"
            if not exe.exists():
                raise SystemExit(f"no {exe}: run benchmarks/peers/setup_peers.sh llama-levels")
        probes = {level: llama_backend_probe(args.llama_levels, level) for level in run_levels}
    if "tessera" in args.servers and any(lv not in UNCAPPED for lv in run_levels):
        serve_help = subprocess.run([sys.executable, "-m", "tessera", "serve", "--help"], cwd=REPO, env=clean_env(),
                                    capture_output=True, text=True).stdout
        if "--cpu-isa" not in serve_help:
            raise SystemExit(f"this checkout's `tessera serve` has no --cpu-isa ({REPO}): only --levels native "
                             "runs here")
    ggufs = {m: model_path(m, fetch=True) for m in models}  # downloads happen before the lock
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    raw = args.out / stamp
    raw.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "kind": "tessera-cpu-levels", "version": 1, "command": shlex.join([sys.executable, *sys.argv]),
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"lscpu": lscpu(), "machine": machine_info("cpu_levels")},
        "tessera": git_state(), "llama_cpp_levels": str(args.llama_levels), "llama_cpp_backends": probes,
        "settings": {"threads": args.threads, "warmup": args.warmup, "seed": args.seed,
                     "num_prompts": args.num_prompts, "levels": args.levels, "workloads": args.workloads},
        "workloads": {w: {"model": WORKLOADS[w].model, "gguf": str(ggufs[WORKLOADS[w].model]),
                          "dataset": WORKLOADS[w].dataset, "client_args": list(WORKLOADS[w].client_args),
                          "metric": WORKLOADS[w].metric, "context": WORKLOADS[w].context}
                      for w in args.workloads},
        "ratio_meaning": "Tessera / llama.cpp of the workload's metric: output_tok_s above 1 or ttft_s below 1 "
                         "means Tessera is faster",
        "levels": {},
    }
    summary = args.out / f"cpu_levels_{stamp}.json"

    def save() -> None:
        summary.write_text(json.dumps(doc, indent=1))

    args.lock.parent.mkdir(parents=True, exist_ok=True)
    with open(args.lock, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {args.lock} (another benchmark is running)", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        for level, wname in pairs:
            w = WORKLOADS[wname]
            entry: dict[str, Any] = {"metric": w.metric}
            for kind in args.servers:
                print(f"[{time.strftime('%H:%M:%S')}] {level} / {wname}: {kind}", flush=True)
                entry[kind] = run_one(kind, level, wname, w, ggufs[w.model], args, raw)
                print(f"  {w.metric} median {entry[kind][w.metric]}", flush=True)
            if "tessera" in entry and "llamacpp" in entry:
                entry["ratio"] = ratio(entry["tessera"][w.metric], entry["llamacpp"][w.metric])
                if w.metric == "output_tok_s":
                    entry["decode_ratio"] = ratio(entry["tessera"]["decode_tok_s"],
                                                  entry["llamacpp"]["decode_tok_s"])
            doc["levels"].setdefault(level, {})[wname] = entry
            save()  # a run cut short keeps what it measured
            if entry.get("ratio"):
                print(f"  ratio Tessera / llama.cpp: {entry['ratio']:.3f}", flush=True)
    doc["finished"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    save()
    print(f"\n{'level':<12} {'workload':<22} {'metric':<13} {'tessera':>10} {'llama.cpp':>10} {'ratio':>7}")
    def fmt(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.3f}"

    for level, ws in doc["levels"].items():
        for wname, e in ws.items():
            m = e["metric"]
            print(f"{level:<12} {wname:<22} {m:<13} {fmt(e.get('tessera', {}).get(m)):>10} "
                  f"{fmt(e.get('llamacpp', {}).get(m)):>10} {fmt(e.get('ratio')):>7}")
    print(f"written: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
