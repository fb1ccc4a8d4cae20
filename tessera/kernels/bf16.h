/* bfloat16 <-> float32 helpers for the kernels (one copy, included by each source). */
#ifndef TESSERA_BF16_H
#define TESSERA_BF16_H
#include <stdint.h>

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
