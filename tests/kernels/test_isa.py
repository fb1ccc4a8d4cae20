"""Instruction-set levels: the variant chosen for the host, the cap, and what a cap may not do."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tessera.kernels import isa, library, toolchain

X86 = isa.machine() == "x86_64"
AVX2_HOST = frozenset({"avx2", "fma", "f16c"})


@pytest.fixture(autouse=True)
def _fresh_selection():
    """Each test chooses again (and leaves the next one to choose again too)."""
    library.reset()
    yield
    library.reset()


def test_the_host_level_is_the_best_runnable_level():
    levels = isa.LEVELS[isa.machine()]
    best = isa.host_level()
    assert isa.runnable(best)
    above = levels[levels.index(best) + 1:]
    assert not any(isa.runnable(v) for v in above)
    assert all(isa.runnable(v) for v in levels[:levels.index(best)])  # each level includes the ones below


def test_auto_selects_the_host_level_and_the_library_says_which_it_is(monkeypatch, caplog):
    monkeypatch.delenv(isa.ENV, raising=False)
    assert isa.selected() == isa.host_level()
    with caplog.at_level("INFO", logger="tessera.kernels.library"):
        if library.available() is not None:
            pytest.skip("no kernel library here")
        lib = library.load()
    assert lib.tessera_variant().decode() == isa.host_level().name
    assert f"C kernels: variant {isa.host_level().name} (the best this CPU runs" in caplog.text


@pytest.mark.skipif(not X86, reason="x86 levels")
def test_a_cap_selects_a_lower_variant(monkeypatch):
    monkeypatch.setenv(isa.ENV, "scalar")
    assert isa.selected().name == "scalar"
    assert not isa.level_at_least("avx2")
    if library.available() is not None:
        pytest.skip("no kernel library here")
    lib = library.load()
    assert lib.tessera_variant() == b"scalar"
    assert lib.tessera_avx2_fma() == 0 and lib.tessera_kquant_vector() == 0  # no vector path in the reference


@pytest.mark.skipif(not X86, reason="x86 levels")
def test_a_cap_above_the_host_is_refused_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr(isa, "host_features", lambda: AVX2_HOST)
    assert isa.host_level().name == "avx2"
    with pytest.raises(isa.CpuIsaError, match=r"avx512 is above this CPU's level \(avx2\): it lacks avx512_vnni, avx512bw"):
        isa.check_cap("avx512")
    with pytest.raises(isa.CpuIsaError, match="not a level of this x86_64 host"):
        isa.check_cap("neon")
    with pytest.raises(isa.CpuIsaError, match="unknown CPU instruction-set level 'sse9'"):
        isa.check_cap("sse9")
    assert isa.check_cap("avx512+simde").emulated  # emulation needs only AVX2


@pytest.mark.skipif(not X86, reason="x86 levels")
def test_amx_needs_the_tile_state_granted():
    features = isa.variant("avx512_bf16").needs | {"amx_tile"}
    assert not isa.runnable(isa.variant("amx"), features)
    assert isa.runnable(isa.variant("amx"), features | {"amx_granted"})


@pytest.mark.skipif(not X86, reason="x86 levels")
def test_apply_cap_caps_pytorch_too(monkeypatch):
    for name in (isa.ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.setenv(name, "unset")
    isa.apply_cap("avx2")
    assert (os.environ[isa.ENV], os.environ["ATEN_CPU_CAPABILITY"], os.environ["ONEDNN_MAX_CPU_ISA"]) == \
        ("avx2", "avx2", "AVX2")
    isa.apply_cap("auto")  # auto leaves PyTorch's own choice alone
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ[isa.ENV] == "auto"


@pytest.mark.skipif(not X86, reason="x86 levels")
def test_the_command_line_caps_pytorch_before_importing_it():
    """What `tessera ... --cpu-isa scalar` does first: ATen then dispatches its default kernels."""
    code = ("import sys, argparse; from tessera import cli; cli._cap_cpu_isa(argparse.Namespace(cpu_isa='scalar'));"
            "assert 'torch' not in sys.modules, 'torch imported before the cap';"
            "import torch; print(torch.backends.cpu.get_cpu_capability())")
    env = {k: v for k, v in os.environ.items() if k not in (isa.ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "DEFAULT"


def test_a_cap_above_the_host_is_one_line_from_the_command_line(tmp_path):
    wrong = "neon" if X86 else "avx2"
    env = dict(os.environ, TESSERA_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "tessera", "generate", "smollm2-135m", "--cpu-isa", wrong,
                          "--prompt", "hi"], env=env, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"error: --cpu-isa {wrong} is not a level of this {isa.machine()} "
                                               f"host; its levels: {', '.join(v.name for v in isa.LEVELS[isa.machine()])}"]


def test_the_feature_check_agrees_with_the_kernel_flags():
    """The probe asks CPUID and XCR0; /proc/cpuinfo's flags name what the CPU reports. Every feature
    the probe grants must be one the kernel lists (it may withhold one the OS does not save)."""
    if toolchain.probe_features() is None:
        pytest.skip("no C compiler for the probe")
    from tessera.hostinfo import cpu_flags

    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo")
    granted = isa.host_features() - {"amx_granted"}
    assert granted <= flags, granted - flags
