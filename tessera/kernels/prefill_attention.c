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
 * Work items are (request, KV head, rows), one parallel loop, costliest first: the rows whole tiles
 * of 16, up to 256 query vectors (G heads x rows, row-major), which go in groups of R. An item
 * walks its keys in blocks of 64, from the first key any of its queries sees (sliding window) to
 * its last query's position, and for each block:
 * 1. copies it out of the paged cache into the thread's buffer: the keys transposed into 4 tiles of
 *    16 keys ([tile][D/2][16] bfloat16 pairs, so 16 keys are the lanes of one register; a 16 x 16
 *    transpose in registers), the values interleaved in key pairs ([pair][D] (v_2p[d], v_2p+1[d]));
 * 2. for each group whose range the block meets: scores S = q . k (R x 4 registers), the causal /
 *    window mask where the block crosses it, the running maximum and sum, and O += P V with the
 *    probabilities rounded to bfloat16 (as the values are).
 * The groups' running state (maximum, sum, float32 output) waits in the thread's buffer between
 * blocks. Why not copy each request's whole context once for all its items: that copy grows with
 * the context (4 bytes a key, head dimension and KV head: 128 MiB for 32k tokens of 8 KV heads of
 * 128), and each group would stream all of it again. Here a thread holds one block (16-64 KiB) and
 * one item's queries and outputs (6 bytes a vector and dimension) whatever the context, and a
 * block serves all of the item's groups from L1/L2 for the price of one copy per item.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#if TESSERA_AVX512_BF16
#define HAVE_AVX512_BF16 1
#endif

#include "bf16.h"
#include "softmax.h"
#include "tessera_kernels.h"

#define PF_KEYS 64    /* keys per block of the inner loop: 4 registers of 16 lanes */
#define PF_TILE 16    /* a work item's query rows come in whole tiles of 16 */
#define PF_MAX_Q 256  /* query vectors per work item: at least one tile's (PF_TILE * MAX_GROUP) */

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
        alpha[r] = expf(m[r] - mnew); /* 0 on the first live block (m = -inf) without a sink */
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

/* r[c] <- element c of r[0..15] (a 16 x 16 transpose of 32-bit elements): in, 16 keys' pairs
 * j .. j + 15; out, pair j + c of the 16 keys. Unpacks pair rows within 128-bit lanes, then
 * shuffles whole lanes. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + e], lane k: rows i .. i + 3, element 4k + e */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; e++) { /* t[e]: rows 0-3 and 4-7, elements e and 8 + e; t[4 + e]: 4 + e, 12 + e */
        t[e] = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88);
        t[4 + e] = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xdd);
        t[8 + e] = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88);
        t[12 + e] = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xdd);
    }
    for (int e = 0; e < 4; e++) {
        r[e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0x88);
        r[8 + e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0xdd);
        r[4 + e] = _mm512_shuffle_i32x4(t[4 + e], t[12 + e], 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(t[4 + e], t[12 + e], 0xdd);
    }
}

/* Keys k0 .. k0 + 63 of one (request, KV head) out of the paged cache (kc, vc: the head's key and
 * value planes, table: the request's block table): kt as 4 tiles of 16 keys ([tile][D/2][16]
 * pairs), vp as 32 key pairs ([pair][D]). Keys before `first` (behind every query's window, whose
 * blocks may already hold another request's, NaN even) and from `len` on are read as zeros: the
 * mask drops their scores, and their zero probabilities times zero values add nothing. */
static void copy_block(uint32_t *kt, uint32_t *vp, const uint16_t *kc, const uint16_t *vc, const int64_t *table,
                       int64_t block_size, int64_t k0, int64_t first, int64_t len, int64_t D) {
    static const uint16_t zeros[PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64))) = {0};
    const uint16_t *krow[PF_KEYS], *vrow[PF_KEYS];
    for (int i = 0; i < PF_KEYS; i++) {
        const int64_t t = k0 + i;
        if (t < first || t >= len) {
            krow[i] = vrow[i] = zeros;
            continue;
        }
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        krow[i] = kc + slot * D;
        vrow[i] = vc + slot * D;
    }
    const int64_t D2 = D / 2;
    for (int tile = 0; tile < PF_KEYS / 16; tile++)
        for (int64_t j = 0; j < D2; j += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(krow[tile * 16 + i] + 2 * j));
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512((void *)(kt + (tile * D2 + j + c) * 16), r[c]);
        }
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int p = 0; p < PF_KEYS / 2; p++)
        for (int64_t c = 0; c < D; c += 32) {
            const __m512i a = _mm512_loadu_si512((const void *)(vrow[2 * p] + c));
            const __m512i b = _mm512_loadu_si512((const void *)(vrow[2 * p + 1] + c));
            _mm512_storeu_si512((void *)(vp + p * D + c), _mm512_permutex2var_epi16(a, lo_idx, b));
            _mm512_storeu_si512((void *)(vp + p * D + c + 16), _mm512_permutex2var_epi16(a, hi_idx, b));
        }
}

/* A thread's buffers: the current block's keys (kt) and values (vp), and its work item's query
 * vectors (q, D/2 pairs each) and unnormalized float32 outputs (o), both padded to whole groups. */
typedef struct {
    uint32_t *kt, *vp, *q;
    float *o;
} work_t;

/* One work item: its nq query vectors (rows qrows, positions qpos, sink logits qsink, outputs orows),
 * R at a time, over the blocks of keys they see of one (request, KV head): kc, vc, table and
 * block_size as copy_block takes them, len the request's context. A vector's sink (-inf: none)
 * joins its softmax as a key of that score and no value: the running maximum starts at it and the
 * sum at exp(sink - sink) = 1. */
static inline __attribute__((always_inline)) void item_attend(const int R, const int NC, const uint32_t *const *qrows,
                                                               const int64_t *qpos, const float *qsink,
                                                               uint16_t *const *orows, int64_t nq,
                                                               const uint16_t *kc, const uint16_t *vc,
                                                               const int64_t *table, int64_t block_size, int64_t len,
                                                               int64_t window, float scale, const work_t *w) {
    const int64_t D = NC * 16, D2 = NC * 8, ng = (nq + R - 1) / R;
    int64_t pos[PF_MAX_Q], gfirst[PF_MAX_Q], glast[PF_MAX_Q], gpmin[PF_MAX_Q], gwmax[PF_MAX_Q];
    float m[PF_MAX_Q], l[PF_MAX_Q];
    for (int64_t v = 0; v < ng * R; v++) {
        const int64_t src = v < nq ? v : nq - 1; /* the last group is padded with copies */
        memcpy(w->q + v * D2, qrows[src], D * 2);
        pos[v] = qpos[src];
        m[v] = qsink[src];
        l[v] = qsink[src] == -INFINITY ? 0.f : 1.f;
    }
    memset(w->o, 0, sizeof(float) * ng * R * D);
    /* Per group: its first block, its last position, and what decides whether a block needs the
     * mask (its first position; its latest window start). Per item: the blocks to copy and the
     * first key any vector sees. */
    int64_t first = INT64_MAX, last = 0, seen = INT64_MAX;
    for (int64_t g = 0; g < ng; g++) {
        const int64_t *p = pos + g * R;
        int64_t lo = INT64_MAX, hi = 0, pmin = INT64_MAX, wmax = INT64_MIN;
        for (int r = 0; r < R; r++) {
            const int64_t start = window > 0 && p[r] - window + 1 > 0 ? p[r] - window + 1 : 0;
            if (start < lo) lo = start;
            if (p[r] > hi) hi = p[r];
            if (p[r] < pmin) pmin = p[r];
            if (p[r] - window + 1 > wmax) wmax = p[r] - window + 1;
        }
        gfirst[g] = lo - lo % PF_KEYS;
        glast[g] = hi;
        gpmin[g] = pmin;
        gwmax[g] = wmax;
        if (gfirst[g] < first) first = gfirst[g];
        if (hi > last) last = hi;
        if (lo < seen) seen = lo;
    }
    for (int64_t k0 = first; k0 <= last; k0 += PF_KEYS) {
        copy_block(w->kt, w->vp, kc, vc, table, block_size, k0, seen, len, D);
        for (int64_t g = 0; g < ng; g++) {
            if (k0 < gfirst[g] || k0 > glast[g]) continue;
            const int masked = k0 + PF_KEYS - 1 > gpmin[g] || (window > 0 && k0 < gwmax[g]);
            block_update(R, NC, w->q + g * R * D2, D2, w->kt, w->vp, pos + g * R, k0, window, masked, scale, m + g * R,
                         l + g * R, w->o + g * R * D);
        }
    }
    for (int64_t v = 0; v < nq; v++) store_scaled_row(orows[v], 0, w->o + v * D, 1.f / l[v], D, 1);
}

/* A work item: rows r0 .. r1 of request b against KV head h; cost, its vectors' keys (roughly). */
typedef struct {
    int64_t b, h, r0, r1, cost;
} item_t;

static int costlier_first(const void *a, const void *b) {
    const int64_t x = ((const item_t *)a)->cost, y = ((const item_t *)b)->cost;
    return (x < y) - (x > y);
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
 * sinks:        [Hq] float32 or NULL: per query head, a logit that joins the softmax's denominator
 *               and adds no value (gpt-oss's attention sinks)
 * Returns 0; -1 where this shape is not handled (D not a multiple of 32 or over 256; more than 16
 * query heads per KV head): the caller then uses PyTorch; -2 where the threads' buffers (a few
 * hundred KiB each, whatever the context) could not be allocated. Builds without AVX512-BF16 take a
 * plain C path with the same blocks, order and roundings (the reference; it allocates nothing).
 */
int paged_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *cache,
                                 const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                 const int64_t *seq_lens, uint16_t *out, int64_t B, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                                 const float *sinks) {
#ifdef HAVE_AVX512_BF16
    const int64_t G = Hq / Hkv;
    if (D % 32 || D > PREFILL_MAX_HEAD_DIM || G > MAX_GROUP || G * Hkv != Hq) return -1;
    const int NC = (int)(D / 16);
    const int64_t plane = num_blocks * block_size;
    const int nthreads = omp_get_max_threads();
    /* Rows per item: an item copies each block it reads once for all its vectors, so the more
     * tiles it takes the less it copies; up to PF_MAX_Q vectors, while leaving 8 items a thread
     * to balance (cost grows along a causal prompt; items go costliest first). */
    int64_t tiles = 0;
    for (int64_t b = 0; b < B; b++) tiles += Hkv * ((q_start[b + 1] - q_start[b] + PF_TILE - 1) / PF_TILE);
    int64_t per_item = tiles / (8 * (int64_t)nthreads);
    if (per_item > PF_MAX_Q / (PF_TILE * G)) per_item = PF_MAX_Q / (PF_TILE * G);
    if (per_item < 1) per_item = 1;
    const int64_t rows = per_item * PF_TILE;
    /* Per thread: a block's keys and values (128 D bytes each), an item's queries (2 D bytes a
     * vector, whole tiles, so groups of up to 4 need no padding past them) and their outputs
     * (4 D bytes); each a multiple of 64 bytes. */
    const int64_t nqmax = rows * G;
    const size_t kv_bytes = (size_t)PF_KEYS * D * 2, q_bytes = (size_t)nqmax * D * 2;
    const size_t per_thread = 2 * kv_bytes + q_bytes + (size_t)nqmax * D * 4;
    int64_t nitems = 0;
    for (int64_t b = 0; b < B; b++) nitems += Hkv * ((q_start[b + 1] - q_start[b] + rows - 1) / rows);
    uint8_t *buf = (uint8_t *)aligned_alloc(64, per_thread * nthreads);
    item_t *items = (item_t *)malloc(sizeof(item_t) * (nitems > 0 ? nitems : 1));
    if (!buf || !items) {
        free(buf);
        free(items);
        return -2;
    }
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t qlen = q_start[b + 1] - q_start[b];
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t r0 = 0; r0 < qlen; r0 += rows) {
                const int64_t r1 = r0 + rows < qlen ? r0 + rows : qlen;
                const int64_t p0 = seq_lens[b] - qlen + r0, p1 = seq_lens[b] - qlen + r1 - 1;
                const int64_t lo = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
                items[n++] = (item_t){b, h, r0, r1, (r1 - r0) * (p1 - lo + 1)};
            }
    }
    qsort(items, (size_t)nitems, sizeof(item_t), costlier_first);
#pragma omp parallel
    {
        uint8_t *mine = buf + per_thread * omp_get_thread_num();
        const work_t w = {(uint32_t *)mine, (uint32_t *)(mine + kv_bytes), (uint32_t *)(mine + 2 * kv_bytes),
                          (float *)(mine + 2 * kv_bytes + q_bytes)};
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nitems; i++) {
            const int64_t b = items[i].b, h = items[i].h;
            const int64_t qlen = q_start[b + 1] - q_start[b];
            const uint32_t *qrows[PF_MAX_Q];
            uint16_t *orows[PF_MAX_Q];
            int64_t qpos[PF_MAX_Q];
            float qsink[PF_MAX_Q];
            int64_t nq = 0;
            for (int64_t r = items[i].r0; r < items[i].r1; r++)
                for (int64_t g = 0; g < G; g++, nq++) {
                    const int64_t row = q_start[b] + r;
                    qrows[nq] = (const uint32_t *)(q + row * q_stride + (h * G + g) * D);
                    orows[nq] = out + (row * Hq + h * G + g) * D;
                    qpos[nq] = seq_lens[b] - qlen + r;
                    qsink[nq] = sinks ? sinks[h * G + g] : -INFINITY;
                }
            const uint16_t *kc = cache + h * plane * D, *vc = cache + (Hkv + h) * plane * D;
            const int64_t *table = block_tables + b * max_blocks;
#define ITEM(R, NC_) \
    item_attend(R, NC_, qrows, qpos, qsink, orows, nq, kc, vc, table, block_size, seq_lens[b], window, scale, &w)
            switch (NC) {
            case 2: ITEM(4, 2); break;
            case 4: ITEM(4, 4); break;
            case 6: ITEM(2, 6); break;
            case 8: ITEM(2, 8); break;
            case 10: ITEM(2, 10); break;
            case 12: ITEM(2, 12); break;
            case 14: ITEM(2, 14); break;
            default: ITEM(1, 16); break;
            }
#undef ITEM
        }
    }
    free(items);
    free(buf);
    return 0;
#else
    /* Plain C, one query vector at a time, in the vector path's order and roundings: its keys in the
     * same blocks of PF_KEYS positions, each updating the running maximum m, sum l and output o,
     * the probabilities rounded to bfloat16 for O += P V (not for their sum). */
    const int64_t G = Hq / Hkv;
    if (D % 32 || D > PREFILL_MAX_HEAD_DIM || G > MAX_GROUP || G * Hkv != Hq) return -1;
    const int64_t plane = num_blocks * block_size;
    for (int64_t b = 0; b < B; b++) {
        const int64_t qlen = q_start[b + 1] - q_start[b];
        const int64_t *table = block_tables + b * max_blocks;
#pragma omp parallel for schedule(static) collapse(2)
        for (int64_t r = 0; r < qlen; r++)
            for (int64_t hq = 0; hq < Hq; hq++) {
                const int64_t row = q_start[b] + r, pos = seq_lens[b] - qlen + r, h = hq / G;
                const int64_t first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                const uint16_t *qv = q + row * q_stride + hq * D;
                const uint16_t *kc = cache + h * plane * D, *vc = cache + (Hkv + h) * plane * D;
                /* a sink is a key of that score and no value: m starts at it, l at exp(0) */
                float m = sinks ? sinks[hq] : -INFINITY, l = sinks ? 1.f : 0.f;
                float o[PREFILL_MAX_HEAD_DIM] = {0};
                for (int64_t k0 = first - first % PF_KEYS; k0 <= pos; k0 += PF_KEYS) {
                    const int64_t lo = k0 > first ? k0 : first, hi = k0 + PF_KEYS - 1 < pos ? k0 + PF_KEYS - 1 : pos;
                    float s[PF_KEYS], bm = -INFINITY;
                    for (int64_t t = lo; t <= hi; t++) {
                        const uint16_t *kv = kc + (table[t / block_size] * block_size + t % block_size) * D;
                        float dot = 0.f;
                        for (int64_t i = 0; i < D; i++) dot += bf16_to_f32(qv[i]) * bf16_to_f32(kv[i]);
                        s[t - lo] = dot * scale;
                        if (s[t - lo] > bm) bm = s[t - lo];
                    }
                    const float mnew = bm > m ? bm : m;
                    const float alpha = expf(m - mnew); /* 0 on the first block (m = -inf) without a sink */
                    m = mnew;
                    float sum = 0.f;
                    for (int64_t i = 0; i < D; i++) o[i] *= alpha;
                    for (int64_t t = lo; t <= hi; t++) {
                        const uint16_t *vv = vc + (table[t / block_size] * block_size + t % block_size) * D;
                        const float p = expf(s[t - lo] - mnew), pr = bf16_to_f32(f32_to_bf16(p));
                        sum += p;
                        for (int64_t i = 0; i < D; i++) o[i] += pr * bf16_to_f32(vv[i]);
                    }
                    l = l * alpha + sum;
                }
                store_scaled_row(out, (row * Hq + hq) * D, o, 1.f / l, D, 1);
            }
    }
    return 0;
#endif
}
