/* LoRA updates of many adapters in one call: y[m] += B_s (A_s x[m]) for each row m with adapter s.
 *
 * A step mixes rows of the base model (slot -1) and of up to max_loras adapters; punica's BGMV
 * does what this does on GPUs: shrink each row by its own adapter's A, then expand by its B,
 * without gathering rows per adapter or padding anything. One call per projection and step,
 * whatever the mix, instead of a handful of PyTorch operators per adapter present.
 *
 * A projection merged from parts (QKV, gate/up) has one A block and one B block per part. Both are
 * stored transposed, At [K, P * r_s] (part p's columns at p * r_s) and Bt [r_s, N], so both halves
 * are rows of multiply-adds over contiguous columns, the partial sums held in registers (dots of
 * K or r_s products per output each ended in a horizontal sum and ran at a third of the speed);
 * output o, in part p (part_ends[p-1] <= o < part_ends[p]), reads t[p * r_s ...]. The scale is
 * folded into B. Rows are grouped by slot and taken ROWS at a time, so each weight value is read
 * and widened once for them. Rows (x, y) are bfloat16 or float32 (x_bf16), the adapters' weights
 * too (w_bf16: adapters kept in bfloat16 beside float32 activations halve their bytes); products
 * sum in float32, and a bfloat16 output is rounded once per call.
 *
 * t (the shrunk rows, float32 [M, t_stride]) is the caller's scratch.
 */
#include <stdint.h>
#include <stdlib.h>

/* -std=c11 turns off multiply-add contraction; these loops want fused multiply-adds (one rounding
 * fewer than separate products, within the tests' tolerance). */
#pragma GCC optimize("fp-contract=fast")

#include "bf16.h"
#include "tessera_kernels.h"

#define LORA_TILE 256
#define LORA_MAX_SLOTS 256 /* the most slots (--max-loras) the kernel takes */
#define ROWS 4             /* rows of one adapter computed together */
#define INLINE static inline __attribute__((always_inline))
#define F32(p, i) (((const float *)(p))[i])
#define B16(p, i) bf16_to_f32(((const uint16_t *)(p))[i])

/* acc[q][0..n) += sum_k c[q][k] w[k * ld + 0..n) for q < nq <= ROWS, k < kn, n <= LORA_TILE: 64
 * (then 16) columns at a time in registers across the k multiply-adds, each weight vector widened once and
 * used for every row. The shrink is this with c = x's rows and w = At, the expand with c = the
 * shrunk rows and w = Bt. */
#define ROWS_TIMES_BODY(LW)                                                                           \
    int64_t o = 0;                                                                                    \
    for (; o + 64 <= n; o += 64) {                                                                    \
        float v[ROWS][64];                                                                            \
        for (int q = 0; q < nq; q++) {                                                                \
            _Pragma("omp simd") for (int u = 0; u < 64; u++) v[q][u] = acc[q][o + u];                 \
        }                                                                                             \
        for (int64_t k = 0; k < kn; k++) {                                                            \
            float w64[64];                                                                            \
            _Pragma("omp simd") for (int u = 0; u < 64; u++) w64[u] = LW(w, k * ld + o + u);          \
            for (int q = 0; q < nq; q++) {                                                            \
                const float cq = c[q][k];                                                             \
                _Pragma("omp simd") for (int u = 0; u < 64; u++) v[q][u] += cq * w64[u];              \
            }                                                                                         \
        }                                                                                             \
        for (int q = 0; q < nq; q++) {                                                                \
            _Pragma("omp simd") for (int u = 0; u < 64; u++) acc[q][o + u] = v[q][u];                 \
        }                                                                                             \
    }                                                                                                 \
    for (; o + 16 <= n; o += 16) { /* four partial sums per row over k: independent chains for few rows */ \
        float v[ROWS][4][16] = {{{0}}};                                                               \
        int64_t k = 0;                                                                                \
        for (; k + 4 <= kn; k += 4) {                                                                 \
            for (int j = 0; j < 4; j++) {                                                             \
                float w16[16];                                                                        \
                _Pragma("omp simd") for (int u = 0; u < 16; u++) w16[u] = LW(w, (k + j) * ld + o + u); \
                for (int q = 0; q < nq; q++) {                                                        \
                    const float cq = c[q][k + j];                                                     \
                    _Pragma("omp simd") for (int u = 0; u < 16; u++) v[q][j][u] += cq * w16[u];       \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (; k < kn; k++) {                                                                         \
            for (int q = 0; q < nq; q++) {                                                            \
                const float cq = c[q][k];                                                             \
                _Pragma("omp simd") for (int u = 0; u < 16; u++) v[q][0][u] += cq * LW(w, k * ld + o + u); \
            }                                                                                         \
        }                                                                                             \
        for (int q = 0; q < nq; q++) {                                                                \
            _Pragma("omp simd") for (int u = 0; u < 16; u++)                                          \
                acc[q][o + u] += (v[q][0][u] + v[q][1][u]) + (v[q][2][u] + v[q][3][u]);               \
        }                                                                                             \
    }                                                                                                 \
    for (; o < n; o++) {                                                                              \
        for (int64_t k = 0; k < kn; k++) {                                                            \
            const float wv = LW(w, k * ld + o);                                                       \
            for (int q = 0; q < nq; q++) acc[q][o] += c[q][k] * wv;                                   \
        }                                                                                             \
    }

INLINE void rows_times_f(float (*acc)[LORA_TILE], const float *const *c, int nq, int64_t kn, const void *w,
                         int64_t ld, int64_t n) { ROWS_TIMES_BODY(F32) }
INLINE void rows_times_b(float (*acc)[LORA_TILE], const float *const *c, int nq, int64_t kn, const void *w,
                         int64_t ld, int64_t n) { ROWS_TIMES_BODY(B16) }

/* The body inlined with nq = ROWS and nq = 1 as constants (loops over rows unrolled, sums in
 * registers: one row is the lone decode), and once more for other remainders. */
static void rows_times(int w_bf16, float (*acc)[LORA_TILE], const float *const *c, int nq, int64_t kn,
                       const void *w, int64_t ld, int64_t n) {
    if (w_bf16) {
        if (nq == ROWS) rows_times_b(acc, c, ROWS, kn, w, ld, n);
        else if (nq == 1) rows_times_b(acc, c, 1, kn, w, ld, n);
        else rows_times_b(acc, c, nq, kn, w, ld, n);
    } else {
        if (nq == ROWS) rows_times_f(acc, c, ROWS, kn, w, ld, n);
        else if (nq == 1) rows_times_f(acc, c, 1, kn, w, ld, n);
        else rows_times_f(acc, c, nq, kn, w, ld, n);
    }
}

/* order[first[s] .. first[s + 1]) = the rows of slot s; the multiply-adds of the call. */
static int64_t group_rows(const int32_t *row_slots, int64_t M, int64_t num_slots, const int64_t *ranks, int64_t P,
                          int64_t K, int64_t N, int64_t *first, int64_t *order) {
    int64_t macs = 0, fill[LORA_MAX_SLOTS];
    for (int64_t m = 0; m < M; m++) {
        if (row_slots[m] >= 0) {
            first[row_slots[m] + 1]++;
            macs += ranks[row_slots[m]] * (P * K + N);
        }
    }
    for (int64_t s = 0; s < num_slots; s++) first[s + 1] += first[s];
    for (int64_t s = 0; s < num_slots; s++) fill[s] = first[s];
    for (int64_t m = 0; m < M; m++) {
        if (row_slots[m] >= 0) order[fill[row_slots[m]]++] = m;
    }
    return macs;
}

static void add_rows(void *y, int64_t y_stride, int x_bf16, int64_t m, const float *acc, int64_t lo, int64_t hi) {
    if (x_bf16) {
        uint16_t *yo = (uint16_t *)y + m * y_stride;
        for (int64_t o = lo; o < hi; o++) yo[o] = f32_to_bf16(bf16_to_f32(yo[o]) + acc[o - lo]);
    } else {
        float *yo = (float *)y + m * y_stride;
#pragma omp simd
        for (int64_t o = lo; o < hi; o++) yo[o] += acc[o - lo];
    }
}

int lora_add(const void *x, int64_t x_stride, void *y, int64_t y_stride, int x_bf16, int w_bf16, int64_t M,
             int64_t K, int64_t N, const int32_t *row_slots, const int64_t *a_ptrs, const int64_t *b_ptrs,
             const int64_t *ranks, int64_t num_slots, const int64_t *part_ends, int64_t P, float *t,
             int64_t t_stride) {
    if (num_slots < 1 || num_slots > LORA_MAX_SLOTS) return -1;
    for (int64_t m = 0; m < M; m++) {
        const int32_t s = row_slots[m];
        if (s >= num_slots || (s >= 0 && (ranks[s] < 0 || P * ranks[s] > t_stride))) return -1;
    }
    int64_t first[LORA_MAX_SLOTS + 1] = {0};
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(M > 0 ? M : 1));
    /* Float32 copies of bfloat16 rows: the shrink reads each value once per row group. */
    float *xf = x_bf16 ? malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1)) : 0;
    if (!order || (x_bf16 && !xf)) {
        free(order);
        free(xf);
        return -2;
    }
    const int64_t macs = group_rows(row_slots, M, num_slots, ranks, P, K, N, first, order);
    for (int64_t m = 0; xf && m < M; m++) {
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf16_to_f32(((const uint16_t *)x)[m * x_stride + k]);
    }
    const int wb = w_bf16 ? 2 : 4, parallel = macs > (1 << 21);
    /* Shrink: t[m, 0 .. P r_s) = x[m] At_s. */
    const int64_t col_tiles = (t_stride + LORA_TILE - 1) / LORA_TILE;
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
    for (int64_t s = 0; s < num_slots; s++) {
        for (int64_t ct = 0; ct < col_tiles; ct++) {
            const int64_t cols = P * ranks[s], lo = ct * LORA_TILE, hi = lo + LORA_TILE < cols ? lo + LORA_TILE : cols;
            if (first[s] == first[s + 1] || !a_ptrs[s] || lo >= hi) continue;
            for (int64_t i = first[s]; i < first[s + 1]; i += ROWS) {
                const int nq = first[s + 1] - i < ROWS ? (int)(first[s + 1] - i) : ROWS;
                float acc[ROWS][LORA_TILE] = {{0}};
                const float *xs[ROWS];
                for (int q = 0; q < nq; q++) {
                    xs[q] = xf ? xf + order[i + q] * K : (const float *)x + order[i + q] * x_stride;
                }
                rows_times(w_bf16, acc, xs, nq, K, (const char *)a_ptrs[s] + lo * wb, cols, hi - lo);
                for (int q = 0; q < nq; q++) {
                    for (int64_t c = lo; c < hi; c++) t[order[i + q] * t_stride + c] = acc[q][c - lo];
                }
            }
        }
    }
    /* Expand: y[m, tile] += sum_k t[m, p r_s + k] Bt_s[k, tile], part by part within the tile. */
    const int64_t tiles = (N + LORA_TILE - 1) / LORA_TILE;
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
    for (int64_t s = 0; s < num_slots; s++) {
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (first[s] == first[s + 1] || !b_ptrs[s]) continue;
            const int64_t r = ranks[s], lo = tile * LORA_TILE, hi = lo + LORA_TILE < N ? lo + LORA_TILE : N;
            for (int64_t i = first[s]; i < first[s + 1]; i += ROWS) {
                const int nq = first[s + 1] - i < ROWS ? (int)(first[s + 1] - i) : ROWS;
                float acc[ROWS][LORA_TILE] = {{0}};
                for (int64_t p = 0, start = 0; p < P; start = part_ends[p], p++) {
                    const int64_t a = start > lo ? start : lo, b = part_ends[p] < hi ? part_ends[p] : hi;
                    if (a >= b) continue;
                    const float *ts[ROWS];
                    for (int q = 0; q < nq; q++) ts[q] = t + order[i + q] * t_stride + p * r;
                    rows_times(w_bf16, (float (*)[LORA_TILE])(&acc[0][a - lo]), ts, nq, r,
                               (const char *)b_ptrs[s] + a * wb, N, b - a);
                }
                for (int q = 0; q < nq; q++) add_rows(y, y_stride, x_bf16, order[i + q], acc[q], lo, hi);
            }
        }
    }
    free(order);
    free(xf);
    return 0;
}
