/* Weight-only int4 matrix product for a few float32 rows with int8 activations, on the AVX2 int4pack
 * layout (int4_avx2.c's: tiles of 32 output rows; tile t, column k, byte c holds row 32t + c in its
 * low nibble and row 32t + 16 + c in its high nibble, each group's scales and zeros beside it).
 *
 * Why: int4_gemm_f32 widens every code to float32 and multiplies it by a float (about 0.4 vector
 * instructions a weight), which keeps two AVX2 cores compute-bound below the memory's rate at one
 * row: a SmolLM2-135M step took ~5 ms of products for ~3 ms of weight reads. Here the rows are
 * quantized to int8 per group of 32 (as int4_gemm_i8 does for bfloat16), and codes meet them in
 * VPMADDUBSW, 32 multiply-adds an instruction into int16 sums: about 0.16 instructions a weight.
 * Per group of 32 columns, with Q = sum q xq (exact integers), dx = max|x| / 127 and sx = sum x,
 *   y += s * (dx * Q - 8 * sx) + z * sx          (w = (q - 8) * s + z).
 * Four columns at a time: the two 32-byte loads of columns k .. k + 3 interleave by bytes within
 * their lanes, so lane 0 holds each row's codes of (k, k + 2) and lane 1 those of (k + 1, k + 3),
 * against activations laid out the same way once per call (scratch). A group's eight steps stay
 * under int16's range (8 x 2 x 15 x 128), then widen to int32. Tiles are split across torch's
 * OpenMP threads. It takes any number of rows (two at a time over each tile's codes, in L1), so a
 * prompt's rows are rounded as a decode row is and a token's result does not depend on its step. Builds without AVX2 take a plain C loop of the same integer sums and formula
 * (the reference; tessera_avx2_fma() says 0 there).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"

#include "bf16.h"
#include "tessera_kernels.h"

#define GROUP 32
#define STEP_BYTES 32                                 /* one step's activation vector */
#define GROUP_BYTES (GROUP / 4 * STEP_BYTES)          /* a group's eight steps */

int64_t int4_i8_f32_scratch_bytes(int64_t M, int64_t K) {
    const int64_t G = K / GROUP;
    return M * K + M * G * GROUP_BYTES + 2 * M * G * (int64_t)sizeof(float) + 64;
}

/* Row x [K] -> xq [K] int8 and, per group, dx and sx; the plain C order of sums in every build, so
 * the vector and plain paths multiply the same integers. */
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *dx, float *sx) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const float *v = x + g * GROUP;
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < GROUP; i++) {
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
            sum += v[i];
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < GROUP; i++) {
            const float r = nearbyintf(v[i] * inv);
            xq[g * GROUP + i] = (int8_t)(r > 127.f ? 127.f : r < -128.f ? -128.f : r);
        }
        dx[g] = amax / 127.f;
        sx[g] = sum;
    }
}

#if TESSERA_AVX2
/* xq's steps as VPMADDUBSW reads them: step j of a group, lane 0: (x[4j], x[4j + 2]) eight times,
 * lane 1: (x[4j + 1], x[4j + 3]) eight times. */
static void lay_out_steps(const int8_t *xq, int64_t K, uint8_t *steps) {
    for (int64_t k = 0; k < K; k += 4) {
        uint8_t *s = steps + k / 4 * STEP_BYTES;
        for (int i = 0; i < 8; i++) {
            s[2 * i] = (uint8_t)xq[k], s[2 * i + 1] = (uint8_t)xq[k + 2];
            s[16 + 2 * i] = (uint8_t)xq[k + 1], s[16 + 2 * i + 1] = (uint8_t)xq[k + 3];
        }
    }
}

/* A group of one tile against R rows: Q for rows 0-7, 8-15, 16-23, 24-31 as int32 (q32[r][v]). */
static inline __attribute__((always_inline)) void group_sums(const uint8_t *col, const uint8_t *const *steps,
                                                             __m256i q32[][4], const int R) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i acc[4][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm256_setzero_si256();
    for (int j = 0; j < GROUP / 4; j++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(col + 4 * j * 16));      /* columns 4j, 4j+1 */
        const __m256i b = _mm256_loadu_si256((const __m256i *)(col + 4 * j * 16 + 32)); /* 4j+2, 4j+3 */
        const __m256i alo = _mm256_and_si256(a, low4), blo = _mm256_and_si256(b, low4);
        const __m256i ahi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
        const __m256i bhi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        const __m256i codes[4] = {_mm256_unpacklo_epi8(alo, blo), _mm256_unpackhi_epi8(alo, blo),
                                  _mm256_unpacklo_epi8(ahi, bhi), _mm256_unpackhi_epi8(ahi, bhi)};
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(steps[r] + j * STEP_BYTES));
            for (int v = 0; v < 4; v++) acc[r][v] = _mm256_add_epi16(acc[r][v], _mm256_maddubs_epi16(codes[v], xv));
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) /* the two lanes: the same eight rows, other columns */
            q32[r][v] = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[r][v])),
                                         _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[r][v], 1)));
}

/* R rows (1 or 2) of one tile: out[r][row0 ..] for the tile's rows. */
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *tile, int64_t t, int64_t K,
                                                            const uint8_t *const *steps,
                                                            const float *const *dx, const float *const *sx,
                                                            float *const *out, int64_t n, const int R) {
    __m256 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / GROUP; g++) {
        const uint8_t *gsteps[2];
        for (int r = 0; r < R; r++) gsteps[r] = steps[r] + g * GROUP_BYTES;
        __m256i q32[2][4];
        const uint8_t *col = tile + g * INT4G_GROUP_BYTES;
        group_sums(col, gsteps, q32, R);
        const uint16_t *halves = (const uint16_t *)(col + INT4G_CODE_BYTES);
        for (int v = 0; v < 4; v++) { /* rows 8v..8v+7; bias = z - 8 s */
            const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 8 * v)));
            const __m256 bias = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sc,
                                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 32 + 8 * v))));
            for (int r = 0; r < R; r++) {
                const __m256 sdx = _mm256_mul_ps(sc, _mm256_set1_ps(dx[r][g]));
                acc[r][v] = _mm256_fmadd_ps(sdx, _mm256_cvtepi32_ps(q32[r][v]),
                                            _mm256_fmadd_ps(bias, _mm256_set1_ps(sx[r][g]), acc[r][v]));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float res[32] __attribute__((aligned(32)));
        for (int v = 0; v < 4; v++) _mm256_store_ps(res + 8 * v, acc[r][v]);
        memcpy(out[r] + t * 32, res, sizeof(float) * n);
    }
}
#endif

/* x: [M][K] float32 (K a multiple of 32, any M >= 1); packed: int4_gemm_f32's;
 * out: [M][N_out] float32; scratch: int4_i8_f32_scratch_bytes(M, K) bytes. Returns 0, or -1 when the
 * shape is out of range. */
int int4_gemm_i8_f32(const float *x, const uint8_t *packed, float *out, int64_t M, int64_t N_pad, int64_t N_out,
                     int64_t K, void *scratch) {
    if (M < 1 || K % GROUP != 0 || N_pad % 32 != 0) return -1;
    const int64_t G = K / GROUP;
    int8_t *xq = (int8_t *)scratch;
    uint8_t *steps = (uint8_t *)scratch + M * K;
    float *dx = (float *)(steps + M * G * GROUP_BYTES), *sx = dx + M * G;
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * K, dx + m * G, sx + m * G);
#if TESSERA_AVX2
    for (int64_t m = 0; m < M; m++) lay_out_steps(xq + m * K, K, steps + m * G * GROUP_BYTES);
    const int64_t tiles = N_pad / 32;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = int4g_group(packed, K, t, 0);
        const int64_t n = N_out - t * 32 < 32 ? N_out - t * 32 : 32;
        if (n <= 0) continue;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            const uint8_t *st[2] = {steps + m * G * GROUP_BYTES, steps + (m + 1) * G * GROUP_BYTES};
            const float *d[2] = {dx + m * G, dx + (m + 1) * G}, *s[2] = {sx + m * G, sx + (m + 1) * G};
            float *o[2] = {out + m * N_out, out + (m + 1) * N_out};
            tile_rows(tile, t, K, st, d, s, o, n, 2);
        }
        if (m < M) {
            const uint8_t *st[1] = {steps + m * G * GROUP_BYTES};
            const float *d[1] = {dx + m * G}, *s[1] = {sx + m * G};
            float *o[1] = {out + m * N_out};
            tile_rows(tile, t, K, st, d, s, o, n, 1);
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N_out; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                const int32_t q = int4g_group_idot(xq + m * K + g * GROUP, packed, K, n, g);
                float s, z;
                int4g_scale_zero(packed, K, n, g, &s, &z);
                const float sxg = sx[m * G + g];
                acc += s * (dx[m * G + g] * (float)q - 8.f * sxg) + z * sxg;
            }
            out[m * N_out + n] = acc;
        }
#endif
    return 0;
}
