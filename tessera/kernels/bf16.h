/* bfloat16 <-> float32 helpers for the kernels (one copy, included by each source). */
#ifndef TESSERA_BF16_H
#define TESSERA_BF16_H
#include <stdint.h>
#include "simd.h"

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)v) << 16;
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40); /* NaN stays NaN */
    x.u += 0x7fffu + ((x.u >> 16) & 1u);
    return (uint16_t)(x.u >> 16);
}

/* Column n of a product's output [M][N] (bfloat16 if is_bf16, else float32) from its M sums. */
static inline void store_column(void *out, int64_t N, int64_t n, const float *sums, int64_t M, int is_bf16) {
    for (int64_t m = 0; m < M; m++) {
        if (is_bf16)
            ((uint16_t *)out)[m * N + n] = f32_to_bf16(sums[m]);
        else
            ((float *)out)[m * N + n] = sums[m];
    }
}

/* Code (0..15) of weight row n, input column k, in PyTorch's int4pack layout with tiles of
 * `tile_rows` rows (64: int4_gemv.c's AVX-512 layout; 32: int4_avx2.c's AVX2 one): tile t, column k
 * holds tile_rows / 2 bytes, byte j holding row j of the tile in its low nibble and row
 * tile_rows / 2 + j in its high nibble. For the plain C paths; the vector paths unpack whole tiles. */
static inline int int4pack_code(const uint8_t *packed, int64_t K, int64_t tile_rows, int64_t n, int64_t k) {
    const int64_t half = tile_rows / 2, t = n / tile_rows, r = n % tile_rows;
    const uint8_t byte = packed[(t * K + k) * half + r % half];
    return r < half ? byte & 0x0F : byte >> 4;
}

/* One group of 32 columns k0 .. k0 + 31 of weight row n (int4pack_code's layout) against x[0..31]:
 * returns sum x (q - 8), and the group's sum x in *xsum; w = (q - 8) * s + z makes the group's share
 * of the product s * (the return) + z * (*xsum). */
static inline float int4pack_group_dot(const float *x, const uint8_t *packed, int64_t K, int64_t tile_rows,
                                       int64_t n, int64_t k0, float *xsum) {
    float dot = 0.f, sum = 0.f;
    for (int i = 0; i < 32; i++) {
        dot += x[i] * (float)(int4pack_code(packed, K, tile_rows, n, k0 + i) - 8);
        sum += x[i];
    }
    *xsum = sum;
    return dot;
}

/* One group of 32 codes k0 .. k0 + 31 of weight row n (int4pack_code's layout) against 32 int8
 * activations: the exact sum q * xq of the int8-activation kernels' plain paths. */
static inline int32_t int4pack_group_idot(const int8_t *xq, const uint8_t *packed, int64_t K, int64_t tile_rows,
                                          int64_t n, int64_t k0) {
    int32_t q = 0;
    for (int i = 0; i < 32; i++) q += int4pack_code(packed, K, tile_rows, n, k0 + i) * (int32_t)xq[i];
    return q;
}

#if TESSERA_AVX2
/* The sum of an AVX register's 8 floats. */
static inline float hsum_ps256(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}
#endif

/* out[at : at + D] = src * scale, as bfloat16 (is_bf16) or float32: an attention row, normalized. */
static inline void store_scaled_row(void *out, int64_t at, const float *src, float scale, int64_t D, int is_bf16) {
    if (is_bf16) {
        uint16_t *o = (uint16_t *)out + at;
        for (int64_t i = 0; i < D; i++) o[i] = f32_to_bf16(src[i] * scale);
    } else {
        float *o = (float *)out + at;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) o[i] = src[i] * scale;
    }
}
#endif
