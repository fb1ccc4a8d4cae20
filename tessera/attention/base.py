"""The attention backend interface: KV cache layout, per-step metadata, and the kernel.

The engine never assumes a KV layout: it asks the backend for the cache's
shape, dtype and bytes per token (to size the cache from a memory budget),
allocates through it, and builds each step's metadata through it. Models
reach the backend only through the metadata handed to their Attention layers,
so a new backend (a C++ kernel, a quantized cache, a GPU kernel) slots in
without touching models or the engine.

Every backend stores, per layer, one tensor whose first three dimensions are
`[2, num_kv_heads, num_blocks]` (keys, values; KV heads outermost), so a block
is the slice `[:, :, block_id]` whatever its format (swap copies such slices).
The rest depends on `--kv-cache-dtype`:
- bfloat16 / float32: `[block_size, head_dim]` in that dtype;
- int8: `[block_size * head_dim + 4]` bytes, the block's tokens quantized with
  one float32 scale per (K or V, head, block) kept in the block's last 4 bytes
  (tessera/kernels/kv_int8.c): half the bytes of bfloat16, plus 4 per block.
A token's slot is `block_id * block_size + offset`.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tessera.kernels import attention_ops, bindings, library
from tessera.config_choices import KV_CACHE_DTYPES
from tessera.hostinfo import lazy_zeros

SCALE_BYTES = 4  # one float32 scale at the end of each quantized block row


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the packed batch and in the KV cache.

    Requests are ordered decodes first (query length 1), then prefills. Built
    once per step and shared by every layer; `_cache` holds index tensors that
    layers of the same step reuse (masks, padding maps).
    """

    backend: "AttentionBackend"
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    query_start_loc: list[int]  # [B+1] offsets of each request in the packed batch
    seq_lens: list[int]  # [B] context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    block_size: int
    num_decodes: int  # leading requests with exactly one query token
    _cache: dict = field(default_factory=dict, repr=False)
    # Each layer's own metadata when layers read different block tables (kv_groups.py: sliding-window
    # layers keep only their window's blocks); None when every layer reads these.
    layers: Optional[list["AttentionMetadata"]] = None
    # Models with recurrent layers (engine/core/state_slots.py), per request in this order: the
    # index of its state in each such layer's state tensor, and whether that state carries over
    # from earlier steps (False: the request's first chunk, whose state starts at zeros).
    state_slots: Optional[list[int]] = None
    state_continues: Optional[list[bool]] = None

    def for_layer(self, index: int) -> "AttentionMetadata":
        """The metadata decoder layer `index` attends with."""
        return self if self.layers is None else self.layers[index]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


def build_metadata(
    backend: "AttentionBackend",
    query_lens: list[int],
    seq_lens: list[int],
    block_table_rows: list[list[int]],
    block_size: int,
) -> AttentionMetadata:
    """Metadata from per-request lists (decodes must come first); O(batch) Python work."""
    num_decodes = 0
    for q in query_lens:
        if q != 1:
            break
        num_decodes += 1
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    width = max((len(r) for r in block_table_rows), default=1) or 1
    table = torch.tensor([r + [0] * (width - len(r)) for r in block_table_rows], dtype=torch.long)
    if num_decodes == len(query_lens):
        # Decode-only step: each request's one new token sits at position seq_len - 1.
        pos = torch.tensor(seq_lens, dtype=torch.long) - 1
        slots = table.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1) * block_size + pos % block_size
    else:
        qlens = torch.tensor(query_lens, dtype=torch.long)
        req = torch.repeat_interleave(torch.arange(len(query_lens)), qlens)
        first_pos = torch.tensor(seq_lens, dtype=torch.long) - qlens
        starts = torch.tensor(query_start_loc[:-1], dtype=torch.long)
        pos = torch.arange(query_start_loc[-1]) - starts[req] + first_pos[req]
        slots = table[req, pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(backend, slots, query_start_loc, list(seq_lens), table, block_size, num_decodes)


class AttentionBackend(ABC):
    """One attention implementation and the KV cache layout it reads.

    `kv_cache_dtype` (vLLM's --kv-cache-dtype) picks the cache format: "auto" is
    the model's dtype; "int8" quantizes with per-block scales and needs the C
    kernels (writes grow a block's scale in place, which PyTorch operators
    cannot do row by row at any reasonable cost).
    """

    name: str = ""
    # Where the cache and each step's metadata live; a GPU backend sets its own.
    device: torch.device = torch.device("cpu")

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype!r}")
        if kv_cache_dtype == "int8":
            why = library.available()
            if why is not None:
                raise library.KernelUnavailable(f"--kv-cache-dtype int8 needs Tessera's C kernels: {why}")
        self.kv_dtype_name = kv_cache_dtype

    @property
    def quantized(self) -> bool:
        return self.kv_dtype_name == "int8"

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Element type of the cache tensor."""
        if self.kv_dtype_name == "auto":
            return model_dtype
        return getattr(torch, self.kv_dtype_name)

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        if self.quantized:
            if block_size % 2 or head_dim % 2 or head_dim > bindings.MAX_HEAD_DIM:
                raise ValueError(f"--kv-cache-dtype int8 needs an even --block-size (not {block_size}) and an "
                                 f"even head dimension up to {bindings.MAX_HEAD_DIM} (not {head_dim})")
            return (2, num_kv_heads, num_blocks, block_size * head_dim + SCALE_BYTES)
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def bytes_per_block(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        model_dtype: torch.dtype) -> int:
        """Cache bytes one block takes across all layers (keys and values, scales included)."""
        shape = self.kv_cache_shape(1, block_size, num_kv_heads, head_dim)
        n = 1
        for dim in shape:
            n *= dim
        return num_layers * n * self.kv_cache_dtype(model_dtype).itemsize

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 model_dtype: torch.dtype, host: bool = False) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer on the backend's device, on a CPU mapped on first
        write (hostinfo.lazy_zeros: resident memory follows the blocks used). `host=True`: the host pool
        for swapped-out blocks instead, left untouched (a swapped block is always written whole
        before it is read, so pages no block has used stay out of the resident set: 1 GiB of swap
        space costs nothing until requests are swapped out) and pinned when the cache is on a GPU
        (copies to and from it then run at the bus's speed)."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        dtype = self.kv_cache_dtype(model_dtype)
        if host:
            pin = self.device.type == "cuda"
            return [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        if self.device.type == "cpu":
            return [lazy_zeros(shape, dtype) for _ in range(num_layers)]
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    def copy_blocks(self, src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: torch.Tensor,
                    dst_ids: torch.Tensor) -> None:
        """Copy whole blocks between two caches of this layout (swap out / in), across devices."""
        for s, d in zip(src, dst):
            d[:, :, dst_ids.to(d.device)] = s[:, :, src_ids.to(s.device)].to(d.device)

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> AttentionMetadata:
        return build_metadata(self, query_lens, seq_lens, block_tables, block_size)

    def forward_bidirectional(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
        """Encoder attention: every token of a request attends to all of that request's tokens,
        before and after it; `[T, Hq, D]` -> `[T, Hq * D]`. No KV cache is read or written: an
        encoder's keys and values are of no use after its one forward, so each request must be
        whole in this step (its query is its context), which the scheduler guarantees by never
        chunking a pooling request. The same for every backend (one padded SDPA call)."""
        lens = [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in range(meta.num_reqs)]
        if lens != meta.seq_lens:
            raise ValueError("bidirectional attention needs each request whole in its step (no cached context)")
        t, hq, d = q.shape
        sdpa = torch.nn.functional.scaled_dot_product_attention
        b, width = len(lens), max(lens)
        if min(lens) == width:  # all as long (one request, or a batch of equal inputs): views, no copy
            def batched(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
                return x.view(b, width, *x.shape[1:]).transpose(1, 2)

            o = sdpa(batched(q), batched(k.to(q.dtype)), batched(v.to(q.dtype)), scale=scale, enable_gqa=True)
            return o.transpose(1, 2).reshape(t, hq * d)
        rows, mask = _padded_layout(meta, lens)

        def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D], zeros as padding
            out = x.new_zeros((b * width, *x.shape[1:])).index_copy_(0, rows, x)
            return out.view(b, width, *x.shape[1:]).transpose(1, 2)

        o = sdpa(padded(q), padded(k.to(q.dtype)), padded(v.to(q.dtype)), attn_mask=mask, scale=scale,
                 enable_gqa=True)
        return o.transpose(1, 2).reshape(b * width, hq * d).index_select(0, rows)

    def decode_in_c(self, num_heads: int, kv_cache: torch.Tensor) -> bool:
        """Whether a decode step may write and read this cache from C (tessera/kernels/decode_step.c)
        instead of through `forward`: only where that is what `forward` would do, a bfloat16 or float32
        cache in the [2, Hkv, blocks, block_size, D] layout of the paged decode kernel."""
        return False

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: Optional[int],
                key_bias: Optional[KeyBias] = None, softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store k/v `[T, Hkv, D]` at their slots, attend q `[T, Hq, D]`; return `[T, Hq * D]`.
        `key_bias` (quantized caches only; others ignore it): the keys' bias share, kept out of the
        cache and added back in float32. `softcap`: scores become softcap * tanh(score / softcap)
        before the softmax (Gemma 2). `sinks` (gpt-oss's attention sinks): float32 `[Hq]`, one
        logit per query head that joins the softmax's denominator and adds no value, so a query
        may attend to nothing: out = softmax([scores, sink])[:-1] @ v, the unsunk output times
        sigmoid(logsumexp(scores) - sink). Refused with `softcap` (no model has both)."""


def check_sinks(sinks: Optional[torch.Tensor], num_heads: int, softcap: Optional[float],
                device: torch.device) -> Optional[torch.Tensor]:
    """A layer's attention sinks as every backend reads them: float32 `[Hq]`, contiguous, on
    `device`; None for none. Sinks with a soft-cap are refused rather than given a meaning no
    model defines (is the sink capped too?)."""
    if sinks is None:
        return None
    if softcap is not None:
        raise ValueError("attention sinks with a score soft-cap: no model has both, and which of them "
                         "applies to the sink is undefined")
    return attention_ops.sink_logits(sinks, num_heads).to(device)


def _padded_layout(meta: AttentionMetadata, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For bidirectional attention over requests of `lens` tokens packed back to back, padded to
    the longest: the padded row of each packed token ([T]) and a key mask [B, 1, 1, L] (True:
    a real token), built once per step and shared by the layers."""
    key = ("bidirectional", meta.num_tokens)
    if key not in meta._cache:
        width, b, device = max(lens), len(lens), meta.slot_mapping.device
        real = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
        meta._cache[key] = (real.view(-1).nonzero().view(-1), real.view(b, 1, 1, width))
    return meta._cache[key]


# A RoPE pair's bias is taken out of the keys when its norm is over this many times its head's
# median (measured on qwen2.5-coder-1.5b / -0.5b, int8 perplexity against bfloat16: 4x +0.8 / +2.1 %,
# 2x +0.85 / -0.03 %, 1x +0.34 / -0.24 %, every pair +0.35 / +0.20 %; the decode term costs in
# proportion to a head's pairs: 1x, the top half, takes 32 of 64 on the 1.5B).
KEY_BIAS_OUTLIER = 1.0


@dataclass(frozen=True)
class KeyBias:
    """The share of a layer's keys that its key projection's bias contributes on its outlier RoPE
    pairs, RoPE_p(b) at position p (Qwen2), kept out of an int8 cache and added back in float32.

    Why: Qwen2's key bias puts a few channels at 20-500x the median (qwen2.5-coder-1.5b's first
    layer: 540x), so whatever scale a block gets, those channels set it and the others round to
    a few levels (+7.5 % / +5.4 % perplexity on the 0.5B / 1.5B with plain per-block scales).
    Dividing those channels down before rounding (and multiplying the queries' back) trades that
    for their own error, multiplied back (+1.5 % / +16 %). But a key's bias share is known from
    its position alone: the cache stores k - RoPE_p(b_out) (b_out: the bias on the pairs whose
    norm is over KEY_BIAS_OUTLIER times the head's median, zero elsewhere), whose channels are
    alike, and attention adds q . RoPE_p(b_out) back in float32 -- on a dense read as keys
    (prefill), in the decode kernel as a term of each score -- so q.k is what the model computed
    up to the rounding of the residual (docs/models.md, "int8 KV cache"). Only the outlier
    pairs are carried so that the decode term costs a few multiply-adds per key (carrying all of
    them, a second q.k in PyTorch, made qwen2.5-coder-1.5b's decode step 1.2x slower).

    RoPE_p here is the exact rotation (cos/sin of float64 angles, times the rotary's attention
    scaling), not the model's rounded tables: the decode kernel makes it by rotating 16 positions
    at a time instead of reading a table of positions (a 1 MB float32 table at 2,000 tokens, read
    once per layer, had made int8 decode steps slower than bfloat16 ones), and its values stay
    within ~1e-5 of these.
    """

    lo: torch.Tensor  # [Hkv, m] float32: bias of channel pairs[h, i] (zero where not an outlier)
    hi: torch.Tensor  # [Hkv, m] float32: bias of channel pairs[h, i] + D/2
    pairs: torch.Tensor  # [Hkv, m] int64: each KV head's outlier RoPE pairs (ascending, then padding)
    inv_freq: torch.Tensor  # [D/2] float32: the rotary's frequency of each pair
    # positions [T] -> cos, sin [T, D/2] float32 of inv_freq's angles computed in float64 (the
    # model's shared, cached table: layers/rotary.py's RotaryEmbedding.exact_cos_sin)
    table: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def for_layer(cls, bias: torch.Tensor, num_kv_heads: int, head_dim: int, inv_freq: torch.Tensor,
                  table: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                  attention_scaling: float = 1.0) -> Optional["KeyBias"]:
        """A layer's key bias [Hkv * D] under a rotary of `inv_freq` (its exact cos/sin from `table`)
        whose cos/sin are multiplied by `attention_scaling` (YaRN's), or None when no pair stands out."""
        found = cls.outliers(bias, num_kv_heads, head_dim)
        if found is None:
            return None
        lo, hi, pairs = found
        return cls(lo * attention_scaling, hi * attention_scaling, pairs, inv_freq.float().contiguous(), table)

    @staticmethod
    def outliers(bias: torch.Tensor, num_kv_heads: int,
                 head_dim: int) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(`lo`, `hi`, `pairs`) for a key bias [Hkv * D], or None when no pair stands out.

        Each KV head carries its own pairs (the decode term's cost is per pair: a union over the
        heads was 1.5x as many on the Qwen2 models); a head with fewer than the most is padded
        with pairs of its own that are not outliers, their bias share zero."""
        b = bias.detach().float().view(num_kv_heads, head_dim)
        h = head_dim // 2
        norm = torch.sqrt(b[:, :h] ** 2 + b[:, h:2 * h] ** 2)
        big = norm > KEY_BIAS_OUTLIER * norm.median(dim=1, keepdim=True).values.clamp_min(1e-6)
        m = int(big.sum(dim=1).max())
        if m == 0:
            return None
        # A stable sort on "not an outlier" puts each head's outliers first, in channel order.
        pairs = torch.sort((~big).to(torch.int8), dim=1, stable=True).indices[:, :m]
        keep = torch.gather(big, 1, pairs)
        zero = torch.zeros(())
        lo = torch.where(keep, torch.gather(b[:, :h], 1, pairs), zero)
        hi = torch.where(keep, torch.gather(b[:, h:2 * h], 1, pairs), zero)
        return lo.contiguous(), hi.contiguous(), pairs.contiguous()

    @functools.cached_property
    def _rotation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(basis [D/2, 2, 16]: cos, sin of l f_p for l < 16; step [D/2, 2]: cos, sin of 16 f_p)."""
        c, s = self.table(torch.arange(16))
        c16, s16 = self.table(torch.tensor([16]))
        return (torch.stack([c.t(), s.t()], dim=1).contiguous(),
                torch.stack([c16[0], s16[0]], dim=1).contiguous())

    def kernel_args(self, positions: torch.Tensor, cache: dict) -> attention_ops.KeyBiasArgs:
        """What the int8 kernels take for a step whose keys sit at `positions` [T] (their cos/sin
        made once per step and shared by every layer through `cache`, the step metadata's)."""
        key = ("key_bias_rows", self.inv_freq.data_ptr())
        rows = cache.get(key)
        if rows is None:
            rows = cache[key] = self.table(positions)
        basis, step = self._rotation
        return attention_ops.KeyBiasArgs(self.lo, self.hi, self.pairs, self.inv_freq, basis, step, *rows)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE_p(b) at each of `positions` [T]: [T, Hkv, D] float32, zero off the outlier pairs."""
        h = self.inv_freq.shape[0]
        t, (hkv, m) = positions.shape[0], self.pairs.shape
        cos, sin = self.table(positions)
        flat = self.pairs.flatten()
        c, s = cos[:, flat].view(t, hkv, m), sin[:, flat].view(t, hkv, m)
        out = torch.zeros(t, hkv, 2 * h)
        at = self.pairs.expand(t, hkv, m)  # a head's pairs are distinct: no two writes collide
        out.scatter_(2, at, self.lo * c - self.hi * s)
        out.scatter_(2, at + h, self.hi * c + self.lo * s)
        return out

    def context_keys(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """RoPE_p(b) for p in [0, length), transformed as the cache stores keys: [Hkv, 1, length, D],
        to add to dequantized keys [Hkv, B, length, D]."""
        rows = self.at(torch.arange(length)) @ key_rotation(2 * self.inv_freq.shape[0])
        return rows.transpose(0, 1).unsqueeze(1).to(dtype)


def step_positions(meta: "AttentionMetadata") -> torch.Tensor:
    """Position of each of the step's tokens [T] (a request's queries end at its context length)."""
    pos = meta._cache.get("positions")
    if pos is None:
        qsl, lens = meta.query_start_loc, meta.seq_lens
        pos = meta._cache["positions"] = torch.cat(
            [torch.arange(lens[i] - (qsl[i + 1] - qsl[i]), lens[i]) for i in range(len(lens))])
    return pos


def rotation_is_hadamard(head_dim: int) -> bool:
    """Whether `key_rotation(head_dim)` is the normalized Sylvester Hadamard matrix (which the
    kernels apply by butterflies instead of a matrix product)."""
    return head_dim & (head_dim - 1) == 0


@functools.lru_cache(maxsize=None)
def key_rotation(head_dim: int) -> torch.Tensor:
    """The orthogonal [D, D] float32 matrix keys are multiplied by before int8 rounding (and queries
    before they meet them): q.k = (qR).(kR), so attention is unchanged, while outlier channels are
    spread over all of them instead of setting every block's scale. A normalized Hadamard matrix for
    powers of two (QuaRot's choice), else a seeded random orthogonal one. A constant of the format:
    the same R for every layer and process."""
    if rotation_is_hadamard(head_dim):
        r = torch.ones(1, 1)
        while r.shape[0] < head_dim:
            r = torch.cat([torch.cat([r, r], 1), torch.cat([r, -r], 1)], 0)
        return (r / head_dim ** 0.5).contiguous()
    gen = torch.Generator().manual_seed(head_dim)
    r, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    return r.float().contiguous()


def transform_for_cache(x: torch.Tensor) -> torch.Tensor:
    """Queries or keys [T, H, D] as an int8 cache meets them: x @ R, in x's dtype."""
    return x @ key_rotation(x.shape[-1]).to(x.dtype)


def rotate_for_cache(kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, meta: "AttentionMetadata",
                     key_bias: Optional[KeyBias]) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as an int8 cache stores and reads keys (k less its bias share, both rotated);
    unchanged for other caches. Every read of an int8 cache goes through the stored keys, so every
    query is transformed."""
    if not is_quantized(kv_cache):
        return q, k
    if key_bias is not None:
        k = k.float() - key_bias.at(step_positions(meta))
    return transform_for_cache(q), transform_for_cache(k)


def add_key_bias(keys: torch.Tensor, key_bias: Optional[KeyBias]) -> torch.Tensor:
    """Dequantized keys [Hkv, B, L, D] (positions 0..L-1) with their bias share put back."""
    if key_bias is None:
        return keys
    return keys + key_bias.context_keys(keys.shape[2], keys.dtype)


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether a layer's cache is in the int8 block format (see the module docstring)."""
    return kv_cache.dtype == torch.int8


def dequantize_blocks(rows: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """int8 block rows `[2, ..., block_size * D + 4]` (keys, values) -> `[2, ..., block_size, D]` in
    `dtype`, undoing the pair-interleaved order the kernels keep them in (kv_int8.c)."""
    data = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [2, ..., 1]
    vals = data.to(dtype) * scale.to(dtype)
    lead, d = vals.shape[1:-1], vals.shape[-1] // block_size
    keys = vals[0].view(*lead, d // 2, block_size, 2).transpose(-3, -2).reshape(*lead, block_size, d)
    values = vals[1].view(*lead, block_size // 2, d, 2).transpose(-2, -1).reshape(*lead, block_size, d)
    return torch.stack([keys, values])


def read_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, block_size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The keys and values of some blocks, `[2, Hkv, n, block_size, D]` in `dtype`, any cache format."""
    rows = kv_cache[:, :, block_ids]
    if is_quantized(kv_cache):
        return dequantize_blocks(rows, block_size, dtype)
    return rows.to(dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's keys and values at their slots, in the cache's format."""
    if is_quantized(kv_cache):
        attention_ops.kv_write_int8(kv_cache, k, v, meta.slot_mapping, meta.block_size)
        return
    _, h, nb, bs, d = kv_cache.shape
    flat = kv_cache.view(2, h * nb * bs, d)
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if h == 1:
        flat[0].index_copy_(0, meta.slot_mapping, k[:, 0])
        flat[1].index_copy_(0, meta.slot_mapping, v[:, 0])
        return
    # One index_copy per K and V over all heads: head i's slots are offset by i * nb * bs.
    key = ("kv_slots", h, nb * bs)
    idx = meta._cache.get(key)
    if idx is None:
        idx = (meta.slot_mapping.unsqueeze(0)
               + torch.arange(h, device=meta.slot_mapping.device).unsqueeze(1) * (nb * bs)).reshape(-1)
        meta._cache[key] = idx
    flat[0].index_copy_(0, idx, k.transpose(0, 1).reshape(-1, d))
    flat[1].index_copy_(0, idx, v.transpose(0, 1).reshape(-1, d))
