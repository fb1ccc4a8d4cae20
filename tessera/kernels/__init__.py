"""Small C kernels for what PyTorch's CPU operators cannot do well, built for the host CPU.

They are compiled once per instruction-set variant (`isa.py`, `simd.h`; by `scripts/install.sh` for
the selected one, or on first use) with the system C compiler into `$TESSERA_HOME/kernels`
(default ~/.cache/tessera/kernels), named by variant and a hash of sources, flags and CPU, and
loaded with ctypes. They run on
PyTorch's own OpenMP thread pool: the library asks for `libgomp.so.1`, which
torch has already loaded, so both share one team of threads. Where no compiler
is found, callers fall back to PyTorch operators (and say so in the log).

The interface is declared once in C, in `tessera_kernels.h` (every exported function, the limits
and kinds callers must respect, the decode step's structs), and mirrored once in Python, in
`bindings.py`; tests/kernels/test_kernel_bindings.py holds the two together. `library.py` builds and
loads the library (`available()`, `load()`, `calls()`, `KernelUnavailable`). The kernels are
wrapped for tensors, by topic, in modules of their own (this package re-exports nothing):

- `capabilities`: which vector paths run here (`bf16_matmuls()`, `int4_i8_matmuls()`,
  `avx2_matmuls()`, `kquant_matmuls()`);
- `attention_ops`: paged decode attention (bfloat16, float32 and int8 caches), the int8 cache's
  writes, paged prefill attention (`PrefillPlan`), attention sinks;
- `rowwise_ops`: `rms_norm`, `silu_mul`;
- `matmul_ops`: the few-row int8 and int4 products (`int8_gemv`, `int8_gemm_bf16`,
  `int4_gemm_bf16`, `int4_gemm_i8`, `int4_gemm_f32`);
- `gguf_ops`: GGUF's block formats as stored (`q6k_gemm`, `q4k_gemm`, `kquant_dequant_*`,
  `int8_matmul`, `mxfp4_gemm`, `mxfp4_dequant`);
- `decode_ops`: the one-call decode step (`decode_step`: bfloat16 or float32, `decode_step_workspace_bytes`);
- `lora_ops`: `lora_add`;
- `triton_attention`: the GPU attention kernel (Triton).

    python -m tessera.kernels build    # compile now (what install.sh runs)
"""
