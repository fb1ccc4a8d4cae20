"""KV blocks, their reference counts, and the prefix cache index.

A block is free when no request holds it (ref_cnt == 0). A free block may still
carry a hash, which keeps its contents findable by the prefix cache until the
block is handed out again (eviction); such blocks wait in an LRU queue.

Blocks are handed out from the warm end: the most recently freed block whose
contents nobody can find again (no hash) first, then a block no request has
ever used, and only then the least recently freed cached block. The cache's
pages are mapped by the OS on first write (attention/base.py), so the server's
resident memory grows with the tokens actually held or cached rather than with
the cache's reserved size.
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
        # Free blocks a request has used, in three places by warmth. Unhashed ones (nothing can
        # find their contents) on a stack, the most recently freed on top; hashed ones in LRU
        # order, kept findable by the prefix cache until nothing else is left.
        self.recycled: list[int] = []
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict()
        # Never-used blocks, popped lowest id first; their pages are not resident yet.
        self.untouched: list[int] = list(range(num_blocks - 1, -1, -1))
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.recycled) + len(self.untouched) + len(self.free_queue)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks some request has written: an upper bound on the cache's resident pages."""
        return self.num_blocks - len(self.untouched)

    def is_free(self, block_id: int) -> bool:
        """Whether the block waits in one of the free structures (a check for tests and
        invariants, linear in the free blocks: the reference count says the same when all is well)."""
        return block_id in self.free_queue or block_id in self.recycled or block_id in self.untouched

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self.recycled:
                block = self.blocks[self.recycled.pop()]
            elif self.untouched:
                block = self.blocks[self.untouched.pop()]
            else:
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
        `evict_first`, cached blocks that become free go ahead of every other cached block."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.recycled.append(block.block_id)
                    continue
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
