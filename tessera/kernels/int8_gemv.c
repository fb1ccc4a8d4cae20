/* Weight-only int8 matrix products with a scale (and optionally a zero) per group of G values
 * along each weight row: out[m, n] = sum_k x[m, k] * (w[n, k] * scale[n, k / G] + zero[n, k / G]).
 *
 * The groups are the checkpoint's own: GGUF Q8_0 and Q5_0 blocks are int8 codes times one scale
 * per 32 values, Q6_K sub-blocks one per 16, Q5_1 and Q5_K add a minimum per 32. Keeping those
 * codes and scales (rather than requantizing each row to one scale, which rounds every weight a
 * second time) makes the product the file's weights exactly, in float32. PyTorch's weight-only
 * int8 kernel takes one scale per row, so every row count up to 8 comes here.
 *
 * int8_gemv streams each weight row once, widening 16 codes at a time to float32, applying the
 * group's scale (and zero) once per code, and multiplying by up to 8 activation rows (float32
 * accumulation, one rounding of the result). Rows are split across torch's OpenMP threads. AVX2
 * hosts take 8 codes at a time (16 for one row, the scale applied once per group).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "simd.h"

#include "bf16.h"
#include "tessera_kernels.h"

/* One weight row against M activation rows: sums[m] = sum_k xf[m, k] * (wr[k] * sr[k / G] + zr[k / G]).
 * Inlined with G and the presence of zeros as constants (int8_gemv's dispatch), so the group loop
 * unrolls and the zero test leaves the inner loop. */
static inline __attribute__((always_inline)) void row_dot(const int8_t *wr, const float *sr, const float *zr,
                                                          const float *xf, int64_t M, int64_t K, const int64_t G,
                                                          const int has_zero, float *sums) {
    const int64_t groups = K / G;
#if TESSERA_AVX512
    if (M == 1 && G == 32) {
        /* One row (a decode step's LM head), as the AVX2 branch below: the group's scale (and
         * zero) factored out of its two 16-code products, so a code costs no multiply by its scale. */
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k = g * 32;
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + k))));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + k + 16))));
            const __m512 x0 = _mm512_loadu_ps(xf + k), x1 = _mm512_loadu_ps(xf + k + 16);
            const __m512 d = _mm512_fmadd_ps(c1, x1, _mm512_mul_ps(c0, x0));
            acc = _mm512_fmadd_ps(_mm512_set1_ps(sr[g]), d, acc);
            if (has_zero) acc = _mm512_fmadd_ps(_mm512_set1_ps(zr[g]), _mm512_add_ps(x0, x1), acc);
        }
        sums[0] = _mm512_reduce_add_ps(acc);
        return;
    }
    __m512 acc[INT8_GEMV_MAX_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m512 s = _mm512_set1_ps(sr[g]);
        const __m512 z = has_zero ? _mm512_set1_ps(zr[g]) : _mm512_setzero_ps();
        for (int64_t j = 0; j < G; j += 16) {
            const int64_t k = g * G + j;
            const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + k))));
            const __m512 wv = has_zero ? _mm512_fmadd_ps(c, s, z) : _mm512_mul_ps(c, s);
            for (int64_t m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + m * K + k), acc[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(acc[m]);
#elif TESSERA_AVX2
    if (M == 1) {
        /* One row (a decode step's LM head): the group's scale (and zero) factored out,
         * acc += s * sum(c x) + z * sum(x), over two chains of code products, so the row is not
         * bound by one FMA chain's latency (SmolLM2's 49k x 576 LM head: 4.2 -> 2.3 ms on an
         * AVX2-only AMD EPYC). More rows share each widened code below. */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps(), xs = _mm256_setzero_ps();
            for (int64_t j = 0; j < G; j += 16) {
                const int64_t k = g * G + j;
                const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + k))));
                const __m256 c1 =
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + k + 8))));
                const __m256 x0 = _mm256_loadu_ps(xf + k), x1 = _mm256_loadu_ps(xf + k + 8);
                d0 = _mm256_fmadd_ps(c0, x0, d0);
                d1 = _mm256_fmadd_ps(c1, x1, d1);
                if (has_zero) xs = _mm256_add_ps(xs, _mm256_add_ps(x0, x1));
            }
            if (has_zero) acc = _mm256_fmadd_ps(_mm256_set1_ps(zr[g]), xs, acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(sr[g]), _mm256_add_ps(d0, d1), acc);
        }
        sums[0] = hsum_ps256(acc);
        return;
    }
    __m256 acc[INT8_GEMV_MAX_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256 s = _mm256_set1_ps(sr[g]);
        const __m256 z = has_zero ? _mm256_set1_ps(zr[g]) : _mm256_setzero_ps();
        for (int64_t j = 0; j < G; j += 8) {
            const int64_t k = g * G + j;
            const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + k))));
            const __m256 wv = has_zero ? _mm256_fmadd_ps(c, s, z) : _mm256_mul_ps(c, s);
            for (int64_t m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + m * K + k), acc[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) sums[m] = hsum_ps256(acc[m]);
#else
    for (int64_t m = 0; m < M; m++) sums[m] = 0.f;
    for (int64_t k = 0; k < K; k++) {
        const float wk = (float)wr[k] * sr[k / G] + (has_zero ? zr[k / G] : 0.f);
        for (int64_t m = 0; m < M; m++) sums[m] += wk * xf[m * K + k];
    }
#endif
}

/* x: [M][K] (bf16 if is_bf16 else f32), w: [N][K] int8, scale and zero (NULL: none): [N][K/G] f32,
 * out: [M][N] like x. xf: scratch of M*K floats. Returns 0, or -1 if M > INT8_GEMV_MAX_ROWS or K is not a
 * whole number of groups of 16 or 32 values. */
int int8_gemv(const void *x, const int8_t *w, const float *scale, const float *zero, void *out, int64_t M,
              int64_t N, int64_t K, int64_t G, int is_bf16, float *xf) {
    if (M > INT8_GEMV_MAX_ROWS || (G != 16 && G != 32) || K % G != 0) return -1;
    const int64_t groups = K / G;
    for (int64_t i = 0; i < M * K; i++)
        xf[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w + n * K;
        const float *sr = scale + n * groups;
        const float *zr = zero ? zero + n * groups : NULL;
        float sums[INT8_GEMV_MAX_ROWS];
        if (G == 32 && !zr) row_dot(wr, sr, zr, xf, M, K, 32, 0, sums);
        else if (G == 32) row_dot(wr, sr, zr, xf, M, K, 32, 1, sums);
        else if (!zr) row_dot(wr, sr, zr, xf, M, K, 16, 0, sums);
        else row_dot(wr, sr, zr, xf, M, K, 16, 1, sums);
        store_column(out, N, n, sums, M, is_bf16);
    }
    return 0;
}

/* Weight row wr against rows m0 .. m0 + R - 1 of int8_gemv_i16's int16 rows: sums[r]. */
static inline __attribute__((always_inline)) void i16_rows(const int8_t *wr, const int16_t *xq, const float *dxg,
                                                           const float *sxg, const float *sr, const float *zr,
                                                           int64_t m0, int64_t K, const int64_t G, const int R,
                                                           float *sums) {
    const int64_t groups = K / G;
    float tail[4] = {0.f, 0.f, 0.f, 0.f};
#if TESSERA_AVX2
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i q[4];
        for (int r = 0; r < R; r++) q[r] = _mm256_setzero_si256();
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
            const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k)));
            for (int r = 0; r < R; r++)
                q[r] = _mm256_add_epi32(q[r], _mm256_madd_epi16(c, _mm256_loadu_si256((const __m256i *)(xq + (m0 + r) * K + k))));
        }
        for (int r = 0; r < R; r++) {
            const int64_t at = (m0 + r) * groups + g;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sr[g] * dxg[at]), _mm256_cvtepi32_ps(q[r]), acc[r]);
            if (zr) tail[r] += zr[g] * sxg[at];
        }
    }
    for (int r = 0; r < R; r++) sums[r] = hsum_ps256(acc[r]) + tail[r];
#else
    for (int r = 0; r < R; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = (m0 + r) * groups + g;
            int32_t q = 0;
            for (int64_t k = g * G; k < (g + 1) * G; k++) q += (int32_t)wr[k] * xq[(m0 + r) * K + k];
            tail[r] += sr[g] * dxg[at] * (float)q + (zr ? zr[g] * sxg[at] : 0.f);
        }
        sums[r] = tail[r];
    }
#endif
}

/* float32 rows times grouped int8 weights with each row rounded to int16 per 32 values
 * (dx = max|x| / 32767): int8_gemv's product for M <= INT8_GEMV_MAX_ROWS, G 16 or 32, K a multiple
 * of 32, where the Linear's method allows rounded activations. Why: a decode step's LM head
 * (SmolLM2-135M's 49k x 576 Q8_0 one) widened every code to a float, ~0.6 vector instructions a
 * weight and ~19 % of its step on an AMD EPYC with AVX2; here 16 codes widen to int16 once and meet
 * up to 4 rows in one VPMADDWD each (exact int32 sums per group): as fast at one row, 1.7x at two,
 * 1.15x at eight there (a 49k x 576 head). Each row is rounded and summed alone, so a row's result
 * does not depend on the rows beside it (a decode row and the same row in a verification step
 * agree, which int8_gemv's one-row and several-row paths do not). Within 1/65,534 of a group's largest value of each x: closer to the
 * float product than bfloat16 rows. scratch: int8_gemv_i16_scratch_bytes(M, K). Returns 0, or -1
 * for a shape it does not take. Builds without AVX2 compute the same integer sums in plain C. */
int64_t int8_gemv_i16_scratch_bytes(int64_t M, int64_t K) {
    return M * (2 * K + 2 * (K / 16) * (int64_t)sizeof(float)) + 64;
}

int int8_gemv_i16(const float *x, const int8_t *w, const float *scale, const float *zero, float *out, int64_t M,
                  int64_t N, int64_t K, int64_t G, void *scratch) {
    if (M < 1 || M > INT8_GEMV_MAX_ROWS || (G != 16 && G != 32) || K % 32 != 0) return -1;
    const int64_t groups = K / G;
    int16_t *xq = (int16_t *)scratch;                             /* [M][K] */
    float *dxg = (float *)(xq + M * K), *sxg = dxg + M * groups; /* [M][groups]: each row's step and sum */
    for (int64_t m = 0; m < M; m++)
        for (int64_t a = 0; a < K / 32; a++) {
            const float *v = x + m * K + a * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            const float inv = amax > 0.f ? 32767.f / amax : 0.f;
            for (int i = 0; i < 32; i++) xq[m * K + a * 32 + i] = (int16_t)nearbyintf(v[i] * inv);
            for (int64_t g = a * 32 / G; g < (a + 1) * 32 / G; g++) {
                float sum = 0.f;
                for (int64_t i = g * G; i < (g + 1) * G; i++) sum += x[m * K + i];
                dxg[m * groups + g] = amax / 32767.f, sxg[m * groups + g] = sum;
            }
        }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w + n * K;
        const float *sr = scale + n * groups, *zr = zero ? zero + n * groups : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t R = M - m0 < 4 ? M - m0 : 4;
            float sums[4];
            /* constant row counts and group sizes, so the loops unroll and the sums stay in registers */
            if (G == 32 && R == 1) i16_rows(wr, xq, dxg, sxg, sr, zr, m0, K, 32, 1, sums);
            else if (G == 32 && R == 2) i16_rows(wr, xq, dxg, sxg, sr, zr, m0, K, 32, 2, sums);
            else if (G == 32 && R == 3) i16_rows(wr, xq, dxg, sxg, sr, zr, m0, K, 32, 3, sums);
            else if (G == 32) i16_rows(wr, xq, dxg, sxg, sr, zr, m0, K, 32, 4, sums);
            else if (R == 1) i16_rows(wr, xq, dxg, sxg, sr, zr, m0, K, 16, 1, sums);
            else if (R == 2) i16_rows(wr, xq, dxg, sxg, sr, zr, m0, K, 16, 2, sums);
            else if (R == 3) i16_rows(wr, xq, dxg, sxg, sr, zr, m0, K, 16, 3, sums);
            else i16_rows(wr, xq, dxg, sxg, sr, zr, m0, K, 16, 4, sums);
            for (int64_t r = 0; r < R; r++) out[(m0 + r) * N + n] = sums[r];
        }
    }
    return 0;
}

/* A few bfloat16 rows times grouped int8 weights, for verification steps (k + 1 rows) and small
 * batches, M <= INT8_GEMM_MAX_ROWS, K a multiple of 32 and of G, G a power of two from 16.
 *
 * The float32 loop above is compute-bound from ~3 rows (a 151k x 1536 LM head: 9 ms at one row,
 * 29 ms at five). Here each 32 codes are scaled (and shifted) in float32, rounded once to
 * bfloat16 (the weight a dense bfloat16 copy would hold) and fed to AVX512-BF16 dot products,
 * 32 multiply-adds an instruction, against the rows' bfloat16 activations; float32
 * accumulation, one rounding of the result. Four weight rows at a time share each activation load.
 * Builds without AVX512-BF16 compute the same in a plain C loop (the reference; tessera_avx512_bf16()
 * says 0 there, and callers keep int8_gemv). Returns 0, or -1 for a shape outside the above.
 */
#define INT8_GEMM_NB 4

int int8_gemm_bf16(const uint16_t *x, const int8_t *w, const float *scale, const float *zero, uint16_t *out,
                   int64_t M, int64_t N, int64_t K, int64_t G) {
    if (M > INT8_GEMM_MAX_ROWS || K % 32 != 0 || G < 16 || (G & (G - 1)) != 0 || K % G != 0) return -1;
    const int64_t groups = K / G;
#if TESSERA_AVX512_BF16
    const int shift = __builtin_ctzll((unsigned long long)G); /* k / G without a division per block */
    const int64_t blocks = (N + INT8_GEMM_NB - 1) / INT8_GEMM_NB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * INT8_GEMM_NB;
        const int nn = (int)(N - n0 < INT8_GEMM_NB ? N - n0 : INT8_GEMM_NB);
        __m512 acc[INT8_GEMM_NB][INT8_GEMM_MAX_ROWS];
        for (int j = 0; j < INT8_GEMM_NB; j++)
            for (int m = 0; m < INT8_GEMM_MAX_ROWS; m++) acc[j][m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m512bh wv[INT8_GEMM_NB];
            for (int j = 0; j < nn; j++) {
                const int64_t row = n0 + j;
                const int8_t *wr = w + row * K + k;
                const int64_t g_lo = row * groups + (k >> shift), g_hi = row * groups + ((k + 16) >> shift);
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wr)));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + 16))));
                if (zero) {
                    lo = _mm512_fmadd_ps(lo, _mm512_set1_ps(scale[g_lo]), _mm512_set1_ps(zero[g_lo]));
                    hi = _mm512_fmadd_ps(hi, _mm512_set1_ps(scale[g_hi]), _mm512_set1_ps(zero[g_hi]));
                } else {
                    lo = _mm512_mul_ps(lo, _mm512_set1_ps(scale[g_lo]));
                    hi = _mm512_mul_ps(hi, _mm512_set1_ps(scale[g_hi]));
                }
                wv[j] = _mm512_cvtne2ps_pbh(hi, lo);
            }
            for (int64_t m = 0; m < M; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k));
                for (int j = 0; j < nn; j++) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv[j], xv);
            }
        }
        for (int j = 0; j < nn; j++)
            for (int64_t m = 0; m < M; m++) out[m * N + n0 + j] = f32_to_bf16(_mm512_reduce_add_ps(acc[j][m]));
    }
    return 0;
#else
    /* Plain C: each weight scaled (and shifted) in float32 and rounded to bfloat16, times x. */
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) {
                const int64_t g = n * groups + k / G;
                const float wk = (float)w[n * K + k] * scale[g] + (zero ? zero[g] : 0.f);
                acc += bf16_to_f32(f32_to_bf16(wk)) * bf16_to_f32(x[m * K + k]);
            }
            out[m * N + n] = f32_to_bf16(acc);
        }
    return 0;
#endif
}
