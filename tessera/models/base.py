"""What the engine may ask of a model: the interface every architecture implements.

Two parts. `CausalLM` is the call surface of a decoder (forward over a packed batch, logits).
`ModelBase` says which execution paths a model offers beside its modules' forward; the model
runner (tessera/engine/worker) decides which path each step takes, so a model's forward never
switches paths on its own and one model object can serve an engine that takes the C decode step
beside one that runs every step through the modules.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Optional, Protocol, Sequence

from torch import Tensor

from tessera.attention.base import AttentionMetadata
from tessera.config import ModelConfig
from tessera.layers.lora import LoRASlots


class CausalLM(Protocol):
    """A decoder over a packed batch (all scheduled tokens of a step, no padding).

    `forward` writes each token's keys and values into `kv_caches` (one tensor per layer, laid
    out by the metadata's backend) and returns the final hidden states, one row per token;
    `layers` restricts it to those decoder layers, in order (self-speculative drafting: the
    caches of the others are left untouched); `embeds` (rows, vectors) replaces those rows' token
    embeddings (a vision-language model's image placeholders). `compute_logits` turns hidden rows into float32
    logits over the vocabulary.
    """

    config: ModelConfig

    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                 attn_meta: AttentionMetadata, layers: Optional[Sequence[int]] = None,
                 embeds: Optional[tuple[Tensor, Tensor]] = None) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor: ...


class ExecutionPath(Enum):
    """A way to compute a step's final hidden states. Every path gives the same result (up to
    float32 sum order); they differ in cost, and in which steps they can take."""

    # The model's own forward through its modules: every model, every step.
    MODULES = "modules"
    # A decode-only step as one native call over the loaded weights (`FusedDecodeStep`): at a few
    # rows the modules' per-operator dispatch costs more than their arithmetic.
    C_DECODE = "c_decode"


class FusedDecodeStep(Protocol):
    """A model's decode step planned as one native call, bound to its loaded weights."""

    def applies(self, input_ids: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata) -> bool:
        """Whether the call can take this step (its rows, cache format and backend)."""
        ...

    def run(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
            meta: AttentionMetadata, lora: Optional[LoRASlots] = None) -> Optional[Tensor]:
        """The step's final hidden states, as the modules' forward returns them (with the rows'
        adapters in `lora` applied), or None when a kernel refused at run time: the caller then
        runs the modules, which rewrite every cache slot the refused call wrote."""
        ...


class ModelBase(ABC):
    """The execution paths a model offers its runner. Every model class derives from it (beside
    torch.nn.Module); the runner picks a path per step from what `execution_paths` lists."""

    config: ModelConfig

    @abstractmethod
    def execution_paths(self) -> frozenset[ExecutionPath]:
        """The paths this architecture offers; always MODULES. A path offered here may still be
        unavailable for the loaded weights or this host (see `plan_fused_decode`)."""

    def decode_step_limits(self) -> list[str]:
        """What of this model keeps C_DECODE from being offered, for the start-up log (empty when it
        is offered, or for a model that has no such path at all, as an encoder)."""
        return []

    def encode_images(self, pixels: Tensor) -> Tensor:
        """A vision-language model's placeholder embeddings of processed images [B, C, H, W]:
        [B, tokens, hidden], which its forward takes as `embeds`. Only models whose config has
        a vision side offer it."""
        raise NotImplementedError(f"{type(self).__name__} does not take images")

    def fit_context(self, max_model_len: int) -> None:
        """Settle what depends on the longest sequence the engine runs (LongRoPE's choice of
        factors); called once the engine has decided it, before any step. Most models need nothing."""

    def plan_fused_decode(self) -> Optional[FusedDecodeStep]:
        """The C_DECODE step over the loaded weights, or None where some part of it has no native
        kernel here (weight format, dtype, host). Asked only of a model that offers C_DECODE, once
        its weights are loaded and on their device: the plan holds their addresses, so weights
        loaded again need a new plan."""
        raise NotImplementedError(f"{type(self).__name__} offers no {ExecutionPath.C_DECODE.value} path")
