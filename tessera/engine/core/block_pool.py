"""KV blocks, their reference counts, and the prefix cache index.

A block is free when no request holds it (ref_cnt == 0). Free blocks wait in
an LRU queue; a free block may still carry a hash, which keeps its contents
findable by the prefix cache until the block is handed out again (eviction).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[int] = None


class NoFreeBlocksError(RuntimeError):
    pass


def hash_block(parent_hash: Optional[int], token_ids: Iterable[int], extra: object = None) -> int:
    """Chain a full block's tokens onto its parent's hash, so equal hashes mean equal prefixes.

    A 64-bit BLAKE2b digest rather than Python's hash(): the same prompt gets the same hashes
    in every process, which the disk tier (engine/core/kv_offload.py) needs across restarts."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash or 0).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(str(extra).encode())
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Allocation takes from the front: the least recently freed block goes first.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict its cached contents
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: int) -> Optional[KVBlock]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock], evict_first: bool = False) -> None:
        """Drop one reference each; pass tail blocks first so they are evicted first. With
        `evict_first`, blocks that become free go ahead of every other free block."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if evict_first:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def register(self, block: KVBlock, block_hash: int) -> None:
        """Make a full, computed block findable by its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
