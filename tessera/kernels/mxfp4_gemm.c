/* MXFP4 weights (gpt-oss's expert format in GGUF) multiplied in the file's own blocks, and decoded
 * to a dense weight for prompt-sized steps.
 *
 * A block is 32 values of one weight row in 17 bytes: an E8M0 exponent e, then 16 bytes of 4-bit
 * E2M1 codes, value j (j < 16) in the low nibble of byte j, value 16 + j in its high nibble (gguf's
 * quants.MXFP4, llama.cpp's block_mxfp4). w = kvalues[code] * 2^(e - 128): kvalues are E2M1 doubled
 * to integers (0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0 .. 12, sign in bit 3), so the half goes into the
 * scale (ggml's E8M0_TO_FP32_HALF). The matrix is kept exactly as the file has it (4.25 bits a
 * weight): the codes are looked up 32 at a time with one byte shuffle, no repacking needed.
 *
 * The product quantizes the activations to int8 per 32 values, as llama.cpp's q8_0 does (xd =
 * amax / 127, xq = round(x / xd), xd kept in float32), and then per block sums kvalues x xq exactly
 * in integers (pmaddubsw on |w| and xq with w's sign: at most 2 * 12 * 127 per int16 pair) and
 * scales the sum once by 2^(e - 128) * xd. The error is the activations' rounding only: half an xq
 * step (xd / 2) per value. Weight rows are split across torch's OpenMP threads; each block's codes
 * are looked up once per group of MX_ROW_GROUP activation rows, whose products share it. AVX2
 * hosts (AVX-512 ones included) take the vector path, others a plain C loop.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"

#include "bf16.h"
#include "tessera_kernels.h"

#define MX_BLOCK 32
#define MX_BLOCK_BYTES 17
#define MX_ROW_GROUP 8 /* activation rows whose products share a looked-up block (registers) */

static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) as float32, e the block's E8M0 byte (ggml_e8m0_to_fp32_half: e < 2 are subnormal). */
static inline float e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return v.f;
}

/* Row m of x (K bfloat16 or float32 values) -> xq (K int8), xd (K/32 float scales) and xs (K/32:
 * 12 * xd * the block's sum of xq, the offset row_dot's unsigned codes add). */
static void quantize_row_q8(const void *x, int is_bf16, int64_t m, int64_t K, int8_t *xq, float *xd, float *xs) {
    for (int64_t b = 0; b < K / MX_BLOCK; b++) {
        const int64_t at = m * K + b * MX_BLOCK;
        int8_t *q = xq + b * MX_BLOCK;
#if TESSERA_AVX2
        __m256 v[4];
        __m256 vmax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (int g = 0; g < 4; g++) {
            v[g] = is_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                 _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + 8 * g))), 16))
                           : _mm256_loadu_ps((const float *)x + at + 8 * g);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v[g]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const __m256 iscale = _mm256_set1_ps(amax == 0.f ? 0.f : 127.f / amax);
        __m256i r[4];
        for (int g = 0; g < 4; g++) r[g] = _mm256_cvtps_epi32(_mm256_mul_ps(v[g], iscale)); /* nearest even */
        /* |r| <= 127, so the saturating packs are exact; they interleave 128-bit lanes, undone by the permute */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        const int32_t qsum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
#else
        float v[MX_BLOCK], amax = 0.f;
        for (int j = 0; j < MX_BLOCK; j++) {
            v[j] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + j]) : ((const float *)x)[at + j];
            const float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        const float iscale = amax == 0.f ? 0.f : 127.f / amax;
        for (int j = 0; j < MX_BLOCK; j++) {
            const float t = nearbyintf(v[j] * iscale);
            q[j] = (int8_t)(t > 127.f ? 127.f : t < -127.f ? -127.f : t);
        }
        int32_t qsum = 0;
        for (int j = 0; j < MX_BLOCK; j++) qsum += q[j];
#endif
        xd[b] = amax == 0.f ? 0.f : amax / 127.f;
        xs[b] = 12.f * xd[b] * (float)qsum;
    }
}

#if TESSERA_AVX2
/* One weight row (NB blocks) against R activation rows (xq rows K apart, xd and xs rows NB apart)
 * -> sums[0..R-1]. The codes are looked up as kvalues + 12 (0..24, unsigned, as pmaddubsw wants
 * its first operand), so no row pays for a sign; the 12 * sum(xq) this adds per block is taken
 * off as 2^(e - 128) * xs, eight blocks a vector. R is a constant at each call, so the loops over
 * rows unroll into registers. */
static inline __attribute__((always_inline)) void row_dot(const uint8_t *w, int64_t NB, const int8_t *xq,
                                                          const float *xd, const float *xs, int64_t K, float *sums,
                                                          const int R) {
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MX_ROW_GROUP];
    float tail[MX_ROW_GROUP];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), tail[r] = 0.f;
    for (int64_t b8 = 0; b8 < NB; b8 += 8) {
        const int nb = NB - b8 < 8 ? (int)(NB - b8) : 8;
        float dw[8];
        for (int i = 0; i < nb; i++) dw[i] = e8m0_half(w[(b8 + i) * MX_BLOCK_BYTES]);
        for (int i = 0; i < nb; i++) {
            const uint8_t *blk = w + (b8 + i) * MX_BLOCK_BYTES;
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 1));
            /* lane 0: values 0..15 (low nibbles), lane 1: values 16..31 (high nibbles) */
            const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                                                   _mm_and_si128(bytes, low4));
            const __m256i wu = _mm256_shuffle_epi8(lut, codes);
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + (b8 + i) * MX_BLOCK));
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[i] * xd[r * NB + b8 + i]), acc[r]);
            }
        }
        if (nb == 8) {
            const __m256 dwv = _mm256_loadu_ps(dw);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fnmadd_ps(dwv, _mm256_loadu_ps(xs + r * NB + b8), acc[r]);
        } else {
            for (int r = 0; r < R; r++)
                for (int i = 0; i < nb; i++) tail[r] += dw[i] * xs[r * NB + b8 + i];
        }
    }
    for (int r = 0; r < R; r++) sums[r] = hsum_ps256(acc[r]) - tail[r];
}
#else
/* row_dot in plain C, one code at a time. */
static inline __attribute__((always_inline)) void row_dot(const uint8_t *w, int64_t NB, const int8_t *xq,
                                                          const float *xd, const float *xs, int64_t K, float *sums,
                                                          const int R) {
    (void)xs;
    for (int r = 0; r < R; r++) {
        float total = 0.f;
        for (int64_t b = 0; b < NB; b++) {
            const uint8_t *blk = w + b * MX_BLOCK_BYTES;
            const int8_t *xb = xq + r * K + b * MX_BLOCK;
            int32_t isum = 0;
            for (int j = 0; j < MX_BLOCK / 2; j++)
                isum += kvalues_mxfp4[blk[1 + j] & 0x0F] * xb[j] + kvalues_mxfp4[blk[1 + j] >> 4] * xb[j + 16];
            total += (float)isum * (e8m0_half(blk[0]) * xd[r * NB + b]);
        }
        sums[r] = total;
    }
}
#endif

/* Bytes of scratch mxfp4_gemm needs for M rows of K: xq, then xd and xs. */
int64_t mxfp4_scratch_bytes(int64_t M, int64_t K) {
    return M * K + 2 * M * (K / MX_BLOCK) * (int64_t)sizeof(float) + 64;
}

/* x: [M][K] (bfloat16 if is_bf16 else float32), blocks: [N][K/32][17] uint8 as the file stores
 * them, out: [M][N] like x, scratch: mxfp4_scratch_bytes(M, K). Returns 0, or -1 if M is not in
 * 1..MXFP4_MAX_ROWS or K is not a multiple of 32. */
int mxfp4_gemm(const void *x, const uint8_t *blocks, void *out, int64_t M, int64_t N, int64_t K, int is_bf16,
               void *scratch) {
    if (M < 1 || M > MXFP4_MAX_ROWS || K % MX_BLOCK != 0) return -1;
    const int64_t NB = K / MX_BLOCK;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(((uintptr_t)(xq + M * K) + 15) & ~(uintptr_t)15);
    float *xs = xd + M * NB;
    for (int64_t m = 0; m < M; m++) quantize_row_q8(x, is_bf16, m, K, xq + m * K, xd + m * NB, xs + m * NB);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w = blocks + n * NB * MX_BLOCK_BYTES;
        float sums[MXFP4_MAX_ROWS];
        int64_t m = 0;
        for (; m + MX_ROW_GROUP <= M; m += MX_ROW_GROUP)
            row_dot(w, NB, xq + m * K, xd + m * NB, xs + m * NB, K, sums + m, MX_ROW_GROUP);
        for (; m < M; m++) row_dot(w, NB, xq + m * K, xd + m * NB, xs + m * NB, K, sums + m, 1);
        store_column(out, N, n, sums, M, is_bf16);
    }
    return 0;
}

/* The dense weight [N][K] (bfloat16 if is_bf16 else float32) of blocks as mxfp4_gemm reads them:
 * every MXFP4 value is exact in float32 (and in bfloat16 but for the two subnormal exponents). */
void mxfp4_dequant(const uint8_t *blocks, void *out, int64_t N, int64_t K, int is_bf16) {
    const int64_t NB = K / MX_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < NB; b++) {
            const uint8_t *blk = blocks + (n * NB + b) * MX_BLOCK_BYTES;
            const float d = e8m0_half(blk[0]);
            float v[MX_BLOCK];
#if TESSERA_AVX2
            const __m128i lut = _mm_loadu_si128((const __m128i *)kvalues_mxfp4);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 1));
            const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, _mm_set1_epi8(0x0F)));
            const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F)));
            const __m256 dv = _mm256_set1_ps(d);
            _mm256_storeu_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), dv));
            _mm256_storeu_ps(v + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), dv));
            _mm256_storeu_ps(v + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), dv));
            _mm256_storeu_ps(v + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), dv));
#else
            for (int j = 0; j < MX_BLOCK / 2; j++) {
                v[j] = (float)kvalues_mxfp4[blk[1 + j] & 0x0F] * d;
                v[j + 16] = (float)kvalues_mxfp4[blk[1 + j] >> 4] * d;
            }
#endif
            if (is_bf16) {
                uint16_t *o = (uint16_t *)out + n * K + b * MX_BLOCK;
                for (int j = 0; j < MX_BLOCK; j++) o[j] = f32_to_bf16(v[j]);
            } else {
                memcpy((float *)out + n * K + b * MX_BLOCK, v, sizeof v);
            }
        }
    }
}
