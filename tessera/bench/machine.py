"""What a benchmark result must say about where it ran, so numbers are never compared blind."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


NOTABLE_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_flags() -> list[str]:
    """The vector extensions that decide which kernels a server can use."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [f for f in NOTABLE_CPU_FLAGS if f in present]
    except OSError:
        pass
    return []


def machine_info(label: Optional[str] = None) -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "hostname": platform.node(),
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "server_label": label or "",
    }
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["memory_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
                    break
    except OSError:
        pass
    return info


def median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """Milliseconds one call of `fn` takes: a warm-up call (first-touch pages, JIT, caches), then
    the median of `repeats` timed calls (the kernel benchmarks' measure)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000
