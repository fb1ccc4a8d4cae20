"""Building and loading the kernel library: compiled once per source, flags, compiler and CPU.

The library is named by a hash of all of these, so an edit to any source or header (the interface
in tessera_kernels.h included) builds a new one, and a home directory shared by machines of
different CPUs never hands one's build to another. Its functions get their ctypes types from
bindings.py's table when it is loaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from tessera.kernels import bindings

SOURCES = ("paged_attention.c", "prefill_attention.c", "kv_int8.c", "rms_norm.c", "int8_gemv.c", "int4_gemv.c",
           "int4_avx2.c", "kquant_gemm.c", "kquant_dequant.c", "mxfp4_gemm.c", "decode_step.c", "lora.c")
HEADERS = ("tessera_kernels.h", "bf16.h", "softmax.h", "kquant.h")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]


class KernelUnavailable(RuntimeError):
    pass


def kernel_dir() -> Path:
    home = os.environ.get("TESSERA_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "tessera") / "kernels"


def _source_text() -> str:
    return "".join((Path(__file__).parent / name).read_text() for name in SOURCES + HEADERS)


def _host_cpu() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a home directory
    shared by machines of different CPUs must not hand one's build to the other)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def library_path(compiler: str) -> Path:
    digest = hashlib.sha256((_source_text() + " ".join(CFLAGS) + compiler + _host_cpu()).encode()).hexdigest()[:16]
    return kernel_dir() / f"tessera_kernels-{digest}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels if they are not built yet; return the library's path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable("no C compiler (cc/gcc) found")
    path = library_path(compiler)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    sources = [str(Path(__file__).parent / name) for name in SOURCES]
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so.partial", delete=False) as tmp:
        partial = Path(tmp.name)
    cmd = [compiler, *CFLAGS, *sources, "-o", str(partial), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        partial.unlink(missing_ok=True)
        raise KernelUnavailable(f"compiling the kernels failed: {exc}") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise KernelUnavailable(f"compiling the kernels failed: {done.stderr.strip()[:2000]}")
    os.replace(partial, path)  # atomic: concurrent builders never load a half-written file
    if verbose:
        print(f"built {path}")
    return path


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The kernel library, compiled on first use, its functions typed by bindings.SIGNATURES;
    raises KernelUnavailable if that cannot work."""
    return bindings.apply(ctypes.CDLL(str(build())))


@lru_cache(maxsize=1)
def calls() -> SimpleNamespace:
    """The library's functions as bindings.keyword_call makes them: every argument named."""
    lib = load()
    return SimpleNamespace(**{name: bindings.keyword_call(getattr(lib, name), name) for name in bindings.SIGNATURES})


def available() -> Optional[str]:
    """None when the kernels load, else why not."""
    try:
        load()
        return None
    except (KernelUnavailable, OSError) as exc:
        return str(exc)


def main(argv: list[str]) -> int:
    if argv[1:] != ["build"]:
        print("usage: python -m tessera.kernels build", file=sys.stderr)
        return 2
    try:
        build(verbose=True)
    except KernelUnavailable as exc:
        print(f"warning: {exc}; Tessera will use PyTorch operators instead", file=sys.stderr)
        return 1
    return 0
