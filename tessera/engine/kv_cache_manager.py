"""Owns KV blocks on behalf of requests: allocation, prefix reuse, release, swap.

It decides which block ids a request holds; it never touches tensors. Copies
for swapping are returned as (src, dst) pairs for the model runner to perform.

A request holds one block table per group of layers (attention/kv_groups.py): one in
all for most models; for Gemma 3 a full-attention group and sliding-window groups whose
tables drop the blocks behind the window (`free_out_of_window`). Every table has an entry
for each block of the context, NULL_BLOCK where a sliding group no longer holds one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

from tessera.attention.kv_groups import NULL_BLOCK, KVCacheGroups
from tessera.engine.block_pool import BlockPool, KVBlock, hash_block
from tessera.engine.request import Request


class OffloadTier(Protocol):
    """A second tier of the prefix cache, by block hash (engine/kv_offload.py)."""

    def contains(self, block_hash: int) -> bool: ...

    def read(self, block_hash: int) -> Optional[bytes]: ...


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks heading a request's tokens: per group, one entry per block of the hit
    (None where a sliding group needs nothing, behind the window of the hit's end)."""

    blocks: list[list[Optional[KVBlock]]]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0

    def held(self) -> Iterator[KVBlock]:
        return (b for group in self.blocks for b in group if b is not None)


NO_HIT = PrefixHit([])


def group_hash(block_hash: int, group: int) -> int:
    """The prefix-cache key of a group's block: the chained hash itself for group 0 (what the disk
    tier and KV transfers name), mixed with the group's index for the others (same tokens, other
    layers' K/V)."""
    if group == 0:
        return block_hash
    return (block_hash * 0x9E3779B97F4A7C15 + group) & 0xFFFFFFFFFFFFFFFF


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        hash_extra: object = None,
        offload: Optional[OffloadTier] = None,
        groups: Optional[KVCacheGroups] = None,
    ) -> None:
        self.block_size = block_size
        self.groups = groups or KVCacheGroups.plain(1)
        self.pool = BlockPool(num_blocks, enable_caching)
        if self.groups.hybrid:  # NULL_BLOCK: taken for good, so no request is ever handed it
            assert self.pool.allocate(1)[0].block_id == NULL_BLOCK
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra  # anything besides tokens that changes K/V (model id)
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.num_host_blocks = num_host_blocks
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Second tier: blocks found there are loaded instead of recomputed; blocks entering the
        # RAM cache are handed to the engine (`take_offload`) to be written there. One group only:
        # its blocks are whole-context blocks of every layer (the engine keeps it plain then).
        self.offload = offload if enable_caching else None
        self.offload_hits = 0  # tokens loaded from the second tier
        self._to_offload: list[tuple[int, int]] = []  # (block id, hash) registered since the last take
        self._sliding = [g for g, w in enumerate(self.groups.windows) if w is not None]

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

    def blocks_held(self, req: Request) -> int:
        """Pool blocks the request holds, every group (a sliding group's dropped entries excluded)."""
        n = len(req.block_ids)
        return sum(n - (req.num_null_blocks if g in self._sliding else 0) for g in range(len(req.block_tables)))

    def blocks_to_reach(self, req: Request, num_tokens: int, cached: PrefixHit = NO_HIT) -> int:
        """More pool blocks `req` must take to keep `num_tokens` tokens (sliding groups: their
        window; a step's chunk takes more for that step, see `fitting_tokens`). Blocks of a prefix hit that
        running requests share cost nothing; a hit's unreferenced (evictable) blocks are counted
        as needed, as they are among the free ones."""
        need = self.groups.blocks_per_sequence(num_tokens, self.block_size) - self.blocks_held(req)
        return max(0, need - sum(1 for b in cached.held() if b.ref_cnt > 0))

    def _tables(self, req: Request) -> list[list[int]]:
        if not req.block_tables:
            req.block_tables = [[] for _ in range(self.groups.num_groups)]
        return req.block_tables

    def _held(self, req: Request) -> list[KVBlock]:
        """Every block the request holds, tail blocks first (freed first, so evicted first)."""
        out = []
        for i in range(len(req.block_ids) - 1, -1, -1):
            for g, table in enumerate(req.block_tables):
                if i >= req.num_null_blocks or g not in self._sliding:
                    out.append(self.pool.blocks[table[i]])
        return out

    # -- prefix cache -----------------------------------------------------
    def _update_hashes(self, req: Request, upto_tokens: int) -> None:
        bs = self.block_size
        full = min(upto_tokens, req.num_tokens) // bs
        while len(req.block_hashes) < full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(
                hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs], self.hash_extra))

    def _lookup(self, req: Request, index: int, group: int) -> Optional[KVBlock]:
        return self.pool.lookup(group_hash(req.block_hashes[index], group))

    def find_cached_prefix(self, req: Request) -> PrefixHit:
        """Longest run of cached full blocks heading this request's tokens.

        At least one token is always left to compute, so the step that
        finishes the prompt produces logits (and never writes a shared block).
        With sliding groups, the hit also needs their blocks inside the window
        of its end (older ones were dropped and are not needed).
        """
        if not self.enable_caching:
            return NO_HIT
        self._update_hashes(req, req.num_tokens - 1)
        n = (req.num_tokens - 1) // self.block_size
        for g, w in enumerate(self.groups.windows):
            if w is None:
                run = 0
                while run < n and self._lookup(req, run, g) is not None:
                    run += 1
                n = run
        bs = self.block_size
        while n > 0 and self._sliding:
            first = self.groups.first_needed_block(self._sliding[0], n * bs, bs)
            missing = next((i for i in range(n - 1, first - 1, -1)
                            if any(self._lookup(req, i, g) is None for g in self._sliding)), None)
            if missing is None:
                break
            n = missing  # no hit ending past a missing block of the window can be used
        if n == 0:
            return NO_HIT
        first = self.groups.first_needed_block(self._sliding[0], n * bs, bs) if self._sliding else 0
        return PrefixHit([[self._lookup(req, i, g) if w is None or i >= first else None for i in range(n)]
                          for g, w in enumerate(self.groups.windows)])

    def find_offloaded(self, req: Request, num_cached: int) -> list[tuple[int, bytes]]:
        """After `num_cached` blocks found in RAM, the run of blocks the second tier holds, each
        read and verified (hash, payload; kept on the request until it is admitted, so waiting
        steps do not read them again); the same one-token-left rule as in RAM. None with sliding
        groups: a payload holds every layer's K/V of one plain block."""
        if self.groups.hybrid or (self.offload is None and not req.offload_payloads):
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
    def _room(self, req: Request, cached: PrefixHit, num_loaded: int) -> tuple[int, int, int]:
        """(table entries the request would have, tokens it would have computed, new blocks each
        group can still take) once `cached` and `num_loaded` loaded blocks are its own. A hit's
        unreferenced blocks are among the free ones, so they do not count as room."""
        have = len(req.block_ids) + cached.num_blocks
        computed = req.num_computed_tokens + (cached.num_blocks + num_loaded) * self.block_size
        evictable_hits = sum(1 for b in cached.held() if b.ref_cnt == 0)
        return have, computed, (self.pool.num_free_blocks - evictable_hits) // self.groups.num_groups

    def fitting_tokens(self, req: Request, num_new_tokens: int, cached: PrefixHit = NO_HIT,
                       num_loaded: int = 0) -> int:
        """The most of `num_new_tokens` that `allocate_slots` can give `req` now (same arguments)."""
        have, computed, spare = self._room(req, cached, num_loaded)
        return max(0, min(num_new_tokens, (have + spare) * self.block_size - computed))

    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached: PrefixHit = NO_HIT,
        loaded: Optional[list[int]] = None,
    ) -> bool:
        """Give `req` room for `num_new_tokens` more tokens; False if blocks are short.

        `cached` blocks (a prefix hit for a request holding no blocks yet) are
        taken together with the new ones, or not at all; so are `loaded` (hashes
        of the second tier's blocks that follow them): fresh blocks, registered
        under those hashes, that the runner fills before the step
        (`req.block_ids[hit:hit + len(loaded)]`). Each group gets the same number
        of new blocks (its table has an entry for every block of the context).
        """
        loaded = loaded or []
        tables = self._tables(req)
        hit = cached.num_blocks
        have, computed, spare = self._room(req, cached, len(loaded))
        need = self.blocks_for(computed + num_new_tokens) - have
        if need > spare:
            return False
        if hit:
            self.pool.touch(cached.held())
            for table, blocks in zip(tables, cached.blocks):
                table.extend(NULL_BLOCK if b is None else b.block_id for b in blocks)
            if self._sliding:
                req.num_null_blocks = sum(1 for b in cached.blocks[self._sliding[0]] if b is None)
        if hit or loaded:
            req.num_computed_tokens = computed
            req.num_registered_blocks = hit + len(loaded)
        if req.offload_payloads:  # admitted: what it read is in its blocks now, or no longer needed
            req.offload_payloads = {}
        if need > 0:
            fresh = self.pool.allocate(need * self.groups.num_groups)
            for block, h in zip(fresh, loaded):  # group 0's (loads only come with one group)
                self.pool.register(block, h)
            for g, table in enumerate(tables):
                table.extend(b.block_id for b in fresh[g * need:(g + 1) * need])
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Enter the request's newly completed blocks into the prefix cache."""
        if not self.enable_caching:
            return
        self._update_hashes(req, req.num_computed_tokens)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        for i in range(req.num_registered_blocks, full):
            for g, table in enumerate(req.block_tables):
                if table[i] == NULL_BLOCK and g in self._sliding:
                    continue  # behind the window (re-registering after a swap-in)
                block = self.pool.blocks[table[i]]
                self.pool.register(block, group_hash(req.block_hashes[i], g))
                if g == 0 and self.offload is not None and block.block_hash == req.block_hashes[i]:
                    self._to_offload.append((block.block_id, block.block_hash))
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    def free_out_of_window(self, req: Request) -> None:
        """Release the sliding groups' blocks that fell behind the window of the request's next
        query (at position num_computed_tokens). Cached ones stay findable until evicted, first
        among the free blocks: a later prompt rarely ends right where they are needed."""
        if not self._sliding or not req.block_tables:
            return
        bs = self.block_size
        first = min(self.groups.first_needed_block(self._sliding[0], req.num_computed_tokens, bs),
                    len(req.block_ids))
        if first <= req.num_null_blocks:
            return
        dropped = []
        for g in self._sliding:
            table = req.block_tables[g]
            for i in range(req.num_null_blocks, first):
                dropped.append(self.pool.blocks[table[i]])
                table[i] = NULL_BLOCK
        req.num_null_blocks = first
        self.pool.free(dropped, evict_first=True)

    def release_tail(self, req: Request, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (slots of rejected proposals).

        They were allocated as lookahead and never entered the prefix cache, which only
        takes blocks of computed (so accepted) tokens.
        """
        keep = self.blocks_for(num_tokens)
        if len(req.block_ids) > keep:
            tail = [self.pool.blocks[t[i]] for i in range(len(req.block_ids) - 1, keep - 1, -1)
                    for t in req.block_tables]
            for table in req.block_tables:
                del table[keep:]
            self.pool.free(tail)

    def _drop_all(self, req: Request) -> None:
        self.pool.free(self._held(req))
        req.block_tables = []
        req.num_null_blocks = 0
        req.num_registered_blocks = 0

    def free(self, req: Request) -> None:
        self._drop_all(req)
        if req.swapped_blocks:
            self.host_free.extend(req.swapped_blocks)
            req.swapped_blocks = []

    # -- swap ---------------------------------------------------------------
    def swap_out(self, req: Request) -> Optional[list[tuple[int, int]]]:
        """Move the request's computed blocks to host memory; None if host space is short.
        Host blocks follow the tables group after group, NULL_BLOCK entries left out (the
        request keeps `num_null_blocks`, so swap_in rebuilds the same tables)."""
        n = self.blocks_for(req.num_computed_tokens)
        device = [t[i] for g, t in enumerate(req.block_tables)
                  for i in range(req.num_null_blocks if g in self._sliding else 0, n)]
        if len(device) > len(self.host_free):
            return None
        host = [self.host_free.pop() for _ in device]
        nulls = req.num_null_blocks
        self._drop_all(req)
        req.num_null_blocks = nulls
        req.swapped_blocks = host
        return list(zip(device, host))

    def swap_in(self, req: Request) -> Optional[list[tuple[int, int]]]:
        """Bring a swapped request's blocks back; None if device blocks are short."""
        n = len(req.swapped_blocks)
        if n > self.pool.num_free_blocks:
            return None
        dev = [b.block_id for b in self.pool.allocate(n)]
        pairs = list(zip(req.swapped_blocks, dev))
        self.host_free.extend(req.swapped_blocks)
        req.swapped_blocks = []
        tables = self._tables(req)
        it = iter(dev)
        width = self.blocks_for(req.num_computed_tokens)
        for g, table in enumerate(tables):
            nulls = req.num_null_blocks if g in self._sliding else 0
            table.extend([NULL_BLOCK] * nulls + [next(it) for _ in range(width - nulls)])
        return pairs
