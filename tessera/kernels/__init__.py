"""Small C kernels for what PyTorch's CPU operators cannot do well, built for the host CPU.

They are compiled once (by `scripts/install.sh`, or on first use) with the
system C compiler into `$TESSERA_HOME/kernels` (default ~/.cache/tessera/kernels),
named by a hash of the source and flags, and loaded with ctypes. They run on
PyTorch's own OpenMP thread pool: the library asks for `libgomp.so.1`, which
torch has already loaded, so both share one team of threads. Where no compiler
is found, callers fall back to PyTorch operators (and say so in the log).

The interface is declared once in C, in `tessera_kernels.h` (every exported function, the limits
and kinds callers must respect, the decode step's structs), and mirrored once in Python, in
`bindings.py`; tests/test_kernel_bindings.py holds the two together. `library.py` builds and
loads the library; this module wraps each kernel for tensors.

    python -m tessera.kernels build    # compile now (what install.sh runs)
"""
from __future__ import annotations

import ctypes
import logging
from typing import NamedTuple, Optional

import torch

from tessera.kernels.bindings import (INT4_F32_MAX_ROWS, INT4_GEMM_MAX_ROWS, INT8_GEMM_MAX_ROWS,  # noqa: F401
                                      INT8_GEMV_MAX_ROWS, KQUANT_MAX_ROWS, MXFP4_MAX_ROWS, LINEAR_INT4, LINEAR_INT4_I8, LINEAR_INT8,
                                      LINEAR_Q4K, LINEAR_Q6K, MAX_BLOCK_SIZE, MAX_GROUP, MAX_HEAD_DIM,
                                      MAX_KEY_BIAS_PAIRS, MAX_NORM_HIDDEN, PREFILL_MAX_HEAD_DIM, ROT_HADAMARD,
                                      ROT_MATRIX, ROT_NONE, DecodeDims, DecodeLayer, LinearOperand, LoRAStep)
from tessera.kernels.library import (CFLAGS, HEADERS, SOURCES, KernelUnavailable, available, build,  # noqa: F401
                                     calls, kernel_dir, library_path, load, main)

logger = logging.getLogger(__name__)


def bf16_matmuls() -> bool:
    """Whether the few-row AVX512-BF16 matrix kernels (int8_gemm_bf16,
    int4_gemm_bf16) run here; the others have portable paths and only need `available()`."""
    return available() is None and bool(load().tessera_avx512_bf16())


def int4_i8_matmuls() -> bool:
    """Whether the int8-activation int4 kernel (int4_gemm_i8: AVX512-VNNI dot products, VBMI byte
    permutes, bfloat16 out) runs here."""
    return available() is None and bool(load().tessera_int4_i8())


def avx2_matmuls() -> bool:
    """Whether the float32 AVX2 + FMA int4 kernel (int4_gemm_f32) runs here: hosts without
    AVX-512, where PyTorch's int4pack kernel is the slow path (see int4_avx2.c)."""
    return available() is None and bool(load().tessera_avx2_fma())


def kquant_matmuls() -> bool:
    """Whether the K-quant kernels' vector paths (AVX512-BW, AVX2, or NEON's dot products) run here
    (kquant_gemm.c): without them the native Q6_K / Q4_K storage would multiply in a plain C loop,
    so those tensors keep the int8 and int4 layouts."""
    return available() is None and bool(load().tessera_kquant_vector())


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
                           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, Hq, D] against each request's cached context -> [B, Hq, D] in the cache's dtype.

    q may be a row-strided view (e.g. the Q part of a fused QKV output) as long as each row's heads
    are contiguous. kv_cache [2, Hkv, num_blocks, block_size, D] (bfloat16 or float32), block_tables
    [B, max_blocks] int64, seq_lens [B] int64 (context including the new token); `scratch`, if given,
    holds at least B * Hq * max_len float32 (callers reuse one across the layers of a step). `sinks`
    [Hq] (gpt-oss): a logit per query head that joins its softmax's denominator and adds no value.
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
        window=window or 0, sinks=_ptr(sinks), scratch=scratch.data_ptr(), max_len=max_len)
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


NORM_DTYPES = (torch.bfloat16, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of bfloat16 or float32 rows [T, H]; with `residual`, first residual += x in place
    and normalise that. Contiguous inputs of one dtype in NORM_DTYPES, H <= MAX_NORM_HIDDEN."""
    lib = load()
    out = torch.empty_like(x)
    fn = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm_f32
    fn(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                      out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for bfloat16 rows [T, 2I] of [gate | up] -> [T, I], in one pass (roundings
    as F.silu then a multiply: bfloat16 after each)."""
    assert gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
    gate_up = gate_up.contiguous()
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), dtype=torch.bfloat16)
    load().silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), t, i)
    return out


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32, M <= 8) @ W.T -> [M, N] in x's dtype, where W [N, K] is the int8
    `weight` times float32 `scale` [N, K/G] (plus `zero` [N, K/G]) per group of G = K / (K/G)
    values, G a multiple of 16 (see int8_gemv.c)."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, weight.shape[0], dtype=x.dtype)
    scratch = torch.empty(m * k, dtype=torch.float32)
    if lib.int8_gemv(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), _ptr(zero), out.data_ptr(), m,
                     weight.shape[0], k, k // scale.shape[1], int(x.dtype == torch.bfloat16), scratch.data_ptr()) != 0:
        raise KernelUnavailable(f"int8_gemv takes at most {INT8_GEMV_MAX_ROWS} rows and groups of a multiple "
                                f"of 16 values (got {m} rows, groups of {k // scale.shape[1]})")
    return out


def int8_gemm_bf16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A few bfloat16 rows [M, K] (M <= INT8_GEMM_MAX_ROWS, K a multiple of 32) @ W.T -> [M, N]
    bfloat16, W as `int8_gemv` reads it (see int8_gemv.c)."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, weight.shape[0], dtype=torch.bfloat16)
    if lib.int8_gemm_bf16(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), _ptr(zero), out.data_ptr(), m,
                          weight.shape[0], k, k // scale.shape[1]) != 0:
        raise KernelUnavailable(f"int8_gemm_bf16 needs AVX-512 BF16, at most {INT8_GEMM_MAX_ROWS} rows and K "
                                f"a multiple of 32 (got {m} x {k})")
    return out


def int4_gemm_bf16(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, out_rows: int) -> torch.Tensor:
    """A few bfloat16 rows [M, K] times an int4pack weight (see int4_gemv.c) -> [M, out_rows] bfloat16."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, out_rows, dtype=torch.bfloat16)
    scratch = torch.empty(m * (k // 32), dtype=torch.float32)
    if lib.int4_gemm_bf16(x.data_ptr(), packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), m,
                          scales_zeros.shape[1], out_rows, k, scratch.data_ptr()) != 0:
        raise KernelUnavailable("int4_gemm_bf16 needs AVX-512 BF16 on the build machine")
    return out


def int4_gemm_i8(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, out_rows: int) -> torch.Tensor:
    """bfloat16 rows [M, K] times an int4pack weight -> [M, out_rows] bfloat16, the rows quantized to
    int8 per group of 32 on the way in (see int4_gemv.c): exact integer products of the codes."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, out_rows, dtype=torch.bfloat16)
    scratch = torch.empty(lib.int4_i8_scratch_bytes(m, k), dtype=torch.uint8)
    if lib.int4_gemm_i8(x.data_ptr(), packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), m,
                        scales_zeros.shape[1], out_rows, k, scratch.data_ptr()) != 0:
        raise KernelUnavailable("int4_gemm_i8 needs AVX512-VNNI and VBMI on the build machine")
    return out


def int4_gemm_f32(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, out_rows: int) -> torch.Tensor:
    """float32 rows [M, K] (M <= INT4_F32_MAX_ROWS) times an int4pack weight in the AVX2 layout,
    float32 scales and zeros (see int4_avx2.c) -> [M, out_rows] float32."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, out_rows, dtype=torch.float32)
    if lib.int4_gemm_f32(x.data_ptr(), packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), m,
                         scales_zeros.shape[1], out_rows, k) != 0:
        raise KernelUnavailable(f"int4_gemm_f32 needs AVX2 + FMA, at most {INT4_F32_MAX_ROWS} rows and K a "
                                f"multiple of 32 (got {m} x {k})")
    return out


def _kquant(fn_name: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, floats: torch.Tensor,
            out_rows: int) -> torch.Tensor:
    lib = load()
    m, k = x.shape
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    out = torch.empty(m, out_rows, dtype=x.dtype)
    scratch = torch.empty(lib.kquant_scratch_bytes(m, k), dtype=torch.uint8)
    if getattr(lib, fn_name)(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), floats.data_ptr(), out.data_ptr(), m,
                             out_rows, k, int(x.dtype == torch.bfloat16), scratch.data_ptr()) != 0:
        raise KernelUnavailable(f"{fn_name} takes 1-{KQUANT_MAX_ROWS} rows and K a multiple of 256 (got {m} x {k})")
    return out


def q6k_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32, M <= KQUANT_MAX_ROWS, K a multiple of 256) @ W.T -> [M, N] in
    x's dtype, W a Q6_K matrix as `GGUFWeight.q6k_blocks` lays it out; x is quantized to int8 per
    256 values on the way in (see kquant_gemm.c)."""
    return _kquant("q6k_gemm", x, codes, scales, d, d.shape[0])


def q4k_gemm(x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """As `q6k_gemm` for a Q4_K matrix as `GGUFWeight.q4k_blocks` lays it out."""
    return _kquant("q4k_gemm", x, codes, scale_min, dm, dm.shape[0])


def kquant_dequant_bf16(kind: str, codes: torch.Tensor, scales: torch.Tensor, floats: torch.Tensor,
                        in_features: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense bfloat16 weight [N, K] of a `kind` ("q6_k" or "q4_k") matrix as q6k_gemm /
    q4k_gemm read it: the float32 values rounded once (see kquant_dequant.c); into `out` if given."""
    n = floats.shape[0]
    if out is None:
        out = torch.empty(n, in_features, dtype=torch.bfloat16)
    assert out.shape == (n, in_features) and out.dtype == torch.bfloat16 and out.is_contiguous()
    fn = load().q6k_dequant_bf16 if kind == "q6_k" else load().q4k_dequant_bf16
    fn(codes.data_ptr(), scales.data_ptr(), floats.data_ptr(), out.data_ptr(), n, in_features)
    return out


def kquant_dequant_int8(kind: str, codes: torch.Tensor, scales: torch.Tensor, floats: torch.Tensor,
                        in_features: int, out: Optional[torch.Tensor] = None,
                        columns: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight of a `kind` ("q6_k" or "q4_k") matrix, its columns times `columns` [K] float32 if
    given, requantized to int8 per row for int8 x int8 products: ([N, K] int8 (`out` if given),
    [N] float32 row scales), w * columns ~ q * scale (see kquant_dequant.c)."""
    n = floats.shape[0]
    if out is None:
        out = torch.empty(n, in_features, dtype=torch.int8)
    assert out.shape == (n, in_features) and out.dtype == torch.int8 and out.is_contiguous()
    row_scales = torch.empty(n, dtype=torch.float32)
    fn = load().q6k_dequant_int8 if kind == "q6_k" else load().q4k_dequant_int8
    col = None if columns is None else columns.float().contiguous()
    fn(codes.data_ptr(), scales.data_ptr(), floats.data_ptr(), None if col is None else col.data_ptr(), out.data_ptr(),
       row_scales.data_ptr(), n, in_features)
    return out, row_scales


def mxfp4_gemm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32, M <= MXFP4_MAX_ROWS, K a multiple of 32) @ W.T -> [M, N] in x's
    dtype, W an MXFP4 matrix as the GGUF file stores it (`blocks` [N, K/32 * 17] uint8); x is
    quantized to int8 per 32 values on the way in (see mxfp4_gemm.c)."""
    lib = load()
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    scratch = torch.empty(lib.mxfp4_scratch_bytes(m, k), dtype=torch.uint8)
    if blocks.shape[1] * 32 != k * 17 or lib.mxfp4_gemm(x.data_ptr(), blocks.data_ptr(), out.data_ptr(), m, n, k,
                                                       int(x.dtype == torch.bfloat16), scratch.data_ptr()) != 0:
        raise KernelUnavailable(f"mxfp4_gemm takes 1-{MXFP4_MAX_ROWS} rows, K a multiple of 32 and 17 bytes a "
                                f"block (got {m} x {k}, blocks {tuple(blocks.shape)})")
    return out


def mxfp4_dequant(blocks: torch.Tensor, in_features: int, dtype: torch.dtype,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense weight [N, K] in `dtype` (float32 or bfloat16) of MXFP4 `blocks` [N, K/32 * 17] as
    mxfp4_gemm reads them (see mxfp4_gemm.c); into `out` if given."""
    n = blocks.shape[0]
    assert blocks.is_contiguous() and blocks.shape[1] * 32 == in_features * 17
    if out is None:
        out = torch.empty(n, in_features, dtype=dtype)
    assert out.shape == (n, in_features) and out.dtype == dtype and out.is_contiguous()
    assert dtype in (torch.float32, torch.bfloat16)
    load().mxfp4_dequant(blocks.data_ptr(), out.data_ptr(), n, in_features, int(dtype == torch.bfloat16))
    return out


def int8_matmul(x: torch.Tensor, wq: torch.Tensor, row_scales: torch.Tensor,
                acc: Optional[torch.Tensor] = None, columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32) @ (wq [N, K] int8 * row_scales [N]).T -> [M, N] in x's dtype:
    x quantized to int8 per row, the product exact in int32 (torch._int_mm, oneDNN's VNNI
    kernels; into `acc` [M, N] int32 if given), scaled once in float32 (kquant_gemm.c's
    int8_quantize_rows, int8_scale_products). `columns` [K]: x's columns are divided by these
    before rounding (the weight's were multiplied by them: kquant_dequant_int8)."""
    lib = load()
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    m, k = x.shape
    is_bf16 = int(x.dtype == torch.bfloat16)
    xq = torch.empty(m, k, dtype=torch.int8)
    token_scales = torch.empty(m, dtype=torch.float32)
    col = None if columns is None else columns.float().contiguous()
    lib.int8_quantize_rows(x.data_ptr(), is_bf16, None if col is None else col.data_ptr(), xq.data_ptr(),
                           token_scales.data_ptr(), m, k)
    acc = torch._int_mm(xq, wq.t(), out=acc) if acc is not None else torch._int_mm(xq, wq.t())
    out = torch.empty(m, wq.shape[0], dtype=x.dtype)
    lib.int8_scale_products(acc.data_ptr(), token_scales.data_ptr(), row_scales.data_ptr(), out.data_ptr(), is_bf16,
                            m, wq.shape[0])
    return out


def decode_step_workspace_bytes(layers: "ctypes.Array[DecodeLayer]", dims: DecodeDims, rows: int, max_len: int) -> int:
    return load().decode_step_workspace_bytes(ctypes.addressof(layers), len(layers), ctypes.byref(dims), rows, max_len)


def decode_step_bf16(layers: "ctypes.Array[DecodeLayer]", dims: DecodeDims, final_norm: torch.Tensor,
                     x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int, slots: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                     workspace: torch.Tensor, lora: Optional[LoRAStep] = None) -> bool:
    """Run every layer of a llama-family decode step over x [M, H] bfloat16 in place (embeddings in,
    the final norm's output out); see decode_step.c. cos/sin [M, D] bfloat16, slots [M] and seq_lens
    [M] int64, block_tables [M, max_blocks] int64, all contiguous; `workspace` at least
    decode_step_workspace_bytes; `lora`: the rows' adapters, or None. False when a kernel refused its
    arguments."""
    return calls().decode_step_bf16(
        layers=ctypes.addressof(layers), L=len(layers), d=ctypes.byref(dims), final_norm=final_norm.data_ptr(),
        M=x.shape[0], x=x.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), half=half, slots=slots.data_ptr(),
        block_tables=block_tables.data_ptr(), seq_lens=seq_lens.data_ptr(), max_len=max_len,
        workspace=workspace.data_ptr(), lora=None if lora is None else ctypes.addressof(lora)) == 0


def lora_add(x: torch.Tensor, y: torch.Tensor, row_slots: int, a_ptrs: int, b_ptrs: int, ranks: int,
             num_slots: int, part_ends: int, num_parts: int, scratch: int, t_stride: int, weights_bf16: bool) -> None:
    """y[m] += Bt_s^T (At_s^T x[m]) in place for each row m whose slot (int32 `row_slots`[m]) s >= 0 (see
    lora.c): x [M, K] and y [M, N] rows of unit stride (both bfloat16 or both float32), each slot's
    At [K, P * r] and Bt [r, N] (bfloat16 with `weights_bf16`, else float32). The other arguments
    are addresses (int64 per slot: `a_ptrs`, `b_ptrs`, `ranks`; int64 [P] `part_ends`; float32
    scratch [M, t_stride >= P * max rank]), taken once by the caller: this runs once per
    projection and step."""
    rc = calls().lora_add(
        x=x.data_ptr(), x_stride=x.stride(0), y=y.data_ptr(), y_stride=y.stride(0),
        x_bf16=int(x.dtype == torch.bfloat16), w_bf16=int(weights_bf16), M=x.shape[0], K=x.shape[1], N=y.shape[1],
        row_slots=row_slots, a_ptrs=a_ptrs, b_ptrs=b_ptrs, ranks=ranks, num_slots=num_slots, part_ends=part_ends,
        P=num_parts, t=scratch, t_stride=t_stride)
    if rc == -2:
        raise MemoryError("lora_add: no memory for its row buffers")
    if rc != 0:
        raise ValueError("lora_add: a row's slot is out of range or its rank exceeds the scratch")
