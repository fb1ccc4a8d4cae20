/* Decode attention read straight from the paged KV cache (no gathered copy of K/V).
 *
 * One query row per request, grouped-query attention: for each (request, KV head)
 * pair -- run in parallel with OpenMP -- the G query heads that share the KV head
 * score every cached key of the request's blocks, take a softmax, and sum the
 * values. Keys and values are read once from their blocks in place, in the
 * cache's own dtype (bfloat16 widened to float32 on the fly, or float32).
 *
 * Cache layout per layer: [2][Hkv][num_blocks][block_size][D] (keys, then values).
 * Built at install time (or first use) with -O3 -march=native -fopenmp; plain
 * loops with `omp simd` so the compiler vectorises them for the host CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#if TESSERA_AVX512_BF16
#define HAVE_AVX512_BF16 1
#endif
#if TESSERA_AVX2
#define HAVE_AVX2_FMA 1
#endif

#include "bf16.h"
#include "softmax.h"
#include "tessera_kernels.h"

/* Widen one cached row of D elements to float32. */
static inline void load_row(const void *base, int64_t index, int d, int is_bf16, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + index * d;
#pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + index * d, sizeof(float) * d);
    }
}

/* A score soft-capped as the modules' attention does (attention/sdpa.py: tanh(s / c) * c), or as is
 * where cap is 0. */
static inline float capped(float s, float cap) { return cap > 0.f ? tanhf(s / cap) * cap : s; }

#ifdef HAVE_AVX2_FMA
/* float32 values (hosts without native bfloat16): out[0 .. 8 nv) = sum_t p_t * v_t[c .. c + 8 nv)
 * for one query head, the sums kept in registers over all tokens (the generic loop loads and
 * stores them for every token). `nv` is a constant at each call, so `a` stays in registers. */
static inline __attribute__((always_inline)) void values_f32(const float *vb, const int64_t *table,
                                                             int64_t block_size, int64_t D, int64_t c,
                                                             const float *p, int64_t start, int64_t len,
                                                             float *out, const int nv) {
    __m256 a[8];
    for (int j = 0; j < nv; j++) a[j] = _mm256_setzero_ps();
    for (int64_t t = start; t < len; t++) {
        const float *vr = vb + (table[t / block_size] * block_size + t % block_size) * D + c;
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int j = 0; j < nv; j++) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8 * j), a[j]);
    }
    for (int j = 0; j < nv; j++) _mm256_storeu_ps(out + 8 * j, a[j]);
}
#endif

/*
 * q:            [B] rows of q_stride elements, each starting with [Hq][D], in the cache's dtype
 * cache:        [2][Hkv][num_blocks][block_size][D], bfloat16 (is_bf16=1) or float32
 * block_tables: [B][max_blocks] int64
 * seq_lens:     [B] int64 (context length including the new token)
 * out:          [B][Hq][D] in the cache's dtype
 * softcap:      scores (after the scale) become softcap * tanh(score / softcap) (Gemma 2); 0 for none
 * window:       sliding window in tokens, 0 for none
 * sinks:        [Hq] float32 or NULL: per query head, a logit that joins the softmax's denominator
 *               and adds no value (gpt-oss's attention sinks): the maximum starts at it and the sum
 *               gains exp(sink - max)
 * scratch:      B * Hkv * (G * max_len) floats for the scores
 * Limits (checked by the caller): D <= MAX_HEAD_DIM, G <= MAX_GROUP, block_size <= MAX_BLOCK_SIZE.
 */
void paged_decode_attention(const void *q, int64_t q_stride, const void *cache, int is_bf16,
                            const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t B, int64_t Hq,
                            int64_t Hkv,
                            int64_t D, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                            float scale, float softcap, int64_t window, const float *sinks, float *scratch,
                            int64_t max_len) {
    const int64_t G = Hq / Hkv;
    const int64_t plane = num_blocks * block_size; /* rows per (K or V, head) */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < B * Hkv; pair++) {
        const int64_t b = pair / Hkv, h = pair % Hkv;
        const int64_t len = seq_lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int64_t *table = block_tables + b * max_blocks;
        /* This pair's G query rows, widened to float32 (q is in the cache's dtype; rows of a
         * request are q_stride elements apart, its heads contiguous). */
        float qh[MAX_GROUP * MAX_HEAD_DIM];
        for (int64_t i = 0; i < G * D; i++) {
            const int64_t at = b * q_stride + h * G * D + i;
            qh[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)q)[at]) : ((const float *)q)[at];
        }
        float *scores = scratch + pair * G * max_len;
        float row[MAX_HEAD_DIM];
        float kt[MAX_HEAD_DIM * MAX_BLOCK_SIZE]; /* one block of keys, transposed: kt[i * block_size + t] */
        float acc[MAX_GROUP * MAX_HEAD_DIM];
        float maxs[MAX_GROUP], sums[MAX_GROUP];
        for (int64_t g = 0; g < G; g++) maxs[g] = sinks ? sinks[h * G + g] : -INFINITY;
#ifdef HAVE_AVX512_BF16
        if (is_bf16 && D % 32 == 0) {
            /* bfloat16 keys: dot products straight on the stored pairs with VDPBF16PS (float32
             * accumulation), the query rounded to bfloat16 once (it was bfloat16 to begin with
             * in a bfloat16 model). */
            __m512bh qv[16][16];
            const int64_t nv = D / 32;
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < nv; j++)
                    qv[g][j] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qh + g * D + 32 * j + 16),
                                                   _mm512_loadu_ps(qh + g * D + 32 * j));
            const uint16_t *kbase = (const uint16_t *)cache + h * plane * D;
            for (int64_t t = start; t < len; t++) {
                const uint16_t *kr = kbase + (table[t / block_size] * block_size + t % block_size) * D;
                __m512bh kv[16];
                for (int64_t j = 0; j < nv; j++) kv[j] = (__m512bh)_mm512_loadu_si512((const void *)(kr + 32 * j));
                for (int64_t g = 0; g < G; g++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t j = 0; j < nv; j++) a = _mm512_dpbf16_ps(a, kv[j], qv[g][j]);
                    const float v = capped(_mm512_reduce_add_ps(a) * scale, softcap);
                    scores[g * max_len + t] = v;
                    if (v > maxs[g]) maxs[g] = v;
                }
            }
        } else
#endif
#ifdef HAVE_AVX2_FMA
        if (!is_bf16 && D % 16 == 0) {
            /* float32 keys (hosts without native bfloat16): each key row is dotted in place with
             * the G query rows, two FMA chains each, no widened or transposed copy (the block
             * transpose below moved every key element one at a time: ~3x the work here). */
            const float *kbase = (const float *)cache + h * plane * D;
            for (int64_t t = start; t < len; t++) {
                const float *kr = kbase + (table[t / block_size] * block_size + t % block_size) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qh + g * D;
                    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                    for (int64_t i = 0; i < D; i += 16) {
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kr + i), _mm256_loadu_ps(qg + i), a0);
                        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(kr + i + 8), _mm256_loadu_ps(qg + i + 8), a1);
                    }
                    const float v = capped(hsum_ps256(_mm256_add_ps(a0, a1)) * scale, softcap);
                    scores[g * max_len + t] = v;
                    if (v > maxs[g]) maxs[g] = v;
                }
            }
        } else
#endif
        /* Scores, one block at a time: widen and transpose the block's keys, then for each
         * query head accumulate over the head dimension with the block's tokens as the vector
         * lanes, which needs no horizontal sums. */
        for (int64_t t0 = start - start % block_size; t0 < len; t0 += block_size) {
            const int64_t base = h * plane + table[t0 / block_size] * block_size;
            const int64_t n = (len - t0 < block_size) ? len - t0 : block_size;
            for (int64_t t = 0; t < n; t++) {
                load_row(cache, base + t, (int)D, is_bf16, row);
                for (int64_t i = 0; i < D; i++) kt[i * block_size + t] = row[i];
            }
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + g * D;
                float s[64];
#pragma omp simd
                for (int64_t t = 0; t < block_size; t++) s[t] = 0.f;
                for (int64_t i = 0; i < D; i++) {
                    const float qi = qg[i];
                    const float *kr = kt + i * block_size;
#pragma omp simd
                    for (int64_t t = 0; t < block_size; t++) s[t] += qi * kr[t];
                }
                float *sg = scores + g * max_len + t0;
                for (int64_t t = 0; t < n; t++) {
                    if (t0 + t < start) continue;
                    const float v = capped(s[t] * scale, softcap);
                    sg[t] = v;
                    if (v > maxs[g]) maxs[g] = v;
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {
            sums[g] = exp_shifted_sum(scores + g * max_len + start, len - start, maxs[g]);
            if (sinks) sums[g] += expf(sinks[h * G + g] - maxs[g]);
            memset(acc + g * D, 0, sizeof(float) * D);
        }
        const int64_t vbase = (Hkv + h) * plane;
        int64_t t_done = start;
#ifdef HAVE_AVX512_BF16
        if (is_bf16 && D % 32 == 0) {
            /* Values two tokens at a time with VDPBF16PS: interleave the two rows element by
             * element, and each float32 lane gets p_t * v_t[i] + p_t+1 * v_t+1[i] (the
             * probabilities rounded to bfloat16, as the values already are). */
            const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                    39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
            const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
            const uint16_t *vb = (const uint16_t *)cache + vbase * D;
            for (; t_done + 1 < len; t_done += 2) {
                const int64_t t = t_done;
                const uint16_t *v0 = vb + (table[t / block_size] * block_size + t % block_size) * D;
                const uint16_t *v1 = vb + (table[(t + 1) / block_size] * block_size + (t + 1) % block_size) * D;
                for (int64_t j = 0; j < D; j += 32) {
                    const __m512i a = _mm512_loadu_si512((const void *)(v0 + j));
                    const __m512i c = _mm512_loadu_si512((const void *)(v1 + j));
                    const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(a, lo_idx, c);
                    const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(a, hi_idx, c);
                    for (int64_t g = 0; g < G; g++) {
                        const float *sg = scores + g * max_len + t;
                        const __m512bh pp = (__m512bh)_mm512_castps_si512(_mm512_castsi512_ps(
                            _mm512_set1_epi32((int)((uint32_t)f32_to_bf16(sg[0]) |
                                                    ((uint32_t)f32_to_bf16(sg[1]) << 16)))));
                        float *ag = acc + g * D + j;
                        _mm512_storeu_ps(ag, _mm512_dpbf16_ps(_mm512_loadu_ps(ag), lo, pp));
                        _mm512_storeu_ps(ag + 16, _mm512_dpbf16_ps(_mm512_loadu_ps(ag + 16), hi, pp));
                    }
                }
            }
        }
#endif
#ifdef HAVE_AVX2_FMA
        if (!is_bf16 && D % 32 == 0) {
            const float *vb = (const float *)cache + vbase * D;
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < D; c += D % 64 == 0 ? 64 : 32) {
                    if (D % 64 == 0) values_f32(vb, table, block_size, D, c, scores + g * max_len, start, len,
                                                acc + g * D + c, 8);
                    else values_f32(vb, table, block_size, D, c, scores + g * max_len, start, len, acc + g * D + c, 4);
                }
            t_done = len;
        }
#endif
        for (int64_t t = t_done; t < len; t++) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            load_row(cache, vbase + slot, (int)D, is_bf16, row);
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[g * max_len + t];
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t i = 0; i < D; i++) ag[i] += p * row[i];
            }
        }
        for (int64_t g = 0; g < G; g++)
            store_scaled_row(out, (b * Hq + h * G + g) * D, acc + g * D, 1.f / sums[g], D, is_bf16);
    }
}
