/* A llama-family decoder's whole decode step in one call: every layer's norms, projections, RoPE,
 * KV-cache writes, paged attention and gated MLP for a few decode rows, in bfloat16
 * (decode_step_bf16) or float32 (decode_step_f32: hosts without native bfloat16).
 *
 * At one decode row SmolLM2-135M's 30 layers are ~600 PyTorch operators and ctypes calls; their
 * dispatch (a few microseconds each) cost more than the arithmetic, which needs ~3 ms of weight
 * reads. Here the step is the same kernels (int4_gemv.c, int8_gemv.c, rms_norm.c,
 * paged_attention.c) called from C, with the small element-wise work (bias, RoPE, KV writes,
 * SiLU x up) done in loops between them. The arithmetic and its roundings follow the module
 * path (models/llama.py): each tensor the module path stores in bfloat16 is rounded to
 * bfloat16 here at the same point, so both give the same tokens up to the order of float32
 * sums inside the kernels.
 *
 * The caller (models/fused_decode.py) checks what this handles: int4pack (bfloat16: AVX-512 layout, or
 * int8 activations; float32: the float32 layout of int4_avx2.c, scales within), int8-group or Q4_K / Q6_K (kquant_gemm.c)
 * projections, a bias on the QKV projection only, a paged cache of the step's dtype
 * [2][Hkv][num_blocks][block_size][D], neox RoPE tables, no sliding window. Rows of LoRA adapters
 * get their updates beside every projection (lora.c), so a step with adapters stays one call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"

#include "bf16.h"
#include "softmax.h"
#include "tessera_kernels.h"

/* Rows per call of each product: its kernel's limit (int8: the smaller of int8_gemv's and
 * int8_gemm_bf16's, as a chunk may go to either); int4 chunks as the module path splits them. */
#define INT4_ROWS_PER_CALL INT4_GEMM_MAX_ROWS
#define INT8_ROWS_PER_CALL (INT8_GEMV_MAX_ROWS < INT8_GEMM_MAX_ROWS ? INT8_GEMV_MAX_ROWS : INT8_GEMM_MAX_ROWS)
#define KQ_ROWS_PER_CALL KQUANT_MAX_ROWS

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Floats of scratch the projections of `l` need for M rows (their kernels' own scratch):
 * int4_gemm_bf16 takes a sum per row and group of 32, int4_gemm_i8 the rows quantized, int8_gemv
 * its rows widened to float32. */
static int64_t linear_scratch(const linear_t *l, int64_t M) {
    if (l->kind == LINEAR_INT4) return M * (l->k / 32);
    if (l->kind == LINEAR_INT4_I8) /* int4_gemm_i8's (bfloat16) or int4_gemm_i8_f32's */
        return (max64(int4_i8_scratch_bytes(M, l->k), int4_i8_f32_scratch_bytes(M, l->k)) + 3) / 4;
    if (l->kind == LINEAR_Q4K || l->kind == LINEAR_Q6K)
        return (kquant_scratch_bytes(M < KQ_ROWS_PER_CALL ? M : KQ_ROWS_PER_CALL, l->k) + 3) / 4;
    return (M < INT8_ROWS_PER_CALL ? M : INT8_ROWS_PER_CALL) * l->k;
}

/* The most any projection of the step needs. */
static int64_t step_linear_scratch(const layer_t *layers, int64_t L, int64_t M) {
    int64_t lin = 0;
    for (int64_t i = 0; i < L; i++) {
        lin = max64(lin, linear_scratch(&layers[i].qkv, M));
        lin = max64(lin, linear_scratch(&layers[i].o, M));
        lin = max64(lin, linear_scratch(&layers[i].gate_up, M));
        lin = max64(lin, linear_scratch(&layers[i].down, M));
    }
    return lin;
}

static int64_t align64(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

/* Bytes of workspace decode_step_bf16 or decode_step_f32 needs for M rows and contexts of at most
 * max_len tokens (activations counted at 4 bytes, float32's width). */
int64_t decode_step_workspace_bytes(const layer_t *layers, int64_t L, const dims_t *d, int64_t M, int64_t max_len) {
    const int64_t qkv_n = (d->num_heads + 2 * d->num_kv_heads) * d->head_dim;
    const int64_t lin = step_linear_scratch(layers, L, M);
    int64_t bytes = 0;
    bytes += align64(4 * M * d->hidden) * 2;                  /* residual, h */
    bytes += align64(4 * M * qkv_n);                          /* qkv */
    bytes += align64(4 * M * d->num_heads * d->head_dim);    /* attention output */
    bytes += align64(4 * M * 2 * d->intermediate);            /* gate_up */
    bytes += align64(4 * M * d->intermediate);                /* act */
    bytes += align64(4 * lin);                                /* kernels' scratch */
    bytes += align64(4 * M * d->num_heads * max_len);         /* attention scores */
    return bytes;
}

/* Element i of an activation row as float32, and a float32 stored into one: the step's dtype is
 * bfloat16 (bf) or float32. */
static inline float ld(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void st(void *p, int64_t i, float v, int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}
/* v as the step's dtype holds it: rounded to bfloat16, or as is. */
static inline float rnd(float v, int bf) { return bf ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* out [M, n] = x [M, k] W^T (+ bias) (+ the rows' LoRA updates), through the kernel the module path
 * picks for this row count and dtype; the adapters' update after the bias, as layers/linear.py adds it. */
static int linear(const linear_t *l, const void *x, int64_t M, void *out, float *scratch, const lora_step_t *lora,
                  int bf) {
    const int64_t es = bf ? 2 : 4;
    const char *xc = (const char *)x;
    char *oc = (char *)out;
    if (l->max_rows && M > l->max_rows) return -1;
    if (l->kind == LINEAR_Q4K || l->kind == LINEAR_Q6K) {
        for (int64_t i = 0; i < M; i += KQ_ROWS_PER_CALL) {
            const int64_t m = M - i < KQ_ROWS_PER_CALL ? M - i : KQ_ROWS_PER_CALL;
            const void *xi = xc + i * l->k * es;
            void *oi = oc + i * l->n * es;
            const int rc = l->kind == LINEAR_Q4K
                ? q4k_gemm(xi, l->weight, l->scales, l->zeros, oi, m, l->n, l->k, bf, scratch)
                : q6k_gemm(xi, l->weight, l->scales, l->zeros, oi, m, l->n, l->k, bf, scratch);
            if (rc != 0) return -1;
        }
    } else if (l->kind == LINEAR_INT4_I8) {
        const int rc = bf ? int4_gemm_i8(x, l->weight, l->scales, out, M, l->n_pad, l->n, l->k, scratch)
                          : int4_gemm_i8_f32(x, l->weight, out, M, l->n_pad, l->n, l->k, scratch);
        if (rc != 0) return -1;
    } else if (l->kind == LINEAR_INT4) {
        const int64_t step = bf ? INT4_ROWS_PER_CALL : INT4_F32_MAX_ROWS;
        for (int64_t i = 0; i < M; i += step) {
            const int64_t m = M - i < step ? M - i : step;
            const int rc = bf
                ? int4_gemm_bf16((const uint16_t *)(xc + i * l->k * es), l->weight, l->scales,
                                 (uint16_t *)(oc + i * l->n * es), m, l->n_pad, l->n, l->k, scratch)
                : int4_gemm_f32((const float *)(xc + i * l->k * es), l->weight, (float *)(oc + i * l->n * es), m,
                                l->n_pad, l->n, l->k);
            if (rc != 0) return -1;
        }
    } else if (l->kind == LINEAR_INT8) {
        for (int64_t i = 0; i < M; i += INT8_ROWS_PER_CALL) {
            const int64_t m = M - i < INT8_ROWS_PER_CALL ? M - i : INT8_ROWS_PER_CALL;
            const void *xi = xc + i * l->k * es;
            void *oi = oc + i * l->n * es;
            const int rc = (bf && l->int8_gemm && m >= 3)
                ? int8_gemm_bf16(xi, l->weight, l->scales, l->zeros, oi, m, l->n, l->k, l->group)
                : int8_gemv(xi, l->weight, l->scales, l->zeros, oi, m, l->n, l->k, l->group, bf, scratch);
            if (rc != 0) return -1;
        }
    } else {
        return -1;
    }
    if (l->bias) { /* y + b as PyTorch adds two tensors of the step's dtype: in float32, rounded once */
        for (int64_t r = 0; r < M; r++) {
            void *y = oc + r * l->n * es;
            for (int64_t j = 0; j < l->n; j++) st(y, j, ld(y, j, bf) + ld(l->bias, j, bf), bf);
        }
    }
    if (lora && l->lora_a &&
        lora_add(x, l->k, out, l->n, bf, (int)lora->w_bf16, M, l->k, l->n, lora->row_slots, l->lora_a, l->lora_b,
                 lora->ranks, lora->num_slots, l->lora_ends, l->lora_parts, lora->t, lora->t_stride) != 0)
        return -1;
    return 0;
}

/* x*cos + roll(x, half)*sin over one head (layers/rotary.py's apply_rope): x*cos rounded to the
 * step's dtype first, then the multiply-add rounded once, as addcmul does. */
static void rope_head(void *x, const void *cos, const void *sin, int64_t D, int64_t half, int bf) {
    float v[1024];
    for (int64_t i = 0; i < D; i++) v[i] = ld(x, i, bf);
    for (int64_t i = 0; i < D; i++) {
        const float a = rnd(v[i] * ld(cos, i, bf), bf);
        st(x, i, a + v[(i + half) % D] * ld(sin, i, bf), bf);
    }
}

/* a = bf16(bf16(silu(g)) * u) for one row of [gate | up] (F.silu, then a multiply, as the modules
 * do); 16 lanes at a time with softmax.h's exponential, as scalar expf cost ~0.3 ms a token. */
static void silu_mul(const uint16_t *g, uint16_t *a, int64_t I) {
    const uint16_t *u = g + I;
    int64_t i = 0;
#if TESSERA_AVX512_BF16
    for (; i + 16 <= I; i += 16) {
        const __m512 gv = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i))), 16));
        const __m512 uv = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(u + i))), 16));
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        const __m512 sr = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(sv)), 16));
        _mm256_storeu_si256((__m256i *)(a + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, uv)));
    }
#endif
    for (; i < I; i++) {
        const float gv = bf16_to_f32(g[i]);
        const float s = bf16_to_f32(f32_to_bf16(gv / (1.f + expf(-gv))));
        a[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
    }
}

/* a = silu(g) * u for one float32 row of [gate | up] (F.silu, then a multiply, as the modules do). */
static void silu_mul_f32(const float *g, float *a, int64_t I) {
    const float *u = g + I;
    for (int64_t i = 0; i < I; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* silu_mul over M rows of [gate | up] [M][2I] into [M][I]: the MLP activation of the modules'
 * path (prefill-sized steps), where F.silu and the multiply are two passes over the rows and
 * two dispatches, with the C step's roundings (bfloat16 after the SiLU and after the product). */
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) silu_mul(gu + r * 2 * I, out + r * I, I);
}

/* One decode step of either dtype (see decode_step_bf16 for the arguments); bf: bfloat16 rows. */
static int decode_step(const layer_t *layers, int64_t L, const dims_t *d, const void *final_norm, int64_t M,
                       void *x, const void *cos, const void *sin, int64_t half, const int64_t *slots,
                       const int64_t *block_tables, const int64_t *seq_lens, int64_t max_len, void *workspace,
                       const lora_step_t *lora, int bf) {
    const int64_t H = d->hidden, D = d->head_dim, nq = d->num_heads, nkv = d->num_kv_heads, I = d->intermediate;
    const int64_t qkv_n = (nq + 2 * nkv) * D;
    const int64_t plane = d->num_blocks * d->block_size;
    const int64_t es = bf ? 2 : 4;
    const float eps = (float)d->eps;
    if (D > 1024) return -1;
    char *p = (char *)workspace;
    char *residual = p; p += align64(4 * M * H);
    char *h = p; p += align64(4 * M * H);
    char *qkv = p; p += align64(4 * M * qkv_n);
    char *attn = p; p += align64(4 * M * nq * D);
    char *gu = p; p += align64(4 * M * 2 * I);
    char *act = p; p += align64(4 * M * I);
    const int64_t lin = step_linear_scratch(layers, L, M);
    float *scratch = (float *)p; p += align64(4 * lin);
    float *scores = (float *)p;
#define NORM(in, res, w, out) \
    (bf ? rms_norm_bf16((const uint16_t *)(in), (uint16_t *)(res), (const uint16_t *)(w), (uint16_t *)(out), M, H, eps) \
        : rms_norm_f32((const float *)(in), (float *)(res), (const float *)(w), (float *)(out), M, H, eps))

    for (int64_t li = 0; li < L; li++) {
        const layer_t *ly = &layers[li];
        char *cache = (char *)ly->kv_cache;
        if (li == 0) { /* the embeddings are the first residual */
            memcpy(residual, x, es * M * H);
            NORM(x, 0, ly->input_norm, h);
        } else {
            NORM(x, residual, ly->input_norm, h);
        }
        if (linear(&ly->qkv, h, M, qkv, scratch, lora, bf) != 0) return -1;
        for (int64_t r = 0; r < M; r++) {
            char *row = qkv + r * qkv_n * es;
            for (int64_t j = 0; j < nq + nkv; j++)
                rope_head(row + j * D * es, (const char *)cos + r * D * es, (const char *)sin + r * D * es, D, half, bf);
            for (int64_t j = 0; j < nkv; j++) { /* keys, then values, at the row's slot of each head */
                memcpy(cache + ((j * plane) + slots[r]) * D * es, row + (nq + j) * D * es, es * D);
                memcpy(cache + ((nkv + j) * plane + slots[r]) * D * es, row + (nq + nkv + j) * D * es, es * D);
            }
        }
        paged_decode_attention(qkv, qkv_n, cache, bf, block_tables, seq_lens, attn, M, nq, nkv, D,
                               d->num_blocks, d->block_size, d->max_blocks, (float)d->scale, 0, NULL, scores, max_len);
        if (linear(&ly->o, attn, M, x, scratch, lora, bf) != 0) return -1;
        NORM(x, residual, ly->post_norm, h);
        if (linear(&ly->gate_up, h, M, gu, scratch, lora, bf) != 0) return -1;
        for (int64_t r = 0; r < M; r++) {
            if (bf)
                silu_mul((const uint16_t *)gu + r * 2 * I, (uint16_t *)act + r * I, I);
            else
                silu_mul_f32((const float *)gu + r * 2 * I, (float *)act + r * I, I);
        }
        if (linear(&ly->down, act, M, x, scratch, lora, bf) != 0) return -1;
    }
    NORM(x, residual, final_norm, x);
#undef NORM
    return 0;
}

/*
 * x:            [M, H] bf16: the rows' embeddings in, the final norm's output out
 * cos, sin:     [M, D] bf16 RoPE rows of the rows' positions (RotaryEmbedding's tables)
 * slots:        [M] int64 cache slot of each row's new token
 * block_tables: [M, max_blocks] int64; seq_lens: [M] int64 (context including the new token)
 * workspace:    decode_step_workspace_bytes(...) bytes
 * lora:         the rows' adapters (lora.c adds them beside each projection), or NULL: none
 * Returns 0, or -1 when a kernel refused its arguments (nothing is then left half-written that
 * the module path would not overwrite: the caller reruns the step there).
 */
int decode_step_bf16(const layer_t *layers, int64_t L, const dims_t *d, const uint16_t *final_norm, int64_t M,
                     uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half, const int64_t *slots,
                     const int64_t *block_tables, const int64_t *seq_lens, int64_t max_len, void *workspace,
                     const lora_step_t *lora) {
    return decode_step(layers, L, d, final_norm, M, x, cos, sin, half, slots, block_tables, seq_lens, max_len,
                       workspace, lora, 1);
}

/* decode_step_bf16 for float32 rows, norms, RoPE tables and cache: every tensor the module path
 * keeps in float32 is float32 here, and the int4 operands are int4_gemm_f32's. */
int decode_step_f32(const layer_t *layers, int64_t L, const dims_t *d, const float *final_norm, int64_t M, float *x,
                    const float *cos, const float *sin, int64_t half, const int64_t *slots,
                    const int64_t *block_tables, const int64_t *seq_lens, int64_t max_len, void *workspace,
                    const lora_step_t *lora) {
    return decode_step(layers, L, d, final_norm, M, x, cos, sin, half, slots, block_tables, seq_lens, max_len,
                       workspace, lora, 0);
}
