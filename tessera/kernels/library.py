"""Building and loading the kernel library: one build per instruction-set variant, compiler and CPU.

Each variant (isa.py: scalar, avx2, avx512, avx512_bf16, amx; neon on aarch64; and the SIMDe-emulated
ones tests use) is every source compiled with that variant's flags, one object per source in
parallel, then linked. A library is named by its variant and a hash of the sources, headers, flags,
compiler and CPU, so an edit to any of them builds a new one and a home directory shared by
machines of different CPUs never hands one's build to another. The variant loaded is isa.selected():
the host's best, or the TESSERA_CPU_ISA cap; the log names it. Its functions get their ctypes types
from bindings.py's table when it is loaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from tessera.kernels import bindings, isa
from tessera.kernels.toolchain import SOURCE_DIR, KernelUnavailable, compiler, host_cpu, kernel_dir, run

logger = logging.getLogger(__name__)

SOURCES = ("paged_attention.c", "prefill_attention.c", "kv_int8.c", "rms_norm.c", "int8_gemv.c", "int4_gemv.c",
           "int4_avx2.c", "int4_i8_f32.c", "kquant_gemm.c", "kquant_dequant.c", "mxfp4_gemm.c", "step_ops.c",
           "moe_step.c", "decode_step.c", "lora.c", "variant.c")
HEADERS = ("tessera_kernels.h", "simd.h", "bf16.h", "softmax.h", "kquant.h")
# Flags of every variant; the instruction-set ones come from isa.Variant.flags. -mtune=native only
# schedules for this CPU: it never emits an instruction the variant's level lacks.
CFLAGS = ["-O3", "-mtune=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-std=c11"]


def _source_text(source_dir: Path, names: tuple[str, ...]) -> str:
    return "".join((source_dir / name).read_text() for name in names)


def variant_flags(variant: isa.Variant) -> list[str]:
    return [*CFLAGS, *variant.flags]


def library_path(cc: str, variant: isa.Variant, source_dir: Path = SOURCE_DIR) -> Path:
    text = _source_text(source_dir, SOURCES + HEADERS) + " ".join(variant_flags(variant)) + cc + host_cpu()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return kernel_dir() / f"tessera_kernels-{variant.name}-{digest}.so"


def missing_headers(variant: isa.Variant) -> list[str]:
    """System headers `variant` needs that the compiler does not find (SIMD Everywhere's, say)."""
    missing = []
    for header in variant.headers:
        probe = subprocess.run([compiler(), "-E", "-x", "c", "-", "-o", os.devnull], input=f"#include <{header}>\n",
                               capture_output=True, text=True)
        if probe.returncode != 0:
            missing.append(header)
    return missing


def build(variant: Optional[isa.Variant] = None, verbose: bool = False, source_dir: Path = SOURCE_DIR) -> Path:
    """Compile `variant` (default: the selected one) of the kernels from `source_dir` if it is not
    built yet; return the library's path. Objects compile in parallel, one per source."""
    variant = variant or isa.selected()
    cc = compiler()
    path = library_path(cc, variant, source_dir)
    if path.is_file():
        return path
    missing = missing_headers(variant)
    if missing:
        raise KernelUnavailable(f"the {variant.name} kernels need {', '.join(missing)} (e.g. Debian's libsimde-dev)")
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = variant_flags(variant)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        objects = [str(Path(tmp) / (name + ".o")) for name in SOURCES]
        jobs = [[cc, *flags, "-c", str(source_dir / name), "-o", obj] for name, obj in zip(SOURCES, objects)]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            list(pool.map(run, jobs))
        partial = Path(tmp) / "lib.so"
        run([cc, *flags, "-shared", *objects, "-o", str(partial), "-lm"])
        os.replace(partial, path)  # atomic: concurrent builders never load a half-written file
    if verbose:
        print(f"built {path}")
    return path


@lru_cache(maxsize=None)
def load_variant(name: str) -> ctypes.CDLL:
    """Variant `name` of the library, compiled on first use, its functions typed by
    bindings.SIGNATURES; raises KernelUnavailable if that cannot work."""
    variant = isa.variant(name)
    if not isa.runnable(variant):
        raise KernelUnavailable(f"this CPU cannot run the {name} kernels")
    lib = bindings.apply(ctypes.CDLL(str(build(variant))))
    built = lib.tessera_variant().decode()
    if built != name:
        raise KernelUnavailable(f"the {name} build of the kernels says it is {built!r}: its flags do not give "
                                "its level")
    return lib


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The library of the selected variant (isa.selected()); the first call logs which."""
    lib = load_variant(isa.selected().name)
    logger.info("C kernels: variant %s", isa.describe())
    return lib


@lru_cache(maxsize=1)
def calls() -> SimpleNamespace:
    """The library's functions as bindings.keyword_call makes them: every argument named."""
    lib = load()
    return SimpleNamespace(**{name: bindings.keyword_call(getattr(lib, name), name) for name in bindings.SIGNATURES})


def reset() -> None:
    """Forget the loaded variant, so the next load() follows TESSERA_CPU_ISA again (tests switch it)."""
    isa._selected.cache_clear()
    load.cache_clear()
    calls.cache_clear()


def available() -> Optional[str]:
    """None when the kernels load, else why not."""
    try:
        load()
        return None
    except (KernelUnavailable, isa.CpuIsaError, OSError) as exc:
        return str(exc)


def main(argv: list[str]) -> int:
    """`build`: the selected variant (TESSERA_CPU_ISA's, else the host's best); `build --all`: every
    variant this host can run or emulate (what the kernel tests load)."""
    if argv[1:] not in (["build"], ["build", "--all"]):
        print("usage: python -m tessera.kernels build [--all]", file=sys.stderr)
        return 2
    try:
        if argv[2:] == ["--all"]:
            for v in isa.variants():
                if isa.runnable(v) and not missing_headers(v):
                    build(v, verbose=True)
        else:
            build(verbose=True)
        print(f"C kernels: variant {isa.describe()}")
    except (KernelUnavailable, isa.CpuIsaError) as exc:
        print(f"warning: {exc}; Tessera will use PyTorch operators instead", file=sys.stderr)
        return 1
    return 0
