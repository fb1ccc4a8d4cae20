"""Which replica answers a request: round-robin, least-loaded, or prefix-aware.

A policy sees the request's prompt token ids and a load figure per replica in
rotation (requests routed to it and not yet finished: running, waiting, or on
their way), and returns the replica's id. Pure bookkeeping, no I/O: the
ReplicaSet calls it on the event loop for every request.

`prefix-aware` is SGLang's cache-aware router and llm-d's prefix scorer in
their simplest form: the prompt's first blocks are hashed the way the engine's
prefix cache hashes them (a chain over block_size-token blocks), the router
remembers which replica each chain hash was last sent to, and a request goes
to the replica holding its longest known prefix, unless that replica is
markedly busier than the least-loaded one (both an absolute and a relative
gap, as SGLang's balance thresholds), in which case load wins. A request with
no known prefix goes to the least-loaded replica.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Protocol, Sequence, get_args

RouterPolicyName = Literal["round-robin", "least-loaded", "prefix-aware"]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicyName)


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica in rotation, as a policy sees it."""

    replica_id: int
    load: int  # requests routed to it and not finished


class RouterPolicy(Protocol):
    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad]) -> int:
        """The id of the replica (one of `replicas`, never empty) that takes this request."""
        ...

    def forget(self, replica_id: int) -> None:
        """The replica left rotation for good (scaled down): drop what is known about it."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad]) -> int:
        return replicas[next(self._counter) % len(replicas)].replica_id

    def forget(self, replica_id: int) -> None:
        pass


class LeastLoaded:
    """Fewest unfinished requests; ties go round-robin so an idle set spreads its first requests."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad]) -> int:
        least = min(r.load for r in replicas)
        tied = [r for r in replicas if r.load == least]
        return tied[next(self._counter) % len(tied)].replica_id

    def forget(self, replica_id: int) -> None:
        pass


@dataclass(frozen=True)
class PrefixAwareConfig:
    block_size: int = 16
    max_blocks: int = 64  # prompt head hashed: the first max_blocks * block_size tokens
    capacity: int = 1 << 17  # chain hashes remembered (LRU), about 10 MiB
    balance_abs_threshold: int = 8  # load gap (requests) past which the cache match yields...
    balance_rel_threshold: float = 1.5  # ...if the matched replica also has this many times the least load

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_blocks < 1 or self.capacity < 1:
            raise ValueError("block_size, max_blocks and capacity must be positive")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Chain hashes of the prompt's full leading blocks: hash i covers tokens [0, (i+1)*block_size)."""
    out: list[int] = []
    parent = 0
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


class PrefixAware:
    def __init__(self, config: PrefixAwareConfig = PrefixAwareConfig()) -> None:
        self.config = config
        self._owner: OrderedDict[int, int] = OrderedDict()  # chain hash -> replica id it was sent to
        self._least = LeastLoaded()
        self.matched_tokens = 0  # prompt tokens routed to a replica that had them (for stats)

    def match(self, hashes: Sequence[int], in_rotation: set[int]) -> tuple[int, int]:
        """(replica id, blocks matched) of the longest known prefix on a replica in rotation; (-1, 0) if none."""
        for i in range(len(hashes) - 1, -1, -1):
            owner = self._owner.get(hashes[i])
            if owner is not None and owner in in_rotation:
                return owner, i + 1
        return -1, 0

    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad]) -> int:
        cfg = self.config
        hashes = prefix_hashes(token_ids, cfg.block_size, cfg.max_blocks)
        loads = {r.replica_id: r.load for r in replicas}
        owner, matched = self.match(hashes, set(loads))
        least = min(loads.values())
        if owner >= 0 and not (loads[owner] - least > cfg.balance_abs_threshold
                               and loads[owner] > least * cfg.balance_rel_threshold):
            chosen = owner
            self.matched_tokens += matched * cfg.block_size
        else:
            chosen = self._least.choose(token_ids, replicas)
        for h in hashes:  # the chosen replica will hold this whole prefix
            self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > cfg.capacity:
            self._owner.popitem(last=False)
        return chosen

    def forget(self, replica_id: int) -> None:
        for h in [h for h, r in self._owner.items() if r == replica_id]:
            del self._owner[h]


def make_policy(name: RouterPolicyName, block_size: int = 16) -> RouterPolicy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(PrefixAwareConfig(block_size=block_size))
    raise ValueError(f"unknown router policy {name!r}; choose from {', '.join(ROUTER_POLICIES)}")
