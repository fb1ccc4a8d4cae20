/* What every projection and gated MLP of the one-call decode step runs (decode_step.c, and each
 * expert of moe_step.c): a projection through the kernel that the module path picks for its
 * storage, row count and dtype (int4 layouts, int8 groups, Q4_K / Q6_K and MXFP4 at file width),
 * with its bias and LoRA rows, and the activation times up, rounded where the modules round.
 */
#include <math.h>
#include <stdint.h>
#include "simd.h"

#include "bf16.h"
#include "softmax.h"
#include "tessera_kernels.h"

/* Rows per call of each product: its kernel's limit (int8: the smaller of int8_gemv's and
 * int8_gemm_bf16's, as a chunk may go to either); int4 chunks as the module path splits them. */
#define INT4_ROWS_PER_CALL INT4_GEMM_MAX_ROWS
#define INT8_ROWS_PER_CALL (INT8_GEMV_MAX_ROWS < INT8_GEMM_MAX_ROWS ? INT8_GEMV_MAX_ROWS : INT8_GEMM_MAX_ROWS)
#define KQ_ROWS_PER_CALL KQUANT_MAX_ROWS

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Floats of scratch linear_forward needs for M rows of `l` (its kernels' own scratch):
 * int4_gemm_bf16 takes a sum per row and group of 32, int4_gemm_i8 and the K-quant and MXFP4
 * products the rows quantized, int8_gemv its rows widened to float32. */
int64_t linear_scratch_floats(const linear_t *l, int64_t M) {
    if (l->kind == LINEAR_INT4) return M * (l->k / 32);
    if (l->kind == LINEAR_INT4_I16) return (int4_i16_f32_scratch_bytes(min64(M, INT4_I16_MAX_ROWS), l->k) + 3) / 4;
    if (l->kind == LINEAR_INT4_I8) { /* int4_gemm_i8's (bfloat16) or int4_gemm_i8_f32's */
        const int64_t a = int4_i8_scratch_bytes(M, l->k), b = int4_i8_f32_scratch_bytes(M, l->k);
        return ((a > b ? a : b) + 3) / 4;
    }
    if (l->kind == LINEAR_Q4K || l->kind == LINEAR_Q6K)
        return (kquant_scratch_bytes(min64(M, KQ_ROWS_PER_CALL), l->k) + 3) / 4;
    if (l->kind == LINEAR_MXFP4) return (mxfp4_scratch_bytes(min64(M, MXFP4_MAX_ROWS), l->k) + 3) / 4;
    const int64_t i16 =
        l->kind == LINEAR_INT8_I16 ? (int8_gemv_i16_scratch_bytes(min64(M, INT8_GEMV_MAX_ROWS), l->k) + 3) / 4 : 0;
    return i16 > min64(M, INT8_ROWS_PER_CALL) * l->k ? i16 : min64(M, INT8_ROWS_PER_CALL) * l->k;
}


/* out [M, n] = x [M, k] W^T (+ bias) (+ the rows' LoRA updates, lora NULL: none), through the kernel
 * the module path picks for this row count and dtype (is_bf16: bfloat16 rows, else float32);
 * the adapters' update after the bias, as layers/linear.py adds it. scratch:
 * linear_scratch_floats(l, M) floats. Returns 0, or -1 where a kernel refused. */
int linear_forward(const linear_t *l, const void *x, int64_t M, void *out, float *scratch, const lora_step_t *lora,
                   int is_bf16) {
    const int bf = is_bf16;
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
    } else if (l->kind == LINEAR_MXFP4) {
        for (int64_t i = 0; i < M; i += MXFP4_MAX_ROWS) {
            const int64_t m = min64(M - i, MXFP4_MAX_ROWS);
            if (mxfp4_gemm(xc + i * l->k * es, l->weight, oc + i * l->n * es, m, l->n, l->k, bf, scratch) != 0)
                return -1;
        }
    } else if (l->kind == LINEAR_INT4_I8) {
        const int rc = bf ? int4_gemm_i8(x, l->weight, l->scales, out, M, l->n_pad, l->n, l->k, scratch)
                          : int4_gemm_i8_f32(x, l->weight, out, M, l->n_pad, l->n, l->k, scratch);
        if (rc != 0) return -1;
    } else if (l->kind == LINEAR_INT4_I16 && !bf && M <= INT4_I16_MAX_ROWS) {
        if (int4_gemm_i16_f32(x, l->weight, out, M, l->n_pad, l->n, l->k, scratch) != 0) return -1;
    } else if (l->kind == LINEAR_INT4 || l->kind == LINEAR_INT4_I16) {
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
    } else if (l->kind == LINEAR_INT8_I16 && !bf) {
        for (int64_t i = 0; i < M; i += INT8_GEMV_MAX_ROWS) {
            const int64_t m = min64(M - i, INT8_GEMV_MAX_ROWS);
            if (int8_gemv_i16((const float *)(xc + i * l->k * es), l->weight, l->scales, l->zeros,
                              (float *)(oc + i * l->n * es), m, l->n, l->k, l->group, scratch) != 0)
                return -1;
        }
    } else if (l->kind == LINEAR_INT8 || l->kind == LINEAR_INT8_I16) {
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
            for (int64_t j = 0; j < l->n; j++) act_st(y, j, act_ld(y, j, bf) + act_ld(l->bias, j, bf), bf);
        }
    }
    if (lora && l->lora_a &&
        lora_add(x, l->k, out, l->n, bf, (int)lora->w_bf16, M, l->k, l->n, lora->row_slots, l->lora_a, l->lora_b,
                 lora->ranks, lora->num_slots, l->lora_ends, l->lora_parts, lora->t, lora->t_stride) != 0)
        return -1;
    return 0;
}


/* GELU with the tanh approximation, as PyTorch computes F.gelu(approximate="tanh") in float32. */
static inline float gelu_tanh(float x) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    const float inner = beta * (x + kappa * (x * x * x));
    return 0.5f * x * (1.f + tanhf(inner));
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

/* a = silu(g) * u for one float32 row of [gate | up] (F.silu, then a multiply, as the modules do);
 * 8 lanes at a time on AVX2 (scalar expf took ~3 % of a SmolLM2-135M decode step there). */
static void silu_mul_f32(const float *g, float *a, int64_t I) {
    const float *u = g + I;
    int64_t i = 0;
#if TESSERA_AVX2
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp_ps256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                              _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* a = gelu_tanh(g) * u for one row of [gate | up], the activation rounded to the step's dtype
 * before the product (F.gelu, then a multiply, as the modules do). */
static void gelu_mul(const void *gu, void *a, int64_t I, int bf) {
    for (int64_t i = 0; i < I; i++) act_st(a, i, act_rnd(gelu_tanh(act_ld(gu, i, bf)), bf) * act_ld(gu, I + i, bf), bf);
}

/* gpt-oss's a = (clamp(u, +-limit) + 1) * (g * sigmoid(alpha g)), g = min(gate, limit), for one row
 * of [gate | up], each operator's result rounded to the step's dtype as layers/mlp.py's
 * _swiglu_clamped computes it. */
static void swiglu_clamped(const void *gu, void *a, int64_t I, float limit, float alpha, int bf) {
    for (int64_t i = 0; i < I; i++) {
        float g = act_ld(gu, i, bf), u = act_ld(gu, I + i, bf);
        g = g > limit ? limit : g;
        u = u < -limit ? -limit : u > limit ? limit : u;
        const float s = act_rnd(1.f / (1.f + expf(-act_rnd(g * alpha, bf))), bf);
        act_st(a, i, act_rnd(g * s, bf) * act_rnd(u + 1.f, bf), bf);
    }
}

/* The gated MLP's activation times up (kind: ACT_*) for M rows of [gate | up] [M][2I] into [M][I]
 * of the step's dtype; limit and alpha: ACT_SWIGLU_CLAMPED's. Returns 0, or -1 for an unknown kind. */
int gated_activation(int64_t kind, const void *gu, void *act, int64_t M, int64_t I, double limit, double alpha,
                     int is_bf16) {
    const int bf = is_bf16;
    const int64_t es = bf ? 2 : 4;
    for (int64_t r = 0; r < M; r++) {
        const char *g = (const char *)gu + r * 2 * I * es;
        char *a = (char *)act + r * I * es;
        if (kind == ACT_SILU && bf)
            silu_mul((const uint16_t *)g, (uint16_t *)a, I);
        else if (kind == ACT_SILU)
            silu_mul_f32((const float *)g, (float *)a, I);
        else if (kind == ACT_GELU_TANH)
            gelu_mul(g, a, I, bf);
        else if (kind == ACT_SWIGLU_CLAMPED)
            swiglu_clamped(g, a, I, (float)limit, (float)alpha, bf);
        else
            return -1;
    }
    return 0;
}

/* silu_mul over M rows of [gate | up] [M][2I] into [M][I]: the MLP activation of the modules'
 * path (prefill-sized steps), where F.silu and the multiply are two passes over the rows and
 * two dispatches, with the C step's roundings (bfloat16 after the SiLU and after the product). */
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) silu_mul(gu + r * 2 * I, out + r * I, I);
}

