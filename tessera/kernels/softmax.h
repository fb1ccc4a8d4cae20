/* The softmax's exponentials for the attention kernels (one copy, included by each source).
 *
 * Why not expf in a loop: glibc's vector expf is only declared under -ffast-math, so the compiler
 * calls scalar expf once per score (about a tenth of a decode step's attention time at 2,000 tokens).
 * This is Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial, then 2^n by
 * VSCALEFPS), 16 lanes at a time: within 2 ulp of expf over the softmax's range (x <= 0). */
#ifndef TESSERA_SOFTMAX_H
#define TESSERA_SOFTMAX_H
#include <math.h>
#include <stdint.h>
#include "simd.h"
#if TESSERA_AVX512

static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f)); /* exp(-104) is 0 in float32: keeps n finite */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
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
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum;
}
#endif
