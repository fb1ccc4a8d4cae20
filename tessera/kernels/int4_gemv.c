/* Weight-only int4 matrix products for 1 to 64 bfloat16 rows, on PyTorch's CPU int4pack layout.
 *
 * Layout (as torch._convert_weight_to_int4pack_for_cpu writes it): output rows in tiles of 64;
 * tile t, input column k, byte j holds row 64t + j in its low nibble and row 64t + 32 + j in its
 * high nibble. scales_zeros is [K/32][N][2] bfloat16 pairs (scale, zero) with
 * w = (code - 8) * scale + zero. Tiles are split across torch's OpenMP threads.
 * (A one-row kernel that widened each code to float32 was replaced by int4_gemm_bf16 at one row
 * too: SmolLM2-135M's projections for one token, 3.5 -> 2.9 ms, its bfloat16 dot products doing
 * two codes per lane.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "simd.h"
#if TESSERA_AVX512_BF16
#define HAVE_AVX512 1
#endif

#include "bf16.h"
#include "tessera_kernels.h"

/* 1 when this build has the AVX512-BF16 paths of the few-row matrix kernels (int4_gemm_bf16,
 * int8_gemm_bf16), 0 when they take their plain C paths (an AVX2 host, say: callers then prefer
 * PyTorch's kernels). */
int tessera_avx512_bf16(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_AVX512
/* Rows row..row+15 of an output row of N_out values, as bfloat16; stops at N_out. */
static inline void store_bf16x16(uint16_t *out, int64_t row, int64_t N_out, __m512 values) {
    if (row >= N_out) return;
    const __m256i packed_out = (__m256i)_mm512_cvtneps_pbh(values);
    if (row + 16 <= N_out) {
        _mm256_storeu_si256((__m256i *)(out + row), packed_out);
    } else {
        uint16_t tmp[16];
        _mm256_storeu_si256((__m256i *)tmp, packed_out);
        for (int64_t r = row; r < N_out; r++) out[r] = tmp[r - row];
    }
}
#endif

/* Weight-only int4 matrix product for a few rows (M up to a few dozen: decode batches and the
 * small mixed steps of latency-targeted scheduling), on the same int4pack layout.
 *
 * Where PyTorch dequantizes or runs a small-M bf16 GEMM at a fraction of the machine's rate,
 * this reads each tile of codes once per block of 4 input rows and feeds AVX512-BF16 dot
 * products (vdpbf16ps, 32 multiply-adds per instruction) directly from the codes: a code q
 * becomes the bfloat16 128 + q by OR-ing it into 0x4300 (exact: bf16's unit in [128, 256) is 1),
 * and two consecutive input columns are interleaved so each 32-bit lane holds one output row's
 * pair of weights. Per group of 32 columns:
 *   y += s * (sum x (128 + q) - 136 * sum x) + z * sum x      (w = (q - 8) * s + z).
 * The unpack instructions permute the 64 rows of a tile (lane l of vector v holds row
 * ROW_OF(v, l)); scales, zeros and outputs follow the same permutation.
 * x: [M, K] bf16 (K a multiple of 32); packed: [N_pad/64][K][32]; sz: [K/32][N_pad][2] bf16;
 * out: [M, N_out] bf16; scratch: M * K/32 floats. Builds without AVX512-BF16 compute the same sums
 * in a plain C loop (the reference the vector path is tested against). */
#ifdef HAVE_AVX512
#define INT4_MB 4
static inline int row_of(int v, int l) { /* v: 0..3 vector, l: 0..15 lane -> row in the tile */
    return (v >> 1) * 32 + (l < 8 ? 0 : 16) + (v & 1) * 8 + (l & 7);
}

/* The sum of each group of 32 values of x's M rows of K: xs [M][K/32]. */
static inline __attribute__((always_inline)) void group_sums(const uint16_t *x, int64_t M, int64_t K, float *xs) {
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
            for (int64_t i = 0; i < 32; i++) s += bf16_to_f32(x[m * K + g * 32 + i]);
            xs[m * G + g] = s;
        }
}
#endif

int int4_gemm_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t M,
                   int64_t N_pad, int64_t N_out, int64_t K, float *scratch) {
#ifdef HAVE_AVX512
    const int64_t G = K / 32;
    float *xs = scratch; /* [M][G] sums of x per group */
    group_sums(x, M, K, xs);
    const int64_t tiles = N_pad / 64;
    const int64_t mblocks = (M + INT4_MB - 1) / INT4_MB;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t mb = 0; mb < mblocks; mb++) {
            const uint8_t *tile = packed + t * K * 32;
            const int64_t m0 = mb * INT4_MB;
            const int nm = (int)(M - m0 < INT4_MB ? M - m0 : INT4_MB);
            const __m256i low4 = _mm256_set1_epi8(0x0F);
            const __m512i bias = _mm512_set1_epi16(0x4300);
            const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
            __m512 acc[INT4_MB][4];
            for (int r = 0; r < INT4_MB; r++)
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
            /* scales and zeros of this tile in the permuted row order, one group at a time */
            for (int64_t g = 0; g < G; g++) {
                __m512 q[INT4_MB][4];
                for (int r = 0; r < INT4_MB; r++)
                    for (int v = 0; v < 4; v++) q[r][v] = _mm512_setzero_ps();
                const uint8_t *col = tile + g * 32 * 32;
                for (int64_t kk = 0; kk < 32; kk += 2) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(col + kk * 32));
                    const __m256i b = _mm256_loadu_si256((const __m256i *)(col + (kk + 1) * 32));
                    const __m256i alo = _mm256_and_si256(a, low4), blo = _mm256_and_si256(b, low4);
                    const __m256i ahi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
                    const __m256i bhi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
                    __m512bh w[4];
                    w[0] = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(alo, blo)), bias);
                    w[1] = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(alo, blo)), bias);
                    w[2] = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(ahi, bhi)), bias);
                    w[3] = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(ahi, bhi)), bias);
                    for (int r = 0; r < nm; r++) {
                        uint32_t pair;
                        __builtin_memcpy(&pair, x + (m0 + r) * K + g * 32 + kk, 4);
                        const __m512bh xp = (__m512bh)_mm512_set1_epi32((int)pair);
                        for (int v = 0; v < 4; v++) q[r][v] = _mm512_dpbf16_ps(q[r][v], w[v], xp);
                    }
                }
                const uint16_t *pairs = sz + (g * N_pad + t * 64) * 2;
                for (int v = 0; v < 4; v++) {
                    /* lanes 0-7: rows base..base+7, lanes 8-15: rows base+16..base+23 */
                    const int base = (v >> 1) * 32 + (v & 1) * 8;
                    const __m256i lo8 = _mm256_loadu_si256((const __m256i *)(pairs + base * 2));
                    const __m256i hi8 = _mm256_loadu_si256((const __m256i *)(pairs + (base + 16) * 2));
                    const __m512i sv = _mm512_inserti64x4(_mm512_castsi256_si512(lo8), hi8, 1);
                    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(sv, 16));
                    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(sv, hi_mask));
                    for (int r = 0; r < nm; r++) {
                        const float sx = xs[(m0 + r) * G + g];
                        const __m512 t1 = _mm512_sub_ps(q[r][v], _mm512_set1_ps(136.f * sx));
                        acc[r][v] = _mm512_fmadd_ps(s, t1, acc[r][v]);
                        acc[r][v] = _mm512_fmadd_ps(z, _mm512_set1_ps(sx), acc[r][v]);
                    }
                }
            }
            for (int r = 0; r < nm; r++) {
                float rowbuf[64];
                for (int v = 0; v < 4; v++) {
                    float lanes[16];
                    _mm512_storeu_ps(lanes, acc[r][v]);
                    for (int l = 0; l < 16; l++) rowbuf[row_of(v, l)] = lanes[l];
                }
                for (int i = 0; i < 64; i += 16)
                    store_bf16x16(out + (m0 + r) * N_out, t * 64 + i, N_out, _mm512_loadu_ps(rowbuf + i));
            }
        }
    }
    return 0;
#else
    /* Plain C: per output row n and group g, y += s * sum x (q - 8) + z * sum x, float32 sums. */
    (void)scratch;
    if (K % 32 != 0) return -1;
    const int64_t G = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N_out; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                float xg[32], sum;
                for (int i = 0; i < 32; i++) xg[i] = bf16_to_f32(x[m * K + g * 32 + i]);
                const float dot = int4pack_group_dot(xg, packed, K, 64, n, g * 32, &sum);
                const uint16_t *pair = sz + (g * N_pad + n) * 2;
                acc += bf16_to_f32(pair[0]) * dot + bf16_to_f32(pair[1]) * sum;
            }
            out[m * N_out + n] = f32_to_bf16(acc);
        }
    return 0;
#endif
}

/* The same int4pack weight times int8-quantized activations, with AVX512-VNNI integer dot products
 * (vpdpbusd: 64 unsigned-by-signed byte products a instruction, twice vdpbf16ps's 32), for steps of
 * a few to 64 rows: batched decode, verification, small prompt chunks. llama.cpp's Q4_1 x Q8_1.
 *
 * Each row of x is quantized per group of 32 values (the weight's group): xq = round(x * 127 /
 * amax), dx = amax / 127, and the exact float sum sx of the 32 values kept. Per output row n, row m
 * and group g, with Q = sum q * xq computed exactly in int32 (at most 32 * 15 * 127):
 *   y += s * (dx * Q - 8 * sx) + z * sx          (w = (q - 8) * s + z, as int4_gemm_bf16).
 * The codes stay in PyTorch's int4pack layout (the other int4 paths read it): vpdpbusd wants each
 * 32-bit lane to hold one output row's codes for 4 consecutive k, so the tile bytes of k .. k + 3
 * (two 64-byte loads) are regrouped by one two-source byte permutation (vpermt2b, AVX512-VBMI) per
 * half tile; the low nibbles are then rows 16h + j, the high nibbles rows 32 + 16h + j.
 * Work is split across torch's OpenMP threads by half tile (32 output rows), each running blocks of
 * up to I8_MB activation rows over its codes (which stay in L1). x: [M, K] bf16; scratch:
 * int4_i8_scratch_bytes(M, K) bytes. Builds without AVX512-VNNI and VBMI (or BF16) quantize the rows
 * the same way and take a plain C loop of the same integer sums and formula (the reference;
 * tessera_int4_i8() says 0 there). */
#if defined(HAVE_AVX512) && TESSERA_AVX512_VNNI && TESSERA_AVX512_VBMI
#define HAVE_INT4_I8 1
#define I8_MB 6
#define I8_CHUNK 96 /* a multiple of I8_MB */
#define I8_UNPACK_ROWS 12 /* more rows than this: codes unpacked once per chunk and half tile */
#endif

int tessera_int4_i8(void) {
#ifdef HAVE_INT4_I8
    return 1;
#else
    return 0;
#endif
}

int64_t int4_i8_scratch_bytes(int64_t M, int64_t K) {
    return M * K + 3 * M * (K / 32) * (int64_t)sizeof(float) + 64;
}

/* Row m of x -> xq [K] int8, and per group of 32: dx, sx, 8 * sx. */
static void quantize_row_g32(const uint16_t *x, int64_t K, int8_t *xq, float *dx, float *sx, float *sx8) {
    for (int64_t g = 0; g < K / 32; g++) {
#ifdef HAVE_INT4_I8
        const __m512i raw = _mm512_loadu_si512((const void *)(x + g * 32));
        const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        /* round to nearest even (the default mode), as nearbyintf; |x * inv| <= 127 */
        _mm_storeu_si128((__m128i *)(xq + g * 32), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
        _mm_storeu_si128((__m128i *)(xq + g * 32 + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
#else
        /* as the vector path: the sum in its order (value i plus value 16 + i, then halving, as
         * the register's reduction adds), each value rounded to nearest even and saturated */
        float v[16], amax = 0.f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(bf16_to_f32(x[g * 32 + i]));
            amax = a > amax ? a : amax;
        }
        for (int i = 0; i < 16; i++) v[i] = bf16_to_f32(x[g * 32 + i]) + bf16_to_f32(x[g * 32 + 16 + i]);
        for (int w = 8; w >= 1; w /= 2)
            for (int i = 0; i < w; i++) v[i] += v[i + w];
        const float sum = v[0];
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < 32; i++) {
            const float r = nearbyintf(bf16_to_f32(x[g * 32 + i]) * inv);
            xq[g * 32 + i] = (int8_t)(r > 127.f ? 127.f : r < -128.f ? -128.f : r);
        }
#endif
        dx[g] = amax / 127.f;
        sx[g] = sum;
        sx8[g] = 8.f * sum;
    }
}

#ifdef HAVE_INT4_I8
/* Rows m0 .. m0 + NM - 1 against NH half tiles from half h0 of tile `tile` (NH = 2: the whole
 * tile, for one or two rows, where four accumulator chains a row keep the dot products busy and the
 * tile's bytes are loaded once; NH = 1 for more rows, the registers holding six rows' sums). NM and
 * NH are constants after inlining, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void int4_i8_block(
    const int NM, const int NH, const uint8_t *tile, const __m512i *unpacked, const uint16_t *sz,
    const __m512i perm[2], int h0, const int8_t *xq, const float *dx, const float *sx, const float *sx8, int64_t m0,
    int64_t K, int64_t N_pad, uint16_t *out, int64_t N_out, int64_t row0) {
    const int64_t G = K / 32;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    /* vector v = 2 * (half - h0) + nibble: rows row0 + 16 * half + 32 * nibble + lane */
    __m512 f[4][I8_MB];
    for (int v = 0; v < 2 * NH; v++)
        for (int r = 0; r < NM; r++) f[v][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i a[4][I8_MB];
        for (int v = 0; v < 2 * NH; v++)
            for (int r = 0; r < NM; r++) a[v][r] = _mm512_setzero_si512();
        const uint8_t *col = tile + g * 32 * 32;
        for (int kk = 0; kk < 32; kk += 4) {
            __m512i w[4];
            if (unpacked) { /* one half tile's codes, regrouped and split once for a chunk of rows */
                w[0] = _mm512_load_si512((const void *)(unpacked + 2 * (g * 8 + kk / 4)));
                w[1] = _mm512_load_si512((const void *)(unpacked + 2 * (g * 8 + kk / 4) + 1));
            } else {
                const __m512i lo = _mm512_loadu_si512((const void *)(col + kk * 32));
                const __m512i hi = _mm512_loadu_si512((const void *)(col + kk * 32 + 64));
                for (int hh = 0; hh < NH; hh++) {
                    const __m512i p = _mm512_permutex2var_epi8(lo, perm[h0 + hh], hi);
                    w[2 * hh] = _mm512_and_si512(p, low4);
                    w[2 * hh + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
                }
            }
            for (int r = 0; r < NM; r++) {
                int32_t quad;
                __builtin_memcpy(&quad, xq + (m0 + r) * K + g * 32 + kk, 4);
                const __m512i xv = _mm512_set1_epi32(quad);
                for (int v = 0; v < 2 * NH; v++) a[v][r] = _mm512_dpbusd_epi32(a[v][r], w[v], xv);
            }
        }
        const uint16_t *pairs = sz + g * N_pad * 2;
        for (int v = 0; v < 2 * NH; v++) {
            const int64_t row = row0 + 16 * (h0 + v / 2) + 32 * (v % 2);
            const __m512i sv = _mm512_loadu_si512((const void *)(pairs + row * 2));
            const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(sv, 16));
            const __m512 zr = _mm512_castsi512_ps(_mm512_and_si512(sv, hi_mask));
            for (int r = 0; r < NM; r++) {
                const int64_t at = (m0 + r) * G + g;
                const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(a[v][r]), _mm512_set1_ps(dx[at]),
                                                 _mm512_set1_ps(sx8[at]));
                f[v][r] = _mm512_fmadd_ps(sc, t, f[v][r]);
                f[v][r] = _mm512_fmadd_ps(zr, _mm512_set1_ps(sx[at]), f[v][r]);
            }
        }
    }
    for (int v = 0; v < 2 * NH; v++)
        for (int r = 0; r < NM; r++)
            store_bf16x16(out + (m0 + r) * N_out, row0 + 16 * (h0 + v / 2) + 32 * (v % 2), N_out, f[v][r]);
}
#endif

int int4_gemm_i8(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t M,
                 int64_t N_pad, int64_t N_out, int64_t K, void *scratch) {
    if (K % 32 != 0 || M < 1) return -1;
    const int64_t G = K / 32;
    int8_t *xq = (int8_t *)scratch;
    float *dx = (float *)(((uintptr_t)(xq + M * K) + 63) & ~(uintptr_t)63);
    float *sx = dx + M * G, *sx8 = sx + M * G;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row_g32(x + m * K, K, xq + m * K, dx + m * G, sx + m * G, sx8 + m * G);
#ifdef HAVE_INT4_I8
    /* output byte 4j + i of half h: code byte 16h + j of k + i (k, k + 1 in lo; k + 2, k + 3 in hi) */
    uint8_t idx[2][64];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 16; j++)
            for (int i = 0; i < 4; i++) idx[h][4 * j + i] = (uint8_t)(64 * (i / 2) + 32 * (i % 2) + 16 * h + j);
    const __m512i perm[2] = {_mm512_loadu_si512((const void *)idx[0]), _mm512_loadu_si512((const void *)idx[1])};
    const int64_t tiles = N_pad / 64;
    if (M <= 2) { /* whole tiles */
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (M == 1)
                int4_i8_block(1, 2, packed + t * K * 32, NULL, sz, perm, 0, xq, dx, sx, sx8, 0, K, N_pad, out, N_out,
                              t * 64);
            else
                int4_i8_block(2, 2, packed + t * K * 32, NULL, sz, perm, 0, xq, dx, sx, sx8, 0, K, N_pad, out, N_out,
                              t * 64);
        }
        return 0;
    }
    /* half tiles, rows in chunks of I8_CHUNK (their int8 copies stay in L2 while every half tile
     * passes over them), blocks of I8_MB rows. Past I8_UNPACK_ROWS rows a half tile's codes are
     * regrouped and split into bytes once per chunk (K / 4 pairs of vectors, 32 bytes a k) rather
     * than once per block: the blocks then run dot products and loads alone. */
    const int unpack = M > I8_UNPACK_ROWS;
#pragma omp parallel
    {
        /* without the buffer (allocation failed) a thread unpacks per block, as for few rows */
        __m512i *w8 = unpack ? (__m512i *)aligned_alloc(64, (size_t)K * 32) : NULL;
        for (int64_t c0 = 0; c0 < M; c0 += I8_CHUNK) {
            const int64_t end = c0 + I8_CHUNK < M ? c0 + I8_CHUNK : M;
#pragma omp for schedule(static)
            for (int64_t th = 0; th < tiles * 2; th++) {
                const int64_t t = th / 2;
                const int h = (int)(th % 2);
                const uint8_t *tile = packed + t * K * 32;
                if (w8) {
                    const __m512i low4 = _mm512_set1_epi8(0x0F);
                    for (int64_t q = 0; q < K / 4; q++) {
                        const __m512i p = _mm512_permutex2var_epi8(
                            _mm512_loadu_si512((const void *)(tile + q * 128)), perm[h],
                            _mm512_loadu_si512((const void *)(tile + q * 128 + 64)));
                        _mm512_store_si512((void *)(w8 + 2 * q), _mm512_and_si512(p, low4));
                        _mm512_store_si512((void *)(w8 + 2 * q + 1), _mm512_and_si512(_mm512_srli_epi16(p, 4), low4));
                    }
                }
                for (int64_t m0 = c0; m0 < end; m0 += I8_MB) {
                    const int nm = (int)(end - m0 < I8_MB ? end - m0 : I8_MB);
#define I8_CASE(n) case n: \
    if (w8) int4_i8_block(n, 1, tile, w8, sz, perm, h, xq, dx, sx, sx8, m0, K, N_pad, out, N_out, t * 64); \
    else int4_i8_block(n, 1, tile, NULL, sz, perm, h, xq, dx, sx, sx8, m0, K, N_pad, out, N_out, t * 64); \
    break;
                    switch (nm) { I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4) I8_CASE(5) I8_CASE(6) }
#undef I8_CASE
                }
            }
        }
        free(w8);
    }
    return 0;
#else
    /* Plain C: per output row n, row m and group g, the exact integer sum Q = sum q * xq, then
     * y += s * (dx * Q - 8 * sx) + z * sx. */
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N_out; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                const int32_t q = int4pack_group_idot(xq + m * K + g * 32, packed, K, 64, n, g * 32);
                const uint16_t *pair = sz + (g * N_pad + n) * 2;
                const int64_t at = m * G + g;
                acc += bf16_to_f32(pair[0]) * (dx[at] * (float)q - sx8[at]);
                acc += bf16_to_f32(pair[1]) * sx[at];
            }
            out[m * N_out + n] = f32_to_bf16(acc);
        }
    return 0;
#endif
}
