"""Which requests raise the API process's resident memory, and does it keep rising when repeated?"""
import asyncio, json, random, sys, time
import httpx
from tessera.bench.client import launch_server, stop_server
from tessera.bench.hostile import hostile_cases
from tessera.hostinfo import resident_bytes
from pathlib import Path

if __name__ == "__main__":
    port = 8241
    proc = launch_server("smollm2-135m", port, Path("/tmp/api_rss_server.log"), "--disable-log-stats")
    url = f"http://127.0.0.1:{port}"
    rss = lambda: resident_bytes(proc.pid) / 2**20
    cases = hostile_cases("smollm2-135m")
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            for i in range(20):
                c.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "hello " * 50, "max_tokens": 8})
            print(f"after warm-up: {rss():.1f} MiB", flush=True)
            for rnd in range(10):
                jumps = []
                for case in cases:
                    before = rss()
                    try:
                        c.request(case.method, case.path, content=case.body, headers={"content-type": case.content_type})
                    except Exception as e:
                        pass
                    after = rss()
                    if after - before > 0.5:
                        jumps.append((case.name, round(after - before, 1)))
                time.sleep(3)
                print(f"round {rnd}: {rss():.1f} MiB after 3 s; jumps > 2 MiB: {[j for j in jumps if j[1] > 2]}", flush=True)
    finally:
        stop_server(proc)
