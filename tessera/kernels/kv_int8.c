/* A KV cache in int8 with one float32 scale per (K or V, KV head, block): writes and decode attention.
 *
 * Layout per layer: int8 [2][Hkv][num_blocks][row], row = block_size * D + 4: the block's data, then
 * its scale (float32, the last 4 bytes). Keeping the scale inside the block means whatever moves
 * blocks (swap, a disk tier) moves their scales with them. Within a block the int8 data is laid out
 * so that one 32-byte load widens to 16 lanes of int16 pairs:
 *   keys   [D/2][block_size][2]: for each pair of dimensions, the tokens in order, the two values of
 *          a token side by side -- 16 tokens' (k[2p], k[2p+1]), split into two float vectors, each
 *          multiplied by one broadcast query element (tokens are the lanes: no horizontal sums);
 *   values [block_size/2][D][2]: for each pair of tokens, the dimensions in order, the two tokens'
 *          values side by side -- one load widens 16 dims of two tokens.
 * (Block size and head dim must be even; the vector path wants block_size % 16 == 0 and D % 32 == 0,
 * the plain loops below take the rest.)
 *
 * Writes quantize each new row with its block's scale. A block's scale is reset by a write at
 * offset 0 (a block is always filled from its start) and grows when a new row's largest magnitude
 * does not fit: the rows already in the block are then re-rounded to the larger scale. So a scale is
 * the largest magnitude of its block's rows / 127 (at most half a step of extra error per growth).
 *
 * Decode attention: keys and values are widened to float32 (two tokens or two dims per load) and
 * meet the float32 query and softmax weights in FMAs. (Rounding the query and the weights to int16
 * for VPDPWSSD was faster but cost +0.3 to +14 % perplexity on the Qwen2 models, whose smoothed
 * queries span 500x between channels.)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_Q8 1
#endif

#include "bf16.h"

static inline float block_scale(const int8_t *blk, int64_t data_bytes) {
    float s;
    memcpy(&s, blk + data_bytes, sizeof(float));
    return s;
}

static inline int8_t quantize(float x, float inv) {
    float r = rintf(x * inv);
    if (r > 127.f) r = 127.f;
    if (r < -127.f) r = -127.f;
    return (int8_t)r;
}

/* Byte offset of (token t, dim i) inside a block's data. */
static inline int64_t key_at(int64_t t, int64_t i, int64_t bs) { return (i >> 1) * bs * 2 + t * 2 + (i & 1); }
static inline int64_t val_at(int64_t t, int64_t i, int64_t D) { return (t >> 1) * D * 2 + i * 2 + (t & 1); }

/* k, v: [T] rows of k_stride / v_stride elements, each starting with [Hkv][D] (bf16 if is_bf16,
 * else float32); slots: [T] int64 cache slots (block * block_size + offset), in order of position
 * within each request. Returns 0, or -1 if D > 512 or D or block_size is odd. */
static inline void transform_row(float *x, const float *rot, int64_t D) {
    /* x <- x @ rot, rot row-major [D][D] (NULL: unchanged). */
    if (!rot) return;
    float y[512];
    for (int64_t j = 0; j < D; j++) y[j] = 0.f;
    for (int64_t i = 0; i < D; i++) {
        const float xi = x[i];
        const float *r = rot + i * D;
#pragma omp simd
        for (int64_t j = 0; j < D; j++) y[j] += xi * r[j];
    }
    memcpy(x, y, sizeof(float) * D);
}

/* A key bias's share on its outlier RoPE pairs (attention/base.py's KeyBias): pair i is channels
 * (pairs[i], pairs[i] + D/2), its bias (lo[h][i], hi[h][i]) for KV head h; table: float32
 * [N/16][D][16], the model's rotary tables in chunks of 16 positions: entry (p / 16, j, p % 16) is
 * cos(p f_j) for j < D/2 and sin(p f_{j - D/2}) above (so one chunk's values of every pair are
 * together, 16 positions to a vector). The share of a key at position p is RoPE_p of that bias.
 * m == 0: no key bias. */
typedef struct {
    const float *lo, *hi, *table;
    const int64_t *pairs;
    int64_t m, n;
} key_bias_t;

static inline float kb_at(const float *table, int64_t D, int64_t row, int64_t pos) {
    return table[((pos >> 4) * D + row) * 16 + (pos & 15)];
}

/* x -= RoPE_pos(bias of head h) on the outlier pairs. */
static inline void take_out_key_bias(float *x, const key_bias_t *kb, int64_t h, int64_t pos, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < kb->m; i++) {
        const int64_t p = kb->pairs[i];
        const float c = kb_at(kb->table, D, p, pos), s = kb_at(kb->table, D, half + p, pos);
        const float bl = kb->lo[h * kb->m + i], bh = kb->hi[h * kb->m + i];
        x[p] -= bl * c - bh * s;
        x[half + p] -= bh * c + bl * s;
    }
}

/* k_rot: the keys' transform before rounding (see transform_row), NULL for none; kb_* (kb_m 0 for
 * none) and positions [T]: the key bias's share, taken out of each key first (see key_bias_t).
 * Values are stored as they come. */
int kv_write_int8(int8_t *cache, const void *k, int64_t k_stride, const void *v, int64_t v_stride, int is_bf16,
                  const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t num_blocks, int64_t block_size,
                  const float *k_rot, const float *kb_lo, const float *kb_hi, const int64_t *kb_pairs,
                  int64_t kb_m, const float *kb_table, int64_t kb_n, const int64_t *positions) {
    const key_bias_t kb = {kb_lo, kb_hi, kb_table, kb_pairs, kb_m, kb_n};
    if (D > 512 || D % 2 || block_size % 2) return -1;
    const int64_t bs = block_size, data = bs * D, row = data + 4;
#pragma omp parallel for schedule(static)
    for (int64_t pair = 0; pair < 2 * Hkv; pair++) {
        const int64_t which = pair / Hkv, h = pair % Hkv;
        const void *src = which ? v : k;
        const int64_t stride = which ? v_stride : k_stride;
        int8_t *plane = cache + (which * Hkv + h) * num_blocks * row;
        float x[512];
        for (int64_t t = 0; t < T; t++) {
            const int64_t at = t * stride + h * D;
            for (int64_t i = 0; i < D; i++)
                x[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)src)[at + i]) : ((const float *)src)[at + i];
            if (!which) {
                if (kb.m) take_out_key_bias(x, &kb, h, positions[t], D);
                transform_row(x, k_rot, D);
            }
            float amax = 0.f;
            for (int64_t i = 0; i < D; i++) {
                const float a = fabsf(x[i]);
                if (a > amax) amax = a;
            }
            const int64_t slot = slots[t], off = slot % bs;
            int8_t *blk = plane + (slot / bs) * row;
            float s = off == 0 ? 0.f : block_scale(blk, data);
            if (!(s >= 0.f) || isinf(s)) s = 0.f; /* never trust garbage in a reused block */
            if (amax > s * 127.f) {
                const float grown = amax / 127.f;
                const float ratio = s / grown; /* 0 when the block starts here: earlier rows zeroed */
                for (int64_t u = 0; u < off; u++)
                    for (int64_t i = 0; i < D; i++) {
                        int8_t *e = blk + (which ? val_at(u, i, D) : key_at(u, i, bs));
                        *e = quantize((float)*e, ratio);
                    }
                s = grown;
                memcpy(blk + data, &s, sizeof(float));
            }
            const float inv = s > 0.f ? 1.f / s : 0.f;
            for (int64_t i = 0; i < D; i++) blk[which ? val_at(off, i, D) : key_at(off, i, bs)] = quantize(x[i], inv);
        }
    }
    return 0;
}

/* Decode attention over the int8 cache, one query row per request (see paged_attention.c for the
 * bfloat16 version and the argument conventions); q and out in bf16 (q_is_bf16) or float32.
 * scratch: B * Hq * P float32 (P = max_len rounded up to whole blocks): scores, then weights. q_rot
 * ([D][D]): the queries' transform, matching the keys'. kb_* (kb_m 0 for none): a key bias's share
 * kept out of the cached keys (key_bias_t; kb_n >= max_len positions), added back
 * to each score as q . RoPE_t(bias) = sum_i c (q_i lo_i + q_i' hi_i) + s (q_i' lo_i - q_i hi_i) over
 * the outlier pairs (i' = i + D/2; c, s at key position t). Limits (checked by the caller): D <= 512
 * and even, G <= 16, block_size even, kb_m <= 64. */
void paged_decode_attention_int8(const void *q, int64_t q_stride, int q_is_bf16, const int8_t *cache,
                                 const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t B,
                                 int64_t Hq, int64_t Hkv, int64_t D, int64_t num_blocks, int64_t block_size,
                                 int64_t max_blocks, float scale, int64_t window, void *scratch, int64_t max_len,
                                 const float *q_rot, const float *kb_lo, const float *kb_hi,
                                 const int64_t *kb_pairs, int64_t kb_m, const float *kb_table, int64_t kb_n) {
    const int64_t G = Hq / Hkv, bs = block_size;
    const int64_t data = bs * D, row = data + 4;
    const int64_t plane = num_blocks * row;
    const int64_t P = (max_len + bs - 1) / bs * bs; /* scores per query head, whole blocks */
#ifdef HAVE_AVX512_Q8
    const int vector = bs % 16 == 0 && D % 32 == 0;
#endif
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < B * Hkv; pair++) {
        const int64_t b = pair / Hkv, h = pair % Hkv;
        const int64_t len = seq_lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int64_t first_block = start / bs, end_block = (len + bs - 1) / bs;
        const int64_t *table = block_tables + b * max_blocks;
        float *scores = (float *)scratch + pair * G * P;
        float qf[16 * 512], maxs[16], sums[16], ka[16 * 64], kbb[16 * 64];
        for (int64_t g = 0; g < G; g++) {
            for (int64_t i = 0; i < D; i++) {
                const int64_t at = b * q_stride + (h * G + g) * D + i;
                qf[g * D + i] = q_is_bf16 ? bf16_to_f32(((const uint16_t *)q)[at]) : ((const float *)q)[at];
            }
            for (int64_t i = 0; i < kb_m; i++) { /* the bias term's coefficients, from the untransformed q */
                const float ql = qf[g * D + kb_pairs[i]], qh = qf[g * D + D / 2 + kb_pairs[i]];
                const float bl = kb_lo[h * kb_m + i], bh = kb_hi[h * kb_m + i];
                ka[g * 64 + i] = ql * bl + qh * bh;
                kbb[g * 64 + i] = qh * bl - ql * bh;
            }
            transform_row(qf + g * D, q_rot, D);
            maxs[g] = -INFINITY;
        }
        /* Scores: every token of the touched blocks (those outside [start, len) are ignored below). */
        const int8_t *kplane = cache + h * plane;
        for (int64_t j = first_block; j < end_block; j++) {
            const int8_t *blk = kplane + table[j] * row;
            const float sk = block_scale(blk, data) * scale;
#ifdef HAVE_AVX512_Q8
            if (vector) {
                for (int64_t t16 = 0; t16 < bs; t16 += 16) {
                    __m512 acc[16];
                    for (int64_t g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
                    for (int64_t p = 0; p < D / 2; p++) {
                        /* 16 tokens' dims 2p and 2p+1, side by side: split into two float vectors. */
                        const __m512i kv = _mm512_cvtepi8_epi16(
                            _mm256_loadu_si256((const __m256i *)(blk + (p * bs + t16) * 2)));
                        const __m512 k0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(kv, 16), 16));
                        const __m512 k1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(kv, 16));
                        for (int64_t g = 0; g < G; g++) {
                            const float *qg = qf + g * D + 2 * p;
                            acc[g] = _mm512_fmadd_ps(k0, _mm512_set1_ps(qg[0]), acc[g]);
                            acc[g] = _mm512_fmadd_ps(k1, _mm512_set1_ps(qg[1]), acc[g]);
                        }
                    }
                    for (int64_t g = 0; g < G; g++)
                        _mm512_storeu_ps(scores + g * P + j * bs + t16, _mm512_mul_ps(acc[g], _mm512_set1_ps(sk)));
                }
            } else
#endif
            for (int64_t t = 0; t < bs; t++)
                for (int64_t g = 0; g < G; g++) {
                    float dot = 0.f;
                    for (int64_t i = 0; i < D; i++) dot += qf[g * D + i] * (float)blk[key_at(t, i, bs)];
                    scores[g * P + j * bs + t] = dot * sk;
                }
        }
        if (kb_m) { /* the key bias's term, 16 positions at a time (scores outside [start, len) are unused) */
#ifdef HAVE_AVX512_Q8
            if (vector) {
                for (int64_t t0 = start & ~(int64_t)15; t0 < len; t0 += 16) {
                    const float *chunk = kb_table + (t0 >> 4) * D * 16;
                    __m512 acc[16];
                    for (int64_t g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
                    for (int64_t i = 0; i < kb_m; i++) {
                        const __m512 c = _mm512_loadu_ps(chunk + kb_pairs[i] * 16);
                        const __m512 sn = _mm512_loadu_ps(chunk + (D / 2 + kb_pairs[i]) * 16);
                        for (int64_t g = 0; g < G; g++) {
                            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(ka[g * 64 + i]), c, acc[g]);
                            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(kbb[g * 64 + i]), sn, acc[g]);
                        }
                    }
                    const __m512 sc = _mm512_set1_ps(scale);
                    for (int64_t g = 0; g < G; g++) {
                        float *sg = scores + g * P + t0;
                        _mm512_storeu_ps(sg, _mm512_fmadd_ps(acc[g], sc, _mm512_loadu_ps(sg)));
                    }
                }
            } else
#endif
            for (int64_t t = start; t < len; t++)
                for (int64_t g = 0; g < G; g++) {
                    float term = 0.f;
                    for (int64_t i = 0; i < kb_m; i++)
                        term += ka[g * 64 + i] * kb_at(kb_table, D, kb_pairs[i], t) +
                                kbb[g * 64 + i] * kb_at(kb_table, D, D / 2 + kb_pairs[i], t);
                    scores[g * P + t] += term * scale;
                }
        }
        for (int64_t g = 0; g < G; g++) {
            const float *sg = scores + g * P;
            for (int64_t t = start; t < len; t++)
                if (sg[t] > maxs[g]) maxs[g] = sg[t];
        }
        /* Weights e = exp(s - max) in (0, 1], in place of the scores; zero outside [start, len). */
        for (int64_t g = 0; g < G; g++) {
            float *sg = scores + g * P;
            const float m = maxs[g];
            float sum = 0.f;
            for (int64_t t = first_block * bs; t < start; t++) sg[t] = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = start; t < len; t++) {
                const float e = expf(sg[t] - m);
                sg[t] = e;
                sum += e;
            }
            for (int64_t t = len; t < end_block * bs; t++) sg[t] = 0.f;
            sums[g] = sum;
        }
        float acc[16 * 512];
        memset(acc, 0, sizeof(float) * G * D);
        const int8_t *vplane = cache + (Hkv + h) * plane;
        for (int64_t j = first_block; j < end_block; j++) {
            const int8_t *blk = vplane + table[j] * row;
            const float sv = block_scale(blk, data);
#ifdef HAVE_AVX512_Q8
            if (vector) {
                /* 16 dims of two tokens per load, split into the two tokens' float32 vectors. */
                for (int64_t i0 = 0; i0 < D; i0 += 16) {
                    __m512 a[16];
                    for (int64_t g = 0; g < G; g++) a[g] = _mm512_setzero_ps();
                    for (int64_t tp = 0; tp < bs / 2; tp++) {
                        const __m512i vv = _mm512_cvtepi8_epi16(
                            _mm256_loadu_si256((const __m256i *)(blk + (tp * D + i0) * 2)));
                        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(vv, 16), 16));
                        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(vv, 16));
                        for (int64_t g = 0; g < G; g++) {
                            const float *pg = scores + g * P + j * bs + 2 * tp;
                            a[g] = _mm512_fmadd_ps(v0, _mm512_set1_ps(pg[0]), a[g]);
                            a[g] = _mm512_fmadd_ps(v1, _mm512_set1_ps(pg[1]), a[g]);
                        }
                    }
                    const __m512 s = _mm512_set1_ps(sv);
                    for (int64_t g = 0; g < G; g++) {
                        float *ag = acc + g * D + i0;
                        _mm512_storeu_ps(ag, _mm512_fmadd_ps(a[g], s, _mm512_loadu_ps(ag)));
                    }
                }
                continue;
            }
#endif
            for (int64_t t = 0; t < bs; t++)
                for (int64_t g = 0; g < G; g++) {
                    const float p = scores[g * P + j * bs + t] * sv;
                    if (p == 0.f) continue;
                    for (int64_t i = 0; i < D; i++) acc[g * D + i] += p * (float)blk[val_at(t, i, D)];
                }
        }
        for (int64_t g = 0; g < G; g++)
            store_scaled_row(out, (b * Hq + h * G + g) * D, acc + g * D, 1.f / sums[g], D, q_is_bf16);
    }
}
