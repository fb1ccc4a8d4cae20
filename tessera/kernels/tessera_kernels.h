/* Every function the kernel library exports, the limits and kinds its callers must respect, and the
 * structs they pass: one declaration each, included by every source.
 *
 * Including it in each .c file makes the compiler check every definition against its prototype;
 * Python mirrors this file in bindings.py (ctypes argument tables, constants, Structures), and
 * tests/kernels/test_kernel_bindings.py parses it and fails where the two disagree. Arguments are
 * documented at the definitions. Adding a kernel: its .c file, a prototype here, a row there.
 */
#ifndef TESSERA_KERNELS_H
#define TESSERA_KERNELS_H
#include <stdint.h>

/* ---- Shared constants (bindings.py holds the same names and values) ---- */

/* linear_t.kind: how a projection's weight is stored. */
enum { LINEAR_INT4 = 1, LINEAR_INT8 = 2, LINEAR_INT4_I8 = 3, LINEAR_Q4K = 4, LINEAR_Q6K = 5, LINEAR_MXFP4 = 6,
       LINEAR_INT4_I16 = 7, LINEAR_INT8_I16 = 8 };
/* rot_kind of the int8 cache: the keys' (and queries') transform (kv_int8.c's transform_row). */
enum { ROT_NONE = 0, ROT_MATRIX = 1, ROT_HADAMARD = 2 };
/* layer_t.rope: which RoPE tables rotate a layer's queries and keys (none: a NoPE layer, SmolLM3). */
enum { ROPE_NONE = 0, ROPE_GLOBAL = 1, ROPE_LOCAL = 2 };
/* dims_t.qk_norm: RMSNorm on queries and keys before RoPE, over each head (Qwen3, Gemma 3) or over the
 * whole query and key projections (OLMo 2). */
enum { QK_NORM_NONE = 0, QK_NORM_HEAD = 1, QK_NORM_PROJ = 2 };
/* dims_t.activation, moe_t.activation: the gated MLP's activation (tessera/activations.py names them;
 * ACT_SWIGLU_CLAMPED is gpt-oss's, with moe_t's limit and alpha). */
enum { ACT_SILU = 1, ACT_GELU_TANH = 2, ACT_SWIGLU_CLAMPED = 3 };

#define MAX_HEAD_DIM 512         /* paged decode attention (bfloat16/float32 and int8 caches) */
#define MAX_GROUP 16             /* query heads per KV head, every attention kernel */
#define MAX_BLOCK_SIZE 64        /* paged_decode_attention's cache block (an int8 cache takes any) */
#define MAX_KEY_BIAS_PAIRS 256   /* kb_m of the int8 cache: every pair of a head up to MAX_HEAD_DIM */
#define PREFILL_MAX_HEAD_DIM 256 /* paged_prefill_attention_bf16 */
#define MAX_NORM_HIDDEN 8192     /* rms_norm_bf16's row buffer */
#define INT8_GEMV_MAX_ROWS 8
#define INT8_GEMM_MAX_ROWS 8
#define INT4_F32_MAX_ROWS 64
#define INT4_I16_MAX_ROWS 8     /* int4_gemm_i16_f32: decode and verification steps (the K-quant kernels' 8) */
#define INT4_GEMM_MAX_ROWS 64    /* rows past which the module path takes the dense copy (decode_step follows) */
#define KQUANT_MAX_ROWS 8
#define MXFP4_MAX_ROWS 64

/* ---- Structs (bindings.py's LinearOperand, DecodeLayer, DecodeDims, LoRAStep: same fields, same order) ---- */

/* One projection's weight as its QuantMethod stores it (all fields 8 bytes). */
typedef struct {
    int64_t kind;          /* LINEAR_INT4, LINEAR_INT4_I8 (int8 activations), LINEAR_INT4_I16 (float32 rows as
                              int16 up to INT4_I16_MAX_ROWS, then LINEAR_INT4's), LINEAR_INT8, LINEAR_INT8_I16
                              (float32 rows as int16, bfloat16 ones as LINEAR_INT8), LINEAR_Q4K, LINEAR_Q6K,
                              LINEAR_MXFP4 */
    const void *weight;    /* int4: packed [N_pad/64][K][32] uint8 (decode_step_f32: the float32 layout, bf16.h
                              INT4G_*, scales within); int8: [N][K] int8; K-quants: code blocks; MXFP4: the
                              file's blocks [N][K/32][17] */
    const void *scales;    /* int4: [K/32][N_pad][2] (scale, zero) bf16 (decode_step_f32: unused); int8: [N][K/G] float32; K-quants:
                              the sub-blocks' integer scales (and Q4_K's minimums) */
    const float *zeros;    /* int8: [N][K/G] float32 or NULL; K-quants: the super-blocks' d (and dmin) */
    const void *bias;      /* [N] of the step's dtype (bf16 or float32) or NULL */
    int64_t n_pad, n, k;   /* int4: rows padded to the tile, real rows, columns */
    int64_t group;         /* int8: values per scale */
    int64_t int8_gemm;     /* int8: int8_gemm_bf16 may take steps of 3+ rows */
    int64_t max_rows;      /* rows past which the module path multiplies another way (0: none); more refused */
    const int64_t *lora_a, *lora_b; /* the projection's LoRA slots (layers/lora.py's LoRATable): At and Bt
                                       addresses per slot, or NULL where no adapter can reach it */
    const int64_t *lora_ends;       /* [lora_parts] ends of its parts' outputs (Q, K, V or gate, up) */
    int64_t lora_parts;
} linear_t;

/* A step's LoRA rows for decode_step_bf16 (lora_add's per-step arguments, layers/lora.py's LoRASlots). */
typedef struct {
    const int32_t *row_slots; /* [M] each row's slot, -1: the base */
    const int64_t *ranks;     /* [num_slots] */
    int64_t num_slots;
    float *t;                 /* [M][t_stride] scratch of the shrunk rows */
    int64_t t_stride;
    int64_t w_bf16;           /* the adapters' weights are bfloat16 (else float32) */
} lora_step_t;

/* A mixture-of-experts feed-forward block (moe_step.c; layers/moe.py's SparseMoE): a float32 router,
 * experts that are gated MLPs of `ffn` rows. */
typedef struct {
    const float *router;      /* [E][H] float32 */
    const float *router_bias; /* [E] float32 or NULL */
    const linear_t *gate_up;  /* [E] each expert's fused gate and up rows (with their biases, if any) */
    const linear_t *down;     /* [E] */
    int64_t num_experts, top_k, ffn;
    int64_t renormalize;      /* routing weights: softmax over the chosen logits (1) or over all, taken at the chosen (0) */
    int64_t activation;       /* ACT_SILU or ACT_SWIGLU_CLAMPED */
    double swiglu_limit, swiglu_alpha;
} moe_t;

/* One decoder layer of decode_step_bf16 / decode_step_f32 (tensors of the step's dtype). Each sublayer
 * (attention, then the MLP) has an input norm, an output norm, or both (models/decoder.py's
 * DecoderLayer.sublayer): without an output norm (llama) the residual add is folded into the next
 * norm's call; with one (Gemma, OLMo 2) the normed output is added to the stream. */
typedef struct {
    const void *attn_norm, *attn_out_norm; /* [H] RMSNorm weights around attention, NULL where none */
    const void *mlp_norm, *mlp_out_norm;   /* [H] around the MLP, NULL where none */
    const void *q_norm, *k_norm;           /* QK_NORM_HEAD: [D] each; QK_NORM_PROJ: [Hq D] and [Hkv D]; else NULL */
    linear_t qkv, o, gate_up, down;
    void *kv_cache; /* [2][Hkv][num_blocks][block_size][D] */
    int64_t rope;   /* ROPE_NONE, ROPE_GLOBAL or ROPE_LOCAL */
    int64_t window; /* sliding window in tokens, 0 for none */
    int64_t group;  /* its KV-cache group: which of the step's slot rows and block tables it reads */
    const moe_t *moe;    /* the MLP is this mixture of experts (gate_up and down unused), or NULL: dense */
    const float *sinks;  /* [Hq] float32 attention sink logits (gpt-oss), or NULL */
} layer_t;

/* The decoder's shapes and the cache's, and what its layers share. */
typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size, max_blocks;
    double eps, scale;
    int64_t rotary_dim;         /* the leading dimensions of each head RoPE turns (partial rotary: < head_dim) */
    int64_t qk_norm;            /* QK_NORM_NONE, QK_NORM_HEAD or QK_NORM_PROJ */
    int64_t activation;         /* ACT_SILU or ACT_GELU_TANH */
    double residual_multiplier; /* each sublayer's output times this before the residual add (Granite) */
    double softcap;             /* attention scores become softcap * tanh(score / softcap) (Gemma 2); 0: none */
} dims_t;

/* ---- variant.c ---- */
const char *tessera_variant(void);

/* ---- paged_attention.c ---- */
void paged_decode_attention(const void *q, int64_t q_stride, const void *cache, int is_bf16,
                            const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t B, int64_t Hq,
                            int64_t Hkv, int64_t D, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                            float scale, float softcap, int64_t window, const float *sinks, float *scratch,
                            int64_t max_len);

/* ---- prefill_attention.c ---- */
int paged_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *cache,
                                 const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                 const int64_t *seq_lens, uint16_t *out, int64_t B, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                                 const float *sinks);

/* ---- kv_int8.c ---- */
int kv_write_int8(int8_t *cache, const void *k, int64_t k_stride, const void *v, int64_t v_stride, int is_bf16,
                  const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t num_blocks, int64_t block_size,
                  const float *k_rot, int rot_kind, const float *kb_lo, const float *kb_hi,
                  const int64_t *kb_pairs, int64_t kb_m, const float *kb_row_cos, const float *kb_row_sin);
void paged_decode_attention_int8(const void *q, int64_t q_stride, int q_is_bf16, const int8_t *cache,
                                 const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t B,
                                 int64_t Hq, int64_t Hkv, int64_t D, int64_t num_blocks, int64_t block_size,
                                 int64_t max_blocks, float scale, int64_t window, const float *sinks,
                                 void *scratch, int64_t max_len, const float *q_rot, int rot_kind, const float *kb_lo, const float *kb_hi,
                                 const int64_t *kb_pairs, int64_t kb_m, const float *kb_freqs,
                                 const float *kb_basis, const float *kb_step);

/* ---- rms_norm.c ---- */
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                   int64_t hidden, float eps);
void rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t hidden,
                  float eps);

/* ---- int8_gemv.c ---- */
int int8_gemv(const void *x, const int8_t *w, const float *scale, const float *zero, void *out, int64_t M, int64_t N,
              int64_t K, int64_t G, int is_bf16, float *xf);
int64_t int8_gemv_i16_scratch_bytes(int64_t M, int64_t K);
int int8_gemv_i16(const float *x, const int8_t *w, const float *scale, const float *zero, float *out, int64_t M,
                  int64_t N, int64_t K, int64_t G, void *scratch);
int int8_gemm_bf16(const uint16_t *x, const int8_t *w, const float *scale, const float *zero, uint16_t *out,
                   int64_t M, int64_t N, int64_t K, int64_t G);

/* ---- int4_gemv.c ---- */
int tessera_avx512_bf16(void);
int int4_gemm_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t M,
                   int64_t N_pad, int64_t N_out, int64_t K, float *scratch);
int tessera_int4_i8(void);
int64_t int4_i8_scratch_bytes(int64_t M, int64_t K);
int int4_gemm_i8(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t M,
                 int64_t N_pad, int64_t N_out, int64_t K, void *scratch);

/* ---- int4_avx2.c ---- */
int tessera_avx2_fma(void);
int int4_gemm_f32(const float *x, const uint8_t *packed, float *out, int64_t M, int64_t N_pad, int64_t N_out,
                  int64_t K);

/* ---- int4_i8_f32.c ---- */
int64_t int4_i8_f32_scratch_bytes(int64_t M, int64_t K);
int int4_gemm_i8_f32(const float *x, const uint8_t *packed, float *out, int64_t M, int64_t N_pad, int64_t N_out,
                     int64_t K, void *scratch);
int64_t int4_i16_f32_scratch_bytes(int64_t M, int64_t K);
int int4_gemm_i16_f32(const float *x, const uint8_t *packed, float *out, int64_t M, int64_t N_pad, int64_t N_out,
                      int64_t K, void *scratch);

/* ---- kquant_gemm.c ---- */
int64_t kquant_scratch_bytes(int64_t M, int64_t K);
int q6k_gemm(const void *x, const uint8_t *codes, const int8_t *sc, const float *d, void *out, int64_t M,
             int64_t N, int64_t K, int is_bf16, void *scratch);
int q4k_gemm(const void *x, const uint8_t *codes, const uint8_t *scale_min, const float *dm, void *out, int64_t M,
             int64_t N, int64_t K, int is_bf16, void *scratch);
int tessera_kquant_vector(void);

/* ---- kquant_dequant.c ---- */
void q6k_dequant_bf16(const uint8_t *codes, const int8_t *sc, const float *d, uint16_t *out, int64_t N, int64_t K);
void q4k_dequant_bf16(const uint8_t *codes, const uint8_t *scale_min, const float *dm, uint16_t *out, int64_t N,
                      int64_t K);
void q6k_dequant_int8(const uint8_t *codes, const int8_t *sc, const float *d, const float *col, int8_t *out,
                      float *rs, int64_t N, int64_t K);
void q4k_dequant_int8(const uint8_t *codes, const uint8_t *scale_min, const float *dm, const float *col,
                      int8_t *out, float *rs, int64_t N, int64_t K);
void int8_quantize_rows(const void *x, int is_bf16, const float *col, int8_t *xq, float *ts, int64_t M, int64_t K);
void int8_scale_products(const int32_t *acc, const float *ts, const float *rs, void *out, int is_bf16, int64_t M,
                         int64_t N);

/* ---- mxfp4_gemm.c ---- */
int64_t mxfp4_scratch_bytes(int64_t M, int64_t K);
int mxfp4_gemm(const void *x, const uint8_t *blocks, void *out, int64_t M, int64_t N, int64_t K, int is_bf16,
               void *scratch);
void mxfp4_dequant(const uint8_t *blocks, void *out, int64_t N, int64_t K, int is_bf16);

/* ---- step_ops.c ---- */
int64_t linear_scratch_floats(const linear_t *l, int64_t M);
int linear_forward(const linear_t *l, const void *x, int64_t M, void *out, float *scratch, const lora_step_t *lora,
                   int is_bf16);
int gated_activation(int64_t kind, const void *gu, void *act, int64_t M, int64_t I, double limit, double alpha,
                     int is_bf16);
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I);

/* ---- moe_step.c ---- */
int64_t moe_workspace_bytes(const moe_t *moe, int64_t M, int64_t H);
int moe_forward(const moe_t *moe, const void *h, int64_t M, int64_t H, void *out, void *workspace, int is_bf16);

/* ---- decode_step.c ---- */
int64_t decode_step_workspace_bytes(const layer_t *layers, int64_t L, const dims_t *d, int64_t M, int64_t max_len);
int decode_step_bf16(const layer_t *layers, int64_t L, const dims_t *d, const uint16_t *final_norm, int64_t M,
                     uint16_t *x, const uint16_t *cos, const uint16_t *sin, const uint16_t *cos_local,
                     const uint16_t *sin_local, int64_t half, const int64_t *slots, const int64_t *block_tables,
                     const int64_t *seq_lens, int64_t max_len, void *workspace, const lora_step_t *lora);
int decode_step_f32(const layer_t *layers, int64_t L, const dims_t *d, const float *final_norm, int64_t M, float *x,
                    const float *cos, const float *sin, const float *cos_local, const float *sin_local, int64_t half,
                    const int64_t *slots, const int64_t *block_tables, const int64_t *seq_lens, int64_t max_len,
                    void *workspace, const lora_step_t *lora);

/* ---- lora.c ---- */
int lora_add(const void *x, int64_t x_stride, void *y, int64_t y_stride, int x_bf16, int w_bf16, int64_t M,
             int64_t K, int64_t N, const int32_t *row_slots, const int64_t *a_ptrs, const int64_t *b_ptrs,
             const int64_t *ranks, int64_t num_slots, const int64_t *part_ends, int64_t P, float *t,
             int64_t t_stride);

#endif
