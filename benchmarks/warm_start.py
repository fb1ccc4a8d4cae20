"""Warm from the first request: a fresh server's first open-loop probe against the same server warm.

    flock /tmp/tessera-bench.lock python benchmarks/warm_start.py --out benchmarks/results/warm_start/smollm2.json

Each server starts with a $TESSERA_HOME of its own whose `models`, `packed`, `kernels`,
`tokenizers` and `digests` link to the real cache (nothing is pulled or packed again) but whose
`cost_models` and `host` are empty, so the step-cost model is calibrated at start-up as on a
new host. Runs, one after the other:
- fresh: start, probe at once (the first requests it ever serves), probe again (warm);
- reused: restart on the fresh run's home, whose calibration it reuses, and probe once;
- hog: a new home, a process spinning on one core from before the start until /health is 200
  (the calibration runs beside it), then the hog stops and the server is probed once;
- hog_reused: restart on the hog run's home (a calibration stored there beside the hog would be
  reused) and probe once.
`--server-repo` runs the servers and the client from another checkout, for a baseline.
A probe is `tessera bench capacity` held at one rate (`--start-rate R --max-probes 1`): the
random mix of 10-60-word prompts and 4-32 output tokens, open loop for --probe-duration seconds,
no warm-up request, passing when TTFT p95 <= 1 s and ITL p50 <= 50 ms. Each run records the
start-up time and the step-cost model the server reports (/v1/engine/stats): whether its
calibration was trusted, what other processes took during it, and whether it was stored; each
probe records the cores taken meanwhile by processes other than the server, the client and this
script (`foreign_cores`), since the host may be shared; each run first waits for the host to be
quiet (--wait-quiet).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tessera.bench.client import launch_server, stop_server
from tessera.bench.machine import machine_info
from tessera.hostinfo import others_cpu_seconds, process_tree
from tessera.models.registry import tessera_home

SHARED = ("models", "packed", "kernels", "tokenizers", "digests")  # linked: what loading needs, not what is measured


def fresh_home(parent: Path, name: str) -> Path:
    home = parent / name
    home.mkdir()
    real = tessera_home()
    for sub in SHARED:
        if (real / sub).exists():
            (home / sub).symlink_to(real / sub)
    return home


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return machine_info()["cpu_model"]
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds a process and its descendants have used (utime + stime)."""
    total = 0.0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def foreign_cores(fn, server_pid: int):
    """fn()'s result and the cores processes other than this one, its children and the server's
    tree took meanwhile: what else ran on the host during a measurement."""
    def ours() -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return tree_cpu_seconds(server_pid) + kids.ru_utime + kids.ru_stime

    before, mine, t0 = others_cpu_seconds(), ours(), time.monotonic()
    result = fn()
    after, wall = others_cpu_seconds(), time.monotonic() - t0
    if before is None or after is None:
        return result, None
    return result, round(max(0.0, (after - before) - (ours() - mine)) / wall, 2)


def probe(args: argparse.Namespace, url: str, out: Path, server_pid: int) -> dict:
    """One open-loop probe at --rate; its summary and verdict, and what else ran meanwhile."""
    result, foreign = foreign_cores(lambda: _probe(args, url, out), server_pid)
    return {**result, "foreign_cores": foreign, "loadavg_after": os.getloadavg()[0]}


def _probe(args: argparse.Namespace, url: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tessera", "bench", "capacity", "--base-url", url, "--model", args.model,
           "--dataset", "random", "--prompt-words", "10:60", "--max-tokens", "4:32", "--slo-ttft", "1",
           "--slo-itl", "0.05", "--start-rate", str(args.rate), "--max-probes", "1", "--min-rate", str(args.rate),
           "--probe-duration", str(args.probe_duration), "--min-requests", "6", "--warmup", "0",
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    p = json.loads(out.read_text())["probes"][0]
    s = p["summary"]
    return {"rate": p["rate"], "passed": p["passed"], "reason": p["reason"], "requests": s["num_requests"],
            "failed": s["failed"], "ttft_p95_ms": _ms(s["ttft_s"]["p95"]), "ttft_p50_ms": _ms(s["ttft_s"]["p50"]),
            "itl_p50_ms": _ms(s["itl_s"]["p50"])}


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 1)


def cost_model(url: str, model: str, home: Path) -> dict:
    stats = httpx.get(f"{url}/v1/engine/stats", params={"model": model}, timeout=10).json()
    m = stats["step_cost_model"]
    return {"trusted": m.get("calibration_trusted"), "checks": m.get("calibration_checks"),
            "tokens_ms": m.get("tokens_ms"), "calibration_s": m.get("calibration_s"),
            "stored": sorted(p.name for p in (home / "cost_models").glob("*.json"))}


def wait_quiet(max_cores: float, seconds: float, limit: float) -> float:
    """Wait (at most `limit` seconds) until other processes take under `max_cores` over `seconds`:
    on a shared host a run started beside someone's test suite measures the suite. Returns the
    cores measured last."""
    deadline = time.monotonic() + limit
    while True:
        before, t0 = others_cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        after = others_cpu_seconds()
        if before is None or after is None:
            return 0.0
        cores = (after - before) / (time.monotonic() - t0)
        if cores < max_cores or time.monotonic() > deadline:
            return round(cores, 2)
        print(f"host busy ({cores:.2f} cores of other processes); waiting", flush=True)


def start(args: argparse.Namespace, home: Path, log: Path) -> tuple[subprocess.Popen, float]:
    os.environ["TESSERA_HOME"] = str(home)
    t0 = time.monotonic()
    proc = launch_server(args.model, args.port, log, "--no-ui", "--disable-log-stats")
    return proc, time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--port", type=int, default=8127)
    p.add_argument("--rate", type=float, default=2.0, help="requests/s of every probe (default: %(default)s)")
    p.add_argument("--probe-duration", type=float, default=30.0)
    p.add_argument("--runs", default="fresh,reused,hog,hog_reused", help="which runs, in order (default: %(default)s)")
    p.add_argument("--server-repo", type=Path, default=None,
                   help="run servers and client from this checkout (another commit, for a baseline)")
    p.add_argument("--wait-quiet", type=float, default=600.0,
                   help="seconds each run may wait for other processes to leave the host (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out = args.out.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    if args.server_repo is not None:  # `python -m tessera` imports the checkout it runs in
        os.chdir(args.server_repo)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result: dict = {"host": lscpu_model(), "machine": machine_info("tessera"), "model": args.model, "commit": commit,
                    "rate": args.rate, "probe_duration_s": args.probe_duration,
                    "slo": {"ttft_p95_ms": 1000, "itl_p50_ms": 50}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="tessera-warm-") as tmp:
        homes: dict[str, Path] = {}
        for run in args.runs.split(","):
            source = {"reused": "fresh", "hog_reused": "hog"}.get(run)
            home = homes[source] if source in homes else fresh_home(Path(tmp), run)
            homes[run] = home
            quiet = wait_quiet(0.2, 5.0, args.wait_quiet)
            hog = None
            if run == "hog":  # spinning on one core from before the start until the server is ready
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                proc, startup = start(args, home, logs / f"server_{run}.log")
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            try:
                entry = {"foreign_cores_before_start": quiet, "startup_s": round(startup, 1),
                         "cost_model": cost_model(url, args.model, home)}
                entry["first_probe"] = probe(args, url, logs / f"{run}_first.json", proc.pid)
                if run == "fresh":
                    entry["warm_probe"] = probe(args, url, logs / f"{run}_warm.json", proc.pid)
                entry["cost_model_after"] = cost_model(url, args.model, home)
            finally:
                stop_server(proc)
            result["runs"][run] = entry
            print(run, json.dumps(entry), flush=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
