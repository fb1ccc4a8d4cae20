/* Which vector paths one build of the kernel library has: the only file that reads the compiler's
 * instruction-set macros.
 *
 * library.py compiles the same sources once per variant (scalar, avx2, avx512, avx512_bf16, amx on
 * x86-64; neon on aarch64), each with its own flags, and loads the best one the CPU supports (or the
 * one --cpu-isa caps it at). Each kernel's vector paths test the TESSERA_* macros below, all 0 or 1,
 * so that a path exists in a variant exactly when that variant's flags provide its instructions, and
 * the plain C path of every kernel is the scalar variant: the reference the others are tested against.
 *
 * TESSERA_SCALAR (the scalar variant) turns every vector path off.
 * TESSERA_EMULATE_AVX512 (tests, on hosts without AVX-512): the AVX-512 paths are compiled against
 * SIMD Everywhere's portable implementations (Debian's libsimde-dev) over a native AVX2 build, so a
 * host that cannot execute them still checks their results against the scalar reference.
 * TESSERA_EMULATE_BF16 adds the AVX512-BF16 conversions, which SIMDe lacks, as the shims below. */
#ifndef TESSERA_SIMD_H
#define TESSERA_SIMD_H
#include <stdint.h>
#include <string.h>

#if defined(TESSERA_EMULATE_AVX512) && !defined(TESSERA_SCALAR)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define TESSERA_AVX2 1
#define TESSERA_AVX512 1
#define TESSERA_AVX512_VNNI 1
#define TESSERA_AVX512_VBMI 1
/* What SIMDe (0.7) lacks of the AVX-512 the kernels use, lane by lane as the instructions define it. */
static inline __m512 tessera_cvtepi32_ps(__m512i a) {
    int32_t in[16];
    float out[16];
    _mm512_storeu_si512(in, a);
    for (int i = 0; i < 16; i++) out[i] = (float)in[i];
    return _mm512_loadu_ps(out);
}
static inline __m512i tessera_cvtps_epi32(__m512 a) { /* round to nearest even; out of range: INT32_MIN */
    float in[16];
    int32_t out[16];
    _mm512_storeu_ps(in, a);
    for (int i = 0; i < 16; i++) {
        const float r = __builtin_nearbyintf(in[i]);
        out[i] = (r >= -2147483648.f && r < 2147483648.f) ? (int32_t)r : INT32_MIN;
    }
    return _mm512_loadu_si512(out);
}
static inline __m512i tessera_widen32(const void *src, int bytes, int is_signed) {
    int32_t out[16];
    for (int i = 0; i < 16; i++) {
        if (bytes == 1)
            out[i] = is_signed ? ((const int8_t *)src)[i] : ((const uint8_t *)src)[i];
        else
            out[i] = ((const uint16_t *)src)[i];
    }
    return _mm512_loadu_si512(out);
}
static inline __m512i tessera_cvtepi8_epi32(__m128i a) {
    int8_t in[16];
    _mm_storeu_si128((__m128i *)in, a);
    return tessera_widen32(in, 1, 1);
}
static inline __m512i tessera_cvtepu8_epi32(__m128i a) {
    uint8_t in[16];
    _mm_storeu_si128((__m128i *)in, a);
    return tessera_widen32(in, 1, 0);
}
static inline __m512i tessera_cvtepu16_epi32(__m256i a) {
    uint16_t in[16];
    _mm256_storeu_si256((__m256i *)in, a);
    return tessera_widen32(in, 2, 0);
}
static inline __m128i tessera_cvtepi32_epi8(__m512i a) { /* truncation, as vpmovdb */
    int32_t in[16];
    int8_t out[16];
    _mm512_storeu_si512(in, a);
    for (int i = 0; i < 16; i++) out[i] = (int8_t)in[i];
    return _mm_loadu_si128((const __m128i *)out);
}
static inline void tessera_mask_storeu_ps(void *p, __mmask16 k, __m512 a) {
    float in[16];
    _mm512_storeu_ps(in, a);
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) ((float *)p)[i] = in[i];
}
static inline __m512 tessera_maskz_loadu_ps(__mmask16 k, const void *p) { /* masked-off lanes not read */
    float out[16];
    for (int i = 0; i < 16; i++) out[i] = (k >> i & 1) ? ((const float *)p)[i] : 0.f;
    return _mm512_loadu_ps(out);
}
static inline float tessera_reduce_add_ps(__m512 a) { /* pairwise, in the order of GCC's sequence */
    float v[16];
    _mm512_storeu_ps(v, a);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) v[i] += v[i + w];
    return v[0];
}
static inline float tessera_reduce_max_ps(__m512 a) {
    float v[16];
    _mm512_storeu_ps(v, a);
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}
static inline int32_t tessera_reduce_add_epi32(__m512i a) {
    int32_t v[16];
    _mm512_storeu_si512(v, a);
    uint32_t sum = 0;
    for (int i = 0; i < 16; i++) sum += (uint32_t)v[i];
    return (int32_t)sum;
}
static inline __m512i tessera_cvtepu8_epi16(__m256i a) {
    uint8_t in[32];
    int16_t out[32];
    _mm256_storeu_si256((__m256i *)in, a);
    for (int i = 0; i < 32; i++) out[i] = in[i];
    return _mm512_loadu_si512(out);
}
static inline __m256i tessera_cvtepi32_epi16(__m512i a) { /* truncation, as vpmovdw */
    int32_t in[16];
    int16_t out[16];
    _mm512_storeu_si512(in, a);
    for (int i = 0; i < 16; i++) out[i] = (int16_t)in[i];
    return _mm256_loadu_si256((const __m256i *)out);
}
static inline __m512i tessera_zextsi256_si512(__m256i a) {
    int64_t out[8] = {0};
    _mm256_storeu_si256((__m256i *)out, a);
    return _mm512_loadu_si512(out);
}
#define _mm512_cvtepu8_epi16(a) tessera_cvtepu8_epi16(a)
#define _mm512_cvtepi32_epi16(a) tessera_cvtepi32_epi16(a)
#define _mm512_zextsi256_si512(a) tessera_zextsi256_si512(a)
#define _mm512_cvtepi32_ps(a) tessera_cvtepi32_ps(a)
#define _mm512_cvtps_epi32(a) tessera_cvtps_epi32(a)
#define _mm512_cvtepi8_epi32(a) tessera_cvtepi8_epi32(a)
#define _mm512_cvtepu8_epi32(a) tessera_cvtepu8_epi32(a)
#define _mm512_cvtepu16_epi32(a) tessera_cvtepu16_epi32(a)
#define _mm512_cvtepi32_epi8(a) tessera_cvtepi32_epi8(a)
#define _mm512_mask_storeu_ps(p, k, a) tessera_mask_storeu_ps(p, k, a)
#define _mm512_maskz_loadu_ps(k, p) tessera_maskz_loadu_ps(k, p)
#define _mm512_reduce_add_ps(a) tessera_reduce_add_ps(a)
#define _mm512_reduce_max_ps(a) tessera_reduce_max_ps(a)
#define _mm512_reduce_add_epi32(a) tessera_reduce_add_epi32(a)
#if defined(TESSERA_EMULATE_BF16)
#define TESSERA_AVX512_BF16 1
/* vcvtneps2bf16 / vcvtne2ps2bf16: float32 -> bfloat16, round to nearest even (as the instruction,
 * which flushes no normal value and keeps NaN a quiet NaN). */
static inline uint16_t tessera_emulated_bf16(float f) {
    union { float f; uint32_t u; } x = {f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}
static inline __m256i tessera_cvtneps_pbh(__m512 a) {
    float in[16];
    uint16_t out[16];
    _mm512_storeu_ps(in, a);
    for (int i = 0; i < 16; i++) out[i] = tessera_emulated_bf16(in[i]);
    return _mm256_loadu_si256((const __m256i *)out);
}
static inline __m512bh tessera_cvtne2ps_pbh(__m512 hi, __m512 lo) {
    float a[16], b[16];
    uint16_t out[32];
    _mm512_storeu_ps(a, lo);
    _mm512_storeu_ps(b, hi);
    for (int i = 0; i < 16; i++) {
        out[i] = tessera_emulated_bf16(a[i]);
        out[16 + i] = tessera_emulated_bf16(b[i]);
    }
    __m512bh r;
    memcpy(&r, out, sizeof(r));
    return r;
}
#define _mm512_cvtneps_pbh(a) tessera_cvtneps_pbh(a)
#define _mm512_cvtne2ps_pbh(hi, lo) tessera_cvtne2ps_pbh(hi, lo)
#else
#define TESSERA_AVX512_BF16 0
#endif
#define TESSERA_AMX 0

#elif (defined(__x86_64__) || defined(__i386__)) && !defined(TESSERA_SCALAR)
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TESSERA_AVX2 1
#else
#define TESSERA_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TESSERA_AVX512 1
#else
#define TESSERA_AVX512 0
#endif
#if TESSERA_AVX512 && defined(__AVX512VNNI__)
#define TESSERA_AVX512_VNNI 1
#else
#define TESSERA_AVX512_VNNI 0
#endif
#if TESSERA_AVX512 && defined(__AVX512VBMI__)
#define TESSERA_AVX512_VBMI 1
#else
#define TESSERA_AVX512_VBMI 0
#endif
#if TESSERA_AVX512 && defined(__AVX512BF16__)
#define TESSERA_AVX512_BF16 1
#else
#define TESSERA_AVX512_BF16 0
#endif
#if TESSERA_AVX512_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define TESSERA_AMX 1
#else
#define TESSERA_AMX 0
#endif

#else /* the scalar reference (plain C only, whatever the compiler could target), and aarch64 */
#define TESSERA_AVX2 0
#define TESSERA_AVX512 0
#define TESSERA_AVX512_VNNI 0
#define TESSERA_AVX512_VBMI 0
#define TESSERA_AVX512_BF16 0
#define TESSERA_AMX 0
#endif

#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(TESSERA_SCALAR)
#include <arm_neon.h>
#define TESSERA_NEON 1
#else
#define TESSERA_NEON 0
#endif
#if TESSERA_NEON && defined(__ARM_FEATURE_DOTPROD)
#define TESSERA_NEON_DOTPROD 1
#else
#define TESSERA_NEON_DOTPROD 0
#endif

/* The name of the variant these macros describe (tessera_variant() reports it; library.py checks it). */
#if defined(TESSERA_EMULATE_AVX512) && TESSERA_AVX512_BF16
#define TESSERA_VARIANT "avx512_bf16+simde"
#elif defined(TESSERA_EMULATE_AVX512)
#define TESSERA_VARIANT "avx512+simde"
#elif TESSERA_AMX
#define TESSERA_VARIANT "amx"
#elif TESSERA_AVX512_BF16
#define TESSERA_VARIANT "avx512_bf16"
#elif TESSERA_AVX512 && TESSERA_AVX512_VNNI && TESSERA_AVX512_VBMI
#define TESSERA_VARIANT "avx512"
#elif TESSERA_AVX2
#define TESSERA_VARIANT "avx2"
#elif TESSERA_NEON
#define TESSERA_VARIANT "neon"
#else
#define TESSERA_VARIANT "scalar"
#endif
#endif
