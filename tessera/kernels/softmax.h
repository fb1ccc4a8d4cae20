/* The softmax's exponentials for the attention kernels (one copy, included by each source).
 *
 * Why not expf in a loop: glibc's vector expf is only declared under -ffast-math, so the compiler
 * calls scalar expf once per score (about a tenth of a decode step's attention time at 2,000 tokens).
 * This is Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial, then 2^n by
 * VSCALEFPS), 16 lanes at a time (8 on AVX2): within 2 ulp of expf over the softmax's range (x <= 0). */
#ifndef TESSERA_SOFTMAX_H
#define TESSERA_SOFTMAX_H
#include <math.h>
#include <stdint.h>
#include "simd.h"

#include "bf16.h"

/* Cephes' expf constants, shared by the 16- and 8-lane versions: ln 2 in two parts (the range
 * reduction), then the degree-5 polynomial's coefficients, highest first. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

#if TESSERA_AVX512

static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f)); /* exp(-104) is 0 in float32: keeps n finite */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#if TESSERA_AVX2
/* exp_ps's polynomial on 8 lanes, 2^n put in the exponent bits (AVX2 has no VSCALEFPS), so x is
 * clamped to [-87.3, 88] and lanes below -87.3 are set to 0 (expf's subnormals there are nothing
 * beside a softmax's sum of at least 1 or SiLU's 1 + e^-x, and a score a sink or the mask outweighs
 * must weigh exactly nothing); above, e^88. */
static inline __m256 exp_ps256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 kept = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), kept);
}
#endif

/* s[0:n] <- exp(s[0:n] - m) in place; returns their sum. */
static inline float exp_shifted_sum(float *s, int64_t n, float m) {
    float sum = 0.f;
    int64_t t = 0;
#if TESSERA_AVX512
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mv));
        _mm512_mask_storeu_ps(s + t, k, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
    }
    sum = _mm512_reduce_add_ps(acc);
#elif TESSERA_AVX2
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp_ps256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum_ps256(acc);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum;
}
#endif
