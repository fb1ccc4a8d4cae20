"""The values the engine's choice flags accept: the CLI's choices and the configs' checks read
the same tuples."""

DTYPES = ("auto", "bfloat16", "float32")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
DENSE_WEIGHT_COPIES = ("auto", "on", "off")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULER_POLICIES = ("continuous", "static")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
ATTENTION_BACKENDS = ("auto", "paged", "sdpa", "reference", "triton")
# Where the model runs; auto: cuda when torch sees a GPU, else cpu.
DEVICES = ("auto", "cpu", "cuda")
CPU_ISAS = ("auto", "scalar", "avx2", "avx512", "avx512_bf16", "amx", "neon")  # kernels/isa.py's levels
# KV cache element format (vLLM's --kv-cache-dtype); auto = the compute dtype. int8: per-block scales.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")
