"""The kernel library's interface as Python sees it: one row per exported function (its arguments
by name and ctypes type, its return type), the shared constants and the structs, all mirroring
tessera_kernels.h.

ctypes cannot read a C header, so the interface is written twice, here and there; a mistake in
either (an argument dropped, two swapped, a constant changed on one side) would pass a pointer
where an integer belongs, silently. tests/kernels/test_kernel_bindings.py parses the header and every
source and fails where they and this module disagree. Nothing here needs the compiled library.
"""
from __future__ import annotations

import ctypes
from typing import Callable, NamedTuple, Optional

# ---- Shared constants: tessera_kernels.h's #defines and enums, same names (every upper-case integer
# of this module is one, and the test holds it to its value there) ----

(LINEAR_INT4, LINEAR_INT8, LINEAR_INT4_I8, LINEAR_Q4K, LINEAR_Q6K, LINEAR_MXFP4, LINEAR_INT4_I16,
 LINEAR_INT8_I16) = 1, 2, 3, 4, 5, 6, 7, 8  # linear_t.kind
ROT_NONE, ROT_MATRIX, ROT_HADAMARD = 0, 1, 2  # the int8 cache's rot_kind
ROPE_NONE, ROPE_GLOBAL, ROPE_LOCAL = 0, 1, 2  # layer_t.rope
QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_PROJ = 0, 1, 2  # dims_t.qk_norm
ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_CLAMPED = 1, 2, 3  # dims_t/moe_t.activation (tessera/activations.py)
MAX_HEAD_DIM = 512
MAX_GROUP = 16
MAX_BLOCK_SIZE = 64
MAX_KEY_BIAS_PAIRS = 256
PREFILL_MAX_HEAD_DIM = 256
MAX_NORM_HIDDEN = 8192
INT8_GEMV_MAX_ROWS = 8
INT8_GEMM_MAX_ROWS = 8
INT4_F32_MAX_ROWS = 64
INT4_I16_MAX_ROWS = 8
INT4_GEMM_MAX_ROWS = 64
KQUANT_MAX_ROWS = 8
MXFP4_MAX_ROWS = 64


# ---- Structs (tessera_kernels.h's typedefs: same fields in the same order) ----

class LinearOperand(ctypes.Structure):
    """A projection's weight as decode_step.c reads it (linear_t); built by
    QuantMethod.kernel_operand, which knows the storage."""

    _fields_ = [("kind", ctypes.c_int64), ("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n_pad", ctypes.c_int64),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("group", ctypes.c_int64), ("int8_gemm", ctypes.c_int64),
                ("max_rows", ctypes.c_int64), ("lora_a", ctypes.c_void_p), ("lora_b", ctypes.c_void_p),
                ("lora_ends", ctypes.c_void_p), ("lora_parts", ctypes.c_int64)]


class MoEBlock(ctypes.Structure):
    """A mixture-of-experts block for moe_step.c (moe_t): the router and each expert's operands."""

    _fields_ = [("router", ctypes.c_void_p), ("router_bias", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
                ("ffn", ctypes.c_int64), ("renormalize", ctypes.c_int64), ("activation", ctypes.c_int64),
                ("swiglu_limit", ctypes.c_double), ("swiglu_alpha", ctypes.c_double)]


class DecodeLayer(ctypes.Structure):
    """One decoder layer for decode_step_bf16 (layer_t)."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("attn_out_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("mlp_out_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("qkv", LinearOperand), ("o", LinearOperand), ("gate_up", LinearOperand), ("down", LinearOperand),
                ("kv_cache", ctypes.c_void_p), ("rope", ctypes.c_int64), ("window", ctypes.c_int64),
                ("group", ctypes.c_int64), ("moe", ctypes.c_void_p), ("sinks", ctypes.c_void_p)]


class DecodeDims(ctypes.Structure):
    """The decoder's shapes and the cache's (dims_t)."""

    _fields_ = [("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("num_blocks", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("max_blocks", ctypes.c_int64), ("eps", ctypes.c_double),
                ("scale", ctypes.c_double), ("rotary_dim", ctypes.c_int64), ("qk_norm", ctypes.c_int64),
                ("activation", ctypes.c_int64), ("residual_multiplier", ctypes.c_double), ("softcap", ctypes.c_double)]


class LoRAStep(ctypes.Structure):
    """A step's LoRA rows for decode_step_bf16 (lora_step_t): lora_add's per-step arguments."""

    _fields_ = [("row_slots", ctypes.c_void_p), ("ranks", ctypes.c_void_p), ("num_slots", ctypes.c_int64),
                ("t", ctypes.c_void_p), ("t_stride", ctypes.c_int64), ("w_bf16", ctypes.c_int64)]


STRUCTS = {"linear_t": LinearOperand, "moe_t": MoEBlock, "layer_t": DecodeLayer, "dims_t": DecodeDims, "lora_step_t": LoRAStep}


# ---- Functions ----

class Signature(NamedTuple):
    restype: Optional[type]  # None: void
    args: tuple[tuple[str, type], ...]


P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float  # every pointer is P


def _sig(restype: Optional[type], *args: tuple[str, type]) -> Signature:
    return Signature(restype, args)


def _names(ctype: type, *names: str) -> tuple[tuple[str, type], ...]:
    """Consecutive arguments of one type."""
    return tuple((n, ctype) for n in names)


_ATTENTION_SHAPE = _names(I64, "B", "Hq", "Hkv", "D", "num_blocks", "block_size", "max_blocks")
_KQ_DEQUANT_BF16 = (("out", P), ("N", I64), ("K", I64))
_KQ_DEQUANT_INT8 = (("col", P), ("out", P), ("rs", P), ("N", I64), ("K", I64))
_FEATURE = _sig(INT)  # 1 when this build has a vector path, else 0
_DECODE_STEP = _sig(
    INT, ("layers", P), ("L", I64), ("d", P), ("final_norm", P), ("M", I64),
    *_names(P, "x", "cos", "sin", "cos_local", "sin_local"), ("half", I64), *_names(P, "slots", "block_tables", "seq_lens"), ("max_len", I64), ("workspace", P), ("lora", P))

SIGNATURES: dict[str, Signature] = {
    # variant.c
    "tessera_variant": _sig(ctypes.c_char_p),
    # paged_attention.c
    "paged_decode_attention": _sig(
        None, ("q", P), ("q_stride", I64), ("cache", P), ("is_bf16", INT), ("block_tables", P), ("seq_lens", P),
        ("out", P), *_ATTENTION_SHAPE, ("scale", F32), ("softcap", F32), ("window", I64), ("sinks", P),
        ("scratch", P), ("max_len", I64)),
    # prefill_attention.c
    "paged_prefill_attention_bf16": _sig(
        INT, ("q", P), ("q_stride", I64), ("cache", P), ("block_tables", P), ("max_blocks", I64), ("q_start", P),
        ("seq_lens", P), ("out", P), *_names(I64, "B", "Hq", "Hkv", "D", "num_blocks", "block_size"),
        ("scale", F32), ("window", I64), ("sinks", P)),
    # kv_int8.c
    "kv_write_int8": _sig(
        INT, ("cache", P), ("k", P), ("k_stride", I64), ("v", P), ("v_stride", I64), ("is_bf16", INT),
        ("slots", P), *_names(I64, "T", "Hkv", "D", "num_blocks", "block_size"), ("k_rot", P), ("rot_kind", INT),
        ("kb_lo", P), ("kb_hi", P), ("kb_pairs", P), ("kb_m", I64), ("kb_row_cos", P), ("kb_row_sin", P)),
    "paged_decode_attention_int8": _sig(
        None, ("q", P), ("q_stride", I64), ("q_is_bf16", INT), ("cache", P), ("block_tables", P), ("seq_lens", P),
        ("out", P), *_ATTENTION_SHAPE, ("scale", F32), ("window", I64), ("sinks", P), ("scratch", P),
        ("max_len", I64), ("q_rot", P), ("rot_kind", INT), ("kb_lo", P), ("kb_hi", P), ("kb_pairs", P), ("kb_m", I64),
        ("kb_freqs", P), ("kb_basis", P), ("kb_step", P)),
    # rms_norm.c
    "rms_norm_bf16": _sig(None, *_names(P, "x", "residual", "weight", "out"), ("rows", I64), ("hidden", I64),
                          ("eps", F32)),
    "rms_norm_f32": _sig(None, *_names(P, "x", "residual", "weight", "out"), ("rows", I64), ("hidden", I64),
                         ("eps", F32)),
    # int8_gemv.c
    "int8_gemv": _sig(INT, *_names(P, "x", "w", "scale", "zero", "out"), *_names(I64, "M", "N", "K", "G"),
                      ("is_bf16", INT), ("xf", P)),
    "int8_gemm_bf16": _sig(INT, *_names(P, "x", "w", "scale", "zero", "out"), *_names(I64, "M", "N", "K", "G")),
    "int8_gemv_i16_scratch_bytes": _sig(I64, ("M", I64), ("K", I64)),
    "int8_gemv_i16": _sig(INT, *_names(P, "x", "w", "scale", "zero", "out"), *_names(I64, "M", "N", "K", "G"),
                          ("scratch", P)),
    # int4_gemv.c
    "tessera_avx512_bf16": _FEATURE,
    "int4_gemm_bf16": _sig(INT, *_names(P, "x", "packed", "sz", "out"), *_names(I64, "M", "N_pad", "N_out", "K"),
                           ("scratch", P)),
    "tessera_int4_i8": _FEATURE,
    "int4_i8_scratch_bytes": _sig(I64, ("M", I64), ("K", I64)),
    "int4_gemm_i8": _sig(INT, *_names(P, "x", "packed", "sz", "out"), *_names(I64, "M", "N_pad", "N_out", "K"),
                         ("scratch", P)),
    # int4_avx2.c
    "tessera_avx2_fma": _FEATURE,
    "int4_gemm_f32": _sig(INT, *_names(P, "x", "packed", "out"), *_names(I64, "M", "N_pad", "N_out", "K")),
    # int4_i8_f32.c
    "int4_i8_f32_scratch_bytes": _sig(I64, ("M", I64), ("K", I64)),
    "int4_gemm_i8_f32": _sig(INT, *_names(P, "x", "packed", "out"), *_names(I64, "M", "N_pad", "N_out", "K"),
                             ("scratch", P)),
    "int4_i16_f32_scratch_bytes": _sig(I64, ("M", I64), ("K", I64)),
    "int4_gemm_i16_f32": _sig(INT, *_names(P, "x", "packed", "out"), *_names(I64, "M", "N_pad", "N_out", "K"),
                              ("scratch", P)),
    # kquant_gemm.c
    "kquant_scratch_bytes": _sig(I64, ("M", I64), ("K", I64)),
    "q6k_gemm": _sig(INT, *_names(P, "x", "codes", "sc", "d", "out"), *_names(I64, "M", "N", "K"), ("is_bf16", INT),
                     ("scratch", P)),
    "q4k_gemm": _sig(INT, *_names(P, "x", "codes", "scale_min", "dm", "out"), *_names(I64, "M", "N", "K"),
                     ("is_bf16", INT), ("scratch", P)),
    "tessera_kquant_vector": _FEATURE,
    # kquant_dequant.c
    "q6k_dequant_bf16": _sig(None, *_names(P, "codes", "sc", "d"), *_KQ_DEQUANT_BF16),
    "q4k_dequant_bf16": _sig(None, *_names(P, "codes", "scale_min", "dm"), *_KQ_DEQUANT_BF16),
    "q6k_dequant_int8": _sig(None, *_names(P, "codes", "sc", "d"), *_KQ_DEQUANT_INT8),
    "q4k_dequant_int8": _sig(None, *_names(P, "codes", "scale_min", "dm"), *_KQ_DEQUANT_INT8),
    "int8_quantize_rows": _sig(None, ("x", P), ("is_bf16", INT), *_names(P, "col", "xq", "ts"), ("M", I64),
                               ("K", I64)),
    "int8_scale_products": _sig(None, *_names(P, "acc", "ts", "rs", "out"), ("is_bf16", INT), ("M", I64),
                                ("N", I64)),
    # mxfp4_gemm.c
    "mxfp4_scratch_bytes": _sig(I64, ("M", I64), ("K", I64)),
    "mxfp4_gemm": _sig(INT, ("x", P), ("blocks", P), ("out", P), *_names(I64, "M", "N", "K"), ("is_bf16", INT),
                       ("scratch", P)),
    "mxfp4_dequant": _sig(None, ("blocks", P), ("out", P), *_names(I64, "N", "K"), ("is_bf16", INT)),
    # step_ops.c
    "linear_scratch_floats": _sig(I64, ("l", P), ("M", I64)),
    "linear_forward": _sig(INT, ("l", P), ("x", P), ("M", I64), ("out", P), ("scratch", P), ("lora", P),
                           ("is_bf16", INT)),
    "gated_activation": _sig(INT, ("kind", I64), ("gu", P), ("act", P), ("M", I64), ("I", I64),
                             ("limit", ctypes.c_double), ("alpha", ctypes.c_double), ("is_bf16", INT)),
    "silu_mul_bf16": _sig(None, ("gu", P), ("out", P), ("M", I64), ("I", I64)),
    # moe_step.c
    "moe_workspace_bytes": _sig(I64, ("moe", P), ("M", I64), ("H", I64)),
    "moe_forward": _sig(INT, ("moe", P), ("h", P), ("M", I64), ("H", I64), ("out", P), ("workspace", P),
                        ("is_bf16", INT)),
    # decode_step.c
    "decode_step_workspace_bytes": _sig(I64, ("layers", P), ("L", I64), ("d", P), ("M", I64), ("max_len", I64)),
    "decode_step_bf16": _DECODE_STEP,
    "decode_step_f32": _DECODE_STEP,
    # lora.c
    "lora_add": _sig(
        INT, ("x", P), ("x_stride", I64), ("y", P), ("y_stride", I64), ("x_bf16", INT), ("w_bf16", INT),
        *_names(I64, "M", "K", "N"),
        *_names(P, "row_slots", "a_ptrs", "b_ptrs", "ranks"), ("num_slots", I64), ("part_ends", P), ("P", I64),
        ("t", P), ("t_stride", I64)),
}


def apply(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give each of the library's functions its argument and return types (ctypes would otherwise
    pass every Python int as a C int and read every result as one)."""
    for name, sig in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [t for _, t in sig.args]
        fn.restype = sig.restype
    return lib


def keyword_call(fn: Callable, name: str) -> Callable:
    """`fn` (the library's `name`) as a function of the header's parameter names, all keyword-only:
    a call site that names every argument cannot pass them out of order, and one that misses or
    misspells a name fails at once. (A generated def keeps the call as cheap as Python's own
    argument binding: these run once per layer and step.)"""
    params = ", ".join(n for n, _ in SIGNATURES[name].args)
    namespace = {"_fn": fn}
    keyword_only = f"*, {params}" if params else ""
    exec(f"def {name}({keyword_only}):\n    return _fn({params})\n", namespace)  # noqa: S102 - names from the table
    return namespace[name]
