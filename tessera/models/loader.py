"""Turning a model path (a .gguf file or a Hugging Face folder) into a ready model.

Name resolution (registry names, hub ids) happens before this, in
tessera.models.registry; here a path goes in and a LoadedModel comes out:
the network module with its weights in the chosen dtype, its ModelConfig and
its Tokenizer.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from tessera.config import ModelConfig
from tessera.engine.attention import AttentionMetadata, allocate_kv_caches
from tessera.errors import ModelFormatError, ModelNotFoundError
from tessera.models.dtype import resolve_dtype
from tessera.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module  # CausalLM: forward(input_ids, positions, kv_caches, attn_meta), compute_logits(hidden)
    config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    path: Path


def model_class(config: ModelConfig) -> type[nn.Module]:
    from tessera.models.gemma3 import Gemma3ForCausalLM
    from tessera.models.llama import LlamaForCausalLM

    classes = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM}
    if config.architecture not in classes:
        raise ModelFormatError(
            f"architecture {config.architecture!r} is not supported; Tessera runs {', '.join(classes)} models"
        )
    return classes[config.architecture]


def load_model(
    path: Union[str, os.PathLike],
    dtype: Union[str, torch.dtype] = "auto",
    num_threads: Optional[int] = None,
) -> LoadedModel:
    """Load a .gguf file or an HF folder (config.json + *.safetensors) with its tokenizer."""
    path = Path(path).expanduser()
    if num_threads:
        torch.set_num_threads(num_threads)
    t0 = time.perf_counter()
    if path.is_dir():
        loaded = _load_hf_folder(path, dtype, num_threads)
    elif path.is_file():
        loaded = _load_gguf(path, dtype, num_threads)
    else:
        raise ModelNotFoundError(f"model path not found: {path}")
    logger.info("loaded %s (%s, %s, %s) in %.1f s", path.name, loaded.config.architecture,
                loaded.config.quantization or "unquantized", str(loaded.dtype).removeprefix("torch."),
                time.perf_counter() - t0)
    return loaded


def _load_gguf(path: Path, dtype: Union[str, torch.dtype], num_threads: Optional[int]) -> LoadedModel:
    from tessera.models.gguf_loader import config_from_gguf, iter_gguf_weights, read_gguf

    gf = read_gguf(path)
    try:
        config = config_from_gguf(gf, name=path.stem)
        resolved = resolve_dtype(dtype, config)
        t0 = time.perf_counter()
        model = model_class(config)(config, resolved)
        model.load_weights(iter_gguf_weights(gf, config, num_threads, resolved), source=path.name)
        t1 = time.perf_counter()
        tokenizer = Tokenizer.from_gguf(path, gguf=gf)
        logger.debug("weights %.2f s, tokenizer %.2f s", t1 - t0, time.perf_counter() - t1)
    finally:
        gf.close()
    _merge_eos(config, tokenizer)
    return LoadedModel(model.eval(), config, tokenizer, resolved, path)


def _load_hf_folder(path: Path, dtype: Union[str, torch.dtype], num_threads: Optional[int]) -> LoadedModel:
    from tessera.models.safetensors_loader import config_from_hf, iter_safetensors_weights, read_hf_config

    config = config_from_hf(read_hf_config(path), name=path.name)
    resolved = resolve_dtype(dtype, config)
    model = model_class(config)(config, resolved)
    model.load_weights(iter_safetensors_weights(path), source=path.name)
    tokenizer = Tokenizer.from_hf_folder(path, config_eos_ids=tuple(config.eos_token_ids))
    _merge_eos(config, tokenizer)
    return LoadedModel(model.eval(), config, tokenizer, resolved, path)


def _merge_eos(config: ModelConfig, tokenizer: Tokenizer) -> None:
    """One list of end-of-generation ids, shared by the config and the tokenizer."""
    ids = list(dict.fromkeys(list(tokenizer.eos_token_ids) + list(config.eos_token_ids)))
    config.eos_token_ids = ids
    tokenizer.eos_token_ids = ids
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id


@torch.inference_mode()
def forward_single(loaded: LoadedModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [T, vocab] (float32) of one fresh sequence, run without the engine."""
    c = loaded.config
    n = len(token_ids)
    num_blocks = max(1, math.ceil(n / block_size))
    caches = allocate_kv_caches(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, loaded.dtype)
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size)
    hidden = loaded.model(torch.tensor(token_ids, dtype=torch.long), torch.arange(n), caches, meta)
    return loaded.model.compute_logits(hidden)
