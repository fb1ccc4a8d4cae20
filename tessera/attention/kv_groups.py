"""How the layers' KV caches share one block pool: groups of layers by attention kind.

Why: Gemma 3 attends over a sliding window (512 tokens) in five layers of six. Keeping those
layers' keys and values for the whole context, as full attention needs, spends most of a long
sequence's cache on tokens no query will read again. vLLM's answer (its hybrid KV cache manager),
followed here: the layers are split into groups of equal size (`num_slots`, the greatest common
divisor of the full and sliding layer counts; gemma3-270m: 3 full + 15 sliding layers = one full
group and five sliding groups of 3 layers). One pool block holds `num_slots` layers' keys and values
(tensor slot s holds the s-th layer of whichever group owns the block), each group has its own
block table per request, and a sliding group's table drops the blocks that fell behind the window
(their entries become NULL_BLOCK, which the kernels never read: they start at the window). Equal
group sizes keep the pool shared rather than split in advance: a short sequence takes as many
sliding blocks as full ones, a long one mostly full ones, from the same blocks.

Without sliding layers (or with `--disable-hybrid-kv-cache-manager`) there is one group of all the
layers, `num_slots` = number of layers: the plain layout, each layer's tensor indexed by one table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from tessera.attention.base import AttentionMetadata
from tessera.config import EngineConfig, ModelConfig

if TYPE_CHECKING:
    from tessera.attention.base import AttentionBackend

# The block a sliding group's table names for positions behind the window: reserved, never written,
# never read (every kernel and mask starts at the window). Only reserved when there is a sliding group.
NULL_BLOCK = 0


@dataclass(frozen=True)
class KVCacheGroups:
    """Which group and which tensor slot each layer's KV lives in, and each group's window."""

    windows: tuple[Optional[int], ...]  # per group: None (full attention, group 0) or the window in tokens
    layer_group: tuple[int, ...]  # per layer
    layer_slot: tuple[int, ...]  # per layer: which of the num_slots tensors holds its blocks

    def __post_init__(self) -> None:
        if not self.windows or self.windows[0] is not None:
            raise ValueError("group 0 must be a full-attention group")
        if len(self.layer_group) != len(self.layer_slot):
            raise ValueError("one group and one slot per layer")
        for g in range(len(self.windows)):
            slots = sorted(s for lg, s in zip(self.layer_group, self.layer_slot) if lg == g)
            if slots != list(range(self.num_slots)):
                raise ValueError(f"group {g} must hold one layer in each of the {self.num_slots} slots")

    @classmethod
    def plain(cls, num_layers: int) -> "KVCacheGroups":
        """Every layer in one full-attention group: the whole context's blocks for each layer."""
        return cls((None,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def for_layers(cls, windows: Sequence[Optional[int]], hybrid: bool = True) -> "KVCacheGroups":
        """Groups for layers with these sliding windows (None: full attention). Hybrid when asked and
        the model mixes full layers with sliding ones of one window; plain otherwise (a model of only
        sliding layers, or of several windows, keeps every block: none of the packaged ones is)."""
        full = [i for i, w in enumerate(windows) if w is None]
        sliding = [i for i, w in enumerate(windows) if w is not None]
        if not hybrid or not full or not sliding or len({windows[i] for i in sliding}) != 1:
            return cls.plain(len(windows))
        size = math.gcd(len(full), len(sliding))
        group = [0] * len(windows)
        slot = [0] * len(windows)
        group_windows: list[Optional[int]] = []
        for layers, window in ((full, None), (sliding, windows[sliding[0]])):
            for start in range(0, len(layers), size):
                for s, i in enumerate(layers[start:start + size]):
                    group[i], slot[i] = len(group_windows), s
                group_windows.append(window)
        return cls(tuple(group_windows), tuple(group), tuple(slot))

    @classmethod
    def for_engine(cls, model: ModelConfig, engine: EngineConfig) -> "KVCacheGroups":
        """How the model's layers share blocks under these settings: sliding-window layers keep only
        their window's blocks unless that is turned off, or the disk tier is on (its blocks hold every
        layer's K/V of a whole context; a group's blocks hold some layers' of part of it). A model
        with recurrent layers (engine/core/state_slots.py) gets one group of its attention layers
        alone, numbered in their order (the runner puts each state layer's tensor between them)."""
        hybrid = not engine.disable_hybrid_kv_cache_manager and engine.kv_offload_dir is None
        if model.state_layers():  # only the attending layers keep K/V; the others keep a state slot
            return cls.plain(len(model.attention_layers()))
        return cls.for_layers(model.layer_windows(), hybrid)

    # -- shape ----------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Layers whose KV one pool block holds."""
        return max(self.layer_slot) + 1

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    @property
    def window(self) -> Optional[int]:
        """The sliding groups' window, None without one."""
        return next((w for w in self.windows if w is not None), None)

    def describe(self) -> str:
        if not self.hybrid:
            return "one group of all layers"
        n_full = sum(1 for w in self.windows if w is None)
        return (f"hybrid: {n_full} full-attention and {self.num_groups - n_full} sliding-window (window "
                f"{self.window}) group(s) of {self.num_slots} layer(s) per block")

    # -- block accounting ---------------------------------------------------------------
    def first_needed_block(self, group: int, position: int, block_size: int) -> int:
        """The first block of the group a query at `position` reads: 0 for full attention, else
        the block of the window's oldest key (position - window + 1)."""
        w = self.windows[group]
        return 0 if w is None else max(0, (position - w + 1) // block_size)

    def blocks_per_sequence(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Pool blocks a sequence of `num_tokens` holds at most, its tokens computed `chunk` at a
        time (a sliding group holds the window plus the step's chunk, and a block either side)."""
        n = -(-num_tokens // block_size)
        total = 0
        for w in self.windows:
            total += n if w is None else min(n, -(-(w + chunk) // block_size) + 1)
        return total

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int) -> int:
        """The longest sequence `num_blocks` pool blocks can hold (computed `chunk` tokens at a time)."""
        reserved = 1 if self.hybrid else 0  # NULL_BLOCK
        lo, hi = 0, (num_blocks - reserved) * block_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_per_sequence(mid, block_size, chunk) <= num_blocks - reserved:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- tensors and metadata -------------------------------------------------------------
    def layer_caches(self, slots: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's cache tensor, from the pool's `num_slots` tensors."""
        return [slots[s] for s in self.layer_slot]

    def build_metadata(self, backend: "AttentionBackend", query_lens: list[int], seq_lens: list[int],
                       tables: list[list[list[int]]], block_size: int) -> AttentionMetadata:
        """A step's metadata from each request's block tables (one per group): group 0's, with
        every layer's own (`AttentionMetadata.for_layer`) when there are several groups."""
        metas = [backend.build_metadata(query_lens, seq_lens, [t[g] for t in tables], block_size)
                 for g in range(self.num_groups)]
        if self.hybrid:
            metas[0].layers = [metas[g] for g in self.layer_group]
        return metas[0]
