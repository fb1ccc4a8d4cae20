/* The dense path of large K-quant steps: GGUF Q6_K and Q4_K weights (layouts in kquant_gemm.c)
 * decoded to bfloat16 or int8 rows, and the int8 x int8 product's activation quantization and
 * output scaling. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "simd.h"
#include "bf16.h"
#include "kquant.h"
#include "tessera_kernels.h"

/* Dense bfloat16 weights [N][K] from the stored blocks, for the dense path of large steps (which
 * would otherwise rebuild them with a dozen PyTorch passes over the whole matrix: 3-9 s for a
 * 1.5B model's prefill step, against the matmul's ~6). Values are the float32 products the
 * Python decoding (Q6KMethod / Q4KMethod._weights) makes, rounded once to bfloat16. */
static inline void store_bf16x16(uint16_t *dst, const float *src) {
#if TESSERA_AVX512
    const __m512 v = _mm512_loadu_ps(src);
#if TESSERA_AVX512_BF16
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
#else /* round to nearest even by hand (finite weights: no NaN case) */
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
#else
    for (int i = 0; i < 16; i++) dst[i] = f32_to_bf16(src[i]);
#endif
}

/* The 256 codes of one block, in order: Q6_K's in 0..63, Q4_K's in 0..15. */
static inline void q6k_codes(const uint8_t *blk, uint8_t *q) {
    for (int p = 0; p < 64; p++) {
        const uint8_t l0 = blk[p], l1 = blk[64 + p], h = blk[128 + p];
        q[p] = (uint8_t)((l0 & 0x0F) | ((h & 3) << 4));
        q[64 + p] = (uint8_t)((l0 >> 4) | (((h >> 2) & 3) << 4));
        q[128 + p] = (uint8_t)((l1 & 0x0F) | (((h >> 4) & 3) << 4));
        q[192 + p] = (uint8_t)((l1 >> 4) | ((h >> 6) << 4));
    }
}

static inline void q4k_codes(const uint8_t *blk, uint8_t *q) {
    for (int p = 0; p < 64; p++) {
        q[p] = blk[p] & 0x0F;
        q[64 + p] = blk[p] >> 4;
        q[128 + p] = blk[64 + p] & 0x0F;
        q[192 + p] = blk[64 + p] >> 4;
    }
}

/* One super-block decoded to float32 w[256], the values Q6KMethod / Q4KMethod._weights make in
 * Python: Q6_K (q - 32) * (d * sc), Q4_K q * (d * sc) - dmin * mn, a multiply and a subtract
 * (not fused: the same roundings as PyTorch's two operations). */
static inline void q6k_block_f32(const uint8_t *blk, const int8_t *sb, float db, float *w) {
#if TESSERA_AVX512
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03), off = _mm512_set1_epi32(32);
    const __m512i ql0 = _mm512_loadu_si512((const void *)blk), ql1 = _mm512_loadu_si512((const void *)(blk + 64));
    const __m512i qh = _mm512_loadu_si512((const void *)(blk + 128));
    for (int c = 0; c < 4; c++) { /* codes 64c .. 64c + 63 */
        const __m512i ql = c < 2 ? ql0 : ql1;
        const __m512i lo = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(ql, 4) : ql, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * c), low2);
        const __m512i q = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
        __m128i part[4] = {_mm512_extracti32x4_epi32(q, 0), _mm512_extracti32x4_epi32(q, 1),
                           _mm512_extracti32x4_epi32(q, 2), _mm512_extracti32x4_epi32(q, 3)};
        for (int i = 0; i < 4; i++) {
            const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(part[i]), off));
            _mm512_storeu_ps(w + 64 * c + 16 * i, _mm512_mul_ps(v, _mm512_set1_ps(db * (float)sb[4 * c + i])));
        }
    }
#else
    uint8_t q[KQ_BLOCK];
    q6k_codes(blk, q);
    for (int j = 0; j < KQ_BLOCK; j++) w[j] = (float)((int)q[j] - 32) * (db * (float)sb[j / 16]);
#endif
}

static inline void q4k_block_f32(const uint8_t *blk, const uint8_t *sm, float db, float dminb, float *w) {
#if TESSERA_AVX512
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) { /* codes 64c .. 64c + 63: sub-blocks 2c and 2c + 1 */
        const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * (c / 2)));
        const __m512i q = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(ql, 4) : ql, low4);
        __m128i part[4] = {_mm512_extracti32x4_epi32(q, 0), _mm512_extracti32x4_epi32(q, 1),
                           _mm512_extracti32x4_epi32(q, 2), _mm512_extracti32x4_epi32(q, 3)};
        for (int i = 0; i < 4; i++) {
            const int sub = 2 * c + i / 2;
            const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part[i]));
            const __m512 scaled = _mm512_mul_ps(v, _mm512_set1_ps(db * (float)sm[sub]));
            _mm512_storeu_ps(w + 64 * c + 16 * i, _mm512_sub_ps(scaled, _mm512_set1_ps(dminb * (float)sm[8 + sub])));
        }
    }
#else
    uint8_t q[KQ_BLOCK];
    q4k_codes(blk, q);
    for (int j = 0; j < KQ_BLOCK; j++) w[j] = (float)q[j] * (db * (float)sm[j / 32]) - dminb * (float)sm[8 + j / 32];
#endif
}

static inline void kq_block_f32(int q6k, const uint8_t *codes, const void *scales, const float *d, int64_t at,
                                float *w) {
    if (q6k)
        q6k_block_f32(codes + at * Q6K_CODE_BYTES, (const int8_t *)scales + at * 16, d[at], w);
    else
        q4k_block_f32(codes + at * Q4K_CODE_BYTES, (const uint8_t *)scales + at * 16, d[2 * at], d[2 * at + 1], w);
}

/* Dense bfloat16 weights [N][K] from the stored blocks, for the dense path of large steps (which
 * would otherwise rebuild them with a dozen PyTorch passes over the whole matrix). Values are the
 * float32 products of kq_block_f32, rounded once to bfloat16. */
static void kquant_dequant_bf16(int q6k, const uint8_t *codes, const void *scales, const float *d, uint16_t *out,
                                int64_t N, int64_t K) {
    const int64_t NB = K / KQ_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float w[KQ_BLOCK];
        for (int64_t b = 0; b < NB; b++) {
            kq_block_f32(q6k, codes, scales, d, n * NB + b, w);
            for (int g = 0; g < KQ_BLOCK / 16; g++) store_bf16x16(out + n * K + b * KQ_BLOCK + g * 16, w + g * 16);
        }
    }
}

void q6k_dequant_bf16(const uint8_t *codes, const int8_t *sc, const float *d, uint16_t *out, int64_t N, int64_t K) {
    kquant_dequant_bf16(1, codes, sc, d, out, N, K);
}

void q4k_dequant_bf16(const uint8_t *codes, const uint8_t *scale_min, const float *dm, uint16_t *out, int64_t N,
                      int64_t K) {
    kquant_dequant_bf16(0, codes, scale_min, dm, out, N, K);
}

/* The weight requantized to int8 per row for int8 x int8 matrix products (prefill-sized steps,
 * torch._int_mm: oneDNN's VNNI kernels): out [N][K] int8 = round(w / rs[n]), rs[n] = max |w[n]| /
 * 127, w as kq_block_f32 decodes it. The second rounding's error is at most rs / 2 per weight, a
 * 254th of the row's largest, far below the 4- or 6-bit codes' own. A row is decoded once into a
 * per-thread float32 buffer, then scaled. */
static void kquant_dequant_int8(int q6k, const uint8_t *codes, const void *scales, const float *d, const float *col,
                                int8_t *out, float *rs, int64_t N, int64_t K) {
    const int64_t NB = K / KQ_BLOCK;
#pragma omp parallel
    {
        float *w = (float *)malloc((size_t)K * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t b = 0; b < NB; b++) kq_block_f32(q6k, codes, scales, d, n * NB + b, w + b * KQ_BLOCK);
            if (col != NULL)
                for (int64_t k = 0; k < K; k++) w[k] *= col[k];
            int8_t *o = out + n * K;
#if TESSERA_AVX512
            __m512 vmax = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(w + k)));
            const float amax = _mm512_reduce_max_ps(vmax);
            const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            for (int64_t k = 0; k < K; k += 16) /* round to nearest even (the default mode), as nearbyintf */
                _mm_storeu_si128((__m128i *)(o + k),
                                 _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + k), inv))));
#else
            float amax = 0.f;
            for (int64_t k = 0; k < K; k++) amax = fabsf(w[k]) > amax ? fabsf(w[k]) : amax;
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int64_t k = 0; k < K; k++) o[k] = (int8_t)nearbyintf(w[k] * inv);
#endif
            rs[n] = amax / 127.f;
        }
        free(w);
    }
}

/* col: NULL, or K factors each weight column is multiplied by before rounding (the smoothing of
 * int8_quantize_rows, moved onto the weight: (x / col) . (w * col) = x . w). */
void q6k_dequant_int8(const uint8_t *codes, const int8_t *sc, const float *d, const float *col, int8_t *out, float *rs,
                      int64_t N, int64_t K) {
    kquant_dequant_int8(1, codes, sc, d, col, out, rs, N, K);
}

void q4k_dequant_int8(const uint8_t *codes, const uint8_t *scale_min, const float *dm, const float *col, int8_t *out,
                      float *rs, int64_t N, int64_t K) {
    kquant_dequant_int8(0, codes, scale_min, dm, col, out, rs, N, K);
}

/* The two ends of an int8 x int8 product. Activations [M][K] (bfloat16 or float32) -> int8 per
 * row: xq = round(x' / ts[m]), ts[m] = max |x'[m]| / 127, x' = x * (1 / col) (col NULL: x' = x). Products [M][N] int32 -> out (bfloat16 or
 * float32, as x) = acc * ts[m] * rs[n], in float32, in one pass (PyTorch's three elementwise
 * operations over a 512 x 17,920 product took 44 ms, the product itself 58). */
void int8_quantize_rows(const void *x, int is_bf16, const float *col, int8_t *xq, float *ts, int64_t M, int64_t K) {
    float *rcol = (float *)malloc((size_t)K * sizeof(float)); /* 1 / col, or ones */
    for (int64_t k = 0; k < K; k++) rcol[k] = col != NULL ? 1.f / col[k] : 1.f;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) {
            const float v = (is_bf16 ? bf16_to_f32(((const uint16_t *)x)[m * K + k]) : ((const float *)x)[m * K + k]) * rcol[k];
            amax = fabsf(v) > amax ? fabsf(v) : amax;
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int64_t k = 0; k < K; k++) {
            const float v = (is_bf16 ? bf16_to_f32(((const uint16_t *)x)[m * K + k]) : ((const float *)x)[m * K + k]) * rcol[k];
            xq[m * K + k] = (int8_t)nearbyintf(v * inv);
        }
        ts[m] = amax / 127.f;
    }
    free(rcol);
}

void int8_scale_products(const int32_t *acc, const float *ts, const float *rs, void *out, int is_bf16, int64_t M,
                         int64_t N) {
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float t = ts[m];
        for (int64_t n = 0; n < N; n++) {
            const float v = (float)acc[m * N + n] * t * rs[n];
            if (is_bf16)
                ((uint16_t *)out)[m * N + n] = f32_to_bf16(v);
            else
                ((float *)out)[m * N + n] = v;
        }
    }
}
