"""Owns KV blocks on behalf of requests: allocation, prefix reuse, release, swap.

It decides which block ids a request holds and keeps that state itself, keyed by
request id (`RequestBlocks`): the request carries tokens and progress, never its
blocks, so what reaches the model runner is the block tables this manager hands out
(`block_tables`), plain lists. It never touches tensors: copies for swapping are
returned as (src, dst) pairs for the model runner to perform.

A request holds one block table per group of layers (attention/kv_groups.py): one in
all for most models; for Gemma 3 a full-attention group and sliding-window groups whose
tables drop the blocks behind the window (`free_out_of_window`). Every table has an entry
for each block of the context, NULL_BLOCK where a sliding group no longer holds one.

A model with recurrent layers (LFM2's short convolutions) also gives each request a state slot
(engine/core/state_slots.py), taken with its first blocks and released with them: a request that
holds blocks holds a slot, so a preempted one (recompute) loses both and rebuilds both from token 0.
Its prefix cache also keeps state snapshots at block boundaries (`StateSnapshots`): a hit ends only
at a block with one, and the request's state starts as a copy of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

from tessera.attention.kv_groups import NULL_BLOCK, KVCacheGroups
from tessera.engine.core.block_pool import BlockPool, KVBlock, hash_block
from tessera.engine.core.request import Request
from tessera.engine.core.state_slots import StateSlots, StateSnapshots


class OffloadTier(Protocol):
    """A second tier of the prefix cache, by block hash (engine/core/kv_offload.py)."""

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


@dataclass
class RequestBlocks:
    """What the manager holds for one request."""

    # One block table per group of layers (one group for most models), empty while the
    # request holds no blocks; sliding groups' first `num_null_blocks` entries are NULL_BLOCK
    # (behind the window).
    tables: list[list[int]] = field(default_factory=list)
    num_null_blocks: int = 0
    hashes: list[int] = field(default_factory=list)  # chained hashes of the request's full blocks
    num_registered: int = 0  # full blocks already entered in the prefix cache
    swapped: list[int] = field(default_factory=list)  # host block ids while swapped out
    # Disk-tier (or handed-over) blocks already read and verified while the request waits for
    # room, by hash, so a request admitted steps later does not read them again.
    payloads: dict[int, bytes] = field(default_factory=dict)

    @property
    def block_ids(self) -> list[int]:
        """Group 0's table: full attention, every block of the context."""
        return self.tables[0] if self.tables else []


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
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
    ) -> None:
        """`num_state_slots`: per-request states of a model with recurrent layers (0: none). Such a
        model has a prefix cache only with `num_state_snapshots` (a hit that skipped the state of
        the tokens it covers would be wrong), and no second tier."""
        self.block_size = block_size
        self.groups = groups or KVCacheGroups.plain(1)
        self.state = StateSlots(num_state_slots) if num_state_slots else None
        enable_caching = enable_caching and (self.state is None or num_state_snapshots > 0)
        self.snapshots = StateSnapshots(num_state_snapshots, num_state_slots) \
            if self.state is not None and enable_caching else None
        self._state_saves: list[tuple[int, int]] = []  # (request's slot, block hash) reached since the last take
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
        self._requests: dict[str, RequestBlocks] = {}

    # -- per-request state --------------------------------------------------
    def _state(self, req: Request) -> RequestBlocks:
        st = self._requests.get(req.request_id)
        if st is None:
            st = self._requests[req.request_id] = RequestBlocks()
        return st

    def blocks(self, request_id: str) -> RequestBlocks:
        """The request's blocks (empty if it holds none), read-only for callers."""
        return self._requests.get(request_id) or RequestBlocks()

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block tables, one per group, as the model runner addresses the cache."""
        st = self._requests.get(request_id)
        return st.tables if st is not None else []

    def state_slot(self, request_id: str) -> Optional[int]:
        """The request's state slot (None without recurrent layers, or while it holds none)."""
        return self.state.slot_of(request_id) if self.state is not None else None

    def snapshot_boundary(self, req: Request) -> int:
        """Tokens at whose end the request leaves a state snapshot: its prompt's last full block short
        of the prompt's last token (what a repeat of the prompt hits); 0 for none."""
        if self.snapshots is None:
            return 0
        return (req.num_prompt_tokens - 1) // self.block_size * self.block_size

    def clip_to_snapshot(self, req: Request, start: int, n: int) -> int:
        """`n` tokens from `start`, cut to end at the request's snapshot boundary when they would
        cross it (the state is saved between steps, so a chunk must end there)."""
        b = self.snapshot_boundary(req)
        return b - start if start < b < start + n else n

    def take_state_copies(self) -> list[tuple[int, int]]:
        """(source row, destination row) copies of the states that reached their snapshot boundary
        since the last call, each into a snapshot row (the runner makes them before the step)."""
        saves, self._state_saves = self._state_saves, []
        return [(slot, self.snapshots.take(h)) for slot, h in saves] if self.snapshots is not None else []

    def state_restore(self, req: Request, cached: PrefixHit) -> Optional[tuple[int, int]]:
        """After a hit is allocated: the copy of the snapshot at its end into the request's slot."""
        if self.snapshots is None or not cached.num_blocks:
            return None
        row = self.snapshots.row(self._state(req).hashes[cached.num_blocks - 1])
        slot = self.state_slot(req.request_id)
        return None if row is None or slot is None else (row, slot)

    def can_hold_state(self, req: Request) -> bool:
        """Whether `req` holds a state slot or could take one now (always, without recurrent layers)."""
        return self.state is None or self.state.can_take(req.request_id)

    def import_blocks(self, req: Request, payloads: dict[int, bytes]) -> None:
        """Blocks computed elsewhere (a prefill replica, --pd), by hash: loaded like disk-tier
        blocks when the request is admitted."""
        self._state(req).payloads = dict(payloads)

    def export_blocks(self, req: Request, num_tokens: int) -> tuple[list[int], list[int]]:
        """(hashes, block ids) of the run of the request's first `num_tokens` tokens' full blocks
        still in the prefix cache (all of them just after it finished, unless caching is off)."""
        st = self._state(req)
        self._update_hashes(req, num_tokens)
        hashes, ids = [], []
        for h in st.hashes[:num_tokens // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hashes.append(h)
            ids.append(block.block_id)
        if not st.tables and not st.swapped:
            self._requests.pop(req.request_id, None)
        return hashes, ids

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
        st = self.blocks(req.request_id)
        n = len(st.block_ids)
        return sum(n - (st.num_null_blocks if g in self._sliding else 0) for g in range(len(st.tables)))

    def blocks_to_reach(self, req: Request, num_tokens: int, cached: PrefixHit = NO_HIT) -> int:
        """More pool blocks `req` must take to keep `num_tokens` tokens (sliding groups: their
        window; a step's chunk takes more for that step, see `fitting_tokens`). Blocks of a prefix hit that
        running requests share cost nothing; a hit's unreferenced (evictable) blocks are counted
        as needed, as they are among the free ones."""
        need = self.groups.blocks_per_sequence(num_tokens, self.block_size) - self.blocks_held(req)
        return max(0, need - sum(1 for b in cached.held() if b.ref_cnt > 0))

    def _tables(self, st: RequestBlocks) -> list[list[int]]:
        if not st.tables:
            st.tables = [[] for _ in range(self.groups.num_groups)]
        return st.tables

    def _held(self, st: RequestBlocks) -> list[KVBlock]:
        """Every block the request holds, tail blocks first (freed first, so evicted first)."""
        out = []
        for i in range(len(st.block_ids) - 1, -1, -1):
            for g, table in enumerate(st.tables):
                if i >= st.num_null_blocks or g not in self._sliding:
                    out.append(self.pool.blocks[table[i]])
        return out

    # -- prefix cache -----------------------------------------------------
    def _update_hashes(self, req: Request, upto_tokens: int) -> list[int]:
        bs = self.block_size
        hashes = self._state(req).hashes
        full = min(upto_tokens, req.num_tokens) // bs
        extra = self.hash_extra if req.lora_salt is None else f"{self.hash_extra}|lora:{req.lora_salt}"
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if i else None
            # A block holding image placeholders is keyed by those images too: the same tokens with
            # another image are other K/V (and every later block chains from this one).
            seen = [im.hash for im in req.images if im.overlaps(i * bs, (i + 1) * bs)] if req.images else None
            hashes.append(hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs],
                                     f"{extra}|images:{','.join(seen)}" if seen else extra))
        return hashes

    def _lookup(self, hashes: list[int], index: int, group: int) -> Optional[KVBlock]:
        return self.pool.lookup(group_hash(hashes[index], group))

    def find_cached_prefix(self, req: Request) -> PrefixHit:
        """Longest run of cached full blocks heading this request's tokens.

        At least one token is always left to compute, so the step that
        finishes the prompt produces logits (and never writes a shared block).
        With sliding groups, the hit also needs their blocks inside the window
        of its end (older ones were dropped and are not needed).
        """
        if not self.enable_caching:
            return NO_HIT
        hashes = self._update_hashes(req, req.num_tokens - 1)
        n = (req.num_tokens - 1) // self.block_size
        for g, w in enumerate(self.groups.windows):
            if w is None:
                run = 0
                while run < n and self._lookup(hashes, run, g) is not None:
                    run += 1
                n = run
        bs = self.block_size
        while n > 0 and self._sliding:
            first = self.groups.first_needed_block(self._sliding[0], n * bs, bs)
            missing = next((i for i in range(n - 1, first - 1, -1)
                            if any(self._lookup(hashes, i, g) is None for g in self._sliding)), None)
            if missing is None:
                break
            n = missing  # no hit ending past a missing block of the window can be used
        while n > 0 and self.snapshots is not None and not self.snapshots.has(hashes[n - 1]):
            n -= 1  # a hit must end where a state was kept
        if n == 0:
            return NO_HIT
        first = self.groups.first_needed_block(self._sliding[0], n * bs, bs) if self._sliding else 0
        return PrefixHit([[self._lookup(hashes, i, g) if w is None or i >= first else None for i in range(n)]
                          for g, w in enumerate(self.groups.windows)])

    def find_offloaded(self, req: Request, num_cached: int) -> list[tuple[int, bytes]]:
        """After `num_cached` blocks found in RAM, the run of blocks the second tier holds, each
        read and verified (hash, payload; kept until the request is admitted, so waiting
        steps do not read them again); the same one-token-left rule as in RAM. None with sliding
        groups: a payload holds every layer's K/V of one plain block."""
        st = self.blocks(req.request_id)
        if self.groups.hybrid or self.state is not None or (self.offload is None and not st.payloads):
            return []
        st = self._state(req)
        found: list[tuple[int, bytes]] = []
        for h in self._update_hashes(req, req.num_tokens - 1)[num_cached:(req.num_tokens - 1) // self.block_size]:
            payload = st.payloads.get(h)  # read from the tier, or handed over (--pd)
            if payload is None:
                if self.offload is None or not self.offload.contains(h):
                    break
                payload = self.offload.read(h)
                if payload is None:
                    break
                st.payloads[h] = payload
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
        have = len(self.blocks(req.request_id).block_ids) + cached.num_blocks
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
        """Give `req` room for `num_new_tokens` more tokens past its computed ones and the
        `cached` and `loaded` blocks; False if blocks are short.

        `cached` blocks (a prefix hit for a request holding no blocks yet) are
        taken together with the new ones, or not at all; so are `loaded` (hashes
        of the second tier's blocks that follow them): fresh blocks, registered
        under those hashes, that the runner fills before the step
        (`block_tables(id)[0][hit:hit + len(loaded)]`). The caller advances the
        request's computed tokens past both. Each group gets the same number
        of new blocks (its table has an entry for every block of the context).
        """
        loaded = loaded or []
        hit = cached.num_blocks
        have, computed, spare = self._room(req, cached, len(loaded))
        need = self.blocks_for(computed + num_new_tokens) - have
        if need > spare or not self.can_hold_state(req):
            return False
        if self.state is not None:
            self.state.take(req.request_id)
        st = self._state(req)
        tables = self._tables(st)
        if hit:
            self.pool.touch(cached.held())
            for table, blocks in zip(tables, cached.blocks):
                table.extend(NULL_BLOCK if b is None else b.block_id for b in blocks)
            if self._sliding:
                st.num_null_blocks = sum(1 for b in cached.blocks[self._sliding[0]] if b is None)
        if hit or loaded:
            st.num_registered = hit + len(loaded)
        if st.payloads:  # admitted: what it read is in its blocks now, or no longer needed
            st.payloads = {}
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
        st = self._state(req)
        hashes = self._update_hashes(req, req.num_computed_tokens)
        full = min(req.num_computed_tokens // self.block_size, len(st.block_ids))
        for i in range(st.num_registered, full):
            for g, table in enumerate(st.tables):
                if table[i] == NULL_BLOCK and g in self._sliding:
                    continue  # behind the window (re-registering after a swap-in)
                block = self.pool.blocks[table[i]]
                self.pool.register(block, group_hash(hashes[i], g))
                if g == 0 and self.offload is not None and block.block_hash == hashes[i]:
                    self._to_offload.append((block.block_id, block.block_hash))
        st.num_registered = max(st.num_registered, full)
        boundary = self.snapshot_boundary(req)
        if boundary and req.num_computed_tokens == boundary:
            self._state_saves.append((self.state_slot(req.request_id), hashes[boundary // self.block_size - 1]))

    def free_out_of_window(self, req: Request) -> None:
        """Release the sliding groups' blocks that fell behind the window of the request's next
        query (at position num_computed_tokens). Cached ones stay findable until evicted, first
        among the free blocks: a later prompt rarely ends right where they are needed."""
        st = self._requests.get(req.request_id)
        if not self._sliding or st is None or not st.tables:
            return
        bs = self.block_size
        first = min(self.groups.first_needed_block(self._sliding[0], req.num_computed_tokens, bs),
                    len(st.block_ids))
        if first <= st.num_null_blocks:
            return
        dropped = []
        for g in self._sliding:
            table = st.tables[g]
            for i in range(st.num_null_blocks, first):
                dropped.append(self.pool.blocks[table[i]])
                table[i] = NULL_BLOCK
        st.num_null_blocks = first
        self.pool.free(dropped, evict_first=True)

    def release_tail(self, req: Request, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (slots of rejected proposals).

        They were allocated as lookahead and never entered the prefix cache, which only
        takes blocks of computed (so accepted) tokens.
        """
        st = self.blocks(req.request_id)
        keep = self.blocks_for(num_tokens)
        if len(st.block_ids) > keep:
            tail = [self.pool.blocks[t[i]] for i in range(len(st.block_ids) - 1, keep - 1, -1)
                    for t in st.tables]
            for table in st.tables:
                del table[keep:]
            self.pool.free(tail)

    def _drop_all(self, st: RequestBlocks) -> None:
        self.pool.free(self._held(st))
        st.tables = []
        st.num_null_blocks = 0
        st.num_registered = 0

    def free(self, req: Request) -> None:
        """Release everything the request holds (device and host blocks) and forget it."""
        if self.state is not None:
            self.state.release(req.request_id)
        st = self._requests.pop(req.request_id, None)
        if st is None:
            return
        self._drop_all(st)
        self.host_free.extend(st.swapped)

    # -- swap ---------------------------------------------------------------
    def swap_out(self, req: Request) -> Optional[list[tuple[int, int]]]:
        """Move the request's computed blocks to host memory; None if host space is short, and
        always with recurrent layers (their states stay on the device: the request is recomputed).
        Host blocks follow the tables group after group, NULL_BLOCK entries left out (the
        request keeps `num_null_blocks`, so swap_in rebuilds the same tables)."""
        if self.state is not None:
            return None
        st = self._state(req)
        n = self.blocks_for(req.num_computed_tokens)
        device = [t[i] for g, t in enumerate(st.tables)
                  for i in range(st.num_null_blocks if g in self._sliding else 0, n)]
        if len(device) > len(self.host_free):
            return None
        host = [self.host_free.pop() for _ in device]
        nulls = st.num_null_blocks
        self._drop_all(st)
        st.num_null_blocks = nulls
        st.swapped = host
        return list(zip(device, host))

    def swap_in(self, req: Request) -> Optional[list[tuple[int, int]]]:
        """Bring a swapped request's blocks back; None if device blocks are short."""
        st = self._state(req)
        n = len(st.swapped)
        if n > self.pool.num_free_blocks:
            return None
        dev = [b.block_id for b in self.pool.allocate(n)]
        pairs = list(zip(st.swapped, dev))
        self.host_free.extend(st.swapped)
        st.swapped = []
        tables = self._tables(st)
        it = iter(dev)
        width = self.blocks_for(req.num_computed_tokens)
        for g, table in enumerate(tables):
            nulls = st.num_null_blocks if g in self._sliding else 0
            table.extend([NULL_BLOCK] * nulls + [next(it) for _ in range(width - nulls)])
        return pairs
