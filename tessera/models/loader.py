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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from tessera.config import ModelConfig
from tessera.attention import get_backend
from tessera.errors import TesseraError
from tessera.hostinfo import available_memory, map_large_allocations, release_free_memory
from tessera.layers.quantization import QUANTIZATION_MODES, QuantConfig, QuantizationMode, resolve_dense_copy
from tessera.models.dtype import linear_param_count, resolve_dtype
from tessera.models.info import load_model_info
from tessera.models.weights import describe_quantization
from tessera.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module  # a CausalLM, or an encoder (tessera.models.base)
    config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    path: Path
    quant: QuantConfig = field(default_factory=QuantConfig)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """BERT encoders have their own network; every decoder family runs the shared decoder."""
    from tessera.models.bert import BertModel
    from tessera.models.decoder import DecoderForCausalLM
    from tessera.models.families import ENCODERS, family

    if config.architecture in ENCODERS:
        return BertModel
    family(config.architecture)
    if config.vision is not None:  # the text family's decoder with a vision tower beside it
        from tessera.models.llava import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration  # an unknown one: the error lists the supported families
    return DecoderForCausalLM


def load_model(
    path: Union[str, os.PathLike],
    dtype: Union[str, torch.dtype] = "auto",
    num_threads: Optional[int] = None,
    quantization: QuantizationMode = "auto",
    dense_copy: Optional[bool] = None,
    weight_cache: bool = False,
    int8_activations: bool = True,
) -> LoadedModel:
    """Load a .gguf file or an HF folder (config.json + *.safetensors) with its tokenizer.

    `quantization` picks how Linear weights are stored (auto keeps the file's
    precision class); `dense_copy` whether quantized weights also keep a dense
    copy for large steps (None: when it is small, see resolve_dense_copy). `weight_cache`: map
    the weights as packed by an earlier load, or write them for the next (models/weight_cache.py).
    `int8_activations`: Q6_K and Q4_K tensors keep the file's blocks and take int8 activations
    (see QuantConfig).
    """
    if quantization not in QUANTIZATION_MODES:
        raise TesseraError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATION_MODES)}")
    path = Path(path).expanduser()
    if num_threads:
        torch.set_num_threads(num_threads)
    map_large_allocations()
    t0 = time.perf_counter()
    config, tokenizer = load_model_info(path)
    model, quant = _build(config, dtype, quantization, dense_copy, int8_activations)
    if path.is_dir():
        from tessera.models.safetensors_loader import iter_safetensors_weights

        vision = config.vision is not None
        if vision and weight_cache:  # the packed-weight cache holds a decoder's modules, not a tower's
            logger.info("--weight-cache is not used for a vision-language model; weights load from the folder")
        _load_weights(model, path, quant, weight_cache and not vision, lambda: iter_safetensors_weights(path, vision))
    else:
        from tessera.models.gguf_file import read_gguf
        from tessera.models.gguf_loader import iter_gguf_weights

        gf = read_gguf(path)
        try:
            _load_weights(model, path, quant, weight_cache, lambda: iter_gguf_weights(gf, config, num_threads))
        finally:
            gf.close()
    release_free_memory()
    logger.info("loaded %s (%s, %s, %s) in %.1f s", path.name, config.architecture,
                config.quantization or "unquantized", str(quant.dtype).removeprefix("torch."),
                time.perf_counter() - t0)
    logger.info("weights (--quantization %s%s): %s", quantization,
                ", dense copies for large steps" if quant.dense_copy else "",
                "; ".join(describe_quantization(model)))
    return LoadedModel(model.eval(), config, tokenizer, quant.dtype, path, quant)


def _build(config: ModelConfig, dtype: Union[str, torch.dtype], quantization: QuantizationMode,
           dense_copy: Optional[bool], int8_activations: bool = True) -> tuple[nn.Module, QuantConfig]:
    """The model with empty layers; dense-copy policy decided from its size before any weight loads."""
    resolved = resolve_dtype(dtype, config)
    keep = resolve_dense_copy(dense_copy, linear_param_count(config), resolved, available_memory())
    quant = QuantConfig(quantization, resolved, keep, int8_activations)
    return model_class(config)(config, quant), quant


def _load_weights(model: nn.Module, path: Path, quant: QuantConfig, use_cache: bool,
                  weights: Callable[[], Iterable]) -> None:
    """From the packed-weight cache when it has this model and settings, else from the checkpoint
    (then written to the cache for the next start)."""
    if not use_cache:
        model.load_weights(weights(), source=path.name)
        return
    from tessera.models import weight_cache
    from tessera.models.registry import model_digest, tessera_home

    cached = weight_cache.cache_path(tessera_home() / "packed", model_digest(path), quant)
    if cached.is_file() and weight_cache.restore(model, cached, quant):
        logger.info("weights mapped from %s", cached)
        return
    model.load_weights(weights(), source=path.name)
    weight_cache.save(model, cached)
    # Serve from the file just written, as later starts do: the unpacked tensors are freed (a
    # first start then holds what the sizing calculator predicts, not ~260 MiB more for gemma3)
    # and the pages are the page cache's, shared with other servers of the model.
    if cached.is_file() and weight_cache.restore(model, cached, quant):
        logger.info("weights mapped from %s, just written", cached)


@torch.inference_mode()
def forward_single(loaded: LoadedModel, token_ids: list[int], block_size: int = 16,
                   backend_name: str = "sdpa", chunk: Optional[int] = None) -> torch.Tensor:
    """Logits [T, vocab] (float32) of one fresh sequence, run without the engine: in one pass, or
    `chunk` tokens a pass over the KV cache of the earlier ones (the row counts of decode and
    verification steps, which take the quantized layers' few-row kernels)."""
    c = loaded.config
    n = len(token_ids)
    num_blocks = max(1, math.ceil(n / block_size))
    backend = get_backend(backend_name)
    caches = backend.allocate(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, loaded.dtype)
    for i in c.state_layers():  # a recurrent layer's states, one slot: the sequence's
        caches[i] = [torch.zeros(1, *shape, dtype=torch.float32 if f32 else loaded.dtype)
                     for shape, f32 in c.state_shapes(i)]
    step = chunk or n
    logits = []
    for start in range(0, n, step):
        end = min(n, start + step)
        meta = backend.build_metadata([end - start], [end], [list(range(num_blocks))], block_size)
        meta.state_slots, meta.state_continues = [0], [start > 0]
        hidden = loaded.model(torch.tensor(token_ids[start:end], dtype=torch.long), torch.arange(start, end),
                              caches, meta)
        logits.append(loaded.model.compute_logits(hidden))
    return logits[0] if len(logits) == 1 else torch.cat(logits)
