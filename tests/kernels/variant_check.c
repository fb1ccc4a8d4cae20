/* variant_check REF.so VARIANT.so: every kernel of one build of the library checked against another's.
 *
 * Both libraries are dlopened side by side (RTLD_LOCAL: each keeps its own symbols), each says which
 * variant it is (tessera_variant()), then every case of the table below generates its inputs from a
 * fixed-seed xorshift (so both libraries get the same bytes), runs the kernel in each library and
 * compares the outputs part by part, relative to the reference part's scale (its largest magnitude):
 * bfloat16 parts within a few bfloat16 ulps of that scale, float32 parts within a relative tolerance,
 * int8 parts within a code or so. One line per case:
 *   ok NAME | MISMATCH NAME max_err=... | skip NAME (reference refuses: rc=R) | refused NAME (rc=R...)
 * A kernel the reference refuses (a return code other than 0) is skipped, whatever the variant does.
 * One the variant refuses is a failure only where the variant says it has that path (the case's
 * `expect`: a tessera_*() flag function of the library returning 1). Exit status 0 iff nothing failed.
 *
 * Plain C, no Python: it runs the same for native builds, SIMDe-emulated ones and cross-compiled
 * ones under qemu (tests/kernels/test_variants.py builds and runs it).
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tessera_kernels.h"

/* ---- Inputs: a deterministic generator and fills ---- */

static uint64_t rng_state;
static uint32_t rnd(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545F4914F6CDD1DULL) >> 32);
}
static float unif(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() >> 8) * (1.f / 16777216.f); }
static int irange(int lo, int hi) { return lo + (int)(rnd() % (uint32_t)(hi - lo + 1)); } /* lo..hi */

static uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } x = {f};
    x.u += 0x7fffu + ((x.u >> 16) & 1u);
    return (uint16_t)(x.u >> 16);
}
static float from_bf16(uint16_t v) {
    union { uint32_t u; float f; } x = {(uint32_t)v << 16};
    return x.f;
}

/* Arrays of a case: zeroed, freed together when the case ends. */
#define MAX_ALLOCS 256
static void *allocs[MAX_ALLOCS];
static int nallocs;
static void *new0(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p || nallocs == MAX_ALLOCS) abort();
    return allocs[nallocs++] = p;
}
static void free_all(void) {
    while (nallocs) free(allocs[--nallocs]);
}
static float *f32s(int64_t n, float scale) { /* uniform in [-scale, scale) */
    float *p = new0(n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = unif(-scale, scale);
    return p;
}
static float *pos_f32s(int64_t n, float lo, float hi) {
    float *p = new0(n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = unif(lo, hi);
    return p;
}
static uint16_t *bf16s(int64_t n, float scale) {
    uint16_t *p = new0(n * 2);
    for (int64_t i = 0; i < n; i++) p[i] = to_bf16(unif(-scale, scale));
    return p;
}
static uint8_t *bytes(int64_t n, int lo, int hi) {
    uint8_t *p = new0(n);
    for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)irange(lo, hi);
    return p;
}
/* Activations in the case's dtype: bfloat16 or float32. */
static void *acts(int64_t n, int is_bf16, float scale) { return is_bf16 ? (void *)bf16s(n, scale) : (void *)f32s(n, scale); }

/* ---- Outputs: named parts, each with its kind and tolerance ---- */

enum { BF16, F32, I8, I32 };
typedef struct {
    const char *name;
    int kind;
    double tol; /* BF16: ulps of the scale; F32: relative to the scale; I8 / I32: absolute */
    int64_t n;
    double *v;
} part_t;
typedef struct {
    part_t parts[8];
    int nparts;
} out_t;

static void put(out_t *o, const char *name, int kind, const void *p, int64_t n, double tol) {
    part_t *q = &o->parts[o->nparts++];
    *q = (part_t){name, kind, tol, n, malloc((n ? n : 1) * sizeof(double))};
    for (int64_t i = 0; i < n; i++)
        q->v[i] = kind == BF16 ? from_bf16(((const uint16_t *)p)[i]) : kind == F32 ? ((const float *)p)[i]
                  : kind == I8 ? ((const int8_t *)p)[i] : ((const int32_t *)p)[i];
}
/* An output in the activations' dtype. */
static void put_act(out_t *o, const char *name, const void *p, int64_t n, int is_bf16, double bf16_ulps, double rel) {
    put(o, name, is_bf16 ? BF16 : F32, p, n, is_bf16 ? bf16_ulps : rel);
}
static void free_out(out_t *o) {
    for (int i = 0; i < o->nparts; i++) free(o->parts[i].v);
    o->nparts = 0;
}

/* ---- The libraries ---- */

typedef struct {
    const char *path;
    void *handle;
} lib_t;

static void *sym(const lib_t *L, const char *name) {
    void *f = dlsym(L->handle, name);
    if (!f) {
        fprintf(stderr, "%s: no symbol %s\n", L->path, name);
        exit(2);
    }
    return f;
}
/* The kernel `name` of library L, typed by its prototype in tessera_kernels.h. */
#define K(name) ((__typeof__(&name))sym(L, #name))

/* ---- Cases: each builds its inputs from the seed, runs kernel(s) of L, puts the outputs ---- */

typedef struct case_s case_t;
typedef int (*run_fn)(const lib_t *L, const case_t *c, out_t *o);
struct case_s {
    const char *name;
    run_fn run;
    int p[6];           /* the case's shape, as its run function reads it */
    const char *expect; /* a flag function of the variant: when it returns 1, a refusal is a failure */
};

static int run_rms_bf16(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t rows = c->p[0], H = c->p[1];
    uint16_t *x = bf16s(rows * H, 3.f), *res = c->p[2] ? bf16s(rows * H, 3.f) : NULL, *w = bf16s(H, 1.f);
    uint16_t *out = new0(rows * H * 2);
    K(rms_norm_bf16)(x, res, w, out, rows, H, 1e-6f);
    put(o, "out", BF16, out, rows * H, 2);
    if (res) put(o, "residual", BF16, res, rows * H, 0);
    return 0;
}

static int run_rms_f32(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t rows = c->p[0], H = c->p[1];
    float *x = f32s(rows * H, 3.f), *res = c->p[2] ? f32s(rows * H, 3.f) : NULL, *w = f32s(H, 1.f);
    float *out = new0(rows * H * 4);
    K(rms_norm_f32)(x, res, w, out, rows, H, 1e-6f);
    put(o, "out", F32, out, rows * H, 1e-5);
    if (res) put(o, "residual", F32, res, rows * H, 0);
    return 0;
}

static int run_silu_mul(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], I = c->p[1];
    uint16_t *gu = bf16s(M * 2 * I, 6.f), *out = new0(M * I * 2);
    K(silu_mul_bf16)(gu, out, M, I);
    put(o, "out", BF16, out, M * I, 2);
    return 0;
}

/* int8 weights with a float scale (and zero) per group: int8_gemv, int8_gemm_bf16. p: M, N, K, G, zero, bf16 */
static int run_int8_gemv(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N = c->p[1], Kd = c->p[2], G = c->p[3], bf = c->p[5];
    void *x = acts(M * Kd, bf, 1.f);
    int8_t *w = (int8_t *)bytes(N * Kd, 0, 255);
    float *scale = pos_f32s(N * Kd / G, 0.002f, 0.02f), *zero = c->p[4] ? f32s(N * Kd / G, 0.05f) : NULL;
    void *out = new0(M * N * 4);
    const int rc = K(int8_gemv)(x, w, scale, zero, out, M, N, Kd, G, bf, new0(M * Kd * 4));
    put_act(o, "out", out, M * N, bf, 2, 1e-4);
    return rc;
}

static int run_int8_gemv_i16(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N = c->p[1], Kd = c->p[2], G = c->p[3];
    float *x = f32s(M * Kd, 1.f), *out = new0(M * N * 4);
    int8_t *w = (int8_t *)bytes(N * Kd, 0, 255);
    float *scale = pos_f32s(N * Kd / G, 0.002f, 0.02f), *zero = c->p[4] ? f32s(N * Kd / G, 0.05f) : NULL;
    void *scratch = new0(K(int8_gemv_i16_scratch_bytes)(M, Kd));
    const int rc = K(int8_gemv_i16)(x, w, scale, zero, out, M, N, Kd, G, scratch);
    put(o, "out", F32, out, M * N, 1e-5); /* the same integer sums; float32 formula in another order */
    return rc;
}

static int run_int8_gemm_bf16(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N = c->p[1], Kd = c->p[2], G = c->p[3];
    uint16_t *x = bf16s(M * Kd, 1.f), *out = new0(M * N * 2);
    int8_t *w = (int8_t *)bytes(N * Kd, 0, 255);
    float *scale = pos_f32s(N * Kd / G, 0.002f, 0.02f), *zero = c->p[4] ? f32s(N * Kd / G, 0.05f) : NULL;
    const int rc = K(int8_gemm_bf16)(x, w, scale, zero, out, M, N, Kd, G);
    put(o, "out", BF16, out, M * N, 3); /* the weights rounded to bfloat16 first */
    return rc;
}

/* PyTorch's int4pack layout of int4_gemm_bf16 / _i8 (tiles of 64, bf16 pairs). p: M, N_pad, N_out, K */
static void *int4_scales(int64_t Kd, int64_t N_pad, int bf) {
    const int64_t n = Kd / 32 * N_pad;
    float *sz = new0(n * 2 * sizeof(float));
    for (int64_t i = 0; i < n; i++) sz[2 * i] = unif(0.005f, 0.03f), sz[2 * i + 1] = unif(-0.05f, 0.05f);
    if (!bf) return sz;
    uint16_t *b = new0(n * 2 * 2);
    for (int64_t i = 0; i < 2 * n; i++) b[i] = to_bf16(sz[i]);
    return b;
}

static int run_int4_bf16(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N_pad = c->p[1], N_out = c->p[2], Kd = c->p[3];
    uint16_t *x = bf16s(M * Kd, 1.f), *out = new0(M * N_out * 2);
    uint8_t *packed = bytes(N_pad / 64 * Kd * 32, 0, 255);
    const int rc = K(int4_gemm_bf16)(x, packed, int4_scales(Kd, N_pad, 1), out, M, N_pad, N_out, Kd,
                                     new0(M * (Kd / 32) * 4));
    put(o, "out", BF16, out, M * N_out, 2);
    return rc;
}

static int run_int4_i8(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N_pad = c->p[1], N_out = c->p[2], Kd = c->p[3];
    uint16_t *x = bf16s(M * Kd, 1.f), *out = new0(M * N_out * 2);
    uint8_t *packed = bytes(N_pad / 64 * Kd * 32, 0, 255);
    const int rc = K(int4_gemm_i8)(x, packed, int4_scales(Kd, N_pad, 1), out, M, N_pad, N_out, Kd,
                                   new0(K(int4_i8_scratch_bytes)(M, Kd)));
    put(o, "out", BF16, out, M * N_out, 3); /* activations rounded to int8 per 32 values */
    return rc;
}

/* f as a half (|f| < 65504), truncated, not rounded; below float16's normal range, a signed zero. */
static uint16_t to_half(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, exp = (u >> 23) & 0xFFu;
    if (exp < 113) return (uint16_t)sign;
    return (uint16_t)(sign | ((exp - 112u) << 10) | ((u >> 13) & 0x3FFu));
}

/* The float32 kernels' int4 layout (bf16.h, INT4G_*): random codes, each group's 32 scales and 32
 * zeros as halves after them. */
static uint8_t *int4g_packed(int64_t N_pad, int64_t Kd) {
    const int64_t groups = N_pad / 32 * (Kd / 32);
    uint8_t *packed = bytes(groups * 640, 0, 255);
    for (int64_t i = 0; i < groups; i++) {
        uint16_t *h = (uint16_t *)(packed + i * 640 + 512);
        for (int r = 0; r < 32; r++) h[r] = to_half(unif(0.005f, 0.03f)), h[32 + r] = to_half(unif(-0.05f, 0.05f));
    }
    return packed;
}

static int run_int4_f32(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N_pad = c->p[1], N_out = c->p[2], Kd = c->p[3];
    float *x = f32s(M * Kd, 1.f), *out = new0(M * N_out * 4);
    const int rc = K(int4_gemm_f32)(x, int4g_packed(N_pad, Kd), out, M, N_pad, N_out, Kd);
    put(o, "out", F32, out, M * N_out, 1e-4);
    return rc;
}

static int run_int4_i8_f32(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N_pad = c->p[1], N_out = c->p[2], Kd = c->p[3];
    float *x = f32s(M * Kd, 1.f), *out = new0(M * N_out * 4);
    void *scratch = new0(K(int4_i8_f32_scratch_bytes)(M, Kd));
    const int rc = K(int4_gemm_i8_f32)(x, int4g_packed(N_pad, Kd), out, M, N_pad, N_out, Kd, scratch);
    put(o, "out", F32, out, M * N_out, 1e-5); /* the same integer sums; float32 formula in another order */
    return rc;
}

static int run_int4_i16_f32(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N_pad = c->p[1], N_out = c->p[2], Kd = c->p[3];
    float *x = f32s(M * Kd, 1.f), *out = new0(M * N_out * 4);
    void *scratch = new0(K(int4_i16_f32_scratch_bytes)(M, Kd));
    const int rc = K(int4_gemm_i16_f32)(x, int4g_packed(N_pad, Kd), out, M, N_pad, N_out, Kd, scratch);
    put(o, "out", F32, out, M * N_out, 1e-5); /* the same integer sums; float32 formula in another order */
    return rc;
}

/* GGUF K-quants as kquant_gemm.c repacks them: Q6_K (int8 scales per 16, d per block), Q4_K (6-bit
 * scales and minimums per 32, d and dmin per block). */
typedef struct {
    uint8_t *codes;
    void *scales;
    float *d;
} kq_t;
static kq_t kq_weight(int q6k, int64_t N, int64_t Kd) {
    const int64_t NB = N * (Kd / 256);
    kq_t w = {bytes(NB * (q6k ? 192 : 128), 0, 255), bytes(NB * 16, 0, 63), NULL};
    if (q6k)
        for (int64_t i = 0; i < NB * 16; i++) ((int8_t *)w.scales)[i] = (int8_t)irange(-64, 63);
    w.d = q6k ? pos_f32s(NB, 0.0005f, 0.002f) : pos_f32s(2 * NB, 0.001f, 0.004f);
    return w;
}

/* p: M, N, K, bf16, q6k */
static int run_kq_gemm(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N = c->p[1], Kd = c->p[2];
    const int bf = c->p[3], q6k = c->p[4];
    const kq_t w = kq_weight(q6k, N, Kd);
    void *x = acts(M * Kd, bf, 1.f), *out = new0(M * N * 4), *scratch = new0(K(kquant_scratch_bytes)(M, Kd));
    const int rc = q6k ? K(q6k_gemm)(x, w.codes, w.scales, w.d, out, M, N, Kd, bf, scratch)
                       : K(q4k_gemm)(x, w.codes, w.scales, w.d, out, M, N, Kd, bf, scratch);
    put_act(o, "out", out, M * N, bf, 2, 1e-4);
    return rc;
}

/* p: N, K, q6k, int8 (else bfloat16), col */
static int run_kq_dequant(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t N = c->p[0], Kd = c->p[1];
    const int q6k = c->p[2];
    const kq_t w = kq_weight(q6k, N, Kd);
    if (!c->p[3]) {
        uint16_t *out = new0(N * Kd * 2);
        if (q6k) K(q6k_dequant_bf16)(w.codes, w.scales, w.d, out, N, Kd);
        else K(q4k_dequant_bf16)(w.codes, w.scales, w.d, out, N, Kd);
        put(o, "out", BF16, out, N * Kd, 1);
        return 0;
    }
    const float *col = c->p[4] ? pos_f32s(Kd, 0.5f, 2.f) : NULL;
    int8_t *out = new0(N * Kd);
    float *rs = new0(N * 4);
    if (q6k) K(q6k_dequant_int8)(w.codes, w.scales, w.d, col, out, rs, N, Kd);
    else K(q4k_dequant_int8)(w.codes, w.scales, w.d, col, out, rs, N, Kd);
    put(o, "out", I8, out, N * Kd, 1);
    put(o, "rs", F32, rs, N, 1e-6);
    return 0;
}

/* p: M, K, bf16, col */
static int run_quantize_rows(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], Kd = c->p[1];
    const int bf = c->p[2];
    void *x = acts(M * Kd, bf, 2.f);
    const float *col = c->p[3] ? pos_f32s(Kd, 0.5f, 2.f) : NULL;
    int8_t *xq = new0(M * Kd);
    float *ts = new0(M * 4);
    K(int8_quantize_rows)(x, bf, col, xq, ts, M, Kd);
    put(o, "xq", I8, xq, M * Kd, 1);
    put(o, "ts", F32, ts, M, 1e-6);
    return 0;
}

/* p: M, N, bf16 */
static int run_scale_products(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N = c->p[1];
    const int bf = c->p[2];
    int32_t *acc = new0(M * N * 4);
    for (int64_t i = 0; i < M * N; i++) acc[i] = irange(-2000000, 2000000);
    float *ts = pos_f32s(M, 0.001f, 0.01f), *rs = pos_f32s(N, 0.001f, 0.01f);
    void *out = new0(M * N * 4);
    K(int8_scale_products)(acc, ts, rs, out, bf, M, N);
    put_act(o, "out", out, M * N, bf, 1, 1e-6);
    return 0;
}

/* MXFP4 blocks as the file stores them: an E8M0 exponent (kept near 2^0), 16 bytes of codes. */
static uint8_t *mxfp4_blocks(int64_t N, int64_t Kd) {
    const int64_t nb = N * (Kd / 32);
    uint8_t *b = bytes(nb * 17, 0, 255);
    for (int64_t i = 0; i < nb; i++) b[i * 17] = (uint8_t)irange(120, 132);
    return b;
}

/* p: M, N, K, bf16 */
static int run_mxfp4_gemm(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t M = c->p[0], N = c->p[1], Kd = c->p[2];
    const int bf = c->p[3];
    uint8_t *blocks = mxfp4_blocks(N, Kd);
    void *x = acts(M * Kd, bf, 1.f), *out = new0(M * N * 4);
    const int rc = K(mxfp4_gemm)(x, blocks, out, M, N, Kd, bf, new0(K(mxfp4_scratch_bytes)(M, Kd)));
    put_act(o, "out", out, M * N, bf, 2, 1e-4);
    return rc;
}

/* p: N, K, bf16 */
static int run_mxfp4_dequant(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t N = c->p[0], Kd = c->p[1];
    uint8_t *blocks = mxfp4_blocks(N, Kd);
    void *out = new0(N * Kd * 4);
    K(mxfp4_dequant)(blocks, out, N, Kd, c->p[2]);
    put_act(o, "out", out, N * Kd, c->p[2], 0, 0);
    return 0;
}

/* ---- Attention over a paged cache: B requests of the lengths below, blocks dealt at random ---- */

enum { NUM_BLOCKS = 24, BLOCK = 16, MAX_BLOCKS = 7 };
static const int64_t seq_lens3[3] = {1, 45, 100};
static int64_t *block_tables(int64_t B) { /* distinct blocks for every request */
    int64_t perm[NUM_BLOCKS], *t = new0(B * MAX_BLOCKS * 8);
    for (int i = 0; i < NUM_BLOCKS; i++) perm[i] = i;
    for (int i = NUM_BLOCKS - 1; i > 0; i--) {
        const int j = irange(0, i);
        const int64_t s = perm[i];
        perm[i] = perm[j], perm[j] = s;
    }
    for (int64_t i = 0; i < B * MAX_BLOCKS && i < NUM_BLOCKS; i++) t[i] = perm[i];
    return t;
}

/* p: Hq, Hkv, D, bf16, window, sinks | softcap << 1 (scores capped at 3) */
static int run_decode_attn(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t B = 3, Hq = c->p[0], Hkv = c->p[1], D = c->p[2], stride = (Hq + 2 * Hkv) * D, max_len = 100;
    const int bf = c->p[3];
    const int64_t *tables = block_tables(B);
    void *q = acts(B * stride, bf, 1.f), *cache = acts(2 * Hkv * NUM_BLOCKS * BLOCK * D, bf, 2.f);
    const float *sinks = c->p[5] & 1 ? f32s(Hq, 2.f) : NULL;
    void *out = new0(B * Hq * D * 4);
    K(paged_decode_attention)(q, stride, cache, bf, tables, seq_lens3, out, B, Hq, Hkv, D, NUM_BLOCKS, BLOCK,
                              MAX_BLOCKS, 1.f / sqrtf((float)D), c->p[5] & 2 ? 3.f : 0.f, c->p[4], sinks,
                              new0(B * Hq * max_len * 4), max_len);
    put_act(o, "out", out, B * Hq * D, bf, 2, 1e-4);
    return 0;
}

/* kv_write_int8 of every request's tokens, then paged_decode_attention_int8 over that cache.
 * p: Hq, Hkv, D, bf16 | rot_kind << 1, window, sinks */
static int run_int8_attn(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t B = 3, Hq = c->p[0], Hkv = c->p[1], D = c->p[2], max_len = 100, row = BLOCK * D + 4;
    const int bf = c->p[3] & 1, rot = c->p[3] >> 1;
    const int64_t *tables = block_tables(B);
    int64_t T = 0;
    for (int b = 0; b < B; b++) T += seq_lens3[b];
    int64_t *slots = new0(T * 8);
    for (int64_t b = 0, i = 0; b < B; b++)
        for (int64_t t = 0; t < seq_lens3[b]; t++) slots[i++] = tables[b * MAX_BLOCKS + t / BLOCK] * BLOCK + t % BLOCK;
    void *k = acts(T * Hkv * D, bf, 2.f), *v = acts(T * Hkv * D, bf, 2.f);
    int8_t *cache = new0(2 * Hkv * NUM_BLOCKS * row);
    int rc = K(kv_write_int8)(cache, k, Hkv * D, v, Hkv * D, bf, slots, T, Hkv, D, NUM_BLOCKS, BLOCK, NULL, rot,
                              NULL, NULL, NULL, 0, NULL, NULL);
    if (rc) return rc;
    float *scales = new0(2 * Hkv * NUM_BLOCKS * 4);
    int8_t *data = new0(2 * Hkv * NUM_BLOCKS * row); /* the codes, each block's scale bytes zeroed */
    memcpy(data, cache, 2 * Hkv * NUM_BLOCKS * row);
    for (int64_t i = 0; i < 2 * Hkv * NUM_BLOCKS; i++) {
        memcpy(&scales[i], cache + i * row + row - 4, 4);
        memset(data + i * row + row - 4, 0, 4);
    }
    put(o, "cache", I8, data, 2 * Hkv * NUM_BLOCKS * row, 1);
    put(o, "cache scales", F32, scales, 2 * Hkv * NUM_BLOCKS, 1e-6);
    const int64_t stride = (Hq + 2 * Hkv) * D, P = (max_len + BLOCK - 1) / BLOCK * BLOCK;
    void *q = acts(B * stride, bf, 1.f), *out = new0(B * Hq * D * 4);
    const float *sinks = c->p[5] ? f32s(Hq, 2.f) : NULL;
    K(paged_decode_attention_int8)(q, stride, bf, cache, tables, seq_lens3, out, B, Hq, Hkv, D, NUM_BLOCKS, BLOCK,
                                   MAX_BLOCKS, 1.f / sqrtf((float)D), c->p[4], sinks, new0(B * Hq * P * 4), max_len,
                                   NULL, rot, NULL, NULL, NULL, 0, NULL, NULL, NULL);
    put_act(o, "out", out, B * Hq * D, bf, 3, 2e-3);
    return 0;
}

/* Two prefill requests: a first chunk of 37 rows, and 21 rows after 60 cached tokens. p: Hq, Hkv, D, window, sinks */
static int run_prefill_attn(const lib_t *L, const case_t *c, out_t *o) {
    const int64_t B = 2, Hq = c->p[0], Hkv = c->p[1], D = c->p[2], stride = Hq * D;
    const int64_t q_start[3] = {0, 37, 58}, lens[2] = {37, 81}, T = q_start[B];
    const int64_t *tables = block_tables(B);
    uint16_t *q = bf16s(T * stride, 1.f), *cache = bf16s(2 * Hkv * NUM_BLOCKS * BLOCK * D, 2.f);
    uint16_t *out = new0(T * Hq * D * 2);
    const float *sinks = c->p[4] ? f32s(Hq, 2.f) : NULL;
    const int rc = K(paged_prefill_attention_bf16)(q, stride, cache, tables, MAX_BLOCKS, q_start, lens, out, B, Hq,
                                                   Hkv, D, NUM_BLOCKS, BLOCK, 1.f / sqrtf((float)D), c->p[3], sinks);
    put(o, "out", BF16, out, T * Hq * D, 3); /* probabilities rounded to bfloat16 */
    return rc;
}

/* Three adapters (ranks 8, 16, 4) over two parts (outputs 0..47, 48..79), rows of every slot and the base.
 * p: x_bf16, w_bf16 */
static int run_lora(const lib_t *L, const case_t *c, out_t *o) {
    enum { M = 7, KD = 96, N = 80, S = 3, P = 2, XS = KD + 3, YS = N + 5, TS = 32 };
    const int xb = c->p[0], wb = c->p[1];
    const int32_t row_slots[M] = {0, -1, 1, 0, 2, 1, 0};
    const int64_t ranks[S] = {8, 16, 4}, part_ends[P] = {48, 80};
    int64_t a_ptrs[S], b_ptrs[S];
    for (int s = 0; s < S; s++) {
        a_ptrs[s] = (int64_t)(intptr_t)acts(KD * P * ranks[s], wb, 0.2f); /* At [K][P r] */
        b_ptrs[s] = (int64_t)(intptr_t)acts(ranks[s] * N, wb, 0.2f);      /* Bt [r][N] */
    }
    void *x = acts(M * XS, xb, 1.f), *y = acts(M * YS, xb, 1.f);
    const int rc = K(lora_add)(x, XS, y, YS, xb, wb, M, KD, N, row_slots, a_ptrs, b_ptrs, ranks, S, part_ends, P,
                               new0(M * TS * 4), TS);
    put_act(o, "y", y, M * YS, xb, 2, 1e-5);
    return rc;
}

/* A whole decode step of two layers over three rows (decode_step_bf16, or decode_step_f32 where p[0]): Q4_K QKV with a bias,
 * int8-group O and down projections (float32: int4 with int8 activations and int4), Q6_K gate/up, caches of
 * the step's dtype holding the contexts before. p[1], the block: 0 llama's (norms before the sublayers, SiLU); 1 Gemma's (norms before and after, q/k norms per
 * head, GELU, soft-capped scores, layer 0 sliding with its own RoPE table); 2 OLMo 2's and more (norms after only,
 * q/k norms over the projections, a residual multiplier, half the head rotating, layer 1 without RoPE, the layers
 * in two KV-cache groups); 3 llama's with mixture-of-experts MLPs (moe_of), attention sinks and a bias on
 * the output projection. p[2]: rows (0: 3). */
static linear_t linear_of(int kind, int64_t n, int64_t k) {
    linear_t l = {.kind = kind, .n = n, .n_pad = n, .k = k, .group = 32};
    if (kind == LINEAR_MXFP4) {
        l.weight = mxfp4_blocks(n, k);
    } else if (kind == LINEAR_INT4 || kind == LINEAR_INT4_I8 || kind == LINEAR_INT4_I16) { /* the float32 layout */
        l.weight = int4g_packed(n, k);
    } else if (kind == LINEAR_INT8 || kind == LINEAR_INT8_I16) {
        l.weight = bytes(n * k, 0, 255);
        l.scales = pos_f32s(n * k / 32, 0.001f, 0.006f);
    } else {
        const kq_t w = kq_weight(kind == LINEAR_Q6K, n, k);
        l.weight = w.codes, l.scales = w.scales, l.zeros = w.d;
    }
    return l;
}

/* A mixture-of-experts block of 4 experts, 2 a row (moe_step.c): layer 0 gpt-oss's (MXFP4 experts with
 * biases, the clamped SwiGLU, a biased router, the chosen logits' softmax), layer 1 Qwen3-MoE's
 * without norm_topk_prob (Q4_K gate/up, Q6_K down, SiLU, the softmax over all experts). */
static const moe_t *moe_of(int layer, int64_t H, int bf) {
    enum { EXPERTS = 4, FFN = 256 };
    linear_t *gu = new0(EXPERTS * sizeof(linear_t)), *down = new0(EXPERTS * sizeof(linear_t));
    for (int e = 0; e < EXPERTS; e++) {
        gu[e] = linear_of(layer ? LINEAR_Q4K : LINEAR_MXFP4, 2 * FFN, H);
        down[e] = linear_of(layer ? LINEAR_Q6K : LINEAR_MXFP4, H, FFN);
        if (!layer) gu[e].bias = acts(2 * FFN, bf, 0.5f), down[e].bias = acts(H, bf, 0.5f);
    }
    moe_t *m = new0(sizeof(moe_t));
    *m = (moe_t){.router = f32s(EXPERTS * H, 0.1f), .router_bias = layer ? NULL : f32s(EXPERTS, 0.5f), .gate_up = gu,
                 .down = down, .num_experts = EXPERTS, .top_k = 2, .ffn = FFN, .renormalize = !layer,
                 .activation = layer ? ACT_SILU : ACT_SWIGLU_CLAMPED, .swiglu_limit = 2., .swiglu_alpha = 1.702};
    return m;
}

/* [M][R] cos and sin rows of the rows' positions at RoPE base `base`, in the step's dtype. */
static void rope_rows(void *cos, void *sin, const int64_t *pos, int64_t M, int64_t R, float base, int bf) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < R; i++) {
            const float angle = (float)pos[r] * powf(base, -(float)(2 * (i % (R / 2))) / R);
            if (bf)
                ((uint16_t *)cos)[r * R + i] = to_bf16(cosf(angle)), ((uint16_t *)sin)[r * R + i] = to_bf16(sinf(angle));
            else
                ((float *)cos)[r * R + i] = cosf(angle), ((float *)sin)[r * R + i] = sinf(angle);
        }
}

static int run_decode_step(const lib_t *L, const case_t *c, out_t *o) {
    enum { LAYERS = 2, H = 256, NQ = 4, NKV = 2, D = 64, I = 256, MAX_LEN = 100 };
    const int bf = !c->p[0], block = c->p[1]; /* p[0]: float32 (decode_step_f32) */
    const int64_t M = c->p[2] ? c->p[2] : 3;  /* rows, at most 3 */
    const int64_t R = block == 2 ? D / 2 : D, G = block == 2 ? 2 : 1;
    dims_t d = {H, NQ, NKV, D, I, NUM_BLOCKS, BLOCK, MAX_BLOCKS, 1e-6, 0.125, R, QK_NORM_NONE, ACT_SILU, 1., 0.};
    if (block == 1) d.qk_norm = QK_NORM_HEAD, d.activation = ACT_GELU_TANH, d.softcap = 4.;
    if (block == 2) d.qk_norm = QK_NORM_PROJ, d.residual_multiplier = 0.5;
    const int64_t cache_n = 2 * NKV * NUM_BLOCKS * BLOCK * D;
    layer_t layers[LAYERS];
    for (int i = 0; i < LAYERS; i++) {
        layer_t *ly = &layers[i];
        *ly = (layer_t){0};
        if (block != 2) ly->attn_norm = acts(H, bf, 1.f), ly->mlp_norm = acts(H, bf, 1.f);
        if (block != 0) ly->attn_out_norm = acts(H, bf, 1.f), ly->mlp_out_norm = acts(H, bf, 1.f);
        if (block == 1) ly->q_norm = acts(D, bf, 1.f), ly->k_norm = acts(D, bf, 1.f);
        if (block == 2) ly->q_norm = acts(NQ * D, bf, 1.f), ly->k_norm = acts(NKV * D, bf, 1.f);
        ly->qkv = linear_of(LINEAR_Q4K, (NQ + 2 * NKV) * D, H);
        ly->qkv.bias = acts((NQ + 2 * NKV) * D, bf, 0.5f);
        ly->o = linear_of(bf ? LINEAR_INT8 : M == 1 ? LINEAR_INT8_I16 : LINEAR_INT4_I8, H, NQ * D);
        ly->gate_up = linear_of(LINEAR_Q6K, 2 * I, H);
        ly->down = linear_of(bf ? LINEAR_INT8 : LINEAR_INT4_I16, H, I);
        ly->kv_cache = acts(cache_n, bf, 1.f);
        ly->rope = block == 1 && i == 0 ? ROPE_LOCAL : block == 2 && i == 1 ? ROPE_NONE : ROPE_GLOBAL;
        ly->window = block == 1 && i == 0 ? 20 : 0;
        ly->group = G == 2 ? i : 0;
        if (block == 3) ly->moe = moe_of(i, H, bf), ly->sinks = f32s(NQ, 2.f), ly->o.bias = acts(H, bf, 0.5f);
    }
    int64_t *tables = new0(G * M * MAX_BLOCKS * 8), *slots = new0(G * M * 8), pos[3];
    for (int g = 0; g < G; g++) {
        const int64_t *t = block_tables(M);
        memcpy(tables + g * M * MAX_BLOCKS, t, M * MAX_BLOCKS * 8);
        for (int r = 0; r < M; r++) {
            pos[r] = seq_lens3[r] - 1;
            slots[g * M + r] = t[r * MAX_BLOCKS + pos[r] / BLOCK] * BLOCK + pos[r] % BLOCK;
        }
    }
    void *cos = new0(M * R * 4), *sin = new0(M * R * 4), *cos_l = new0(M * R * 4), *sin_l = new0(M * R * 4);
    rope_rows(cos, sin, pos, M, R, 10000.f, bf);
    rope_rows(cos_l, sin_l, pos, M, R, 100.f, bf);
    void *x = acts(M * H, bf, 1.f), *final_norm = acts(H, bf, 1.f);
    void *ws = new0(K(decode_step_workspace_bytes)(layers, LAYERS, &d, M, MAX_LEN));
    const int rc = bf ? K(decode_step_bf16)(layers, LAYERS, &d, final_norm, M, x, cos, sin, cos_l, sin_l, R / 2, slots,
                                            tables, seq_lens3, MAX_LEN, ws, NULL)
                      : K(decode_step_f32)(layers, LAYERS, &d, final_norm, M, x, cos, sin, cos_l, sin_l, R / 2, slots,
                                           tables, seq_lens3, MAX_LEN, ws, NULL);
    /* two layers of roundings after sums in another order; the activations' int8 rounding in the
     * K-quant products may move a code by one step */
    put_act(o, "x", x, M * H, bf, 8, 5e-4);
    for (int i = 0; i < LAYERS; i++) put_act(o, i ? "cache 1" : "cache 0", layers[i].kv_cache, cache_n, bf, 8, 5e-4);
    return rc;
}

/* ---- The table ---- */

static const case_t CASES[] = {
    {"rms_norm_bf16/rows1", run_rms_bf16, {1, 576, 0}},
    {"rms_norm_bf16/rows17+residual", run_rms_bf16, {17, 1000, 1}},
    {"rms_norm_f32/rows1", run_rms_f32, {1, 576, 0}},
    {"rms_norm_f32/rows17+residual", run_rms_f32, {17, 1000, 1}},
    {"silu_mul_bf16", run_silu_mul, {5, 200}},
    /* int8_gemv: M, N, K, G, zero, bf16 */
    {"int8_gemv/f32/M1/G32", run_int8_gemv, {1, 37, 256, 32, 0, 0}},
    {"int8_gemv/f32/M1/G16+zero", run_int8_gemv, {1, 37, 256, 16, 1, 0}},
    {"int8_gemv/f32/M3/G32+zero", run_int8_gemv, {3, 37, 256, 32, 1, 0}},
    {"int8_gemv/f32/M8/G16", run_int8_gemv, {8, 37, 256, 16, 0, 0}},
    {"int8_gemv_i16/M1/G32", run_int8_gemv_i16, {1, 37, 256, 32, 0}},
    {"int8_gemv_i16/M6/G16+zero", run_int8_gemv_i16, {6, 37, 96, 16, 1}},
    {"int8_gemv/bf16/M1/G32+zero", run_int8_gemv, {1, 37, 256, 32, 1, 1}},
    {"int8_gemv/bf16/M1/G16", run_int8_gemv, {1, 37, 256, 16, 0, 1}},
    {"int8_gemv/bf16/M5/G16+zero", run_int8_gemv, {5, 37, 256, 16, 1, 1}},
    {"int8_gemv/bf16/M8/G32", run_int8_gemv, {8, 37, 256, 32, 0, 1}},
    {"int8_gemm_bf16/M1/G32", run_int8_gemm_bf16, {1, 37, 256, 32, 0}, "tessera_avx512_bf16"},
    {"int8_gemm_bf16/M5/G16+zero", run_int8_gemm_bf16, {5, 37, 256, 16, 1}, "tessera_avx512_bf16"},
    {"int8_gemm_bf16/M8/G64+zero", run_int8_gemm_bf16, {8, 37, 256, 64, 1}, "tessera_avx512_bf16"},
    /* int4: M, N_pad, N_out, K */
    {"int4_gemm_bf16/M1", run_int4_bf16, {1, 128, 100, 256}, "tessera_avx512_bf16"},
    {"int4_gemm_bf16/M6", run_int4_bf16, {6, 128, 128, 256}, "tessera_avx512_bf16"},
    {"int4_gemm_i8/M1", run_int4_i8, {1, 128, 100, 256}, "tessera_int4_i8"},
    {"int4_gemm_i8/M7", run_int4_i8, {7, 128, 128, 256}, "tessera_int4_i8"},
    {"int4_gemm_i8/M20", run_int4_i8, {20, 128, 100, 256}, "tessera_int4_i8"},
    {"int4_gemm_f32/M1", run_int4_f32, {1, 96, 90, 256}, "tessera_avx2_fma"},
    {"int4_gemm_f32/M2", run_int4_f32, {2, 96, 96, 256}, "tessera_avx2_fma"},
    {"int4_gemm_f32/M5", run_int4_f32, {5, 96, 90, 256}, "tessera_avx2_fma"},
    {"int4_gemm_i8_f32/M1", run_int4_i8_f32, {1, 96, 90, 256}, "tessera_avx2_fma"},
    {"int4_gemm_i8_f32/M2", run_int4_i8_f32, {2, 96, 96, 512}, "tessera_avx2_fma"},
    {"int4_gemm_i8_f32/M5", run_int4_i8_f32, {5, 96, 70, 256}, "tessera_avx2_fma"},
    {"int4_gemm_i16_f32/M1", run_int4_i16_f32, {1, 96, 90, 256}, "tessera_avx2_fma"},
    {"int4_gemm_i16_f32/M5", run_int4_i16_f32, {5, 96, 70, 1536}, "tessera_avx2_fma"},
    {"int4_gemm_i16_f32/M9", run_int4_i16_f32, {9, 64, 64, 64}, "tessera_avx2_fma"},
    /* K-quants: M, N, K, bf16, q6k */
    {"q6k_gemm/f32/M1", run_kq_gemm, {1, 19, 512, 0, 1}},
    {"q6k_gemm/bf16/M8", run_kq_gemm, {8, 19, 512, 1, 1}},
    {"q4k_gemm/f32/M3", run_kq_gemm, {3, 19, 512, 0, 0}},
    {"q4k_gemm/bf16/M1", run_kq_gemm, {1, 19, 512, 1, 0}},
    /* the AVX2 rows are instantiated per row count: every one of them */
    {"q4k_gemm/f32/M2", run_kq_gemm, {2, 19, 512, 0, 0}},
    {"q4k_gemm/f32/M4", run_kq_gemm, {4, 19, 512, 0, 0}},
    {"q4k_gemm/f32/M5", run_kq_gemm, {5, 19, 512, 0, 0}},
    {"q4k_gemm/f32/M6", run_kq_gemm, {6, 19, 512, 0, 0}},
    {"q4k_gemm/f32/M7", run_kq_gemm, {7, 19, 512, 0, 0}},
    {"q4k_gemm/f32/M8", run_kq_gemm, {8, 19, 512, 0, 0}},
    {"q6k_gemm/f32/M2", run_kq_gemm, {2, 19, 512, 0, 1}},
    {"q6k_gemm/f32/M3", run_kq_gemm, {3, 19, 512, 0, 1}},
    {"q6k_gemm/f32/M4", run_kq_gemm, {4, 19, 512, 0, 1}},
    {"q6k_gemm/f32/M5", run_kq_gemm, {5, 19, 512, 0, 1}},
    {"q6k_gemm/f32/M6", run_kq_gemm, {6, 19, 512, 0, 1}},
    {"q6k_gemm/f32/M7", run_kq_gemm, {7, 19, 512, 0, 1}},
    /* N, K, q6k, int8, col */
    {"q6k_dequant_bf16", run_kq_dequant, {5, 512, 1, 0}},
    {"q4k_dequant_bf16", run_kq_dequant, {5, 512, 0, 0}},
    {"q6k_dequant_int8", run_kq_dequant, {5, 512, 1, 1, 0}},
    {"q4k_dequant_int8+col", run_kq_dequant, {5, 512, 0, 1, 1}},
    {"int8_quantize_rows/f32", run_quantize_rows, {4, 300, 0, 0}},
    {"int8_quantize_rows/bf16+col", run_quantize_rows, {4, 300, 1, 1}},
    {"int8_scale_products/f32", run_scale_products, {5, 77, 0}},
    {"int8_scale_products/bf16", run_scale_products, {5, 77, 1}},
    /* MXFP4: M, N, K, bf16 */
    {"mxfp4_gemm/f32/M1", run_mxfp4_gemm, {1, 21, 256, 0}},
    {"mxfp4_gemm/bf16/M11", run_mxfp4_gemm, {11, 21, 256, 1}},
    {"mxfp4_dequant/f32", run_mxfp4_dequant, {5, 256, 0}},
    {"mxfp4_dequant/bf16", run_mxfp4_dequant, {5, 256, 1}},
    /* decode attention: Hq, Hkv, D, bf16, window, sinks | softcap << 1 */
    {"paged_decode_attention/bf16", run_decode_attn, {8, 2, 64, 1, 0, 0}},
    {"paged_decode_attention/bf16/window+sinks", run_decode_attn, {8, 2, 128, 1, 30, 1}},
    {"paged_decode_attention/bf16/window+softcap", run_decode_attn, {8, 2, 64, 1, 30, 2}},
    {"paged_decode_attention/f32", run_decode_attn, {6, 2, 64, 0, 0, 0}},
    {"paged_decode_attention/f32/window+sinks", run_decode_attn, {8, 1, 48, 0, 30, 1}},
    {"paged_decode_attention/f32/softcap", run_decode_attn, {6, 2, 64, 0, 0, 2}},
    /* int8 cache: Hq, Hkv, D, bf16 | rot_kind << 1, window, sinks */
    {"int8_attention/bf16/rot_none", run_int8_attn, {8, 2, 64, 1 | ROT_NONE << 1, 0, 0}},
    {"int8_attention/f32/rot_hadamard", run_int8_attn, {8, 2, 64, 0 | ROT_HADAMARD << 1, 0, 0}},
    {"int8_attention/bf16/rot_hadamard/window+sinks", run_int8_attn, {8, 2, 128, 1 | ROT_HADAMARD << 1, 30, 1}},
    {"int8_attention/f32/rot_none/D40", run_int8_attn, {4, 2, 40, 0 | ROT_NONE << 1, 0, 1}},
    /* prefill: Hq, Hkv, D, window, sinks */
    {"paged_prefill_attention_bf16", run_prefill_attn, {8, 2, 64, 0, 0}, "tessera_avx512_bf16"},
    {"paged_prefill_attention_bf16/window+sinks", run_prefill_attn, {6, 3, 128, 24, 1}, "tessera_avx512_bf16"},
    /* LoRA: x_bf16, w_bf16 */
    {"lora_add/f32", run_lora, {0, 0}},
    {"lora_add/f32+bf16_weights", run_lora, {0, 1}},
    {"lora_add/bf16", run_lora, {1, 1}},
    /* decode step: float32, block (0 llama, 1 Gemma, 2 OLMo 2 and more, 3 mixtures of experts), rows */
    {"decode_step_bf16", run_decode_step},
    {"decode_step_bf16/gemma", run_decode_step, {0, 1}},
    {"decode_step_bf16/olmo2", run_decode_step, {0, 2}},
    {"decode_step_f32", run_decode_step, {1}},
    {"decode_step_f32/gemma", run_decode_step, {1, 1}},
    {"decode_step_f32/olmo2", run_decode_step, {1, 2}},
    {"decode_step_f32/M1", run_decode_step, {1, 0, 1}}, /* one row: the int16-row products */
    {"decode_step_bf16/moe", run_decode_step, {0, 3}},
    {"decode_step_f32/moe", run_decode_step, {1, 3}},
    {"decode_step_f32/moe1", run_decode_step, {1, 3, 1}},
};

/* ---- Comparison and the driver ---- */

static uint64_t seed_of(const char *name) { /* FNV-1a: each case its own inputs, the same in both runs */
    uint64_t h = 1469598103934665603ULL;
    for (; *name; name++) h = (h ^ (uint8_t)*name) * 1099511628211ULL;
    return h | 1;
}

static int run_case(const lib_t *L, const case_t *c, out_t *o) {
    rng_state = seed_of(c->name);
    const int rc = c->run(L, c, o);
    free_all();
    return rc;
}

/* The worst part's error, in its tolerance's units (> 1: a mismatch); a description of it in `why`. */
static double compare(const out_t *ref, const out_t *var, char *why, size_t len) {
    double worst = 0.;
    snprintf(why, len, "no outputs");
    for (int i = 0; i < ref->nparts; i++) {
        const part_t *a = &ref->parts[i], *b = &var->parts[i];
        double scale = 0., err = 0.;
        int64_t at = 0;
        for (int64_t j = 0; j < a->n; j++) scale = fmax(scale, fabs(a->v[j]));
        for (int64_t j = 0; j < a->n; j++) {
            const double e = isnan(b->v[j]) != isnan(a->v[j]) ? INFINITY : isnan(a->v[j]) ? 0. : fabs(a->v[j] - b->v[j]);
            if (e > err) err = e, at = j;
        }
        const double unit = a->kind == BF16 ? ldexp(scale > 0. ? scale : 1., -8) : a->kind == F32 ? (scale > 0. ? scale : 1.) : 1.;
        const double allowed = a->tol * unit, score = err == 0. ? 0. : allowed > 0. ? err / allowed : INFINITY;
        if (score > worst || i == 0) {
            worst = score;
            snprintf(why, len, "max_err=%.4g part=%s at=%lld ref=%.6g got=%.6g scale=%.4g allowed=%.3g", err, a->name,
                     (long long)at, a->v[at], b->v[at], scale, allowed);
        }
    }
    return worst;
}

static int open_lib(lib_t *L, const char *path, const char *role) {
    L->path = path;
    L->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!L->handle) {
        fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
        return -1;
    }
    printf("%s %s %s\n", role, ((const char *(*)(void))sym(L, "tessera_variant"))(), path);
    return 0;
}

int main(int argc, char **argv) {
    const int verbose = argc > 1 && strcmp(argv[1], "-v") == 0; /* the error of every case */
    argc -= verbose, argv += verbose;
    if (argc < 3) {
        fprintf(stderr, "usage: %s [-v] REF.so VARIANT.so [CASE-PREFIX...]\n", argv[0]);
        return 2;
    }
    lib_t ref, var;
    if (open_lib(&ref, argv[1], "reference") || open_lib(&var, argv[2], "variant")) return 2;
    int failures = 0, ran = 0;
    for (size_t i = 0; i < sizeof(CASES) / sizeof(CASES[0]); i++) {
        const case_t *c = &CASES[i];
        int wanted = argc == 3;
        for (int a = 3; a < argc; a++) wanted |= strncmp(c->name, argv[a], strlen(argv[a])) == 0;
        if (!wanted) continue;
        ran++;
        out_t ro = {0}, vo = {0};
        const int rrc = run_case(&ref, c, &ro);
        if (rrc != 0) {
            printf("skip %s (reference refuses: rc=%d)\n", c->name, rrc);
        } else {
            const int vrc = run_case(&var, c, &vo);
            if (vrc != 0) {
                const int expected = !c->expect || ((int (*)(void))sym(&var, c->expect))() == 1;
                printf("refused %s (rc=%d%s%s%s)\n", c->name, vrc, expected ? "; the variant has this path: " : "",
                       expected && c->expect ? c->expect : "", expected && c->expect ? "() = 1" : "");
                failures += expected;
            } else {
                char why[256];
                const double score = compare(&ro, &vo, why, sizeof why);
                if (score > 1.) {
                    printf("MISMATCH %s %s\n", c->name, why);
                    failures++;
                } else {
                    printf("ok %s", c->name);
                    if (verbose) printf(" (%.2f of the tolerance: %s)", score, why);
                    printf("\n");
                }
            }
        }
        free_out(&ro);
        free_out(&vo);
        fflush(stdout);
    }
    printf("%d cases, %d failed\n", ran, failures);
    return failures ? 1 : 0;
}
