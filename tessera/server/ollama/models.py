"""Ollama's model listing: GET /api/tags (what is served), POST /api/show (one model's facts,
template and architecture numbers, from the files on this machine; never a download) and
GET /api/ps (what is loaded and when keep_alive unloads it)."""
from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tessera import __version__
from tessera.server.served_model import ServedModel
from tessera.server.ollama.protocol import OllamaShowRequest
from tessera.server.ollama.serving import served_model
from tessera.server.serving import ServerState

if TYPE_CHECKING:
    from tessera.config import ModelConfig
    from tessera.engine.frontend.protocols import ServingEngine

# Go's largest duration: what Ollama reports as the expiry of a model kept loaded for ever.
_FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)


def _local_path(served: ServedModel) -> Optional[Path]:
    """The model's file or folder if it is on this machine (never downloads)."""
    from tessera.models import registry

    spec = served.spec.model
    if registry.is_registry_name(spec):
        path = registry.model_path(registry.get_entry(spec))
        return path if path.is_file() else None
    path = Path(spec).expanduser()
    return path if path.exists() else None


def _model_facts(served: ServedModel) -> dict[str, Any]:
    """What /api/tags says of a model: size, digest, modification time and details (blocking:
    an unregistered model's digest is hashed once, then remembered)."""
    from tessera.models import registry

    spec = served.spec.model
    entry = registry.MODELS.get(spec) or registry.MODELS.get(spec.lower())
    path = _local_path(served)
    config = served.engine.model_config if served.engine is not None else None
    size = entry.size if entry is not None else 0
    if entry is None and path is not None:
        size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    digest = entry.sha256 if entry is not None else (registry.model_digest(path) if path is not None else "")
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc) if path is not None else \
        datetime.now(timezone.utc)
    family = entry.architecture if entry is not None else (config.architecture if config is not None else "")
    fmt = "gguf" if entry is not None or (path is not None and path.suffix.lower() == ".gguf") else "safetensors"
    quant = entry.quantization if entry is not None else (config.quantization if config is not None else "")
    return {"size": size, "digest": digest, "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "details": {"parent_model": "", "format": fmt, "family": family,
                        "families": [family] if family else None,
                        "parameter_size": entry.parameters if entry is not None else "",
                        "quantization_level": quant}}


def _config_and_template(served: ServedModel) -> tuple[Optional[ModelConfig], Optional[str]]:
    """The model's shape and chat template: the loaded engine's, else read from its file without
    the weights, else unknown (a model not on this machine yet)."""
    engine = served.engine
    if engine is not None:
        return engine.model_config, engine.tokenizer.chat_template
    path = _local_path(served)
    if path is None:
        return None, None
    from tessera.models.info import load_model_info

    config, tokenizer = load_model_info(path)
    return config, tokenizer.chat_template


def _model_info(config: ModelConfig) -> dict[str, Any]:
    """Ollama's model_info keys (GGUF metadata names) for what Tessera knows of the model."""
    arch = config.architecture
    return {"general.architecture": arch, "general.basename": config.name,
            f"{arch}.context_length": config.max_position_embeddings,
            f"{arch}.embedding_length": config.hidden_size, f"{arch}.block_count": config.num_layers,
            f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.attention.head_count": config.num_heads,
            f"{arch}.attention.head_count_kv": config.num_kv_heads,
            f"{arch}.attention.key_length": config.head_dim, f"{arch}.rope.freq_base": config.rope_theta,
            f"{arch}.vocab_size": config.vocab_size}


async def tags(request: Request) -> Response:
    """Every name this server answers to (aliases and LoRA adapters included, an adapter with its
    base as `details.parent_model`), loaded or not."""
    state: ServerState = request.app.state.tessera
    models = []
    for name, served in state.router.names():
        facts = await asyncio.to_thread(_model_facts, served)
        models.append({"name": name, "model": name, **facts})
    for served in state.router.models:
        adapters = served.adapters()
        if not adapters:
            continue
        facts = await asyncio.to_thread(_model_facts, served)
        for name in sorted(adapters):
            models.append({"name": name, "model": name, **facts,
                           "details": {**facts["details"], "parent_model": served.name}})
    return JSONResponse({"models": models})


async def show(body: OllamaShowRequest, request: Request) -> Response:
    state: ServerState = request.app.state.tessera
    served = served_model(state, body.model or body.name)
    facts = await asyncio.to_thread(_model_facts, served)
    config, template = await asyncio.to_thread(_config_and_template, served)
    capabilities = ["completion"] + (["tools"] if template else []) + (
        ["vision"] if config is not None and config.vision is not None else [])
    parameters = ""
    if served.engine is not None:
        tokenizer = served.engine.tokenizer
        stops = [tokenizer.token_text(i) for i in tokenizer.eos_token_ids]
        parameters = "".join(f'stop "{s}"\n' for s in stops)
    return JSONResponse({
        "license": "", "modelfile": f"# Served by Tessera {__version__}\nFROM {served.spec.model}\n",
        "parameters": parameters, "template": template or "", "details": facts["details"],
        "model_info": _model_info(config) if config is not None else {}, "capabilities": capabilities,
        "modified_at": facts["modified_at"]})


def _expires_at(served: ServedModel, engine: ServingEngine) -> str:
    now = datetime.now(timezone.utc)
    keep = served.keep_alive
    if keep is None or served.fixed or served.pinned:
        expiry = now + _FOREVER
    else:
        idle = 0.0 if engine.num_active() > 0 else time.monotonic() - served.last_used
        expiry = now + timedelta(seconds=max(0.0, keep - idle))
    return expiry.isoformat().replace("+00:00", "Z")


async def ps(request: Request) -> Response:
    """The models loaded now; `size` is the weights' file plus the KV cache, all in CPU memory."""
    state: ServerState = request.app.state.tessera
    models = []
    for served in state.router.loaded():
        engine = served.engine
        if engine is None:
            continue
        facts = await asyncio.to_thread(_model_facts, served)
        size = facts["size"] + int(engine.kv_cache_info().get("bytes") or 0)
        models.append({"name": served.name, "model": served.name, "size": size, "digest": facts["digest"],
                       "details": facts["details"], "expires_at": _expires_at(served, engine), "size_vram": 0,
                       "context_length": engine.config.max_model_len})
    return JSONResponse({"models": models})
