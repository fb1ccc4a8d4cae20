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
 * Decode attention: keys widen to int16 pairs (two dims of 16 tokens per load) and meet the query
 * rounded to int16 (one scale per query head: 1/65534 of its largest element, far below the keys'
 * own int8 step) in VPDPWSSD, 32 multiply-adds per instruction into int32 (|sum| <= D * 127 * 32767
 * < 2^31 for D <= 512); values widen to int16 pairs too (two tokens of 16 dims per load) and meet
 * the softmax weights rounded to int16 steps of their block's largest / 32767 (a scale per block and
 * query head, applied with the values' own) in the same instruction. (The
 * query's rounding once cost +0.3 to +14 % perplexity on Qwen2, when its channels were smoothed to
 * span 500x; the key bias's share (below) and the Hadamard transform leave it even.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#if TESSERA_AVX512
#define HAVE_AVX512_Q8 1
#endif

#include "bf16.h"
#include "softmax.h"
#include "tessera_kernels.h"

#ifdef HAVE_AVX512_Q8
/* acc + the products of a's and b's int16 lanes, summed in pairs into int32 lanes (VPDPWSSD where
 * the CPU has AVX512-VNNI, else VPMADDWD and an add). */
static inline __m512i dot_i16_pairs(__m512i acc, __m512i a, __m512i b) {
#if TESSERA_AVX512_VNNI
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#endif

static inline float block_scale(const int8_t *blk, int64_t data_bytes) {
    float s;
    memcpy(&s, blk + data_bytes, sizeof(float));
    return s;
}

/* Ask for the next block while this one is computed: blocks sit anywhere in the cache, so the
 * hardware prefetcher cannot guess where the next one starts. */
static inline void prefetch_block(const int8_t *blk, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(blk + off, 0, 3);
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

/* The keys' (and queries') transform before an int8 cache meets them: kind ROT_NONE none, ROT_MATRIX
 * x <- x @ rot (row-major [D][D]), ROT_HADAMARD the normalized Sylvester Hadamard matrix (rot unused):
 * the same product by butterflies, D log D operations instead of D^2 (a tenth of a 1.5B decode kernel's time). */
static inline void transform_row(float *x, const float *rot, int kind, int64_t D) {
    if (kind == ROT_HADAMARD) {
        for (int64_t h = 1; h < D; h <<= 1)
            for (int64_t i = 0; i < D; i += 2 * h)
#pragma omp simd
                for (int64_t j = i; j < i + h; j++) {
                    const float a = x[j], b = x[j + h];
                    x[j] = a + b;
                    x[j + h] = a - b;
                }
        const float norm = 1.f / sqrtf((float)D);
#pragma omp simd
        for (int64_t j = 0; j < D; j++) x[j] *= norm;
        return;
    }
    if (kind != ROT_MATRIX) return;
    float y[MAX_HEAD_DIM];
    for (int64_t j = 0; j < D; j++) y[j] = 0.f;
    for (int64_t i = 0; i < D; i++) {
        const float xi = x[i];
        const float *r = rot + i * D;
#pragma omp simd
        for (int64_t j = 0; j < D; j++) y[j] += xi * r[j];
    }
    memcpy(x, y, sizeof(float) * D);
}

/* A key bias's share on its outlier RoPE pairs (attention/base.py's KeyBias): pair i of KV head h
 * is channels (pairs[h][i], pairs[h][i] + D/2), its bias (lo[h][i], hi[h][i]), i < m <= KB_MAX. The
 * share of a key at position t is RoPE_t of that bias: on pair p, (lo c - hi s, hi c + lo s) with
 * c, s = cos, sin(t f_p). Writes take c, s for their rows (row_cos / row_sin [T][D/2], float32 from
 * float64 angles); decode attention makes them 16 positions at a time by rotation (below), from
 * basis [D/2][2][16] = cos, sin(l f_p) for l < 16, step [D/2][2] = cos, sin(16 f_p) and freqs
 * [D/2] = f_p, so that no table of positions is read. m == 0: no key bias. */
#define KB_MAX MAX_KEY_BIAS_PAIRS
typedef struct {
    const float *lo, *hi, *row_cos, *row_sin;
    const int64_t *pairs;
    int64_t m;
} key_bias_t;

/* x -= RoPE_t(bias of head h) on the outlier pairs, row r of the write. */
static inline void take_out_key_bias(float *x, const key_bias_t *kb, int64_t h, int64_t r, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < kb->m; i++) {
        const int64_t p = kb->pairs[h * kb->m + i];
        const float c = kb->row_cos[r * half + p], s = kb->row_sin[r * half + p];
        const float bl = kb->lo[h * kb->m + i], bh = kb->hi[h * kb->m + i];
        x[p] -= bl * c - bh * s;
        x[half + p] -= bh * c + bl * s;
    }
}

/* k, v: [T] rows of k_stride / v_stride elements, each starting with [Hkv][D] (bf16 if is_bf16,
 * else float32); slots: [T] int64 cache slots (block * block_size + offset), in order of position
 * within each request. Returns 0, or -1 if D > MAX_HEAD_DIM or D or block_size is odd.
 * k_rot, rot_kind: the keys' transform before rounding (see transform_row); kb_* (kb_m 0 for
 * none): the key bias's share, taken out of each key first (see key_bias_t). Values are stored as
 * they come. */
int kv_write_int8(int8_t *cache, const void *k, int64_t k_stride, const void *v, int64_t v_stride, int is_bf16,
                  const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t num_blocks, int64_t block_size,
                  const float *k_rot, int rot_kind, const float *kb_lo, const float *kb_hi,
                  const int64_t *kb_pairs, int64_t kb_m, const float *kb_row_cos, const float *kb_row_sin) {
    const key_bias_t kb = {kb_lo, kb_hi, kb_row_cos, kb_row_sin, kb_pairs, kb_m};
    if (D > MAX_HEAD_DIM || D % 2 || block_size % 2) return -1;
    const int64_t bs = block_size, data = bs * D, row = data + 4;
#pragma omp parallel for schedule(static)
    for (int64_t pair = 0; pair < 2 * Hkv; pair++) {
        const int64_t which = pair / Hkv, h = pair % Hkv;
        const void *src = which ? v : k;
        const int64_t stride = which ? v_stride : k_stride;
        int8_t *plane = cache + (which * Hkv + h) * num_blocks * row;
        float x[MAX_HEAD_DIM];
        for (int64_t t = 0; t < T; t++) {
            const int64_t at = t * stride + h * D;
            for (int64_t i = 0; i < D; i++)
                x[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)src)[at + i]) : ((const float *)src)[at + i];
            if (!which) {
                if (kb.m) take_out_key_bias(x, &kb, h, t, D);
                transform_row(x, k_rot, rot_kind, D);
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
 * bfloat16 version and the argument conventions, `sinks` included); q and out in bf16 (q_is_bf16) or
 * float32.
 * scratch: B * Hq * P float32 (P = max_len rounded up to whole blocks): scores, then weights. q_rot,
 * rot_kind: the queries' transform, matching the keys' (transform_row). kb_* (kb_m 0 for none): a key bias's share
 * kept out of the cached keys (key_bias_t), added back to each score as q . RoPE_t(bias) =
 * sum_i c (q_i lo_i + q_i' hi_i) + s (q_i' lo_i - q_i hi_i) over the outlier pairs (i' = i + D/2;
 * c, s at key position t: each chunk of 16 positions' are the previous chunk's rotated by 16 f_p,
 * re-anchored from float64 angles every KB_ANCHOR chunks, so they stay within ~1e-5 of the writes').
 * Limits (checked by the caller): D <= MAX_HEAD_DIM and even, G <= MAX_GROUP, block_size even,
 * kb_m <= KB_MAX. */
#define KB_ANCHOR 64
void paged_decode_attention_int8(const void *q, int64_t q_stride, int q_is_bf16, const int8_t *cache,
                                 const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t B,
                                 int64_t Hq, int64_t Hkv, int64_t D, int64_t num_blocks, int64_t block_size,
                                 int64_t max_blocks, float scale, int64_t window, const float *sinks,
                                 void *scratch, int64_t max_len,
                                 const float *q_rot, int rot_kind, const float *kb_lo, const float *kb_hi,
                                 const int64_t *kb_pairs, int64_t kb_m, const float *kb_freqs,
                                 const float *kb_basis, const float *kb_step) {
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
        float qf[MAX_GROUP * MAX_HEAD_DIM], maxs[MAX_GROUP], sums[MAX_GROUP], ka[MAX_GROUP * KB_MAX],
            kbb[MAX_GROUP * KB_MAX];
        const int64_t *hpairs = kb_pairs + h * kb_m;
        for (int64_t g = 0; g < G; g++) {
            for (int64_t i = 0; i < D; i++) {
                const int64_t at = b * q_stride + (h * G + g) * D + i;
                qf[g * D + i] = q_is_bf16 ? bf16_to_f32(((const uint16_t *)q)[at]) : ((const float *)q)[at];
            }
            for (int64_t i = 0; i < kb_m; i++) { /* the bias term's coefficients, from the untransformed q */
                const float ql = qf[g * D + hpairs[i]], qh = qf[g * D + D / 2 + hpairs[i]];
                const float bl = kb_lo[h * kb_m + i], bh = kb_hi[h * kb_m + i];
                ka[g * KB_MAX + i] = ql * bl + qh * bh;
                kbb[g * KB_MAX + i] = qh * bl - ql * bh;
            }
            transform_row(qf + g * D, q_rot, rot_kind, D);
            maxs[g] = sinks ? sinks[h * G + g] : -INFINITY;
        }
#ifdef HAVE_AVX512_Q8
        /* The transformed query in int16, its dims (2p, 2p+1) packed in one int32 (low, high). */
        float qs[16];
        int32_t qp[16 * 256];
        if (vector)
            for (int64_t g = 0; g < G; g++) {
                float amax = 0.f;
                for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(qf[g * D + i]));
                qs[g] = amax > 0.f ? amax / 32767.f : 1.f;
                const float inv = 1.f / qs[g];
                for (int64_t p = 0; p < D / 2; p++) {
                    const int16_t lo = (int16_t)fmaxf(-32767.f, fminf(32767.f, rintf(qf[g * D + 2 * p] * inv)));
                    const int16_t hi = (int16_t)fmaxf(-32767.f, fminf(32767.f, rintf(qf[g * D + 2 * p + 1] * inv)));
                    qp[g * (D / 2) + p] = (int32_t)((uint32_t)(uint16_t)lo | ((uint32_t)(uint16_t)hi << 16));
                }
            }
#endif
        /* Scores: every token of the touched blocks (those outside [start, len) are ignored below). */
        const int8_t *kplane = cache + h * plane;
        for (int64_t j = first_block; j < end_block; j++) {
            const int8_t *blk = kplane + table[j] * row;
            const float sk = block_scale(blk, data) * scale;
            if (j + 1 < end_block) prefetch_block(kplane + table[j + 1] * row, row);
#ifdef HAVE_AVX512_Q8
            if (vector) {
                for (int64_t t16 = 0; t16 < bs; t16 += 16) {
                    __m512i acc[16];
                    for (int64_t g = 0; g < G; g++) acc[g] = _mm512_setzero_si512();
                    for (int64_t p = 0; p < D / 2; p++) {
                        /* 16 tokens' dims 2p and 2p+1 as int16 pairs, one token per 32-bit lane. */
                        const __m512i kv = _mm512_cvtepi8_epi16(
                            _mm256_loadu_si256((const __m256i *)(blk + (p * bs + t16) * 2)));
                        for (int64_t g = 0; g < G; g++)
                            acc[g] = dot_i16_pairs(acc[g], kv, _mm512_set1_epi32(qp[g * (D / 2) + p]));
                    }
                    for (int64_t g = 0; g < G; g++)
                        _mm512_storeu_ps(scores + g * P + j * bs + t16,
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(acc[g]), _mm512_set1_ps(sk * qs[g])));
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
                __m512 cs[KB_MAX], sn[KB_MAX]; /* each pair's cos, sin at the chunk's 16 positions */
                for (int64_t t0 = start & ~(int64_t)15, k = 0; t0 < len; t0 += 16, k++) {
                    if (k % KB_ANCHOR == 0)
                        for (int64_t i = 0; i < kb_m; i++) { /* the basis rotated by t0 f_p, from float64 */
                            const double a = (double)t0 * (double)kb_freqs[hpairs[i]];
                            const __m512 ca = _mm512_set1_ps((float)cos(a)), sa = _mm512_set1_ps((float)sin(a));
                            const __m512 bc = _mm512_loadu_ps(kb_basis + hpairs[i] * 32);
                            const __m512 bs_ = _mm512_loadu_ps(kb_basis + hpairs[i] * 32 + 16);
                            cs[i] = _mm512_fmsub_ps(bc, ca, _mm512_mul_ps(bs_, sa));
                            sn[i] = _mm512_fmadd_ps(bs_, ca, _mm512_mul_ps(bc, sa));
                        }
                    __m512 acc[16];
                    for (int64_t g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
                    for (int64_t i = 0; i < kb_m; i++) {
                        const __m512 c = cs[i], sv_ = sn[i];
                        for (int64_t g = 0; g < G; g++) {
                            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(ka[g * KB_MAX + i]), c, acc[g]);
                            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(kbb[g * KB_MAX + i]), sv_, acc[g]);
                        }
                        const __m512 c16 = _mm512_set1_ps(kb_step[hpairs[i] * 2]);
                        const __m512 s16 = _mm512_set1_ps(kb_step[hpairs[i] * 2 + 1]);
                        cs[i] = _mm512_fmsub_ps(c, c16, _mm512_mul_ps(sv_, s16));
                        sn[i] = _mm512_fmadd_ps(sv_, c16, _mm512_mul_ps(c, s16));
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
                for (int64_t i = 0; i < kb_m; i++) {
                    const double a = (double)t * (double)kb_freqs[hpairs[i]];
                    const float c = (float)cos(a), sn_ = (float)sin(a);
                    for (int64_t g = 0; g < G; g++)
                        scores[g * P + t] += (ka[g * KB_MAX + i] * c + kbb[g * KB_MAX + i] * sn_) * scale;
                }
        }
        for (int64_t g = 0; g < G; g++) {
            const float *sg = scores + g * P;
            for (int64_t t = start; t < len; t++)
                if (sg[t] > maxs[g]) maxs[g] = sg[t];
        }
        /* Weights e = exp(s - max) in (0, 1], in place of the scores; zero outside [start, len). */
        const int64_t nblk = end_block - first_block;
#ifdef HAVE_AVX512_Q8
        float *wscale = vector ? malloc(sizeof(float) * G * (nblk > 0 ? nblk : 1)) : NULL;
#endif
        for (int64_t g = 0; g < G; g++) {
            float *sg = scores + g * P;
            const float m = maxs[g];
            for (int64_t t = first_block * bs; t < start; t++) sg[t] = 0.f;
            sums[g] = exp_shifted_sum(sg + start, len - start, m);
            if (sinks) sums[g] += expf(sinks[h * G + g] - m);
            for (int64_t t = len; t < end_block * bs; t++) sg[t] = 0.f;
#ifdef HAVE_AVX512_Q8
            if (vector) /* in int16 steps of each block's largest / 32767: token t's at int16 t, in place */
                for (int64_t j = first_block; j < end_block; j++) {
                    __m512 mx = _mm512_setzero_ps();
                    for (int64_t t = j * bs; t < (j + 1) * bs; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
                    const float wmax = _mm512_reduce_max_ps(mx);
                    wscale[g * nblk + j - first_block] = wmax / 32767.f;
                    const __m512 inv = _mm512_set1_ps(wmax > 0.f ? 32767.f / wmax : 0.f);
                    for (int64_t t = j * bs; t < (j + 1) * bs; t += 16) /* bytes [2t, 2t + 32) <= [4t, 4t + 64): read */
                        _mm256_storeu_si256((__m256i *)((int16_t *)sg + t),
                                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(sg + t), inv))));
                }
#endif
        }
        float acc[MAX_GROUP * MAX_HEAD_DIM];
        memset(acc, 0, sizeof(float) * G * D);
        const int8_t *vplane = cache + (Hkv + h) * plane;
        for (int64_t j = first_block; j < end_block; j++) {
            const int8_t *blk = vplane + table[j] * row;
            const float sv = block_scale(blk, data);
            if (j + 1 < end_block) prefetch_block(vplane + table[j + 1] * row, row);
#ifdef HAVE_AVX512_Q8
            if (vector) {
                /* 16 dims of two tokens per load as int16 pairs (one dim per 32-bit lane), against
                 * the two tokens' int16 weights; int32 within a block (|sum| <= bs * 127 * 32767). */
                for (int64_t i0 = 0; i0 < D; i0 += 16) {
                    __m512i a[16];
                    for (int64_t g = 0; g < G; g++) a[g] = _mm512_setzero_si512();
                    for (int64_t tp = 0; tp < bs / 2; tp++) {
                        const __m512i vv = _mm512_cvtepi8_epi16(
                            _mm256_loadu_si256((const __m256i *)(blk + (tp * D + i0) * 2)));
                        for (int64_t g = 0; g < G; g++) { /* tokens 2tp, 2tp + 1: one int32 of int16 weights */
                            const int32_t *wp = (const int32_t *)(scores + g * P);
                            a[g] = dot_i16_pairs(a[g], vv, _mm512_set1_epi32(wp[(j * bs) / 2 + tp]));
                        }
                    }
                    for (int64_t g = 0; g < G; g++) {
                        float *ag = acc + g * D + i0;
                        const __m512 s = _mm512_set1_ps(sv * wscale[g * nblk + j - first_block]);
                        _mm512_storeu_ps(ag, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[g]), s, _mm512_loadu_ps(ag)));
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
#ifdef HAVE_AVX512_Q8
        free(wscale);
#endif
    }
}
