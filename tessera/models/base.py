"""What the engine may ask of a model: the interface every architecture implements."""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

from torch import Tensor

from tessera.attention.base import AttentionMetadata
from tessera.config import ModelConfig


class CausalLM(Protocol):
    """A decoder over a packed batch (all scheduled tokens of a step, no padding).

    `forward` writes each token's keys and values into `kv_caches` (one tensor per layer, laid
    out by the metadata's backend) and returns the final hidden states, one row per token;
    `layers` restricts it to those decoder layers, in order (self-speculative drafting: the
    caches of the others are left untouched). `compute_logits` turns hidden rows into float32
    logits over the vocabulary.
    """

    config: ModelConfig

    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                 attn_meta: AttentionMetadata, layers: Optional[Sequence[int]] = None) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor: ...
