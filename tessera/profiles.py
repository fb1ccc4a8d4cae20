"""Deployment presets: the sizing and scheduling settings each kind of traffic wants.

`EngineConfig` takes the `PROFILE_FIELDS` a flag leaves unset from its profile's `Profile`.
"""
from __future__ import annotations

from dataclasses import dataclass

PROFILES = ("auto", "chat-solo", "multi-agent", "bursty")


@dataclass(frozen=True)
class Profile:
    """A deployment preset (the sizing and scheduling trade-offs of each kind of traffic): the settings one kind of traffic wants.

    chat-solo: one person chatting; latency first, a batch of 1-2, room for long prompts.
    multi-agent: many agents behind an API sharing long prefixes; throughput first, a large
    batch, prefix caching, a looser latency target and a long queue.
    bursty: a small team's uneven traffic; the middle ground, with swap so a burst's
    preemptions do not throw work away, and a shorter queue so overload is refused early.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    target_itl_ms: float  # 0 = no target: the token budget alone sizes prefill chunks
    min_prefill_chunk: int  # least chunk worth the target; less room and prompts take the budget
    enable_prefix_caching: bool
    preemption_mode: str
    max_num_queued_requests: int
    description: str


PROFILE_SETTINGS: dict[str, Profile] = {
    "chat-solo": Profile(2, 2048, 30.0, 32, True, "swap", 8, "one user chatting: latency first"),
    "multi-agent": Profile(64, 1024, 100.0, 64, True, "recompute", 512,
                           "many clients sharing prefixes: throughput first"),
    "bursty": Profile(32, 1024, 50.0, 64, True, "swap", 128, "uneven team traffic: the middle ground"),
}
DEFAULT_PROFILE = "bursty"  # what `auto` means for a server; `tessera chat` picks chat-solo
PROFILE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "target_itl_ms", "min_prefill_chunk",
                  "enable_prefix_caching", "preemption_mode")
