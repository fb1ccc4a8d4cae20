"""Instruction-set levels: which variant of the kernel library a CPU runs, and the cap on it.

The kernel library is built once per variant (library.py), each the same sources compiled for one
level; simd.h turns a level's flags into the paths its kernels take. The host's level is what the
feature check (cpu_probe.c, compiled without any instruction-set flag) says the CPU and the OS allow.
`--cpu-isa` / TESSERA_CPU_ISA caps it: a lower level's variant is loaded, PyTorch's own kernels are
capped to match (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, read when torch is first imported and when
oneDNN first runs), and `--dtype auto` sees the capped level. So any host measures and tests every
level below its own; a level above it is refused, since its code would stop the process on an
illegal instruction.

Emulated variants ("avx512+simde", "avx512_bf16+simde") compile the AVX-512 paths against SIMD
Everywhere's portable implementations on top of a native AVX2 build: slow, for checking their
results on hosts that cannot execute them (tests/kernels/test_variants.py). TESSERA_CPU_ISA accepts
their names too; `--cpu-isa` offers only the real levels.
"""
from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from tessera.kernels import toolchain

logger = logging.getLogger(__name__)

ENV = "TESSERA_CPU_ISA"
AUTO = "auto"

# cpu_probe.c's bits, named as Linux names the flags in /proc/cpuinfo (the fallback where no compiler
# builds the probe); "amx_granted" is the tile state Linux gave this process.
FEATURE_BITS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                "avx512vbmi", "avx512_bf16", "amx_tile", "amx_granted", "asimd", "asimddp", "i8mm", "avx_vnni")


@dataclass(frozen=True)
class Variant:
    """One build of the kernel library: the compiler flags of its level and what a CPU needs to run it."""

    name: str
    arch: str                  # platform.machine() of the hosts it is for
    flags: tuple[str, ...]     # instruction-set flags (library.py adds the common ones)
    needs: frozenset[str]      # FEATURE_BITS names the host must have
    aten: str = "default"      # ATEN_CPU_CAPABILITY at this level
    onednn: Optional[str] = None  # ONEDNN_MAX_CPU_ISA at this level (None: no cap)
    emulated: bool = False     # SIMD Everywhere over a lower native level: for tests
    headers: tuple[str, ...] = ()  # system headers the build needs (else it is skipped, not failed)

    def __post_init__(self) -> None:
        unknown = self.needs - set(FEATURE_BITS)
        if unknown:
            raise ValueError(f"variant {self.name}: unknown features {sorted(unknown)}")


_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi"}
_AVX512_FLAGS = ("-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi")
_SIMDE = ("simde/x86/avx512.h",)
# SIMDe needs GNU C (strict C11 pulls in <complex.h>'s `I`); contraction stays off, as in C11.
_SIMDE_FLAGS = ("-march=x86-64-v3", "-std=gnu11", "-ffp-contract=off", "-DTESSERA_EMULATE_AVX512")

# Each architecture's levels, lowest first: a level's variant runs wherever its `needs` are met.
LEVELS: dict[str, tuple[Variant, ...]] = {
    "x86_64": (
        Variant("scalar", "x86_64", ("-march=x86-64", "-DTESSERA_SCALAR"), frozenset(), onednn="SSE41"),
        Variant("avx2", "x86_64", ("-march=x86-64-v3",), _AVX2, aten="avx2", onednn="AVX2"),
        Variant("avx512", "x86_64", _AVX512_FLAGS, _AVX512, aten="avx512", onednn="AVX512_CORE_VNNI"),
        Variant("avx512_bf16", "x86_64", _AVX512_FLAGS + ("-mavx512bf16",), _AVX512 | {"avx512_bf16"},
                aten="avx512", onednn="AVX512_CORE_BF16"),
        Variant("amx", "x86_64", _AVX512_FLAGS + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
                _AVX512 | {"avx512_bf16", "amx_tile", "amx_granted"}, aten="avx512", onednn="AVX512_CORE_AMX"),
    ),
    "aarch64": (
        Variant("scalar", "aarch64", ("-march=armv8-a", "-DTESSERA_SCALAR"), frozenset()),
        Variant("neon", "aarch64", ("-march=armv8.2-a+dotprod",), frozenset({"asimd", "asimddp"})),
    ),
}
EMULATED: dict[str, tuple[Variant, ...]] = {
    "x86_64": (
        Variant("avx512+simde", "x86_64", _SIMDE_FLAGS, _AVX2, aten="avx2",
                onednn="AVX2", emulated=True, headers=_SIMDE),
        Variant("avx512_bf16+simde", "x86_64",
                _SIMDE_FLAGS + ("-DTESSERA_EMULATE_BF16",), _AVX2, aten="avx2",
                onednn="AVX2", emulated=True, headers=_SIMDE),
    ),
}
# Every level name `--cpu-isa` takes, on any architecture.
LEVEL_NAMES = ("scalar", "avx2", "avx512", "avx512_bf16", "amx", "neon")


class CpuIsaError(ValueError):
    """A cap the host cannot honour (above its level, another architecture's, or unknown)."""


def machine() -> str:
    arch = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def variants(include_emulated: bool = True) -> tuple[Variant, ...]:
    """This architecture's variants: its levels, lowest first, then the emulated ones."""
    arch = machine()
    return LEVELS.get(arch, ()) + (EMULATED.get(arch, ()) if include_emulated else ())


def variant(name: str) -> Variant:
    for v in variants():
        if v.name == name:
            return v
    raise CpuIsaError(f"no kernel variant {name!r} on {machine()}; this architecture has: "
                      f"{', '.join(v.name for v in variants())}")


@lru_cache(maxsize=1)
def host_features() -> frozenset[str]:
    """What this CPU and OS let the process execute (cpu_probe.c; /proc/cpuinfo's flags where no C
    compiler builds the probe)."""
    bits = toolchain.probe_features()
    if bits is not None:
        return frozenset(name for i, name in enumerate(FEATURE_BITS) if bits >> i & 1)
    from tessera.hostinfo import cpu_flags

    flags = cpu_flags()
    found = {name for name in FEATURE_BITS if name in flags}
    if {"amx_tile", "amx_bf16", "amx_int8"} <= flags:
        found.add("amx_granted")  # unverified: the probe would have asked Linux
    return frozenset(found)


def runnable(v: Variant, features: Optional[frozenset[str]] = None) -> bool:
    return v.needs <= (host_features() if features is None else features)


def host_level() -> Variant:
    """The best level this host runs (the scalar variant where none of the vector ones does)."""
    levels = LEVELS.get(machine())
    if not levels:
        raise CpuIsaError(f"the kernels have no variants for {machine()}")
    return [v for v in levels if runnable(v)][-1]


def requested() -> str:
    return os.environ.get(ENV, AUTO).strip().lower() or AUTO


def check_cap(name: str) -> Variant:
    """The variant `name` (a level, an emulated variant or "auto") selects on this host, or
    CpuIsaError saying why it cannot."""
    if name == AUTO:
        return host_level()
    if name not in LEVEL_NAMES and not any(v.name == name for v in variants()):
        raise CpuIsaError(f"unknown CPU instruction-set level {name!r}; choose auto or one of {', '.join(LEVEL_NAMES)}")
    try:
        v = variant(name)
    except CpuIsaError:
        raise CpuIsaError(f"--cpu-isa {name} is not a level of this {machine()} host; its levels: "
                          f"{', '.join(x.name for x in LEVELS.get(machine(), ()))}") from None
    if not runnable(v):
        missing = sorted(v.needs - host_features())
        raise CpuIsaError(f"--cpu-isa {name} is above this CPU's level ({host_level().name}): it lacks "
                          f"{', '.join(missing)}")
    return v


@lru_cache(maxsize=None)
def _selected(name: str) -> Variant:
    return check_cap(name)


def selected() -> Variant:
    """The variant this process runs: TESSERA_CPU_ISA's, else the host's best."""
    return _selected(requested())


def level_at_least(name: str) -> bool:
    """Whether the selected variant's level includes level `name` (emulated variants count as the
    native level they run on)."""
    sel = selected()
    if sel.emulated:
        sel = variant("avx2")
    names = [v.name for v in LEVELS.get(machine(), ())]
    return name in names and sel.name in names and names.index(sel.name) >= names.index(name)


def torch_env(v: Variant) -> dict[str, str]:
    """PyTorch's caps for variant `v`: ATen's kernels and oneDNN's."""
    env = {"ATEN_CPU_CAPABILITY": v.aten}
    if v.onednn:
        env["ONEDNN_MAX_CPU_ISA"] = v.onednn
    return env


def apply_cap(name: str) -> Variant:
    """Cap this process (and the processes it starts) at level `name`: validated against the host,
    put in TESSERA_CPU_ISA for the kernel library, and in PyTorch's variables where a cap was asked
    ("auto" leaves PyTorch to choose). Call before torch is imported: ATen reads its variable then."""
    v = check_cap(name)
    os.environ[ENV] = name
    if name != AUTO:
        os.environ.update(torch_env(v))
        if "torch" in sys.modules:
            logger.warning("--cpu-isa %s: PyTorch was imported before the cap was set, so its own kernels "
                           "keep the host's level; the C kernels are capped", name)
    return v


def describe() -> str:
    """One line for the start-up log: the variant chosen, the host's level and the cap."""
    sel, host = selected(), host_level()
    cap = requested()
    why = "the best this CPU runs" if cap == AUTO else f"capped by {ENV}={cap}"
    return f"{sel.name} ({why}; host level {host.name}, {machine()})"
