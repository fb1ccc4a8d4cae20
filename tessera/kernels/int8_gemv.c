/* Weight-only int8 matrix product for decode-sized steps: out[m, n] = scale[n] * sum_k x[m, k] * w[n, k].
 *
 * PyTorch's _weight_int8pack_mm reads an LM head of 49k x 576 int8 weights at ~12 GB/s on these
 * machines (2-3 ms a token); this streams each weight row once, widening 16 int8 at a time to
 * float32 and multiplying by up to 8 activation rows (float32 accumulation, one rounding of the
 * result, like the PyTorch kernel). Rows are split across torch's OpenMP threads. AVX2 hosts take
 * 8 weights at a time: there PyTorch's kernel computes float32 rows at ~2 GFLOP/s (an LM head of
 * 49k x 576 at 8 rows: 110 ms).
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define MAX_ROWS 8

#include "bf16.h"

/* x: [M][K] (bf16 if is_bf16 else f32), w: [N][K] int8, scale: [N] f32, out: [M][N] like x.
 * xf: scratch of M*K floats. Returns 0, or -1 if M > MAX_ROWS. */
int int8_gemv(const void *x, const int8_t *w, const float *scale, void *out, int64_t M, int64_t N, int64_t K,
              int is_bf16, float *xf) {
    if (M > MAX_ROWS) return -1;
    for (int64_t i = 0; i < M * K; i++)
        xf[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w + n * K;
        float sums[MAX_ROWS] = {0.f};
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 acc[MAX_ROWS];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + k))));
            for (int64_t m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + m * K + k), acc[m]);
        }
        for (int64_t m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc[MAX_ROWS];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) {
            const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wr + k))));
            for (int64_t m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + m * K + k), acc[m]);
        }
        for (int64_t m = 0; m < M; m++) {
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
            const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
            sums[m] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
        }
#endif
        for (; k < K; k++)
            for (int64_t m = 0; m < M; m++) sums[m] += (float)wr[k] * xf[m * K + k];
        for (int64_t m = 0; m < M; m++) {
            const float v = sums[m] * scale[n];
            if (is_bf16)
                ((uint16_t *)out)[m * N + n] = f32_to_bf16(v);
            else
                ((float *)out)[m * N + n] = v;
        }
    }
    return 0;
}

/* A few bfloat16 rows times int8 weights, for verification steps (k + 1 rows) and small batches:
 * out[m, n] = scale[n] * sum_k x[m, k] * w[n, k], M <= INT8_GEMM_MAX_ROWS.
 *
 * PyTorch's kernel and the float32 loop above are compute-bound from ~3 rows (a 151k x 1536 LM
 * head: 9 ms at one row, 29 ms at five). Here each 32 weights are widened once to bfloat16
 * (exact: every int8 is a bfloat16) and fed to AVX512-BF16 dot products, 32 multiply-adds an
 * instruction, against the rows' bfloat16 activations; float32 accumulation, one rounding of the
 * result. Four weight rows at a time share each activation load.
 */
#define INT8_GEMM_MAX_ROWS 8
#define INT8_GEMM_NB 4

int int8_gemm_bf16(const uint16_t *x, const int8_t *w, const float *scale, uint16_t *out, int64_t M, int64_t N,
                   int64_t K) {
#if defined(__AVX512BF16__)
    if (M > INT8_GEMM_MAX_ROWS || K % 32 != 0) return -1;
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
                const int8_t *wr = w + (n0 + j) * K + k;
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wr)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + 16))));
                wv[j] = _mm512_cvtne2ps_pbh(hi, lo);
            }
            for (int64_t m = 0; m < M; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k));
                for (int j = 0; j < nn; j++) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv[j], xv);
            }
        }
        for (int j = 0; j < nn; j++)
            for (int64_t m = 0; m < M; m++)
                out[m * N + n0 + j] = f32_to_bf16(_mm512_reduce_add_ps(acc[j][m]) * scale[n0 + j]);
    }
    return 0;
#else
    (void)x; (void)w; (void)scale; (void)out; (void)M; (void)N; (void)K;
    return -1;
#endif
}
