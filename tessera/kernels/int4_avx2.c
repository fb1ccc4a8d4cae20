/* Weight-only int4 matrix product for float32 activations on AVX2 + FMA hosts (no AVX-512),
 * on the float32 int4 layout (bf16.h: INT4G_*).
 *
 * Why: on those hosts the compute dtype is float32 (no native bfloat16) and PyTorch's
 * _weight_int4pack_mm_for_cpu runs at ~1 GFLOP/s there: one SmolLM2-135M decode step took
 * 112 ms of its 135 ms in it, eight rows 850 ms (benchmarks/step_profile.py on an AMD EPYC with
 * AVX2 only). One or two rows take few_rows_tile (the scale factored out of each group); from
 * three rows on, this kernel dequantizes each group of 32 columns of a 32-row tile once into an
 * L1-resident float block (w = (q - 8) * s + z, what Int4Method.dequantize computes), then
 * multiplies it by every activation row, two rows at a time so eight independent FMA chains
 * hide the FMA latency. Tiles are split across torch's OpenMP threads.
 *
 * Layout: output rows in tiles of 32; within a tile each group of 32 input columns is 512 code
 * bytes (column k, byte c (0..15): row 32t + c in its low nibble, row 32t + 16 + c in its high
 * nibble; PyTorch's int4pack tile on AVX2 hosts) followed by the 32 rows' scales and zeros as
 * halves. The codes are PyTorch's; the scales moved beside them: kept apart as [K/32][N_pad][2]
 * float32, a third of the bytes a step reads were scales, fetched from a second stream 8 N_pad
 * bytes apart, and the int8-activation kernel at one row took 1.32x as long (AMD EPYC, one core).
 */
#include <stdint.h>
#include "simd.h"

#include "bf16.h"
#include "tessera_kernels.h"
#if TESSERA_AVX2
#define HAVE_AVX2_FMA 1
#endif

#define INT4_F32_FEW_ROWS 2 /* up to here rows go through few_rows_tile (3-4 rows in pairs: 0.93x) */

/* 1 when this build has the AVX2 + FMA float32 path of int4_gemm_f32, else 0 (the plain C path). */
int tessera_avx2_fma(void) {
#ifdef HAVE_AVX2_FMA
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_AVX2_FMA
/* One or two rows (decode steps of a few sequences): the scale and zero are factored out of each
 * group,
 *   sum_k ((q - 8) s + z) x_k = s * sum_k q x_k + (z - 8 s) * sum_k x_k,
 * so a code is converted once and multiplied by each row, with no dequantized block written to
 * L1 and read back (the path below spends over half its time there at these row counts: two rows
 * took 2.2x one row's time through it). One row keeps eight FMA chains busy by splitting even
 * and odd columns; two rows have four chains each. `R` is a constant at each call, so the loops
 * over rows and chains unroll into registers. */
static inline __attribute__((always_inline)) void few_rows_tile(const float *x, int64_t K, const uint8_t *tile,
                                                                float *out, int64_t t, int64_t N_out, int64_t G,
                                                                const int R) {
    const int J = R == 1 ? 2 : 1; /* column chains per row */
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m256 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *col = tile + g * INT4G_GROUP_BYTES;
        __m256 d[2][8];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4 * J; v++) d[r][v] = _mm256_setzero_ps();
        for (int kk = 0; kk < 32; kk += J) {
            for (int j = 0; j < J; j++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(col + (kk + j) * 16));
                const __m128i lo = _mm_and_si128(bytes, low4);                    /* rows 0..15 */
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4); /* rows 16..31 */
                const __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
                for (int r = 0; r < R; r++) {
                    const __m256 xv = _mm256_broadcast_ss(x + r * K + g * 32 + kk + j);
                    for (int v = 0; v < 4; v++) d[r][4 * j + v] = _mm256_fmadd_ps(q[v], xv, d[r][4 * j + v]);
                }
            }
        }
        const uint16_t *halves = (const uint16_t *)(col + INT4G_CODE_BYTES);
        __m256 sc[4], bias[4];
        for (int v = 0; v < 4; v++) { /* rows 8v..8v+7 */
            sc[v] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 8 * v)));
            const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 32 + 8 * v)));
            bias[v] = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sc[v], z); /* z - 8 s */
        }
        for (int r = 0; r < R; r++) {
            const float *xg = x + r * K + g * 32;
            const __m256 xs8 = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                                             _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
            const __m256 xsum = _mm256_set1_ps(hsum_ps256(xs8));
            for (int v = 0; v < 4; v++) {
                const __m256 dot = J == 2 ? _mm256_add_ps(d[r][v], d[r][4 + v]) : d[r][v];
                acc[r][v] = _mm256_fmadd_ps(sc[v], dot, _mm256_fmadd_ps(bias[v], xsum, acc[r][v]));
            }
        }
    }
    const int64_t row0 = t * 32;
    const int64_t n = N_out - row0 < 32 ? N_out - row0 : 32;
    for (int r = 0; r < R; r++) {
        float res[32] __attribute__((aligned(32)));
        for (int v = 0; v < 4; v++) _mm256_store_ps(res + 8 * v, acc[r][v]);
        for (int64_t i = 0; i < n; i++) out[r * N_out + row0 + i] = res[i];
    }
}

/* One group of 32 columns of a tile dequantized into wf[k][row] = (q - 8) * s + z. */
static inline __attribute__((always_inline)) void dequant_group(const uint8_t *col, float wf[32][32]) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const uint16_t *halves = (const uint16_t *)(col + INT4G_CODE_BYTES);
    __m256 sv[4], bv[4]; /* w = q * s + (z - 8 s) */
    for (int v = 0; v < 4; v++) {
        sv[v] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 8 * v)));
        bv[v] = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sv[v],
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 32 + 8 * v))));
    }
    const __m256 s0 = sv[0], s1 = sv[1], s2 = sv[2], s3 = sv[3];
    const __m256 b0 = bv[0], b1 = bv[1], b2 = bv[2], b3 = bv[3];
    for (int kk = 0; kk < 32; kk++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(col + kk * 16));
        const __m128i lo = _mm_and_si128(bytes, low4);                     /* rows 0..15 */
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);  /* rows 16..31 */
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        _mm256_store_ps(wf[kk], _mm256_fmadd_ps(q0, s0, b0));
        _mm256_store_ps(wf[kk] + 8, _mm256_fmadd_ps(q1, s1, b1));
        _mm256_store_ps(wf[kk] + 16, _mm256_fmadd_ps(q2, s2, b2));
        _mm256_store_ps(wf[kk] + 24, _mm256_fmadd_ps(q3, s3, b3));
    }
}

/* Two activation rows (xa and the next, K apart) times a dequantized group, added to their 32 sums:
 * eight independent FMA chains. */
static inline __attribute__((always_inline)) void two_rows_group(const float *xa, int64_t K, const float wf[32][32],
                                                                 float *acc_a, float *acc_b) {
    const float *xb = xa + K;
    __m256 a0 = _mm256_load_ps(acc_a), a1 = _mm256_load_ps(acc_a + 8);
    __m256 a2 = _mm256_load_ps(acc_a + 16), a3 = _mm256_load_ps(acc_a + 24);
    __m256 c0 = _mm256_load_ps(acc_b), c1 = _mm256_load_ps(acc_b + 8);
    __m256 c2 = _mm256_load_ps(acc_b + 16), c3 = _mm256_load_ps(acc_b + 24);
    for (int kk = 0; kk < 32; kk++) {
        const __m256 w0 = _mm256_load_ps(wf[kk]), w1 = _mm256_load_ps(wf[kk] + 8);
        const __m256 w2 = _mm256_load_ps(wf[kk] + 16), w3 = _mm256_load_ps(wf[kk] + 24);
        const __m256 xv = _mm256_broadcast_ss(xa + kk), yv = _mm256_broadcast_ss(xb + kk);
        a0 = _mm256_fmadd_ps(w0, xv, a0); a1 = _mm256_fmadd_ps(w1, xv, a1);
        a2 = _mm256_fmadd_ps(w2, xv, a2); a3 = _mm256_fmadd_ps(w3, xv, a3);
        c0 = _mm256_fmadd_ps(w0, yv, c0); c1 = _mm256_fmadd_ps(w1, yv, c1);
        c2 = _mm256_fmadd_ps(w2, yv, c2); c3 = _mm256_fmadd_ps(w3, yv, c3);
    }
    _mm256_store_ps(acc_a, a0); _mm256_store_ps(acc_a + 8, a1);
    _mm256_store_ps(acc_a + 16, a2); _mm256_store_ps(acc_a + 24, a3);
    _mm256_store_ps(acc_b, c0); _mm256_store_ps(acc_b + 8, c1);
    _mm256_store_ps(acc_b + 16, c2); _mm256_store_ps(acc_b + 24, c3);
}

/* The odd last row times a dequantized group: two chains per vector (even and odd k), summed at the end. */
static inline __attribute__((always_inline)) void odd_row_group(const float *xa, const float wf[32][32],
                                                                float *acc) {
    __m256 a[4], e[4];
    for (int v = 0; v < 4; v++) {
        a[v] = _mm256_load_ps(acc + 8 * v);
        e[v] = _mm256_setzero_ps();
    }
    for (int kk = 0; kk < 32; kk += 2) {
        const __m256 xv = _mm256_broadcast_ss(xa + kk), yv = _mm256_broadcast_ss(xa + kk + 1);
        for (int v = 0; v < 4; v++) {
            a[v] = _mm256_fmadd_ps(_mm256_load_ps(wf[kk] + 8 * v), xv, a[v]);
            e[v] = _mm256_fmadd_ps(_mm256_load_ps(wf[kk + 1] + 8 * v), yv, e[v]);
        }
    }
    for (int v = 0; v < 4; v++) _mm256_store_ps(acc + 8 * v, _mm256_add_ps(a[v], e[v]));
}
#endif

/* x: [M][K] float32 (K a multiple of 32, M <= INT4_F32_MAX_ROWS); packed: N_pad/32 tiles of K/32
 * groups of INT4G_GROUP_BYTES (the layout above); out: [M][N_out] float32. Returns 0, or -1 when the shape is out of
 * range (callers then use PyTorch's kernel). Builds without AVX2 + FMA take a plain C loop over the
 * same layout (the reference the vector paths are tested against; tessera_avx2_fma() says 0 there,
 * as callers prefer PyTorch's kernel to it). */
int int4_gemm_f32(const float *x, const uint8_t *packed, float *out, int64_t M, int64_t N_pad, int64_t N_out,
                  int64_t K) {
#ifdef HAVE_AVX2_FMA
    if (M < 1 || M > INT4_F32_MAX_ROWS || K % 32 != 0 || N_pad % 32 != 0) return -1;
    const int64_t G = K / 32;
    const int64_t tiles = N_pad / 32;
    if (M <= INT4_F32_FEW_ROWS) {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *tile = int4g_group(packed, K, t, 0);
            int64_t m = 0;
            for (; m + 2 <= M; m += 2) few_rows_tile(x + m * K, K, tile, out + m * N_out, t, N_out, G, 2);
            if (m < M) few_rows_tile(x + m * K, K, tile, out + m * N_out, t, N_out, G, 1);
        }
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = int4g_group(packed, K, t, 0);
        float acc[INT4_F32_MAX_ROWS][32] __attribute__((aligned(32)));
        float wf[32][32] __attribute__((aligned(32))); /* [k within the group][row of the tile] */
        for (int64_t m = 0; m < M; m++)
            for (int r = 0; r < 32; r++) acc[m][r] = 0.f;
        for (int64_t g = 0; g < G; g++) {
            dequant_group(tile + g * INT4G_GROUP_BYTES, wf);
            int64_t m = 0;
            for (; m + 2 <= M; m += 2) two_rows_group(x + m * K + g * 32, K, wf, acc[m], acc[m + 1]);
            if (m < M) odd_row_group(x + m * K + g * 32, wf, acc[m]);
        }
        const int64_t row0 = t * 32;
        const int64_t n = N_out - row0 < 32 ? N_out - row0 : 32;
        for (int64_t mm = 0; mm < M; mm++)
            for (int64_t r = 0; r < n; r++) out[mm * N_out + row0 + r] = acc[mm][r];
    }
    return 0;
#else
    /* Plain C: per output row n and group g, y += s * sum x (q - 8) + z * sum x, float32 sums. */
    if (M < 1 || M > INT4_F32_MAX_ROWS || K % 32 != 0 || N_pad % 32 != 0) return -1;
    const int64_t G = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N_out; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                float sum, s, z;
                const float dot = int4g_group_dot(x + m * K + g * 32, packed, K, n, g, &sum);
                int4g_scale_zero(packed, K, n, g, &s, &z);
                acc += s * dot + z * sum;
            }
            out[m * N_out + n] = acc;
        }
    return 0;
#endif
}
