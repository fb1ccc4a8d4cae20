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

int64_t int4_i16_f32_scratch_bytes(int64_t M, int64_t K) {
    const int64_t G = K / GROUP;
    return 2 * M * K + 2 * M * G * GROUP_BYTES + 2 * M * G * (int64_t)sizeof(float) + 64;
}

/* Row x [K] rounded to multiples of its groups' max|x| / qmax (127: int8, 32767: int16): the codes
 * into xq8 or xq16 (the other NULL), per group dx and sx; the plain C path's (AVX2 builds take
 * quantize_row_avx2 and quantize_row16_avx2, the same integers). */
static inline void quantize_row(const float *x, int64_t K, float qmax, int8_t *xq8, int16_t *xq16, float *dx,
                                float *sx) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const float *v = x + g * GROUP;
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < GROUP; i++) {
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
            sum += v[i];
        }
        const float inv = amax > 0.f ? qmax / amax : 0.f;
        for (int i = 0; i < GROUP; i++) {
            float r = nearbyintf(v[i] * inv);
            r = r > qmax ? qmax : r < -qmax - 1.f ? -qmax - 1.f : r;
            if (xq8) xq8[g * GROUP + i] = (int8_t)r;
            else xq16[g * GROUP + i] = (int16_t)r;
        }
        dx[g] = amax / qmax;
        sx[g] = sum;
    }
}

/* The plain C path's products of quantize_row's integers (xq8 or xq16) with the codes: per group,
 * y += s * (dx * Q - 8 * sx) + z * sx. */
static inline void plain_products(const int8_t *xq8, const int16_t *xq16, const uint8_t *packed, const float *dx,
                                  const float *sx, float *out, int64_t M, int64_t N_out, int64_t K) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N_out; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                const int64_t at = m * K + g * GROUP;
                const int32_t q = int4g_group_idot(xq8 ? xq8 + at : NULL, xq16 ? xq16 + at : NULL, packed, K, n, g);
                float s, z;
                int4g_scale_zero(packed, K, n, g, &s, &z);
                const float sxg = sx[m * G + g];
                acc += s * (dx[m * G + g] * (float)q - 8.f * sxg) + z * sxg;
            }
            out[m * N_out + n] = acc;
        }
}

#if TESSERA_AVX2
/* A group's 32 values into a[4] and their rounded multiples of inv into q[4]; returns max|x| and
 * sets *sum (the rounding as nearbyintf's, so the vector and plain paths make the same integers). */
static inline float load_group(const float *v, __m256 a[4], float *sum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps(), s = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        a[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(a[i], absmask));
        s = _mm256_add_ps(s, a[i]);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    *sum = hsum_ps256(s);
    return _mm_cvtss_f32(m);
}

static inline void round_group(const __m256 a[4], float inv, __m256i q[4]) {
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a[i], _mm256_set1_ps(inv)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* quantize_row's integers, 8 lanes at a time (the same maximum and the same rounding of the same
 * products, so the same codes; the group's sum in another order). Why: a decode step quantizes
 * every projection's input on one thread while the others wait, and the scalar loop (a libm
 * nearbyintf a value) took ~5 % of a SmolLM2-135M step on an AMD EPYC with AVX2. */
static void quantize_row_avx2(const float *x, int64_t K, int8_t *xq, float *dx, float *sx) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 a[4];
        __m256i q[4];
        const float mx = load_group(x + g * GROUP, a, &sx[g]);
        round_group(a, mx > 0.f ? 127.f / mx : 0.f, q);
        /* int32 -> int8 with saturation (quantize_row's clamp); packs interleave the lanes, the
         * permute puts the 32 values back in order */
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + g * GROUP),
                            _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        dx[g] = mx / 127.f;
    }
}

/* xq's steps as VPMADDUBSW reads them: step j of a group, lane 0: (x[4j], x[4j + 2]) eight times,
 * lane 1: (x[4j + 1], x[4j + 3]) eight times; one byte shuffle of the four values a step. */
static void lay_out_steps(const int8_t *xq, int64_t K, uint8_t *steps) {
    const __m256i pick = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                          1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
    for (int64_t k = 0; k < K; k += 4) {
        int32_t four;
        memcpy(&four, xq + k, 4);
        _mm256_storeu_si256((__m256i *)(steps + k / 4 * STEP_BYTES), _mm256_shuffle_epi8(_mm256_set1_epi32(four), pick));
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

/* quantize_row's int16 integers, 8 lanes at a time (as quantize_row_avx2). */
static void quantize_row16_avx2(const float *x, int64_t K, int16_t *xq, float *dx, float *sx) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 a[4];
        __m256i q[4];
        const float mx = load_group(x + g * GROUP, a, &sx[g]);
        round_group(a, mx > 0.f ? 32767.f / mx : 0.f, q);
        for (int i = 0; i < 2; i++) /* packs interleave the lanes; the permute puts them back in order */
            _mm256_storeu_si256((__m256i *)(xq + g * GROUP + 16 * i),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8));
        dx[g] = mx / 32767.f;
    }
}

/* xq's int16 values as two sets of steps in lay_out_steps' order: their high bytes (signed) and
 * their low bytes (unsigned), x = 256 hi + lo. */
static void lay_out_steps16(const int16_t *xq, int64_t K, uint8_t *hi, uint8_t *lo) {
    const __m256i pick_lo = _mm256_setr_epi8(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4,
                                             2, 6, 2, 6, 2, 6, 2, 6, 2, 6, 2, 6, 2, 6, 2, 6);
    const __m256i pick_hi = _mm256_add_epi8(pick_lo, _mm256_set1_epi8(1));
    for (int64_t k = 0; k < K; k += 4) {
        int64_t four;
        memcpy(&four, xq + k, 8);
        const __m256i v = _mm256_set1_epi64x(four);
        _mm256_storeu_si256((__m256i *)(hi + k / 4 * STEP_BYTES), _mm256_shuffle_epi8(v, pick_hi));
        _mm256_storeu_si256((__m256i *)(lo + k / 4 * STEP_BYTES), _mm256_shuffle_epi8(v, pick_lo));
    }
}

/* group_sums for one row of int16 activations: Q = 256 Qhi + Qlo. The high bytes meet the codes as
 * int8 activations do; the low bytes (0..255) are VPMADDUBSW's unsigned operand and the codes
 * (0..15) its signed one, each pair at most 2 x 255 x 15, and a group's eight steps at most 61,200:
 * non-negative, so the int16 sums are read as unsigned 16-bit. */
static inline __attribute__((always_inline)) void group_sums16(const uint8_t *col, const uint8_t *hi,
                                                               const uint8_t *lo, __m256i q32[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i acc_hi[4], acc_lo[4];
    for (int v = 0; v < 4; v++) acc_hi[v] = acc_lo[v] = _mm256_setzero_si256();
    for (int j = 0; j < GROUP / 4; j++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(col + 4 * j * 16));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(col + 4 * j * 16 + 32));
        const __m256i alo = _mm256_and_si256(a, low4), blo = _mm256_and_si256(b, low4);
        const __m256i ahi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
        const __m256i bhi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        const __m256i codes[4] = {_mm256_unpacklo_epi8(alo, blo), _mm256_unpackhi_epi8(alo, blo),
                                  _mm256_unpacklo_epi8(ahi, bhi), _mm256_unpackhi_epi8(ahi, bhi)};
        const __m256i xh = _mm256_loadu_si256((const __m256i *)(hi + j * STEP_BYTES));
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(lo + j * STEP_BYTES));
        for (int v = 0; v < 4; v++) {
            acc_hi[v] = _mm256_add_epi16(acc_hi[v], _mm256_maddubs_epi16(codes[v], xh));
            acc_lo[v] = _mm256_add_epi16(acc_lo[v], _mm256_maddubs_epi16(xl, codes[v]));
        }
    }
    for (int v = 0; v < 4; v++) {
        const __m256i h = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc_hi[v])),
                                           _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc_hi[v], 1)));
        const __m256i l = _mm256_add_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(acc_lo[v])),
                                           _mm256_cvtepu16_epi32(_mm256_extracti128_si256(acc_lo[v], 1)));
        q32[v] = _mm256_add_epi32(_mm256_slli_epi32(h, 8), l);
    }
}

/* One row of one tile with int16 activations: out[row0 ..] for the tile's rows (tile_rows' formula). */
static void tile_row16(const uint8_t *tile, int64_t t, int64_t K, const uint8_t *hi, const uint8_t *lo,
                       const float *dx, const float *sx, float *out, int64_t n) {
    __m256 acc[4];
    for (int v = 0; v < 4; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256i q32[4];
        const uint8_t *col = tile + g * INT4G_GROUP_BYTES;
        group_sums16(col, hi + g * GROUP_BYTES, lo + g * GROUP_BYTES, q32);
        const uint16_t *halves = (const uint16_t *)(col + INT4G_CODE_BYTES);
        const __m256 d = _mm256_set1_ps(dx[g]), sxg = _mm256_set1_ps(sx[g]);
        for (int v = 0; v < 4; v++) {
            const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 8 * v)));
            const __m256 bias = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sc,
                                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 32 + 8 * v))));
            acc[v] = _mm256_fmadd_ps(_mm256_mul_ps(sc, d), _mm256_cvtepi32_ps(q32[v]), _mm256_fmadd_ps(bias, sxg, acc[v]));
        }
    }
    float res[32] __attribute__((aligned(32)));
    for (int v = 0; v < 4; v++) _mm256_store_ps(res + 8 * v, acc[v]);
    memcpy(out + t * 32, res, sizeof(float) * n);
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
#if TESSERA_AVX2
    for (int64_t m = 0; m < M; m++) {
        quantize_row_avx2(x + m * K, K, xq + m * K, dx + m * G, sx + m * G);
        lay_out_steps(xq + m * K, K, steps + m * G * GROUP_BYTES);
    }
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
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, 127.f, xq + m * K, NULL, dx + m * G, sx + m * G);
    plain_products(xq, NULL, packed, dx, sx, out, M, N_out, K);
#endif
    return 0;
}

/* int4_gemm_i8_f32 with the rows rounded to int16 per group of 32 (dx = max|x| / 32767): for inputs
 * whose outlier channels int8 would flatten (Linear.int8_inputs False: the gated MLP's down
 * projection), at ~1e-5 of each group's largest value from the float32 product. Why: int4_gemm_f32
 * widens every code to a float, ~3x this kernel's time a weight at one row on an AMD EPYC with AVX2
 * (a SmolLM2-135M decode step's down projections took ~15 % of it). Each int16 splits into a
 * signed high byte and an unsigned low byte that meet the codes in VPMADDUBSW as group_sums16 says;
 * a row at a time (two rows' sums would not fit the registers). Same arguments as int4_gemm_i8_f32;
 * scratch: int4_i16_f32_scratch_bytes(M, K) bytes. */
int int4_gemm_i16_f32(const float *x, const uint8_t *packed, float *out, int64_t M, int64_t N_pad, int64_t N_out,
                      int64_t K, void *scratch) {
    if (M < 1 || K % GROUP != 0 || N_pad % 32 != 0) return -1;
    const int64_t G = K / GROUP;
    int16_t *xq = (int16_t *)scratch;
    uint8_t *hi = (uint8_t *)scratch + 2 * M * K, *lo = hi + M * G * GROUP_BYTES;
    float *dx = (float *)(lo + M * G * GROUP_BYTES), *sx = dx + M * G;
#if TESSERA_AVX2
    for (int64_t m = 0; m < M; m++) {
        quantize_row16_avx2(x + m * K, K, xq + m * K, dx + m * G, sx + m * G);
        lay_out_steps16(xq + m * K, K, hi + m * G * GROUP_BYTES, lo + m * G * GROUP_BYTES);
    }
    const int64_t tiles = N_pad / 32;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n = N_out - t * 32 < 32 ? N_out - t * 32 : 32;
        if (n <= 0) continue;
        for (int64_t m = 0; m < M; m++)
            tile_row16(int4g_group(packed, K, t, 0), t, K, hi + m * G * GROUP_BYTES, lo + m * G * GROUP_BYTES,
                       dx + m * G, sx + m * G, out + m * N_out, n);
    }
#else
    (void)hi, (void)lo;
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, 32767.f, NULL, xq + m * K, dx + m * G, sx + m * G);
    plain_products(NULL, xq, packed, dx, sx, out, M, N_out, K);
#endif
    return 0;
}
