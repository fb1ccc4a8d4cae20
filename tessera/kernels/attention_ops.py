"""Tensor wrappers of the attention kernels: paged decode attention over bfloat16, float32 or
int8 caches (paged_attention.c, kv_int8.c), the int8 cache's writes (kv_int8.c) and paged
prefill attention (prefill_attention.c)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from tessera.kernels.bindings import (MAX_BLOCK_SIZE, MAX_GROUP, MAX_HEAD_DIM, MAX_KEY_BIAS_PAIRS, PREFILL_MAX_HEAD_DIM,
                                      ROT_HADAMARD, ROT_MATRIX, ROT_NONE)
from tessera.kernels.library import KernelUnavailable, calls


def supports(num_heads: int, kv_cache: torch.Tensor) -> bool:
    """Whether the paged decode kernel handles this head count and cache (else use PyTorch).

    An int8 cache ([2, Hkv, blocks, block_size * D + 4], see kv_int8.c) takes any block size; the
    head dimension is checked by its writes, which have no PyTorch path to fall back on."""
    if kv_cache.dtype == torch.int8:
        return num_heads // kv_cache.shape[1] <= MAX_GROUP
    _, hkv, _, bs, d = kv_cache.shape
    return (d <= MAX_HEAD_DIM and num_heads // hkv <= MAX_GROUP and bs <= MAX_BLOCK_SIZE
            and kv_cache.dtype in (torch.bfloat16, torch.float32))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] as rows the kernels read in place: heads and elements contiguous, rows strided."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def sink_logits(sinks: Optional[torch.Tensor], num_heads: int) -> Optional[torch.Tensor]:
    """Attention sinks as the kernels read them (`sinks` of the attention kernels, and every
    backend): [Hq] float32, contiguous, on their own device; None for none."""
    if sinks is None:
        return None
    if sinks.numel() != num_heads:
        raise ValueError(f"attention sinks: one logit per query head ({num_heads}), not {tuple(sinks.shape)}")
    return sinks.detach().reshape(num_heads).to(torch.float32).contiguous()


class KeyBiasArgs(NamedTuple):
    """A key bias's share on its outlier RoPE pairs, as the int8 kernels take it (kv_int8.c's
    key_bias_t): pair i of KV head h is channels (pairs[h, i], pairs[h, i] + D/2) with bias
    (lo[h, i], hi[h, i]); its share of a key at position t is RoPE_t of that bias, with frequency
    freqs[p] on pair p. Writes read cos/sin of their rows' angles from row_cos/row_sin; decode makes
    them by rotation from basis (cos, sin of l * f_p for l < 16) and step (cos, sin of 16 f_p)."""

    lo: torch.Tensor  # [Hkv, m] float32
    hi: torch.Tensor  # [Hkv, m] float32
    pairs: torch.Tensor  # [Hkv, m] int64, m <= MAX_KEY_BIAS_PAIRS
    freqs: torch.Tensor  # [D/2] float32
    basis: torch.Tensor  # [D/2, 2, 16] float32
    step: torch.Tensor  # [D/2, 2] float32
    row_cos: torch.Tensor  # [T, D/2] float32: the step's rows (those kv_write_int8 writes)
    row_sin: torch.Tensor


def _key_bias_ptrs(kb: Optional[KeyBiasArgs], write: bool) -> dict:
    """The kb_* arguments of kv_write_int8 (`write`) or paged_decode_attention_int8."""
    tables = ("kb_row_cos", "kb_row_sin") if write else ("kb_freqs", "kb_basis", "kb_step")
    if kb is None:
        return dict(kb_lo=None, kb_hi=None, kb_pairs=None, kb_m=0, **dict.fromkeys(tables))
    m = kb.pairs.shape[-1]
    if m > MAX_KEY_BIAS_PAIRS:
        raise KernelUnavailable(f"at most {MAX_KEY_BIAS_PAIRS} key-bias pairs per head, not {m}")
    for t in kb:
        if not t.is_contiguous():
            raise ValueError("KeyBiasArgs tensors must be contiguous")
    return dict(kb_lo=kb.lo.data_ptr(), kb_hi=kb.hi.data_ptr(), kb_pairs=kb.pairs.data_ptr(), kb_m=m,
                **{name: getattr(kb, name[3:]).data_ptr() for name in tables})


def _rotation(rot: Optional[torch.Tensor], hadamard: bool) -> tuple:
    """kv_int8.c's (rot, rot_kind): the normalized Sylvester Hadamard matrix is applied by
    butterflies (`rot` unused), any other [D, D] float32 matrix as a product, None not at all."""
    if hadamard:
        return None, ROT_HADAMARD
    return (None, ROT_NONE) if rot is None else (rot.data_ptr(), ROT_MATRIX)


def kv_write_int8(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                  block_size: int, k_rot: Optional[torch.Tensor] = None,
                  key_bias: Optional[KeyBiasArgs] = None, hadamard: bool = False) -> None:
    """Quantize k, v [T, Hkv, D] (bfloat16 or float32, row-strided views allowed) into an int8 cache
    [2, Hkv, blocks, block_size * D + 4] at `slots` [T] (int64), growing block scales (kv_int8.c).
    Keys first lose `key_bias`'s share (its rows: the keys'), then are transformed to k @ k_rot
    (float32 [D, D]) if given, or by the normalized Hadamard matrix if `hadamard`."""
    if key_bias is not None and key_bias.row_cos.shape[0] != k.shape[0]:
        raise ValueError("a key bias needs one row of cos/sin per key")
    lib = calls()
    t, hkv, d = k.shape
    if v.dtype != k.dtype or k.dtype not in (torch.bfloat16, torch.float32):
        k, v = k.float(), v.float()
    k, v = _rows(k), _rows(v)
    slots = slots.contiguous()
    k_rot, rot_kind = _rotation(k_rot, hadamard)
    if lib.kv_write_int8(
            cache=kv_cache.data_ptr(), k=k.data_ptr(), k_stride=k.stride(0), v=v.data_ptr(), v_stride=v.stride(0),
            is_bf16=int(k.dtype == torch.bfloat16), slots=slots.data_ptr(), T=t, Hkv=hkv, D=d,
            num_blocks=kv_cache.shape[2], block_size=block_size, k_rot=k_rot, rot_kind=rot_kind,
            **_key_bias_ptrs(key_bias, write=True)) != 0:
        raise KernelUnavailable(f"kv_write_int8 takes head_dim <= {MAX_HEAD_DIM}, not {d}")


def decode_int8_scratch(b: int, num_heads: int, max_len: int, block_size: int) -> torch.Tensor:
    """Scratch for `paged_decode_attention_int8` (float32 scores, then weights, per query head)."""
    padded = -(-max_len // block_size) * block_size
    return torch.empty(b * num_heads * padded * 4, dtype=torch.uint8)


def paged_decode_attention_int8(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                seq_lens: torch.Tensor, max_len: int, block_size: int, scale: float,
                                window: Optional[int], scratch: Optional[torch.Tensor] = None,
                                q_rot: Optional[torch.Tensor] = None,
                                key_bias: Optional[KeyBiasArgs] = None, hadamard: bool = False,
                                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`paged_decode_attention` over an int8 cache [2, Hkv, blocks, block_size * D + 4]; -> [B, Hq, D]
    in q's dtype (bfloat16 or float32). `scratch` from `decode_int8_scratch` (reused across layers);
    q is first transformed like the stored keys, q @ q_rot (float32 [D, D]) or by the normalized
    Hadamard matrix if `hadamard`; `key_bias`'s share of the keys (kept out of the cache) is added
    back to each score; `sinks` as `paged_decode_attention`'s."""
    lib = calls()
    b, hq, d = q.shape
    hkv = kv_cache.shape[1]
    if d > MAX_HEAD_DIM or d % 2 or block_size % 2 or hq // hkv > MAX_GROUP:
        raise KernelUnavailable(f"unsupported shape (head_dim {d}, block size {block_size}, group {hq // hkv})")
    if q.dtype not in (torch.bfloat16, torch.float32):
        q = q.float()
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    tables = block_tables.contiguous()
    out = torch.empty(b, hq, d, dtype=q.dtype)
    if scratch is None or scratch.nbytes < b * hq * 4 * (-(-max_len // block_size) * block_size):
        scratch = decode_int8_scratch(b, hq, max_len, block_size)
    q_rot, rot_kind = _rotation(q_rot, hadamard)
    sinks = sink_logits(sinks, hq)
    lib.paged_decode_attention_int8(
        q=q.data_ptr(), q_stride=q.stride(0), q_is_bf16=int(q.dtype == torch.bfloat16), cache=kv_cache.data_ptr(),
        block_tables=tables.data_ptr(), seq_lens=seq_lens.data_ptr(), out=out.data_ptr(), B=b, Hq=hq, Hkv=hkv, D=d,
        num_blocks=kv_cache.shape[2], block_size=block_size, max_blocks=tables.shape[1], scale=scale,
        window=window or 0, sinks=_ptr(sinks), scratch=scratch.data_ptr(), max_len=max_len, q_rot=q_rot,
        rot_kind=rot_kind,
        **_key_bias_ptrs(key_bias, write=False))
    return out


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, max_len: int, scale: float, window: Optional[int],
                           scratch: Optional[torch.Tensor] = None,
                           sinks: Optional[torch.Tensor] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """q [B, Hq, D] against each request's cached context -> [B, Hq, D] in the cache's dtype.

    q may be a row-strided view (e.g. the Q part of a fused QKV output) as long as each row's heads
    are contiguous. kv_cache [2, Hkv, num_blocks, block_size, D] (bfloat16 or float32), block_tables
    [B, max_blocks] int64, seq_lens [B] int64 (context including the new token); `scratch`, if given,
    holds at least B * Hq * max_len float32 (callers reuse one across the layers of a step). `sinks`
    [Hq] (gpt-oss): a logit per query head that joins its softmax's denominator and adds no value.
    `softcap` (Gemma 2): scores become softcap * tanh(score / softcap) before the softmax.
    """
    lib = calls()
    b, hq, d = q.shape
    hkv = kv_cache.shape[1]
    if not supports(hq, kv_cache):
        raise KernelUnavailable(f"unsupported shape or dtype (head_dim {d}, group {hq // hkv}, block size "
                                f"{kv_cache.shape[3]}, {kv_cache.dtype})")
    if q.dtype != kv_cache.dtype or q.stride(2) != 1 or q.stride(1) != d:
        q = q.to(kv_cache.dtype).contiguous()
    tables = block_tables.contiguous()
    out = torch.empty(b, hq, d, dtype=kv_cache.dtype)
    if scratch is None or scratch.numel() < b * hq * max_len:
        scratch = torch.empty(b * hq * max_len, dtype=torch.float32)
    sinks = sink_logits(sinks, hq)
    lib.paged_decode_attention(
        q=q.data_ptr(), q_stride=q.stride(0), cache=kv_cache.data_ptr(), is_bf16=int(kv_cache.dtype == torch.bfloat16),
        block_tables=tables.data_ptr(), seq_lens=seq_lens.data_ptr(), out=out.data_ptr(), B=b, Hq=hq, Hkv=hkv, D=d,
        num_blocks=kv_cache.shape[2], block_size=kv_cache.shape[3], max_blocks=tables.shape[1], scale=scale,
        softcap=softcap or 0.0, window=window or 0, sinks=_ptr(sinks), scratch=scratch.data_ptr(), max_len=max_len)
    return out


def prefill_supported(num_heads: int, kv_cache: torch.Tensor) -> bool:
    """Whether `paged_prefill_attention` takes this cache and head count: bfloat16 [2, Hkv, blocks,
    block_size, D] with D a multiple of 32 up to 256 and at most MAX_GROUP query heads per KV head
    (the kernel itself also needs AVX512-BF16, and says so by raising KernelUnavailable)."""
    if kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 5:
        return False
    hkv, d = kv_cache.shape[1], kv_cache.shape[4]
    return d % 32 == 0 and d <= PREFILL_MAX_HEAD_DIM and num_heads % hkv == 0 and num_heads // hkv <= MAX_GROUP


class PrefillPlan(NamedTuple):
    """A step's prefill requests as `paged_prefill_attention` reads them, built once per step and
    shared by its layers: row offsets [B + 1] (from the first prefill row), context lengths [B] and
    block tables [B, max_blocks], all int64. The kernel keeps no copy of the contexts (each thread
    copies 64 keys at a time), so any context length takes it."""

    q_start: torch.Tensor
    seq_lens: torch.Tensor
    tables: torch.Tensor
    window: int

    @classmethod
    def build(cls, q_start: list[int], seq_lens: list[int], tables: torch.Tensor,
              window: Optional[int]) -> "PrefillPlan":
        return cls(torch.tensor(q_start, dtype=torch.long), torch.tensor(seq_lens, dtype=torch.long),
                   tables.contiguous(), window or 0)


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan: PrefillPlan, scale: float,
                            out: Optional[torch.Tensor] = None,
                            sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of prefill rows q [T, Hq, D] (bfloat16; a row-strided view is read in
    place) over their requests' cached context, the step's own keys and values already written
    (prefill_attention.c) -> [T, Hq, D] bfloat16, into `out` (contiguous) if given. Row i of
    request b sits at position seq_lens[b] - (its row count) + i. `sinks` as
    `paged_decode_attention`'s."""
    lib = calls()
    t, hq, d = q.shape
    hkv = kv_cache.shape[1]
    if not prefill_supported(hq, kv_cache) or q.dtype != torch.bfloat16:
        raise KernelUnavailable(f"unsupported prefill attention (head_dim {d}, group {hq // max(hkv, 1)}, "
                                f"{kv_cache.dtype} cache, {q.dtype} queries)")
    q = _rows(q)
    if out is None:
        out = torch.empty(t, hq, d, dtype=torch.bfloat16)
    assert out.is_contiguous() and out.shape == (t, hq, d) and out.dtype == torch.bfloat16
    if int(plan.q_start[-1]) != t:
        raise ValueError(f"the plan covers {int(plan.q_start[-1])} rows, the queries {t}")
    sinks = sink_logits(sinks, hq)
    rc = lib.paged_prefill_attention_bf16(
        q=q.data_ptr(), q_stride=q.stride(0), cache=kv_cache.data_ptr(), block_tables=plan.tables.data_ptr(),
        max_blocks=plan.tables.shape[1], q_start=plan.q_start.data_ptr(), seq_lens=plan.seq_lens.data_ptr(),
        out=out.data_ptr(), B=len(plan.seq_lens), Hq=hq, Hkv=hkv, D=d, num_blocks=kv_cache.shape[2],
        block_size=kv_cache.shape[3], scale=scale, window=plan.window, sinks=_ptr(sinks))
    if rc == -2:
        raise MemoryError("paged_prefill_attention: no memory for the threads' buffers")
    if rc != 0:
        raise KernelUnavailable("paged_prefill_attention needs AVX512-BF16 on the build machine")
    return out
