/* GGUF K-quant weights (Q6_K, Q4_K) kept at their own width, multiplied by int8-quantized
 * activations.
 *
 * A K-quant super-block is 256 values of one weight row with small integer scales per sub-block
 * and one or two float scales: Q6_K has 6-bit codes q in 0..63 and an int8 scale per 16 values,
 * w = d * sc[j / 16] * (q - 32); Q4_K 4-bit codes, a 6-bit scale and minimum per 32 values,
 * w = d * sc[j / 32] * q - dmin * mn[j / 32]. Stored as int8 codes with a float32 scale per 16
 * (int8_gemv.c) a Q6_K weight takes 1.25 bytes, here 0.83 (the file's 0.82 and a float32 d); a
 * Q4_K weight 0.625 in int4pack with bfloat16 scales and zeros per 32 (int4_gemv.c), here 0.59.
 *
 * Layouts (repacked at load from the file's; byte p for p in 0..63):
 *   Q6_K, 192 code bytes: byte p holds the low nibbles of codes p (bits 0-3) and 64 + p (bits
 *   4-7), byte 64 + p those of 128 + p and 192 + p, byte 128 + p the top two bits of codes p,
 *   64 + p, 128 + p, 192 + p (bits 0-1, 2-3, 4-5, 6-7); then 16 int8 scales, and d per block.
 *   Q4_K, 128 code bytes: byte p holds codes p and 64 + p, byte 64 + p codes 128 + p and
 *   192 + p; then 8 scales and 8 minimums (uint8), and (d, dmin) per block.
 * Sixty-four codes come out of one 64-byte register with a shift, masks and an or.
 *
 * The activations are quantized per row and per 256 values, as llama.cpp's Q8_K does: xq =
 * round(x * (127 / amax)), xd = amax / 127, and the sum of each 16 xq kept (bsum). Then per
 * super-block, exactly in integers, the codes' dot products per sub-block (block_dot: u8 x s8
 * pairs summed to int16 by pmaddubsw), times the sub-block's scale summed to int32 (pmaddwd, or
 * vpdpwssd with AVX512-VNNI); Q6_K's offset term (32 * sc_g * bsum_g) in the
 * same integers, Q4_K's minimums (dmin * mn_g * xd * bsum over 32) in float; one float multiply
 * per super-block by d * xd. Rows are split across torch's OpenMP threads; each weight
 * super-block is unpacked once for all M activation rows. AVX2 hosts take 32 codes at a time;
 * aarch64 with the dot-product extension (the neon variant) 16 per vdotq_s32; others a plain C loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "simd.h"

#include "bf16.h"
#include "kquant.h"
#include "tessera_kernels.h"

/* Code bytes read ahead of the block being multiplied: on the 2-vCPU EPYC hosts a one-row
 * product over a model's Q4_K matrices streamed 24-25 GB/s without, 26-28 with 1-2 KiB (the
 * hardware prefetcher alone leaves the two cores waiting on memory). */
#define KQ_PREFETCH 2048

/* One step's activations, quantized: xq [M][K] int8, xd [M][K/256] float (the dequantizing
 * scale per super-block), bsum [M][K/16] int16 (the sum of each 16 xq), xmin [M][K/32] float
 * (xd times the sum of each 32 xq: the side of Q4_K's minimum term that does not depend on the
 * weight, so that term costs one 8-wide float FMA a super-block and row). */
typedef struct {
    const int8_t *xq;
    const float *xd;
    const int16_t *bsum;
    const float *xmin;
    int64_t M, K;
} kq_acts_t;

/* One weight row's parts, as each kind stores them: codes, per-sub-block integer scales, floats. */
typedef struct {
    const uint8_t *codes;
    const void *scales;
    const float *d;
} kq_row_t;

/* Row m of x (K bfloat16 or float32 values) -> its xq, xd, bsum and xmin rows. A few-row step
 * quantizes every projection's input (a 1.5B model: ~110 a token), so this is vectorized too. */
static void quantize_row(const void *x, int is_bf16, int64_t m, int64_t K, int8_t *xq, float *xd, int16_t *bsum,
                         float *xmin) {
    for (int64_t b = 0; b < K / KQ_BLOCK; b++) {
        const int64_t at = m * K + b * KQ_BLOCK;
        int8_t *q = xq + b * KQ_BLOCK;
#if TESSERA_AVX512
        __m512 v[KQ_BLOCK / 16], vmax = _mm512_setzero_ps();
        for (int g = 0; g < KQ_BLOCK / 16; g++) {
            v[g] = is_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at + 16 * g))), 16))
                           : _mm512_loadu_ps((const float *)x + at + 16 * g);
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v[g]));
        }
        const float amax = _mm512_reduce_max_ps(vmax);
        const __m512 iscale = _mm512_set1_ps(amax == 0.f ? 0.f : 127.f / amax);
        const __m512i lim = _mm512_set1_epi32(127);
        for (int g = 0; g < KQ_BLOCK / 16; g++) { /* cvtps rounds to nearest even, as nearbyintf */
            __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v[g], iscale));
            r = _mm512_max_epi32(_mm512_min_epi32(r, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
            _mm_storeu_si128((__m128i *)(q + 16 * g), _mm512_cvtepi32_epi8(r));
            bsum[b * 16 + g] = (int16_t)_mm512_reduce_add_epi32(r);
        }
        xd[b] = amax == 0.f ? 0.f : amax / 127.f;
#else
        float v[KQ_BLOCK], amax = 0.f;
        for (int j = 0; j < KQ_BLOCK; j++) {
            v[j] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + j]) : ((const float *)x)[at + j];
            const float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        if (amax == 0.f) {
            for (int j = 0; j < KQ_BLOCK; j++) q[j] = 0;
            xd[b] = 0.f;
        } else {
            const float iscale = 127.f / amax;
            for (int j = 0; j < KQ_BLOCK; j++) {
                float r = nearbyintf(v[j] * iscale);
                q[j] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
            }
            xd[b] = amax / 127.f;
        }
        for (int g = 0; g < KQ_BLOCK / 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += q[g * 16 + j];
            bsum[b * 16 + g] = (int16_t)s;
        }
#endif
        for (int g = 0; g < KQ_BLOCK / 32; g++)
            xmin[b * 8 + g] = xd[b] * (float)(bsum[b * 16 + 2 * g] + bsum[b * 16 + 2 * g + 1]);
    }
}

#if TESSERA_AVX512
static inline __m512i madd_acc(__m512i acc, __m512i p, __m512i s) {
#if TESSERA_AVX512_VNNI
    return _mm512_dpwssd_epi32(acc, p, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
#endif
}

/* A super-block's 256 codes (four registers of 64) against its 256 activations, each code's
 * product weighted by its sub-block's scale, summed to int32 lanes: pmaddubsw sums code x
 * activation pairs to int16 (at most 2 * 63 * 127), vpdpwssd (or pmaddwd) applies the scales.
 * (vpdpbusd's sums of four, packed to int16 for one vpdpwssd per two registers, has two fewer
 * multiplies but measured 3-5 % slower on the 2-vCPU AMD EPYC hosts at 1 and 5 rows:
 * benchmarks/kquant_ab.py.) */
static inline __m512i block_dot(const __m512i q[4], const int8_t *xb, const __m512i s[4], __m512i acc) {
    for (int c = 0; c < 4; c++)
        acc = madd_acc(acc, _mm512_maddubs_epi16(q[c], _mm512_loadu_si512((const void *)(xb + 64 * c))), s[c]);
    return acc;
}

/* Which of a super-block's 16 int16 scales (sub-blocks of `group` codes) each int16 lane of
 * block_dot's scale registers takes: lane i of register c holds codes 64c + 2i and 64c + 2i + 1. */
static void scale_picks(int group, __m512i pick[4]) {
    int16_t idx[32];
    for (int c = 0; c < 4; c++) {
        for (int i = 0; i < 32; i++) idx[i] = (int16_t)((64 * c + 2 * i) / group);
        pick[c] = _mm512_loadu_si512((const void *)idx);
    }
}

/* q6k_row with AVX-512: a super-block's 256 codes in four registers, the scales picked into int16
 * lanes, the -32 of every code as -32 * sc_g per bsum_g (one more pair product a row). */
static inline __attribute__((always_inline)) void q6k_rows(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums,
                                                             const int M) {
    const int8_t *xq = acts->xq;
    const float *xd = acts->xd;
    const int16_t *bsum = acts->bsum;
    const int64_t K = acts->K;
    const uint8_t *codes = row.codes;
    const int8_t *sc = (const int8_t *)row.scales;
    const float *d = row.d;
    __m512 facc[KQUANT_MAX_ROWS];
    for (int m = 0; m < M; m++) facc[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
    __m512i pick[4];
    scale_picks(16, pick);
    for (int64_t b = 0; b < NB; b++) {
        const uint8_t *blk = codes + b * Q6K_CODE_BYTES;
        for (int line = 0; line < 3; line++) _mm_prefetch((const char *)(blk + KQ_PREFETCH + 64 * line), _MM_HINT_T0);
        const __m512i ql0 = _mm512_loadu_si512((const void *)blk);
        const __m512i ql1 = _mm512_loadu_si512((const void *)(blk + 64));
        const __m512i qh = _mm512_loadu_si512((const void *)(blk + 128));
        __m512i q[4];
        q[0] = _mm512_or_si512(_mm512_and_si512(ql0, low4), _mm512_slli_epi16(_mm512_and_si512(qh, low2), 4));
        q[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql0, 4), low4),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2), low2), 4));
        q[2] = _mm512_or_si512(_mm512_and_si512(ql1, low4),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4), low2), 4));
        q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql1, 4), low4),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 6), low2), 4));
        const __m512i s16 = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sc + b * 16))));
        __m512i s[4];
        for (int c = 0; c < 4; c++) s[c] = _mm512_permutexvar_epi16(pick[c], s16);
        /* the -32 of every code as -32 * sc_g per bsum_g: one more pair product a row */
        const __m512i offset = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(s16, 5));
        const __m512 dv = _mm512_set1_ps(d[b]);
        for (int m = 0; m < M; m++) {
            const int8_t *xb = xq + m * K + b * KQ_BLOCK;
            const __m512i bs = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(bsum + m * (K / 16) + b * 16)));
            const __m512i acc = block_dot(q, xb, s, madd_acc(_mm512_setzero_si512(), offset, bs));
            const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(xd[m * (K / KQ_BLOCK) + b]));
            facc[m] = _mm512_fmadd_ps(part, dv, facc[m]);
        }
    }
    for (int m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(facc[m]);
}

/* q4k_row with AVX-512: codes as the header says, scales[b * 16 ..]: 8 scales then 8 minimums,
 * d[2 b], d[2 b + 1]: the block's d and dmin; the minimums' term against xmin. */
static inline __attribute__((always_inline)) void q4k_rows(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums,
                                                             const int M) {
    const int8_t *xq = acts->xq;
    const float *xd = acts->xd;
    const int64_t K = acts->K;
    const uint8_t *codes = row.codes;
    const uint8_t *sm = (const uint8_t *)row.scales;
    const float *d = row.d;
    const float *xmin = acts->xmin;
    __m512 facc[KQUANT_MAX_ROWS];
    __m256 fmin[KQUANT_MAX_ROWS];
    for (int m = 0; m < M; m++) facc[m] = _mm512_setzero_ps(), fmin[m] = _mm256_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i pick[4];
    scale_picks(32, pick);
    for (int64_t b = 0; b < NB; b++) {
        const uint8_t *blk = codes + b * Q4K_CODE_BYTES;
        _mm_prefetch((const char *)(blk + KQ_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + KQ_PREFETCH + 64), _MM_HINT_T0);
        const __m512i ql0 = _mm512_loadu_si512((const void *)blk);
        const __m512i ql1 = _mm512_loadu_si512((const void *)(blk + 64));
        __m512i q[4];
        q[0] = _mm512_and_si512(ql0, low4);
        q[1] = _mm512_and_si512(_mm512_srli_epi16(ql0, 4), low4);
        q[2] = _mm512_and_si512(ql1, low4);
        q[3] = _mm512_and_si512(_mm512_srli_epi16(ql1, 4), low4);
        const __m512i s16 = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sm + b * 16))));
        __m512i s[4];
        for (int c = 0; c < 4; c++) s[c] = _mm512_permutexvar_epi16(pick[c], s16);
        /* dmin * mn_g, the weight's side of the minimum term; xmin holds the activations' */
        const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + b * 16 + 8)))),
                                          _mm256_set1_ps(d[2 * b + 1]));
        const __m512 dv = _mm512_set1_ps(d[2 * b]);
        for (int m = 0; m < M; m++) {
            const int8_t *xb = xq + m * K + b * KQ_BLOCK;
            const __m512i acc = block_dot(q, xb, s, _mm512_setzero_si512());
            const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(xd[m * (K / KQ_BLOCK) + b]));
            facc[m] = _mm512_fmadd_ps(part, dv, facc[m]);
            fmin[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xmin + m * (K / 32) + b * 8), fmin[m]);
        }
    }
    for (int m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(facc[m]) - hsum_ps256(fmin[m]);
}
#elif TESSERA_AVX2
/* Every path's rows take the number of activation rows as a constant (KQ_ROWS instantiates each):
 * with M known the per-row accumulators stay in registers. With M a variable the AVX2 ones lived
 * on the stack, and every product's add waited on the previous one's store: a one-row product
 * over the 1.5B's K-quant matrices took 2.5x as long on the 2-vCPU AMD EPYC hosts
 * (benchmarks/kquant_ab.py). */

/* vpshufb controls that copy one int16 of a 128-bit lane (both lanes alike) to all its lanes:
 * KQ_PICK(k) takes int16 k. */
#define KQ_PICK(k) _mm256_set1_epi16((int16_t)((2 * (k)) | ((2 * (k) + 1) << 8)))
/* ... int16 k in the low lane, k + 1 in the high lane (Q6_K: a register's two 16-code groups). */
#define KQ_PICK2(k)                                                                    \
    _mm256_set_m128i(_mm_set1_epi16((int16_t)((2 * (k) + 2) | ((2 * (k) + 3) << 8))), \
                     _mm_set1_epi16((int16_t)((2 * (k)) | ((2 * (k) + 1) << 8))))

/* q6k_row on AVX2 for M rows: 32 codes a register, each 16-code group's scale applied by pmaddwd;
 * the -32 of every code as -32 * sc_g * bsum_g, one more pmaddwd a block and row. */
static inline __attribute__((always_inline)) void q6k_rows(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums,
                                                             const int M) {
    const int64_t K = acts->K;
    const int8_t *sc = (const int8_t *)row.scales;
    __m256 facc[KQUANT_MAX_ROWS];
    for (int m = 0; m < M; m++) facc[m] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < NB; b++) {
        const uint8_t *blk = row.codes + b * Q6K_CODE_BYTES;
        const __m128i s8 = _mm_loadu_si128((const __m128i *)(sc + b * 16));
        const __m256i s16 = _mm256_cvtepi8_epi16(s8); /* all 16 scales, for the offset term */
        const __m256i slo = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(s16)); /* scales 0-7 */
        const __m256i shi = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(s16, 1)); /* 8-15 */
        const __m256i offset = _mm256_slli_epi16(s16, 5);
        __m256i acc[KQUANT_MAX_ROWS];
        for (int m = 0; m < M; m++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(acts->bsum + m * (K / 16) + b * 16));
            acc[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(offset, bs));
        }
        for (int half = 0; half < 2; half++) { /* bytes 32 * half .. + 31 of each 64-byte row */
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 32 * half));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * half));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), low2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), low2), 4));
            for (int c = 0; c < 4; c++) {
                /* codes 64c + 32 * half .. + 31: groups 4c + 2 * half (low lane) and the next */
                const int g = 4 * c + 2 * half;
                const __m256i s = _mm256_shuffle_epi8(g < 8 ? slo : shi, KQ_PICK2(g % 8));
                for (int m = 0; m < M; m++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(acts->xq + m * K + b * KQ_BLOCK + 64 * c + 32 * half));
                    acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], xv), s));
                }
            }
        }
        for (int m = 0; m < M; m++)
            facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(row.d[b] * acts->xd[m * (K / KQ_BLOCK) + b]),
                                      facc[m]);
    }
    for (int m = 0; m < M; m++) sums[m] = hsum_ps256(facc[m]);
}

/* q4k_row on AVX2 for M rows: 32 codes a register, each sub-block's scale by pmaddwd; the
 * minimums' term one 8-wide float FMA a block and row against xmin, as the AVX-512 path. */
static inline __attribute__((always_inline)) void q4k_rows(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums,
                                                             const int M) {
    const int64_t K = acts->K;
    const uint8_t *sm = (const uint8_t *)row.scales;
    __m256 facc[KQUANT_MAX_ROWS], fmin[KQUANT_MAX_ROWS];
    for (int m = 0; m < M; m++) facc[m] = _mm256_setzero_ps(), fmin[m] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < NB; b++) {
        const uint8_t *blk = row.codes + b * Q4K_CODE_BYTES;
        const uint8_t *sb = sm + b * 16;
        const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sb)));
        const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 8)))),
                                          _mm256_set1_ps(row.d[2 * b + 1]));
        __m256i acc[KQUANT_MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 32 * half));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * half));
            __m256i q[4];
            q[0] = _mm256_and_si256(ql0, low4);
            q[1] = _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4);
            q[2] = _mm256_and_si256(ql1, low4);
            q[3] = _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4);
            for (int c = 0; c < 4; c++) {
                /* codes 64c + 32 * half .. + 31: sub-block 2c + half */
                const __m256i sv = _mm256_shuffle_epi8(s16, KQ_PICK(2 * c + half));
                for (int m = 0; m < M; m++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(acts->xq + m * K + b * KQ_BLOCK + 64 * c + 32 * half));
                    acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], xv), sv));
                }
            }
        }
        for (int m = 0; m < M; m++) {
            const float xs = acts->xd[m * (K / KQ_BLOCK) + b];
            facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(row.d[2 * b] * xs), facc[m]);
            fmin[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(acts->xmin + m * (K / 32) + b * 8), fmin[m]);
        }
    }
    for (int m = 0; m < M; m++) sums[m] = hsum_ps256(facc[m]) - hsum_ps256(fmin[m]);
}

#else
#if TESSERA_NEON_DOTPROD
/* The sixteen 16-code vectors of a Q6_K super-block, as signed values (q - 32): vector g holds
 * codes 16g .. 16g + 15 (sub-block g), so each meets its 16 activations in one vdotq_s32. */
static inline void q6k_unpack_neon(const uint8_t *blk, int8x16_t q[16]) {
    const uint8x16_t low4 = vdupq_n_u8(0x0F), low2 = vdupq_n_u8(0x03);
    const int8x16_t off = vdupq_n_s8(32);
    for (int i = 0; i < 4; i++) { /* bytes 16i .. 16i + 15 of each 64-byte row: codes 64c + 16i .. */
        const uint8x16_t ql0 = vld1q_u8(blk + 16 * i), ql1 = vld1q_u8(blk + 64 + 16 * i);
        const uint8x16_t qh = vld1q_u8(blk + 128 + 16 * i);
        const uint8x16_t c[4] = {
            vorrq_u8(vandq_u8(ql0, low4), vshlq_n_u8(vandq_u8(qh, low2), 4)),
            vorrq_u8(vshrq_n_u8(ql0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(qh, 2), low2), 4)),
            vorrq_u8(vandq_u8(ql1, low4), vshlq_n_u8(vandq_u8(vshrq_n_u8(qh, 4), low2), 4)),
            vorrq_u8(vshrq_n_u8(ql1, 4), vshlq_n_u8(vshrq_n_u8(qh, 6), 4)),
        };
        for (int k = 0; k < 4; k++) q[4 * k + i] = vsubq_s8(vreinterpretq_s8_u8(c[k]), off);
    }
}

/* q6k_row with NEON dot products (ARMv8.2 dotprod): per sub-block one vdotq_s32 of 16 signed
 * codes by 16 activations, times its scale into int32 lanes; exact integers, as the plain loop. */
static inline __attribute__((always_inline)) void q6k_rows(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums,
                                                             const int M) {
    const int64_t K = acts->K;
    const int8_t *sc = (const int8_t *)row.scales;
    float total[KQUANT_MAX_ROWS] = {0};
    for (int64_t b = 0; b < NB; b++) {
        int8x16_t q[16];
        q6k_unpack_neon(row.codes + b * Q6K_CODE_BYTES, q);
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xb = acts->xq + m * K + b * KQ_BLOCK;
            int32x4_t acc = vdupq_n_s32(0);
            for (int g = 0; g < 16; g++)
                acc = vmlaq_n_s32(acc, vdotq_s32(vdupq_n_s32(0), q[g], vld1q_s8(xb + 16 * g)), sc[b * 16 + g]);
            total[m] += (float)vaddvq_s32(acc) * (row.d[b] * acts->xd[m * (K / KQ_BLOCK) + b]);
        }
    }
    for (int64_t m = 0; m < M; m++) sums[m] = total[m];
}

/* q4k_row with NEON dot products: codes 0..15 by activations per 32-code sub-block (two vdotq_s32),
 * times its scale; the minimums' term from the activations' 16-sums (bsum), as the AVX2 path. */
static inline __attribute__((always_inline)) void q4k_rows(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums,
                                                             const int M) {
    const int64_t K = acts->K;
    const uint8x16_t low4 = vdupq_n_u8(0x0F);
    float total[KQUANT_MAX_ROWS] = {0};
    for (int64_t b = 0; b < NB; b++) {
        const uint8_t *blk = row.codes + b * Q4K_CODE_BYTES, *sb = (const uint8_t *)row.scales + b * 16;
        int8x16_t q[16]; /* vector 4c + i: codes 64c + 16i .. + 15 */
        for (int i = 0; i < 4; i++) {
            const uint8x16_t ql0 = vld1q_u8(blk + 16 * i), ql1 = vld1q_u8(blk + 64 + 16 * i);
            q[i] = vreinterpretq_s8_u8(vandq_u8(ql0, low4));
            q[4 + i] = vreinterpretq_s8_u8(vshrq_n_u8(ql0, 4));
            q[8 + i] = vreinterpretq_s8_u8(vandq_u8(ql1, low4));
            q[12 + i] = vreinterpretq_s8_u8(vshrq_n_u8(ql1, 4));
        }
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xb = acts->xq + m * K + b * KQ_BLOCK;
            const int16_t *bs = acts->bsum + m * (K / 16) + b * 16;
            int32x4_t acc = vdupq_n_s32(0);
            int32_t corr = 0;
            for (int g = 0; g < 8; g++) {
                const int32x4_t d2 = vdotq_s32(vdotq_s32(vdupq_n_s32(0), q[2 * g], vld1q_s8(xb + 32 * g)), q[2 * g + 1],
                                               vld1q_s8(xb + 32 * g + 16));
                acc = vmlaq_n_s32(acc, d2, sb[g]);
                corr += sb[8 + g] * (bs[2 * g] + bs[2 * g + 1]);
            }
            const float xs = acts->xd[m * (K / KQ_BLOCK) + b];
            total[m] += (float)vaddvq_s32(acc) * (row.d[2 * b] * xs) - (float)corr * (row.d[2 * b + 1] * xs);
        }
    }
    for (int64_t m = 0; m < M; m++) sums[m] = total[m];
}
#else
/* q6k_row in plain C, one code at a time. */
static inline __attribute__((always_inline)) void q6k_rows(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums,
                                                             const int M) {
    const int8_t *xq = acts->xq;
    const float *xd = acts->xd;
    const int16_t *bsum = acts->bsum;
    const int64_t K = acts->K;
    const uint8_t *codes = row.codes;
    const int8_t *sc = (const int8_t *)row.scales;
    const float *d = row.d;
    for (int64_t m = 0; m < M; m++) {
        float total = 0.f;
        for (int64_t b = 0; b < NB; b++) {
            const uint8_t *blk = codes + b * Q6K_CODE_BYTES;
            int32_t isum = 0;
            for (int j = 0; j < KQ_BLOCK; j++) {
                const int c = j / 64, p = j % 64;
                const int lo = (blk[(c / 2) * 64 + p] >> (4 * (c % 2))) & 0x0F;
                const int hi = (blk[128 + p] >> (2 * c)) & 0x03;
                isum += sc[b * 16 + j / 16] * ((lo | (hi << 4)) - 32) * xq[m * K + b * KQ_BLOCK + j];
            }
            total += (float)isum * (d[b] * xd[m * (K / KQ_BLOCK) + b]);
        }
        sums[m] = total;
    }
    (void)bsum;
}

/* q4k_row in plain C, one code at a time. */
static inline __attribute__((always_inline)) void q4k_rows(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums,
                                                             const int M) {
    const int8_t *xq = acts->xq;
    const float *xd = acts->xd;
    const int16_t *bsum = acts->bsum;
    const int64_t K = acts->K;
    const uint8_t *codes = row.codes;
    const uint8_t *sm = (const uint8_t *)row.scales;
    const float *d = row.d;
    for (int64_t m = 0; m < M; m++) {
        float total = 0.f;
        for (int64_t b = 0; b < NB; b++) {
            const uint8_t *blk = codes + b * Q4K_CODE_BYTES;
            const uint8_t *sb = sm + b * 16;
            int32_t isum = 0, corr = 0;
            for (int j = 0; j < KQ_BLOCK; j++) {
                const int c = j / 64, p = j % 64;
                const int q = (blk[(c / 2) * 64 + p] >> (4 * (c % 2))) & 0x0F;
                const int x = xq[m * K + b * KQ_BLOCK + j];
                isum += sb[j / 32] * q * x;
                corr += sb[8 + j / 32] * x;
            }
            const float xs = xd[m * (K / KQ_BLOCK) + b];
            total += (float)isum * (d[2 * b] * xs) - (float)corr * (d[2 * b + 1] * xs);
        }
        sums[m] = total;
    }
    (void)bsum;
}
#endif /* TESSERA_NEON_DOTPROD */
#endif

/* `rows_fn` instantiated for each M the caller may pass (1 .. KQUANT_MAX_ROWS): with M a constant
 * the vector paths keep each row's accumulators in registers. */
#define KQ_ROWS(rows_fn, row, NB, acts, sums)  \
    switch ((acts)->M) {                           \
    case 1: rows_fn(row, NB, acts, sums, 1); break; \
    case 2: rows_fn(row, NB, acts, sums, 2); break; \
    case 3: rows_fn(row, NB, acts, sums, 3); break; \
    case 4: rows_fn(row, NB, acts, sums, 4); break; \
    case 5: rows_fn(row, NB, acts, sums, 5); break; \
    case 6: rows_fn(row, NB, acts, sums, 6); break; \
    case 7: rows_fn(row, NB, acts, sums, 7); break; \
    default: rows_fn(row, NB, acts, sums, 8); break; \
    }

/* One Q6_K weight row (NB super-blocks) against M quantized activation rows -> sums[m]. */
static void q6k_row(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums) {
    KQ_ROWS(q6k_rows, row, NB, acts, sums);
}

/* One Q4_K weight row: codes as the header says, scales[b * 16 ..]: 8 scales then 8 minimums,
 * d[2 b], d[2 b + 1]: the block's d and dmin. */
static void q4k_row(kq_row_t row, int64_t NB, const kq_acts_t *acts, float *sums) {
    KQ_ROWS(q4k_rows, row, NB, acts, sums);
}

/* Bytes of scratch q6k_gemm and q4k_gemm need for M rows of K: xq, xd, bsum, xmin (kq_acts_t). */
int64_t kquant_scratch_bytes(int64_t M, int64_t K) {
    return M * K + M * (K / KQ_BLOCK) * (int64_t)sizeof(float) + M * (K / 16) * (int64_t)sizeof(int16_t) +
           M * (K / 32) * (int64_t)sizeof(float) + 64;
}

typedef void (*kq_row_fn)(kq_row_t, int64_t, const kq_acts_t *, float *);

/* The shared driver: quantize x's rows, then every weight row against them. Per weight row the
 * kind stores code_bytes * NB code bytes, scale_bytes * NB scale bytes and floats * NB floats. */
static int kquant_gemm(kq_row_fn row_fn, int64_t code_bytes, int64_t scale_bytes, int64_t floats, const void *x,
                       const uint8_t *codes, const void *scales, const float *d, void *out, int64_t M, int64_t N,
                       int64_t K, int is_bf16, void *scratch) {
    if (M < 1 || M > KQUANT_MAX_ROWS || K % KQ_BLOCK != 0) return -1;
    const int64_t NB = K / KQ_BLOCK;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(((uintptr_t)(xq + M * K) + 15) & ~(uintptr_t)15);
    int16_t *bsum = (int16_t *)(xd + M * NB);
    float *xmin = (float *)(bsum + M * (K / 16)); /* K / 16 is even: 4-byte aligned */
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, is_bf16, m, K, xq + m * K, xd + m * NB, bsum + m * (K / 16), xmin + m * (K / 32));
    const kq_acts_t acts = {xq, xd, bsum, xmin, M, K};
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float sums[KQUANT_MAX_ROWS];
        const kq_row_t row = {codes + n * NB * code_bytes, (const uint8_t *)scales + n * NB * scale_bytes,
                              d + n * NB * floats};
        row_fn(row, NB, &acts, sums);
        store_column(out, N, n, sums, M, is_bf16);
    }
    return 0;
}

/* x: [M][K] (bfloat16 if is_bf16 else float32), codes: [N][K/256][192], sc: [N][K/16] int8,
 * d: [N][K/256] float, out: [M][N] like x. Returns 0, or -1 if M > KQUANT_MAX_ROWS or K is not a
 * multiple of 256. */
int q6k_gemm(const void *x, const uint8_t *codes, const int8_t *sc, const float *d, void *out, int64_t M,
             int64_t N, int64_t K, int is_bf16, void *scratch) {
    return kquant_gemm(q6k_row, Q6K_CODE_BYTES, 16, 1, x, codes, sc, d, out, M, N, K, is_bf16, scratch);
}

/* As q6k_gemm for Q4_K: codes [N][K/256][128], scale_min [N][K/256][16] uint8 (8 scales, then 8
 * minimums), dm [N][K/256][2] float (d, dmin). */
int q4k_gemm(const void *x, const uint8_t *codes, const uint8_t *scale_min, const float *dm, void *out, int64_t M,
             int64_t N, int64_t K, int is_bf16, void *scratch) {
    return kquant_gemm(q4k_row, Q4K_CODE_BYTES, 16, 2, x, codes, scale_min, dm, out, M, N, K, is_bf16, scratch);
}

/* Whether the vector paths were compiled in (AVX512-BW, AVX2, or NEON's dot products); else the
 * plain C loops. */
int tessera_kquant_vector(void) {
#if TESSERA_AVX512 || TESSERA_AVX2 || TESSERA_NEON_DOTPROD
    return 1;
#else
    return 0;
#endif
}
