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
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512 1
#endif

#include "bf16.h"

/* 1 when this build has the AVX512-BF16 paths of the few-row matrix kernels (int4_gemm_bf16,
 * int8_gemm_bf16), 0 when they would return -1 (an AVX2 host, say). */
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
 * out: [M, N_out] bf16; scratch: M * K/32 floats. */
#ifdef HAVE_AVX512
#define INT4_MB 4
static inline int row_of(int v, int l) { /* v: 0..3 vector, l: 0..15 lane -> row in the tile */
    return (v >> 1) * 32 + (l < 8 ? 0 : 16) + (v & 1) * 8 + (l & 7);
}
#endif

int int4_gemm_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t M,
                   int64_t N_pad, int64_t N_out, int64_t K, float *scratch) {
#ifdef HAVE_AVX512
    const int64_t G = K / 32;
    float *xs = scratch; /* [M][G] sums of x per group */
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
            for (int64_t i = 0; i < 32; i++) s += bf16_to_f32(x[m * K + g * 32 + i]);
            xs[m * G + g] = s;
        }
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
    (void)x; (void)packed; (void)sz; (void)out; (void)M; (void)N_pad; (void)N_out; (void)K; (void)scratch;
    return -1;
#endif
}
