"""Which execution path computes a step's hidden states, and running the step there.

A model lists the paths it offers (tessera.models.base.ExecutionPath) and runs only its modules
when called; choosing is the runner's, per step, from the engine's settings and the step's shape.
The C decode step is planned here once, when the executor is made: by then the weights are loaded
and on their device, and the plan holds their addresses.
"""
from __future__ import annotations

import logging
from typing import Optional

from torch import Tensor

from tessera.attention.base import AttentionMetadata
from tessera.layers.lora import LoRASlots
from tessera.models.base import ExecutionPath, FusedDecodeStep, ModelBase

logger = logging.getLogger(__name__)


class ModelExecutor:
    """Runs a model's forward over a packed step through the path chosen for that step: the C
    decode step where it is planned and applies, else the modules (also when the C call refuses
    at run time). `enforce_eager` keeps every step on the modules."""

    def __init__(self, model: ModelBase, enforce_eager: bool = False) -> None:
        self.model = model
        offered = model.execution_paths()
        wants_c = ExecutionPath.C_DECODE in offered and not enforce_eager
        # None: not offered, turned off, or no kernel for some part of this model on this host.
        self.c_decode: Optional[FusedDecodeStep] = model.plan_fused_decode() if wants_c else None
        limits = model.decode_step_limits()
        if limits and not enforce_eager:
            logger.info("decode steps run through the modules: the one-call C step cannot express %s",
                        ", ".join(limits))
        elif wants_c and self.c_decode is None:
            logger.info("decode steps run through the modules: the one-call C step has no kernel here for "
                        "this model's weights, dtype or host")

    @property
    def paths(self) -> frozenset[ExecutionPath]:
        """The paths this executor's steps may take."""
        if self.c_decode is None:
            return frozenset({ExecutionPath.MODULES})
        return frozenset({ExecutionPath.MODULES, ExecutionPath.C_DECODE})

    def path_for(self, input_ids: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata) -> ExecutionPath:
        """The path a step of these inputs takes (C_DECODE may still fall back at run time)."""
        if self.c_decode is not None and self.c_decode.applies(input_ids, kv_caches, meta):
            return ExecutionPath.C_DECODE
        return ExecutionPath.MODULES

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list, meta: AttentionMetadata,
                lora: Optional[LoRASlots] = None, embeds: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
        """The step's final hidden states, one row per token. `lora`: the step's adapters, when
        some rows run through one (both paths add them). `embeds`: rows whose embeddings an
        image gives (the modules take them; the C step reads token embeddings only)."""
        if embeds is not None:
            return self.model(input_ids, positions, kv_caches, meta, embeds=embeds)
        if self.c_decode is not None and self.path_for(input_ids, kv_caches, meta) is ExecutionPath.C_DECODE:
            hidden = self.c_decode.run(input_ids, positions, kv_caches, meta, lora)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, kv_caches, meta)
