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

/* IEEE half -> float32, exactly (the float32 int4 layout's scales and zeros; F16C's vcvtph2ps in
 * the vector paths gives the same values). */
static inline float f16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) {
        x.f = (float)man * 0x1p-24f; /* zero or subnormal */
        x.u |= sign;
    } else {
        x.u = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    }
    return x.f;
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

/* The float32 int4 layout (int4_avx2.c, int4_i8_f32.c): output rows in tiles of 32, each tile's
 * K/32 column groups one after another, INT4G_GROUP_BYTES each: 32 columns of 16 bytes (byte c of
 * a column: row c in the low nibble, row 16 + c in the high one), then the 32 rows' scales and
 * their 32 zeros as IEEE halves. One stream per tile: codes and the floats they need arrive
 * together, 0.625 bytes a weight. */
#define INT4G_CODE_BYTES 512
#define INT4G_GROUP_BYTES 640

static inline const uint8_t *int4g_group(const uint8_t *packed, int64_t K, int64_t t, int64_t g) {
    return packed + (t * (K / 32) + g) * INT4G_GROUP_BYTES;
}

/* Row n's (scale, zero) of group g. */
static inline void int4g_scale_zero(const uint8_t *packed, int64_t K, int64_t n, int64_t g, float *s, float *z) {
    const uint16_t *h = (const uint16_t *)(int4g_group(packed, K, n / 32, g) + INT4G_CODE_BYTES);
    *s = f16_to_f32(h[n % 32]);
    *z = f16_to_f32(h[32 + n % 32]);
}

/* Code i (0-15) of row r (0-31) in a group's 32-row column of codes `col`. */
static inline int int4g_code(const uint8_t *col, int r, int i) {
    const uint8_t byte = col[i * 16 + r % 16];
    return r < 16 ? byte & 0x0F : byte >> 4;
}

/* Row n's codes of group g against 32 activations: sum x (q - 8) (returned) and sum x (*xsum), in
 * float32; w = (q - 8) * s + z makes the group's share s * (the return) + z * (*xsum). */
static inline float int4g_group_dot(const float *x, const uint8_t *packed, int64_t K, int64_t n, int64_t g,
                                    float *xsum) {
    const uint8_t *col = int4g_group(packed, K, n / 32, g);
    const int r = (int)(n % 32);
    float dot = 0.f, sum = 0.f;
    for (int i = 0; i < 32; i++) {
        dot += x[i] * (float)(int4g_code(col, r, i) - 8);
        sum += x[i];
    }
    *xsum = sum;
    return dot;
}

/* Row n's codes of group g against 32 int8 activations (xq8) or int16 ones (xq16, the other
 * NULL): the exact sum q * xq. */
static inline int32_t int4g_group_idot(const int8_t *xq8, const int16_t *xq16, const uint8_t *packed, int64_t K,
                                       int64_t n, int64_t g) {
    const uint8_t *col = int4g_group(packed, K, n / 32, g);
    const int r = (int)(n % 32);
    int32_t q = 0;
    for (int i = 0; i < 32; i++) q += int4g_code(col, r, i) * (xq8 ? (int32_t)xq8[i] : (int32_t)xq16[i]);
    return q;
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
/* Element i of an activation row as float32, and a float32 stored into one: the decode step's dtype
 * is bfloat16 (bf) or float32. */
static inline float act_ld(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void act_st(void *p, int64_t i, float v, int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}
/* v as the step's dtype holds it: rounded to bfloat16, or as is. */
static inline float act_rnd(float v, int bf) { return bf ? bf16_to_f32(f32_to_bf16(v)) : v; }

#endif
