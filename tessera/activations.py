"""The gated MLP's activations: one table that the families (models/families), the MoE config, the
modules (layers/mlp.py) and the one-call C decode step (kernels/decode_step.c) all read.

Why one table: a family names its activation once, and each place that runs it (PyTorch's
operators in the modules, a C body in the decode step) looks it up here by that name. A name the
step has no C body for says so here (`c_code` None), and the step refuses such a model in one place
(families/base.py's `decode_step_limits`) instead of each caller comparing strings.

Nothing here imports torch: families and configs are read by processes without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping, Optional

from tessera.kernels.bindings import ACT_GELU_TANH, ACT_SILU, ACT_SWIGLU_CLAMPED

ActivationName = Literal["silu", "gelu_tanh", "swiglu_clamped"]


@dataclass(frozen=True)
class GatedActivation:
    """act(gate) * up, as the MLP combines gate and up."""

    name: str
    c_code: Optional[int]  # decode_step.c's dims_t.activation; None where the C step has no body for it
    summary: str


ACTIVATIONS: Mapping[str, GatedActivation] = MappingProxyType({a.name: a for a in (
    GatedActivation("silu", ACT_SILU, "SwiGLU: silu(gate) * up"),
    GatedActivation("gelu_tanh", ACT_GELU_TANH, "GeGLU: gelu(gate), tanh approximation, * up (Gemma)"),
    GatedActivation("swiglu_clamped", ACT_SWIGLU_CLAMPED, "gpt-oss: (up.clamp(+-limit) + 1) * g * sigmoid(alpha g), "
                                            "g = gate.clamp(max=limit)"),
)})


def activation(name: str) -> GatedActivation:
    """The activation of this name; ValueError for an unknown one."""
    found = ACTIVATIONS.get(name)
    if found is None:
        raise ValueError(f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})")
    return found
