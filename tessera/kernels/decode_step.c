/* A decoder's whole decode step in one call: every layer's norms, projections, q/k norms, RoPE,
 * KV-cache writes, paged attention and gated MLP for a few decode rows, in bfloat16
 * (decode_step_bf16) or float32 (decode_step_f32: hosts without native bfloat16).
 *
 * At one decode row SmolLM2-135M's 30 layers are ~600 PyTorch operators and ctypes calls; their
 * dispatch (a few microseconds each) cost more than the arithmetic, which needs ~3 ms of weight
 * reads. Here the step is the same kernels (int4_gemv.c, int8_gemv.c, rms_norm.c,
 * paged_attention.c) called from C, with the small element-wise work (bias, q/k norms, RoPE, KV
 * writes, the activation times up, residual adds) done in loops between them. The arithmetic and its
 * roundings follow the module path (models/decoder.py): each tensor the module path stores in
 * bfloat16 is rounded to bfloat16 here at the same point, so both give the same tokens up to the
 * order of float32 sums inside the kernels.
 *
 * What differs between the families is data here, as it is in models/families: norms before
 * and/or after each sublayer (layer_t), q/k norms per head or per projection, SiLU or GELU (tanh),
 * a residual multiplier, soft-capped scores (dims_t), and per layer its RoPE table (global, local or
 * none), sliding window, KV-cache group, attention sinks and a dense MLP or a mixture of experts
 * (layer_t.moe: moe_step.c). The caller (models/fused_decode.py) checks what this handles: int4pack
 * (bfloat16: AVX-512 layout, or int8 activations; float32: the float32 layout of int4_avx2.c, scales
 * within), int8-group, Q4_K / Q6_K (kquant_gemm.c) or MXFP4 projections with or without biases
 * (step_ops.c), a paged cache of the step's dtype [2][Hkv][num_blocks][block_size][D], neox RoPE
 * tables. Rows of LoRA adapters get their updates beside every projection but the experts' (lora.c),
 * so a step with adapters stays one call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"

#include "bf16.h"
#include "softmax.h"
#include "tessera_kernels.h"

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The most any dense projection of the step needs (experts' scratch is moe_forward's). */
static int64_t step_linear_scratch(const layer_t *layers, int64_t L, int64_t M) {
    int64_t lin = 0;
    for (int64_t i = 0; i < L; i++) {
        lin = max64(lin, linear_scratch_floats(&layers[i].qkv, M));
        lin = max64(lin, linear_scratch_floats(&layers[i].o, M));
        lin = max64(lin, linear_scratch_floats(&layers[i].gate_up, M));
        lin = max64(lin, linear_scratch_floats(&layers[i].down, M));
    }
    return lin;
}

static int64_t align64(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

/* The most workspace any mixture-of-experts layer's moe_forward needs (0: none has one). */
static int64_t step_moe_bytes(const layer_t *layers, int64_t L, int64_t M, int64_t H) {
    int64_t most = 0;
    for (int64_t i = 0; i < L; i++)
        if (layers[i].moe) most = max64(most, moe_workspace_bytes(layers[i].moe, M, H));
    return most;
}

/* Bytes of workspace decode_step_bf16 or decode_step_f32 needs for M rows and contexts of at most
 * max_len tokens (activations counted at 4 bytes, float32's width). */
int64_t decode_step_workspace_bytes(const layer_t *layers, int64_t L, const dims_t *d, int64_t M, int64_t max_len) {
    const int64_t qkv_n = (d->num_heads + 2 * d->num_kv_heads) * d->head_dim;
    const int64_t lin = step_linear_scratch(layers, L, M);
    int64_t bytes = 0;
    bytes += align64(4 * M * d->hidden) * 2;                  /* residual, h */
    bytes += align64(4 * M * qkv_n);                          /* qkv */
    bytes += align64(4 * M * d->num_heads * d->head_dim);    /* attention output */
    bytes += align64(4 * M * 2 * d->intermediate);            /* gate_up */
    bytes += align64(4 * M * d->intermediate);                /* act */
    bytes += align64(4 * lin);                                /* kernels' scratch */
    bytes += align64(step_moe_bytes(layers, L, M, d->hidden)); /* the experts' */
    bytes += align64(4 * M * d->num_heads * max_len);         /* attention scores */
    return bytes;
}

/* x*cos + roll(x, half)*sin over the first R dimensions of one head (layers/rotary.py's apply_rope;
 * the rest pass through): x*cos rounded to the step's dtype first, then the multiply-add rounded
 * once, as addcmul does. */
static void rope_head(void *x, const void *cos, const void *sin, int64_t R, int64_t half, int bf) {
    float v[1024];
    for (int64_t i = 0; i < R; i++) v[i] = act_ld(x, i, bf);
    for (int64_t i = 0; i < R; i++) {
        const float a = act_rnd(v[i] * act_ld(cos, i, bf), bf);
        act_st(x, i, a + v[(i + half) % R] * act_ld(sin, i, bf), bf);
    }
}

/* RMSNorm over one head, then its scales (models/decoder.py's per-head q/k norm: F.rms_norm without
 * a weight, rounded to the step's dtype, times the scales, rounded again). */
static void head_norm(void *x, const void *w, int64_t D, float eps, int bf) {
    float ss = 0.f;
    for (int64_t i = 0; i < D; i++) {
        const float v = act_ld(x, i, bf);
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; i++) act_st(x, i, act_rnd(act_ld(x, i, bf) * inv, bf) * act_ld(w, i, bf), bf);
}

/* One RMSNorm call over M rows of H of the step's dtype (rms_norm.c), the residual add folded in
 * where `res` is not NULL. */
static void norm_rows(const void *in, void *res, const void *w, void *out, int64_t M, int64_t H, float eps, int bf) {
    if (bf)
        rms_norm_bf16((const uint16_t *)in, (uint16_t *)res, (const uint16_t *)w, (uint16_t *)out, M, H, eps);
    else
        rms_norm_f32((const float *)in, (float *)res, (const float *)w, (float *)out, M, H, eps);
}

/* The residual stream between sublayers, as models/decoder.py's DecoderLayer.sublayer keeps it: the
 * stream is x, or x + residual with the add still pending (folded into the next norm's call). */
typedef struct {
    void *x, *residual, *h;
    int64_t M, H;
    float eps;
    int bf, pending;
} stream_t;

/* A sublayer's input. Without an output norm (llama) the pending add is folded into the input norm's
 * call and stays pending after the sublayer; with one (Gemma, OLMo 2) the stream is added up into
 * `residual` first, normed into h where there is an input norm, and read from `residual` where not. */
static const void *sublayer_in(stream_t *s, const void *norm, const void *out_norm) {
    const int64_t n = s->M * s->H, es = s->bf ? 2 : 4;
    if (!out_norm) {
        if (s->pending) {
            norm_rows(s->x, s->residual, norm, s->h, s->M, s->H, s->eps, s->bf);
        } else {
            memcpy(s->residual, s->x, es * n);
            norm_rows(s->x, NULL, norm, s->h, s->M, s->H, s->eps, s->bf);
        }
        s->pending = 1;
        return s->h;
    }
    if (s->pending) /* x + residual as PyTorch adds two tensors: in float32, rounded once */
        for (int64_t i = 0; i < n; i++) act_st(s->residual, i, act_ld(s->x, i, s->bf) + act_ld(s->residual, i, s->bf), s->bf);
    else
        memcpy(s->residual, s->x, es * n);
    s->pending = 0;
    if (!norm) return s->residual;
    norm_rows(s->residual, NULL, norm, s->h, s->M, s->H, s->eps, s->bf);
    return s->h;
}

/* After the sublayer wrote its output y into x: y times the residual multiplier m (rounded, as
 * `y * m` is), and with an output norm the stream becomes residual + norm(y) (* m). */
static void sublayer_out(stream_t *s, const void *out_norm, float m) {
    const int64_t n = s->M * s->H;
    const int bf = s->bf;
    if (!out_norm) {
        if (m != 1.f)
            for (int64_t i = 0; i < n; i++) act_st(s->x, i, act_ld(s->x, i, bf) * m, bf);
        return;
    }
    norm_rows(s->x, NULL, out_norm, s->x, s->M, s->H, s->eps, bf);
    for (int64_t i = 0; i < n; i++) {
        const float y = m != 1.f ? act_rnd(act_ld(s->x, i, bf) * m, bf) : act_ld(s->x, i, bf);
        act_st(s->x, i, act_ld(s->residual, i, bf) + y, bf);
    }
}

/* Queries and keys of one row [Hq + Hkv][D] normed as dims_t.qk_norm says (models/decoder.py's
 * DecoderAttention._qk): each head with its scales, or the query and key projections each as one
 * RMSNorm row (the module's RMSNorm, through rms_norm.c). */
static void qk_norm(const dims_t *d, const layer_t *ly, char *row, int bf) {
    const int64_t D = d->head_dim, nq = d->num_heads, nkv = d->num_kv_heads, es = bf ? 2 : 4;
    const float eps = (float)d->eps;
    if (d->qk_norm == QK_NORM_HEAD) {
        for (int64_t j = 0; j < nq + nkv; j++) head_norm(row + j * D * es, j < nq ? ly->q_norm : ly->k_norm, D, eps, bf);
    } else if (d->qk_norm == QK_NORM_PROJ) {
        norm_rows(row, NULL, ly->q_norm, row, 1, nq * D, eps, bf);
        norm_rows(row + nq * D * es, NULL, ly->k_norm, row + nq * D * es, 1, nkv * D, eps, bf);
    }
}

/* One decode step of either dtype (see decode_step_bf16 for the arguments); bf: bfloat16 rows. */
static int decode_step(const layer_t *layers, int64_t L, const dims_t *d, const void *final_norm, int64_t M,
                       void *x, const void *cos, const void *sin, const void *cos_local, const void *sin_local,
                       int64_t half, const int64_t *slots, const int64_t *block_tables, const int64_t *seq_lens,
                       int64_t max_len, void *workspace, const lora_step_t *lora, int bf) {
    const int64_t H = d->hidden, D = d->head_dim, nq = d->num_heads, nkv = d->num_kv_heads, I = d->intermediate;
    const int64_t qkv_n = (nq + 2 * nkv) * D;
    const int64_t R = d->rotary_dim ? d->rotary_dim : D;
    const int64_t plane = d->num_blocks * d->block_size;
    const int64_t es = bf ? 2 : 4;
    const float m = (float)d->residual_multiplier;
    if (D > 1024 || R > D || R % 2) return -1;
    if (d->qk_norm == QK_NORM_PROJ && (nq * D > MAX_NORM_HIDDEN || nkv * D > MAX_NORM_HIDDEN)) return -1;
    char *p = (char *)workspace;
    char *residual = p; p += align64(4 * M * H);
    char *h = p; p += align64(4 * M * H);
    char *qkv = p; p += align64(4 * M * qkv_n);
    char *attn = p; p += align64(4 * M * nq * D);
    char *gu = p; p += align64(4 * M * 2 * I);
    char *act = p; p += align64(4 * M * I);
    const int64_t lin = step_linear_scratch(layers, L, M);
    float *scratch = (float *)p; p += align64(4 * lin);
    void *moe_ws = p; p += align64(step_moe_bytes(layers, L, M, H));
    float *scores = (float *)p;
    stream_t s = {x, residual, h, M, H, (float)d->eps, bf, 0};

    for (int64_t li = 0; li < L; li++) {
        const layer_t *ly = &layers[li];
        char *cache = (char *)ly->kv_cache;
        const int64_t *g_slots = slots + ly->group * M;
        const int64_t *g_tables = block_tables + ly->group * M * d->max_blocks;
        const char *lc = (const char *)(ly->rope == ROPE_LOCAL ? cos_local : cos);
        const char *ls = (const char *)(ly->rope == ROPE_LOCAL ? sin_local : sin);
        if (ly->rope != ROPE_NONE && (!lc || !ls)) return -1;
        if (d->qk_norm != QK_NORM_NONE && (!ly->q_norm || !ly->k_norm)) return -1;
        if (!ly->attn_norm && !ly->attn_out_norm) return -1;
        if (!ly->mlp_norm && !ly->mlp_out_norm) return -1;

        const void *in = sublayer_in(&s, ly->attn_norm, ly->attn_out_norm);
        if (linear_forward(&ly->qkv, in, M, qkv, scratch, lora, bf) != 0) return -1;
        for (int64_t r = 0; r < M; r++) {
            char *row = qkv + r * qkv_n * es;
            qk_norm(d, ly, row, bf);
            if (ly->rope != ROPE_NONE)
                for (int64_t j = 0; j < nq + nkv; j++)
                    rope_head(row + j * D * es, lc + r * R * es, ls + r * R * es, R, half, bf);
            for (int64_t j = 0; j < nkv; j++) { /* keys, then values, at the row's slot of each head */
                memcpy(cache + ((j * plane) + g_slots[r]) * D * es, row + (nq + j) * D * es, es * D);
                memcpy(cache + ((nkv + j) * plane + g_slots[r]) * D * es, row + (nq + nkv + j) * D * es, es * D);
            }
        }
        paged_decode_attention(qkv, qkv_n, cache, bf, g_tables, seq_lens, attn, M, nq, nkv, D, d->num_blocks,
                               d->block_size, d->max_blocks, (float)d->scale, (float)d->softcap, ly->window, ly->sinks,
                               scores, max_len);
        if (linear_forward(&ly->o, attn, M, x, scratch, lora, bf) != 0) return -1;
        sublayer_out(&s, ly->attn_out_norm, m);

        in = sublayer_in(&s, ly->mlp_norm, ly->mlp_out_norm);
        if (ly->moe) {
            if (moe_forward(ly->moe, in, M, H, x, moe_ws, bf) != 0) return -1;
        } else {
            if (linear_forward(&ly->gate_up, in, M, gu, scratch, lora, bf) != 0) return -1;
            if (gated_activation(d->activation, gu, act, M, I, 0., 0., bf) != 0) return -1;
            if (linear_forward(&ly->down, act, M, x, scratch, lora, bf) != 0) return -1;
        }
        sublayer_out(&s, ly->mlp_out_norm, m);
    }
    norm_rows(x, s.pending ? residual : NULL, final_norm, x, M, H, s.eps, bf);
    return 0;
}

/*
 * x:            [M, H] bf16: the rows' (scaled) embeddings in, the final norm's output out
 * cos, sin:     [M, R] bf16 RoPE rows of the rows' positions (RotaryEmbedding's tables; R = dims_t.rotary_dim)
 * cos_local, sin_local: the same from the sliding layers' own table (ROPE_LOCAL layers), or NULL
 * slots:        [G, M] int64 cache slot of each row's new token, per KV-cache group (layer_t.group)
 * block_tables: [G, M, max_blocks] int64 per group; seq_lens: [M] int64 (context including the new token)
 * workspace:    decode_step_workspace_bytes(...) bytes
 * lora:         the rows' adapters (lora.c adds them beside each projection), or NULL: none
 * Returns 0, or -1 when a kernel refused its arguments (nothing is then left half-written that
 * the module path would not overwrite: the caller reruns the step there).
 */
int decode_step_bf16(const layer_t *layers, int64_t L, const dims_t *d, const uint16_t *final_norm, int64_t M,
                     uint16_t *x, const uint16_t *cos, const uint16_t *sin, const uint16_t *cos_local,
                     const uint16_t *sin_local, int64_t half, const int64_t *slots, const int64_t *block_tables,
                     const int64_t *seq_lens, int64_t max_len, void *workspace, const lora_step_t *lora) {
    return decode_step(layers, L, d, final_norm, M, x, cos, sin, cos_local, sin_local, half, slots, block_tables,
                       seq_lens, max_len, workspace, lora, 1);
}

/* decode_step_bf16 for float32 rows, norms, RoPE tables and cache: every tensor the module path
 * keeps in float32 is float32 here, and the int4 operands are int4_gemm_f32's. */
int decode_step_f32(const layer_t *layers, int64_t L, const dims_t *d, const float *final_norm, int64_t M, float *x,
                    const float *cos, const float *sin, const float *cos_local, const float *sin_local, int64_t half,
                    const int64_t *slots, const int64_t *block_tables, const int64_t *seq_lens, int64_t max_len,
                    void *workspace, const lora_step_t *lora) {
    return decode_step(layers, L, d, final_norm, M, x, cos, sin, cos_local, sin_local, half, slots, block_tables,
                       seq_lens, max_len, workspace, lora, 0);
}
