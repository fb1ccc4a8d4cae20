"""Every variant of the kernel library against the scalar reference, kernel by kernel.

variant_check.c (a C driver: no Python at run time) loads the scalar build and another, runs every
exported kernel on the same pseudo-random inputs in both and compares (see its header). Here: each
variant this host runs natively or emulates through SIMD Everywhere, the aarch64 variants
cross-compiled and run under qemu (cross.py), and a deliberately broken vector path, which the
driver must catch. Without SIMDe's headers or the cross tools those tests skip, or fail where
TESSERA_REQUIRE_VARIANTS=1 (CI, .ci/run, installs them).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

import cross
from tessera.kernels import isa, library

pytestmark = pytest.mark.skipif(library.available() is not None, reason="C kernels unavailable here")

REQUIRED = os.environ.get("TESSERA_REQUIRE_VARIANTS") == "1"


def unavailable(message: str) -> None:
    """Skip, or fail where the environment promises the tools (TESSERA_REQUIRE_VARIANTS=1)."""
    if REQUIRED:
        pytest.fail(f"{message} (TESSERA_REQUIRE_VARIANTS=1)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return cross.build_driver(library.compiler(), tmp_path_factory.mktemp("variant-check"))


@pytest.fixture(scope="module")
def scalar() -> Path:
    return library.build(isa.variant("scalar"))


def check(done, reference: str, variant: str) -> list[str]:
    """The driver's case lines, once it has said which variants it compared and found no failure."""
    lines = done.stdout.splitlines()
    assert lines[:2] and lines[0].split()[:2] == ["reference", reference], done.stdout + done.stderr
    assert lines[1].split()[:2] == ["variant", variant], done.stdout + done.stderr
    failed = [line for line in lines if line.startswith(("MISMATCH", "refused"))]
    assert done.returncode == 0, "\n".join(failed) or done.stdout + done.stderr
    assert any(line.startswith("ok ") for line in lines)
    return lines[2:]


def _host_variant_params():
    """This architecture's variants but the reference; all but the host's own level (which install
    builds) are `slow`: a build takes 10-60 s on 2 cores, SIMDe's the longest."""
    try:
        own = isa.host_level().name
    except isa.CpuIsaError:
        own = None
    for v in isa.variants():
        if v.name != "scalar":
            yield pytest.param(v.name, id=v.name, marks=[] if v.name == own else [pytest.mark.slow])


@pytest.mark.parametrize("name", list(_host_variant_params()))
def test_variant_matches_scalar(name, driver, scalar):
    v = isa.variant(name)
    if not isa.runnable(v):
        pytest.skip(f"this CPU cannot run the {name} kernels")
    missing = library.missing_headers(v)
    if missing:
        unavailable(f"the {name} kernels need {', '.join(missing)} (Debian: libsimde-dev)")
    check(cross.run_check(None, driver, scalar, library.build(v)), "scalar", name)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(cross.TARGETS))
def test_cross_variants_match_scalar_under_qemu(arch):
    target = cross.TARGETS[arch]
    if isa.machine() == arch:
        pytest.skip(f"{arch} is this host's architecture: test_variant_matches_scalar runs its variants")
    missing = cross.missing_tools(target)
    if missing:
        unavailable(f"no {', '.join(missing)} to cross-compile and run the {arch} kernels "
                    "(Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)")
    driver = cross.build_driver(target.cc, library.kernel_dir())
    names = [v.name for v in isa.LEVELS[arch]]
    ref = cross.build_variant(target, "scalar")
    for name in names:
        check(cross.run_check(target, driver, ref, cross.build_variant(target, name)), "scalar", name)


# Per architecture, one operation of a vector path changed, and the cases that must then mismatch:
# AVX2's one-row int8_gemv adds a group's two partial sums (subtracts them here); NEON's Q4_K rows
# take a sub-block's second 16 activations (one byte early here).
BROKEN = {
    "x86_64": ("avx2", "int8_gemv.c", "_mm256_add_ps(d0, d1), acc);", "_mm256_sub_ps(d0, d1), acc);",
               r"int8_gemv/.*/M1/"),
    "aarch64": ("neon", "kquant_gemm.c", "vld1q_s8(xb + 32 * g + 16));", "vld1q_s8(xb + 32 * g + 15));",
                r"q4k_gemm/|decode_step_(bf16|f32)(/\w+)?$"),  # the steps' QKV projection is Q4_K
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(BROKEN))
def test_a_broken_vector_path_is_caught(arch, tmp_path, monkeypatch, driver, scalar):
    name, source, old, new, cases = BROKEN[arch]
    sources = tmp_path / "kernels"
    shutil.copytree(library.SOURCE_DIR, sources, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    text = (sources / source).read_text()
    assert text.count(old) == 1, f"{source} changed: update BROKEN"
    (sources / source).write_text(text.replace(old, new))
    if isa.machine() == arch:
        if not isa.runnable(isa.variant(name)):
            pytest.skip(f"this CPU cannot run the {name} kernels")
        target, ref = None, scalar
    elif arch in cross.TARGETS:
        target = cross.TARGETS[arch]
        missing = cross.missing_tools(target)
        if missing:
            unavailable(f"no {', '.join(missing)} to cross-compile and run the {arch} kernels")
        driver, ref = cross.build_driver(target.cc, tmp_path), cross.build_variant(target, "scalar")
    else:
        pytest.skip(f"no way to run {arch} code here")
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))  # the broken build stays out of the cache
    broken = library.build(isa.variant(name), source_dir=sources) if target is None else \
        cross.build_variant(target, name, source_dir=sources)
    done = cross.run_check(target, driver, ref, broken)
    assert done.returncode == 1, done.stdout + done.stderr
    mismatches = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("MISMATCH")]
    assert mismatches and all(re.match(cases, case) for case in mismatches), done.stdout
    assert "ok rms_norm_bf16/rows1" in done.stdout  # the rest still compared
