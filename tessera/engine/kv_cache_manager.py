"""Owns KV blocks on behalf of requests: allocation, prefix reuse, release, swap.

It decides which block ids a request holds; it never touches tensors. Copies
for swapping are returned as (src, dst) pairs for the model runner to perform.
"""
from __future__ import annotations

from typing import Optional, Protocol

from tessera.engine.block_pool import BlockPool, KVBlock, hash_block
from tessera.engine.request import Request


class OffloadTier(Protocol):
    """A second tier of the prefix cache, by block hash (engine/kv_offload.py)."""

    def contains(self, block_hash: int) -> bool: ...

    def read(self, block_hash: int) -> Optional[bytes]: ...


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        hash_extra: object = None,
        offload: Optional[OffloadTier] = None,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra  # anything besides tokens that changes K/V (model id)
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.num_host_blocks = num_host_blocks
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Second tier: blocks found there are loaded instead of recomputed; blocks entering the
        # RAM cache are handed to the engine (`take_offload`) to be written there.
        self.offload = offload if enable_caching else None
        self.offload_hits = 0  # tokens loaded from the second tier
        self._to_offload: list[tuple[int, int]] = []  # (block id, hash) registered since the last take

    # -- capacity ---------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # -- prefix cache -----------------------------------------------------
    def _update_hashes(self, req: Request, upto_tokens: int) -> None:
        bs = self.block_size
        full = min(upto_tokens, req.num_tokens) // bs
        while len(req.block_hashes) < full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(
                hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs], self.hash_extra))

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """Longest run of cached full blocks heading this request's tokens.

        At least one token is always left to compute, so the step that
        finishes the prompt produces logits (and never writes a shared block).
        """
        if not self.enable_caching:
            return []
        self._update_hashes(req, req.num_tokens - 1)
        hits: list[KVBlock] = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def find_offloaded(self, req: Request, num_cached: int) -> list[tuple[int, bytes]]:
        """After `num_cached` blocks found in RAM, the run of blocks the second tier holds, each
        read and verified (hash, payload; kept on the request until it is admitted, so waiting
        steps do not read them again); the same one-token-left rule as in RAM."""
        if self.offload is None and not req.offload_payloads:
            return []
        found: list[tuple[int, bytes]] = []
        for h in req.block_hashes[num_cached:(req.num_tokens - 1) // self.block_size]:
            payload = req.offload_payloads.get(h)  # read from the tier, or handed over (--pd)
            if payload is None:
                if self.offload is None or not self.offload.contains(h):
                    break
                payload = self.offload.read(h)
                if payload is None:
                    break
                req.offload_payloads[h] = payload
            found.append((h, payload))
        return found

    def take_offload(self) -> list[tuple[int, int]]:
        """(block id, hash) of blocks registered since the last call, for the second tier."""
        out, self._to_offload = self._to_offload, []
        return out

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached: Optional[list[KVBlock]] = None,
        loaded: Optional[list[int]] = None,
    ) -> bool:
        """Give `req` room for `num_new_tokens` more tokens; False if blocks are short.

        `cached` blocks (a prefix hit for a request holding no blocks yet) are
        taken together with the new ones, or not at all; so are `loaded` (hashes
        of the second tier's blocks that follow them): fresh blocks, registered
        under those hashes, that the runner fills before the step
        (`req.block_ids[len(cached):len(cached) + len(loaded)]`).
        """
        cached = cached or []
        loaded = loaded or []
        have = len(req.block_ids) + len(cached)
        computed = req.num_computed_tokens + (len(cached) + len(loaded)) * self.block_size
        need = self.blocks_for(computed + num_new_tokens) - have
        evictable_hits = sum(1 for b in cached if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return False
        if cached:
            self.pool.touch(cached)
            req.block_ids.extend(b.block_id for b in cached)
        if cached or loaded:
            req.num_computed_tokens = computed
            req.num_registered_blocks = len(cached) + len(loaded)
        if req.offload_payloads:  # admitted: what it read is in its blocks now, or no longer needed
            req.offload_payloads = {}
        if need > 0:
            fresh = self.pool.allocate(need)
            for block, h in zip(fresh, loaded):
                self.pool.register(block, h)
            req.block_ids.extend(b.block_id for b in fresh)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Enter the request's newly completed blocks into the prefix cache."""
        if not self.enable_caching:
            return
        self._update_hashes(req, req.num_computed_tokens)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        for i in range(req.num_registered_blocks, full):
            block = self.pool.blocks[req.block_ids[i]]
            self.pool.register(block, req.block_hashes[i])
            if self.offload is not None and block.block_hash == req.block_hashes[i]:
                self._to_offload.append((block.block_id, block.block_hash))
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    def release_tail(self, req: Request, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (slots of rejected proposals).

        They were allocated as lookahead and never entered the prefix cache, which only
        takes blocks of computed (so accepted) tokens.
        """
        keep = self.blocks_for(num_tokens)
        if len(req.block_ids) > keep:
            tail = req.block_ids[keep:]
            req.block_ids = req.block_ids[:keep]
            self.pool.free(self.pool.blocks[b] for b in reversed(tail))

    def free(self, req: Request) -> None:
        self.pool.free(self.pool.blocks[b] for b in reversed(req.block_ids))
        req.block_ids = []
        req.num_registered_blocks = 0
        if req.swapped_blocks:
            self.host_free.extend(req.swapped_blocks)
            req.swapped_blocks = []

    # -- swap ---------------------------------------------------------------
    def swap_out(self, req: Request) -> Optional[list[tuple[int, int]]]:
        """Move the request's computed blocks to host memory; None if host space is short."""
        n = self.blocks_for(req.num_computed_tokens)
        if n > len(self.host_free):
            return None
        host = [self.host_free.pop() for _ in range(n)]
        pairs = list(zip(req.block_ids[:n], host))
        self.pool.free(self.pool.blocks[b] for b in reversed(req.block_ids))
        req.block_ids = []
        req.num_registered_blocks = 0
        req.swapped_blocks = host
        return pairs

    def swap_in(self, req: Request) -> Optional[list[tuple[int, int]]]:
        """Bring a swapped request's blocks back; None if device blocks are short."""
        n = len(req.swapped_blocks)
        if n > self.pool.num_free_blocks:
            return None
        dev = [b.block_id for b in self.pool.allocate(n)]
        pairs = list(zip(req.swapped_blocks, dev))
        self.host_free.extend(req.swapped_blocks)
        req.swapped_blocks = []
        req.block_ids = dev
        return pairs
