"""A request as the scheduler sees it: tokens, progress and an explicit state.

Its blocks are the KV cache manager's (kept there by request id), and what the model
runner reads of it travels in the scheduler's output as plain data: this object stays
on the scheduler's side of the step.
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Optional

import torch

from tessera.engine.core.spec_acceptance import AcceptanceEstimate
from tessera.engine.outputs import RequestMetrics
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import SamplingParams
from tessera.vision import ImageInput

if TYPE_CHECKING:
    from tessera.engine.core.structured_output import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; will recompute
    SWAPPED = "swapped"  # blocks copied to host memory
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    """One sequence being generated (a parent with n > 1 becomes n of these)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: list[int],
        arrival_time: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
        wait_for: Optional["Request"] = None,
        pooling: Optional[PoolingParams] = None,
    ) -> None:
        """`pooling`: an embedding request, whose whole prompt is computed in one step and pooled
        (max_tokens 0: nothing is sampled)."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.priority = params.priority  # lower first, under the priority policy
        self.max_tokens = max_tokens
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.generator = generator
        self.wait_for = wait_for  # sibling whose prompt prefill should land in the cache first
        self.pooling = pooling
        # Tokens a proposer guessed for the coming step (speculative decoding); verified by the
        # target in that step, never part of all_token_ids unless accepted.
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: Optional[torch.Tensor] = None  # [len, vocab] q of drafted ones, when sampled
        # How often its proposals were accepted lately: the draft length of each step is chosen from it.
        self.spec_acceptance = AcceptanceEstimate()
        self.stop_reason: int | str | None = None
        # Whether the runner holds this request's tokens for its penalties (sent in its first
        # chunk after admission or preemption; the runner appends what it samples).
        self.history_sent = False
        # Where this sequence stands in its structured-output grammar (None: unconstrained);
        # advanced by the tokens each step appends, so it survives preemption.
        self.grammar: Optional["GrammarState"] = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        # The LoRA adapter it runs through (None: the base) and what salts its blocks' hashes,
        # so its KV is never shared with the base's or another adapter's (the adapter file's digest).
        self.lora_name: Optional[str] = None
        self.lora_salt: Optional[str] = None
        # Its images over their placeholder runs: the runner encodes one when a chunk reaches it,
        # and a block holding placeholders is keyed by the hashes of the images over it.
        self.images: list[ImageInput] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def clear_speculation(self) -> None:
        self.spec_token_ids = []
        self.spec_draft_probs = None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
