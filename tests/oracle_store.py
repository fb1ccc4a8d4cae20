"""What transformers computed for the oracle tests, kept on disk by a digest of its inputs.

Running the oracle (transformers in float32, PEFT for adapters) is most of the time of the
real-model oracle tests on 2 cores, and the same inputs give the same outputs: the same model file,
prompt ids, adapter files and library versions. Each result is kept under
$TESSERA_HOME/test-oracles/results by a digest of all of these, so a change to any of them
computes it again; Tessera's side is always computed.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Callable, TypeVar

import torch

from tessera.models.registry import tessera_home

T = TypeVar("T")


class OracleStore:
    """Results of one oracle model file, keyed by the inputs that produced them."""

    def __init__(self, model_file: Path, *extra: object):
        import transformers

        versions = [transformers.__version__]
        try:
            import peft
            versions.append(peft.__version__)
        except ImportError:
            pass
        self.folder = tessera_home() / "test-oracles" / "results"
        self.base = json.dumps([model_file.name, model_file.stat().st_size, versions, torch.__version__,
                                *map(str, extra)])

    def _path(self, kind: str, key: object, suffix: str) -> Path:
        digest = hashlib.sha256(self.base.encode())
        digest.update(json.dumps([kind, key]).encode())
        return self.folder / f"{kind}-{digest.hexdigest()[:24]}{suffix}"

    def tokens(self, kind: str, key: object, compute: Callable[[], T]) -> T:
        """A JSON value (token lists) for (kind, key), computed once."""
        path = self._path(kind, key, ".json")
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        self._write(path, json.dumps(value).encode())
        return value

    def tensor(self, kind: str, key: object, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor (logits) for (kind, key), computed once."""
        path = self._path(kind, key, ".pt")
        if path.is_file():
            return torch.load(path, weights_only=True)
        value = compute()
        buffer = io.BytesIO()
        torch.save(value.clone(), buffer)
        self._write(path, buffer.getvalue())
        return value

    def _write(self, path: Path, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # whole or absent: an interrupted write is never read


def adapter_digest(folder: Path) -> str:
    """A PEFT adapter folder's content (PEFT writes target_modules from a set: in any order)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    digest.update((folder / "adapter_model.safetensors").read_bytes())
    return digest.hexdigest()


def _kept(name: str, load: Callable[[str], T], build: Callable[[], T]) -> T:
    """`load` of the folder $TESSERA_HOME/test-oracles/`name` when a whole one is there, else
    `build()` saved there (as transformers saves it) for the next run."""
    cached = tessera_home() / "test-oracles" / name
    if cached.is_dir():
        return load(str(cached))
    value = build()
    partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    value.save_pretrained(str(partial))
    os.replace(partial, cached)  # whole or absent: an interrupted save is never read
    return value


def load_oracle(model_file: Path):
    """transformers' model of the GGUF file, dequantized, in float32. Reading a GGUF file through
    transformers is slow (its reader walks the metadata in Python: 35 s for SmolLM2, two minutes
    for Gemma 3's 262k-token vocabulary on 2 cores), so the converted model is kept."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return _kept(f"{model_file.name}-{model_file.stat().st_size}",
                 lambda folder: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                 lambda: AutoModelForCausalLM.from_pretrained(
                     str(model_file.parent), gguf_file=model_file.name,
                     quantization_config=GgufConfig(dequantize=True), dtype=torch.float32).eval())


def hf_tokenizer(model_file: Path):
    """transformers' tokenizer of a GGUF file: reading it from the GGUF walks the metadata in Python
    (20 s for Gemma 3's 262k-token vocabulary on 2 cores), reading the saved one takes a second."""
    import transformers
    from transformers import AutoTokenizer

    return _kept(f"tokenizer-{model_file.name}-{model_file.stat().st_size}-{transformers.__version__}",
                 AutoTokenizer.from_pretrained,
                 lambda: AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name))
