/* Weight-only int8 matrix product for decode-sized steps: out[m, n] = scale[n] * sum_k x[m, k] * w[n, k].
 *
 * PyTorch's _weight_int8pack_mm reads an LM head of 49k x 576 int8 weights at ~12 GB/s on these
 * machines (2-3 ms a token); this streams each weight row once, widening 16 int8 at a time to
 * float32 and multiplying by up to 4 activation rows (float32 accumulation, one rounding of the
 * result, like the PyTorch kernel). Rows are split across torch's OpenMP threads.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_ROWS 4

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)v) << 16;
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    x.u += 0x7fffu + ((x.u >> 16) & 1u);
    return (uint16_t)(x.u >> 16);
}

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
        float sums[MAX_ROWS] = {0.f, 0.f, 0.f, 0.f};
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 acc[MAX_ROWS];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + k))));
            for (int64_t m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + m * K + k), acc[m]);
        }
        for (int64_t m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(acc[m]);
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
