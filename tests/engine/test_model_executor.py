"""The runner's choice of execution path (engine/worker/model_executor.py) against the paths a
model offers (models/base.py), with stand-ins for the model and its C decode step: the choice
itself needs no C kernels, so it is checked on every host."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

from tessera.attention.base import AttentionMetadata
from tessera.engine.worker.model_executor import ModelExecutor
from tessera.models.base import ExecutionPath, ModelBase

MODULES_OUT = torch.zeros(1, 4)
C_OUT = torch.ones(1, 4)


class FakeStep:
    """A planned C step that takes the steps `applies_to` says and returns `result` (None: refused)."""

    def __init__(self, applies_to: bool, result: Optional[torch.Tensor]) -> None:
        self.applies_to, self.result, self.runs = applies_to, result, 0

    def applies(self, input_ids, kv_caches, meta) -> bool:
        return self.applies_to

    def run(self, input_ids, positions, kv_caches, meta, lora=None) -> Optional[torch.Tensor]:
        self.runs += 1
        return self.result


class FakeModel(nn.Module, ModelBase):
    def __init__(self, offers_c: bool, step: Optional[FakeStep]) -> None:
        super().__init__()
        self.offers_c, self.step, self.plans, self.calls = offers_c, step, 0, 0

    def forward(self, input_ids, positions, kv_caches, attn_meta, layers=None):
        self.calls += 1
        return MODULES_OUT

    def execution_paths(self) -> frozenset[ExecutionPath]:
        return frozenset({ExecutionPath.MODULES, ExecutionPath.C_DECODE} if self.offers_c else {ExecutionPath.MODULES})

    def plan_fused_decode(self):
        if not self.offers_c:
            return super().plan_fused_decode()
        self.plans += 1
        return self.step


class ModulesOnly(nn.Module, ModelBase):
    """A model that writes down only the required part of the interface."""

    def execution_paths(self) -> frozenset[ExecutionPath]:
        return frozenset({ExecutionPath.MODULES})


def _step(executor: ModelExecutor) -> torch.Tensor:
    meta = AttentionMetadata.__new__(AttentionMetadata)  # the stand-ins never read it
    return executor.forward(torch.tensor([5]), torch.tensor([3]), [], meta)


def test_decode_steps_the_plan_applies_to_take_the_c_step():
    step = FakeStep(applies_to=True, result=C_OUT)
    model = FakeModel(offers_c=True, step=step)
    executor = ModelExecutor(model)
    assert executor.paths == {ExecutionPath.MODULES, ExecutionPath.C_DECODE}
    assert executor.path_for(torch.tensor([5]), [], None) is ExecutionPath.C_DECODE
    assert torch.equal(_step(executor), C_OUT) and (step.runs, model.calls) == (1, 0)
    _step(executor)
    assert model.plans == 1  # planned once, when the executor was made


@pytest.mark.parametrize("applies, result", [(False, C_OUT), (True, None)])
def test_other_steps_and_refused_calls_run_the_modules(applies, result):
    step = FakeStep(applies_to=applies, result=result)
    model = FakeModel(offers_c=True, step=step)
    assert torch.equal(_step(ModelExecutor(model)), MODULES_OUT)
    assert model.calls == 1 and step.runs == (1 if applies else 0)


def test_enforce_eager_does_not_plan():
    model = FakeModel(offers_c=True, step=FakeStep(applies_to=True, result=C_OUT))
    executor = ModelExecutor(model, enforce_eager=True)
    assert executor.c_decode is None and executor.paths == {ExecutionPath.MODULES} and model.plans == 0
    assert torch.equal(_step(executor), MODULES_OUT)


def test_no_plan_here_runs_the_modules():
    model = FakeModel(offers_c=True, step=None)  # offered, but no kernel for some part on this host
    executor = ModelExecutor(model)
    assert executor.paths == {ExecutionPath.MODULES} and model.plans == 1
    assert torch.equal(_step(executor), MODULES_OUT)


def test_a_path_not_offered_is_never_asked_for():
    executor = ModelExecutor(ModulesOnly())
    assert executor.c_decode is None
    with pytest.raises(NotImplementedError):
        ModulesOnly().plan_fused_decode()


def test_every_model_class_writes_down_its_paths():
    """The interface is abstract: a model class without `execution_paths` cannot be made."""
    from tessera.models.bert import BertModel
    from tessera.models.decoder import DecoderForCausalLM

    for cls in (DecoderForCausalLM, BertModel):
        assert issubclass(cls, ModelBase) and not cls.__abstractmethods__

    class Forgot(nn.Module, ModelBase):
        pass

    with pytest.raises(TypeError):
        Forgot()
