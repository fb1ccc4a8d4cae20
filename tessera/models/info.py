"""What a model is, without its weights: its ModelConfig and Tokenizer from a path.

Kept apart from tessera.models.loader, which builds the network: the API process of a
server whose engine runs in another process reads only this, and so never imports torch
(~140 MiB resident for the server's life).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Union

from tessera.config import ModelConfig
from tessera.errors import ModelNotFoundError
from tessera.pooling_params import read_sentence_transformers
from tessera.tokenizer import Tokenizer


def load_model_info(path: Union[str, os.PathLike]) -> tuple[ModelConfig, Tokenizer]:
    """The model's configuration and tokenizer without its weights: what a process that only
    tokenizes and detokenizes for an engine elsewhere needs (seconds, a few MiB)."""
    path = Path(path).expanduser()
    config = read_model_config(path)
    if path.is_dir():
        tokenizer = Tokenizer.from_hf_folder(path, config_eos_ids=tuple(config.eos_token_ids))
    else:
        tokenizer = Tokenizer.from_gguf(path)
    _merge_eos(config, tokenizer)
    return config, tokenizer


def read_model_config(path: Union[str, os.PathLike]) -> ModelConfig:
    """The model's configuration alone (a Hugging Face folder's config files or a GGUF's header):
    what the server says of a model it has not loaded (its capabilities in /v1/models)."""
    path = Path(path).expanduser()
    if path.is_dir():
        from tessera.models.safetensors_loader import config_from_hf, read_hf_config

        config = config_from_hf(read_hf_config(path), name=path.name, folder=path)
        pooler = read_sentence_transformers(path)
        if pooler is not None:
            config.pooler = dataclasses.replace(pooler, matryoshka=config.matryoshka)
        return config
    if path.is_file():
        from tessera.models.gguf_file import read_gguf
        from tessera.models.gguf_loader import config_from_gguf

        gf = read_gguf(path)
        try:
            return config_from_gguf(gf, name=path.stem)
        finally:
            gf.close()
    raise ModelNotFoundError(f"model path not found: {path}")


def _merge_eos(config: ModelConfig, tokenizer: Tokenizer) -> None:
    """One list of end-of-generation ids, shared by the config and the tokenizer."""
    ids = tokenizer.end_of_generation(list(tokenizer.eos_token_ids) + list(config.eos_token_ids))
    config.eos_token_ids = ids
    tokenizer.eos_token_ids = ids
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
