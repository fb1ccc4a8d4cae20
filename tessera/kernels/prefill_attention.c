/* Prefill attention read from the paged bfloat16 KV cache: causal query chunks, with or without
 * cached context (a prompt's first chunk, its later chunks, a prefix-cache hit), in one call per
 * layer for all of a step's prefill requests.
 *
 * Why not SDPA: PyTorch's CPU flash kernel ran SmolLM2-135M's prompts (64-dimensional heads,
 * 100-400 tokens) at 50-100 GFLOP/s, and a chunk with cached context had to gather its keys into a
 * padded tensor and take a masked call for every prompt of the step; a step of ~1,000 prompt
 * tokens spent 300-650 ms of 1.3-1.6 s in attention. Here the keys and values are read where
 * they lie, the query heads that share a KV head are scored together, and the products are
 * VDPBF16PS dot products (float32 sums) with an online softmax (flash attention's order).
 *
 * Two passes, one parallel region:
 * 1. Each request's keys are transposed into tiles of 16 keys ([tile][D/2][16] bfloat16 pairs, so
 *    16 keys are the lanes of one register) and its values interleaved in key pairs ([pair][D]
 *    (v_2p[d], v_2p+1[d])), from the first key any of its queries sees (sliding window) to its
 *    last, padded with zeros to whole blocks of 64 keys. Done once, read by every query tile.
 * 2. Work items are (request, KV head, tile of up to 16 query rows). A tile's query vectors
 *    (G heads x rows, row-major) go R at a time: for every block of 64 keys up to the group's last
 *    position, scores S = q . k (R x 4 registers), the causal / window mask where the block
 *    crosses it, the running maximum and sum, and O += P V with the probabilities rounded to
 *    bfloat16 (as the values are).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif

#include "bf16.h"
#include "softmax.h"

#define PF_KEYS 64    /* keys per block of the inner loop: 4 registers of 16 lanes */
#define PF_TILE 16    /* query rows per work item */
#define PF_MAX_D 256
#define PF_MAX_G 16

/* First key a request's queries see: the window's start for its first query, rounded down to a
 * block (the transposed copies start there). */
static int64_t first_key(int64_t seq_len, int64_t qlen, int64_t window) {
    const int64_t pos0 = seq_len - qlen;
    const int64_t lo = (window > 0 && pos0 - window + 1 > 0) ? pos0 - window + 1 : 0;
    return lo - lo % PF_KEYS;
}

static int64_t padded_keys(int64_t seq_len, int64_t qlen, int64_t window) {
    const int64_t n = seq_len - first_key(seq_len, qlen, window);
    return (n + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
}

/* A request's place in the step: its scratch offset (in pairs), its first key-block and query-tile
 * items of the two flattened loops, its first copied key and its copied keys (whole blocks). */
typedef struct {
    int64_t off, first_block, first_tile, kbase, keys;
} req_t;

/* Scratch bytes for the step: each request's transposed keys and paired values, per KV head. */
int64_t prefill_attention_scratch_bytes(const int64_t *q_start, const int64_t *seq_lens, int64_t B, int64_t Hkv,
                                        int64_t D, int64_t window) {
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++)
        total += 2 * Hkv * padded_keys(seq_lens[b], q_start[b + 1] - q_start[b], window) * D * 2;
    return total;
}

#ifdef HAVE_AVX512_BF16
/* One group of R query vectors against one block of 64 keys (kt: the block's 4 key tiles; vp: its
 * 32 value pairs), updating their running max m, sum l and unnormalized output o[R][D]. pos: each
 * vector's position; kpos0: the block's first key position; masked: whether the block crosses a
 * vector's causal or window edge. NC = D / 16. */
static inline __attribute__((always_inline)) void block_update(const int R, const int NC, const uint32_t *qd,
                                                                int64_t qd_stride, const uint32_t *kt,
                                                                const uint32_t *vp, const int64_t *pos,
                                                                int64_t kpos0, int64_t window, int masked,
                                                                float scale, float *m, float *l, float *o) {
    const int64_t D2 = NC * 8; /* bfloat16 pairs per row */
    __m512 s[4][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++) s[r][t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < D2; j++) {
        __m512bh k[4];
        for (int t = 0; t < 4; t++) k[t] = (__m512bh)_mm512_loadu_si512((const void *)(kt + (t * D2 + j) * 16));
        for (int r = 0; r < R; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qd[r * qd_stride + j]);
            for (int t = 0; t < 4; t++) s[r][t] = _mm512_dpbf16_ps(s[r][t], k[t], qb);
        }
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    uint32_t pp[4][PF_KEYS / 2];
    float alpha[4];
    int live[4];
    for (int r = 0; r < R; r++) {
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < 4; t++) {
            s[r][t] = _mm512_mul_ps(s[r][t], _mm512_set1_ps(scale));
            if (masked) {
                const __m512i kp = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(kpos0 + 16 * t)));
                __mmask16 keep = _mm512_cmple_epi32_mask(kp, _mm512_set1_epi32((int)pos[r]));
                if (window > 0)
                    keep &= _mm512_cmpgt_epi32_mask(kp, _mm512_set1_epi32((int)(pos[r] - window)));
                s[r][t] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), s[r][t]);
            }
            mx = _mm512_max_ps(mx, s[r][t]);
        }
        const float bm = _mm512_reduce_max_ps(mx);
        live[r] = bm != -INFINITY;
        if (!live[r]) { /* every key of the block is outside this vector's range */
            memset(pp[r], 0, sizeof(pp[r]));
            alpha[r] = 1.f;
            continue;
        }
        const float mnew = bm > m[r] ? bm : m[r];
        alpha[r] = expf(m[r] - mnew); /* 0 on the first live block (m = -inf) */
        m[r] = mnew;
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < 4; t++) {
            s[r][t] = exp_ps(_mm512_sub_ps(s[r][t], _mm512_set1_ps(mnew)));
            sum = _mm512_add_ps(sum, s[r][t]);
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        /* Probabilities as bfloat16 pairs: cvtne2ps_pbh(hi, lo) puts lo's 16 values in the low
         * half, so dword p of the pair of registers is keys (2p, 2p + 1), as the values are paired. */
        for (int t = 0; t < 4; t += 2)
            _mm512_storeu_si512((void *)(pp[r] + 8 * t), (__m512i)_mm512_cvtne2ps_pbh(s[r][t + 1], s[r][t]));
    }
    for (int c = 0; c < NC; c++) {
        __m512 acc[4];
        for (int r = 0; r < R; r++) acc[r] = _mm512_mul_ps(_mm512_loadu_ps(o + r * NC * 16 + c * 16),
                                                          _mm512_set1_ps(alpha[r]));
        for (int p = 0; p < PF_KEYS / 2; p++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512((const void *)(vp + p * NC * 16 + c * 16));
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], v, (__m512bh)_mm512_set1_epi32((int)pp[r][p]));
        }
        for (int r = 0; r < R; r++) _mm512_storeu_ps(o + r * NC * 16 + c * 16, acc[r]);
    }
}

/* The query vectors of one work item, R at a time, over their key blocks. */
static inline __attribute__((always_inline)) void tile_attend(const int R, const int NC, const uint32_t *const *qrows,
                                                               const int64_t *qpos, int64_t nq, const uint32_t *kt,
                                                               const uint32_t *vp, int64_t kbase, int64_t window,
                                                               float scale, uint16_t *const *orows) {
    const int64_t D = NC * 16;
    for (int64_t v0 = 0; v0 < nq; v0 += R) {
        uint32_t qd[4 * PF_MAX_D / 2];
        int64_t pos[4];
        float m[4], l[4];
        float o[4 * PF_MAX_D];
        int64_t lo = INT64_MAX, hi = 0;
        for (int r = 0; r < R; r++) {
            const int64_t v = v0 + r < nq ? v0 + r : nq - 1; /* the last group is padded with copies */
            memcpy(qd + r * D / 2, qrows[v], D * 2);
            pos[r] = qpos[v];
            m[r] = -INFINITY;
            l[r] = 0.f;
            const int64_t first = window > 0 && pos[r] - window + 1 > 0 ? pos[r] - window + 1 : 0;
            if (first < lo) lo = first;
            if (pos[r] > hi) hi = pos[r];
        }
        memset(o, 0, sizeof(float) * R * D);
        int64_t pmin = pos[0], wmax = 0;
        for (int r = 1; r < R; r++) if (pos[r] < pmin) pmin = pos[r];
        if (window > 0) {
            wmax = pos[0] - window + 1;
            for (int r = 1; r < R; r++) if (pos[r] - window + 1 > wmax) wmax = pos[r] - window + 1;
        }
        for (int64_t k0 = lo - (lo - kbase) % PF_KEYS; k0 <= hi; k0 += PF_KEYS) {
            const int64_t blk = (k0 - kbase) / PF_KEYS;
            const int masked = k0 + PF_KEYS - 1 > pmin || (window > 0 && k0 < wmax);
            block_update(R, NC, qd, D / 2, kt + blk * PF_KEYS * D / 2, vp + blk * PF_KEYS * D / 2, pos, k0,
                         window, masked, scale, m, l, o);
        }
        for (int r = 0; r < R && v0 + r < nq; r++)
            store_scaled_row(orows[v0 + r], 0, o + r * D, 1.f / l[r], D, 1);
    }
}
#endif

/*
 * q:            prefill rows [T] of q_stride elements, each starting with [Hq][D] bfloat16
 * cache:        [2][Hkv][num_blocks][block_size][D] bfloat16, the step's keys and values written
 * block_tables: [B][max_blocks] int64
 * q_start:      [B + 1] int64, request b's rows are q_start[b] .. q_start[b + 1]
 * seq_lens:     [B] int64, context of request b including its rows (its last row's position + 1)
 * out:          [T][Hq][D] bfloat16
 * window:       sliding window in tokens, 0 for none
 * scratch:      prefill_attention_scratch_bytes(...) bytes
 * Returns 0, or -1 where this build or shape is not handled (no AVX512-BF16; D not a multiple of
 * 32 or over 256; more than 16 query heads per KV head): the caller then uses PyTorch.
 */
int paged_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *cache,
                                 const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                 const int64_t *seq_lens, uint16_t *out, int64_t B, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                                 uint8_t *scratch) {
#ifdef HAVE_AVX512_BF16
    const int64_t G = Hq / Hkv;
    if (D % 32 || D > PF_MAX_D || G > PF_MAX_G || G * Hkv != Hq) return -1;
    const int NC = (int)(D / 16);
    const int64_t plane = num_blocks * block_size;
    /* Per request, for the two flattened loops (entry B closes the item counts). */
    req_t *info = (req_t *)malloc(sizeof(req_t) * (B + 1));
    if (!info) return -1;
    int64_t off = 0, nblocks = 0, ntiles = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t qlen = q_start[b + 1] - q_start[b];
        const int64_t keys = padded_keys(seq_lens[b], qlen, window);
        info[b] = (req_t){off, nblocks, ntiles, first_key(seq_lens[b], qlen, window), keys};
        off += 2 * Hkv * keys * D / 2;
        nblocks += Hkv * keys / PF_KEYS;
        ntiles += Hkv * ((qlen + PF_TILE - 1) / PF_TILE);
    }
    info[B].first_block = nblocks;
    info[B].first_tile = ntiles;
    uint32_t *pairs = (uint32_t *)scratch;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nblocks; item++) {
            int64_t b = 0;
            while (info[b + 1].first_block <= item) b++;
            const int64_t qlen = q_start[b + 1] - q_start[b];
            const int64_t keys = info[b].keys, per_head = keys / PF_KEYS;
            const int64_t h = (item - info[b].first_block) / per_head, blk = (item - info[b].first_block) % per_head;
            const int64_t kbase = info[b].kbase;
            /* The first key any query sees: blocks before it may already be reused (sliding window). */
            const int64_t kfirst = window > 0 && seq_lens[b] - qlen - window + 1 > 0 ? seq_lens[b] - qlen - window + 1 : 0;
            uint32_t *kt = pairs + info[b].off + h * keys * D / 2 + blk * PF_KEYS * D / 2;
            uint32_t *vp = pairs + info[b].off + (Hkv + h) * keys * D / 2 + blk * PF_KEYS * D / 2;
            const int64_t *table = block_tables + b * max_blocks;
            for (int64_t i = 0; i < PF_KEYS; i++) {
                const int64_t t = kbase + blk * PF_KEYS + i;
                const int tile = (int)(i / 16), lane = (int)(i % 16);
                uint32_t *kd = kt + tile * (D / 2) * 16 + lane;
                if (t >= seq_lens[b] || t < kfirst) { /* padding, or before the window: zeros, masked */
                    for (int64_t j = 0; j < D / 2; j++) kd[j * 16] = 0;
                    continue;
                }
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const uint32_t *krow = (const uint32_t *)(cache + (h * plane + slot) * D);
                for (int64_t j = 0; j < D / 2; j++) kd[j * 16] = krow[j];
            }
            const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                    39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
            const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
            for (int64_t p = 0; p < PF_KEYS / 2; p++) {
                const __m512i *rows[2];
                const __m512i zero = _mm512_setzero_si512();
                for (int e = 0; e < 2; e++) {
                    const int64_t t = kbase + blk * PF_KEYS + 2 * p + e;
                    rows[e] = NULL;
                    if (t < seq_lens[b] && t >= kfirst) {
                        const int64_t slot = table[t / block_size] * block_size + t % block_size;
                        rows[e] = (const __m512i *)(cache + ((Hkv + h) * plane + slot) * D);
                    }
                }
                for (int64_t c = 0; c < D; c += 32) {
                    const __m512i a = rows[0] ? _mm512_loadu_si512((const void *)((const uint16_t *)rows[0] + c)) : zero;
                    const __m512i d2 = rows[1] ? _mm512_loadu_si512((const void *)((const uint16_t *)rows[1] + c)) : zero;
                    _mm512_storeu_si512((void *)(vp + p * D + c), _mm512_permutex2var_epi16(a, lo_idx, d2));
                    _mm512_storeu_si512((void *)(vp + p * D + c + 16), _mm512_permutex2var_epi16(a, hi_idx, d2));
                }
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < ntiles; item++) {
            int64_t b = 0;
            while (info[b + 1].first_tile <= item) b++;
            const int64_t qlen = q_start[b + 1] - q_start[b];
            const int64_t tiles = (qlen + PF_TILE - 1) / PF_TILE;
            const int64_t h = (item - info[b].first_tile) / tiles, tile = (item - info[b].first_tile) % tiles;
            const int64_t keys = info[b].keys;
            const uint32_t *kt = pairs + info[b].off + h * keys * D / 2;
            const uint32_t *vp = pairs + info[b].off + (Hkv + h) * keys * D / 2;
            const int64_t r0 = tile * PF_TILE, r1 = r0 + PF_TILE < qlen ? r0 + PF_TILE : qlen;
            const uint32_t *qrows[PF_TILE * PF_MAX_G];
            uint16_t *orows[PF_TILE * PF_MAX_G];
            int64_t qpos[PF_TILE * PF_MAX_G];
            int64_t nq = 0;
            for (int64_t i = r0; i < r1; i++)
                for (int64_t g = 0; g < G; g++, nq++) {
                    const int64_t row = q_start[b] + i;
                    qrows[nq] = (const uint32_t *)(q + row * q_stride + (h * G + g) * D);
                    orows[nq] = out + (row * Hq + h * G + g) * D;
                    qpos[nq] = seq_lens[b] - qlen + i;
                }
            const int64_t kbase = info[b].kbase;
            switch (NC) {
            case 2: tile_attend(4, 2, qrows, qpos, nq, kt, vp, kbase, window, scale, orows); break;
            case 4: tile_attend(4, 4, qrows, qpos, nq, kt, vp, kbase, window, scale, orows); break;
            case 6: tile_attend(2, 6, qrows, qpos, nq, kt, vp, kbase, window, scale, orows); break;
            case 8: tile_attend(2, 8, qrows, qpos, nq, kt, vp, kbase, window, scale, orows); break;
            case 10: tile_attend(2, 10, qrows, qpos, nq, kt, vp, kbase, window, scale, orows); break;
            case 12: tile_attend(2, 12, qrows, qpos, nq, kt, vp, kbase, window, scale, orows); break;
            case 14: tile_attend(2, 14, qrows, qpos, nq, kt, vp, kbase, window, scale, orows); break;
            default: tile_attend(1, 16, qrows, qpos, nq, kt, vp, kbase, window, scale, orows); break;
            }
        }
    }
    free(info);
    return 0;
#else
    (void)q; (void)q_stride; (void)cache; (void)block_tables; (void)max_blocks; (void)q_start; (void)seq_lens;
    (void)out; (void)B; (void)Hq; (void)Hkv; (void)D; (void)num_blocks; (void)block_size; (void)scale;
    (void)window; (void)scratch;
    return -1;
#endif
}
