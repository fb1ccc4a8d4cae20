/* Weight-only int4 matrix-vector product for one decode row, on PyTorch's CPU int4pack layout.
 *
 * Layout (as torch._convert_weight_to_int4pack_for_cpu writes it): output rows in tiles of 64;
 * tile t, input column k, byte j holds row 64t + j in its low nibble and row 64t + 32 + j in its
 * high nibble. scales_zeros is [K/32][N][2] bfloat16 pairs (scale, zero) with
 * w = (code - 8) * scale + zero. Per group of 32 columns this sums x * code for 64 rows at once
 * (four float32 vectors), then applies scale and zero once: y += s * (sum(x q) - 8 sum(x)) + z sum(x).
 * Each tile's bytes are read once, in order; tiles are split across torch's OpenMP threads.
 */
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512 1
#endif

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)v) << 16;
    return x.f;
}

/* Returns 0, or -1 when this build has no AVX-512 path (callers then use PyTorch's kernel).
 * x: [K] bf16; packed: [N_pad/64][K][32] uint8; sz: [K/32][N_pad][2] bf16; out: [N_out] bf16;
 * scratch: K + K/32 floats. */
int int4_gemv_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t N_pad,
                   int64_t N_out, int64_t K, float *scratch) {
#ifdef HAVE_AVX512
    const int64_t G = K / 32;
    float *xf = scratch, *xs = scratch + K;
    for (int64_t g = 0; g < G; g++) {
        float s = 0.f;
        for (int64_t i = 0; i < 32; i++) {
            xf[g * 32 + i] = bf16_to_f32(x[g * 32 + i]);
            s += xf[g * 32 + i];
        }
        xs[g] = s;
    }
    const int64_t tiles = N_pad / 64;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = packed + t * K * 32;
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t g = 0; g < G; g++) {
            __m512 q[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            const uint8_t *col = tile + g * 32 * 32;
            for (int64_t kk = 0; kk < 32; kk++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(col + kk * 32));
                const __m256i lo = _mm256_and_si256(bytes, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
                const __m512 xk = _mm512_set1_ps(xf[g * 32 + kk]);
                q[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))), xk, q[0]);
                q[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))), xk, q[1]);
                q[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))), xk, q[2]);
                q[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))), xk, q[3]);
            }
            const __m512 sumx = _mm512_set1_ps(xs[g]);
            const __m512 eight_sumx = _mm512_set1_ps(8.f * xs[g]);
            const uint16_t *pairs = sz + (g * N_pad + t * 64) * 2;
            for (int i = 0; i < 4; i++) {
                const __m512i v = _mm512_loadu_si512((const void *)(pairs + i * 32)); /* 16 (scale, zero) */
                const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
                acc[i] = _mm512_fmadd_ps(s, _mm512_sub_ps(q[i], eight_sumx), acc[i]);
                acc[i] = _mm512_fmadd_ps(z, sumx, acc[i]);
            }
        }
        for (int i = 0; i < 4; i++) {
            const int64_t row = t * 64 + i * 16;
            if (row >= N_out) break;
            const __m256i packed_out = (__m256i)_mm512_cvtneps_pbh(acc[i]);
            if (row + 16 <= N_out) {
                _mm256_storeu_si256((__m256i *)(out + row), packed_out);
            } else {
                uint16_t tmp[16];
                _mm256_storeu_si256((__m256i *)tmp, packed_out);
                for (int64_t r = row; r < N_out; r++) out[r] = tmp[r - row];
            }
        }
    }
    return 0;
#else
    (void)x; (void)packed; (void)sz; (void)out; (void)N_pad; (void)N_out; (void)K; (void)scratch;
    return -1;
#endif
}
