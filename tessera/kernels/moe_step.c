/* A mixture-of-experts block over a decode step's rows, as layers/moe.py's SparseMoE runs it: the
 * router product in float32 on each row, the top k experts and their routing weights, then each
 * chosen expert's gated MLP (step_ops.c: its gate/up product with its bias, the activation, its
 * down product) and the weighted sum into the block's output.
 *
 * The decode step (decode_step.c) calls it in place of the dense MLP of a layer whose layer_t.moe
 * is set. Rows that chose the same expert go through that expert's products in one call, so with
 * eight decode rows a layer reads each chosen expert's weights once, not once per row, and an
 * expert no row chose is never read. The order of every sum and rounding is the module path's, so
 * the results match it up to the order of float32 sums inside the kernels: one row takes its
 * experts in the router's order, each output times its float32 weight rounded to the step's dtype
 * and added in turn; several rows take the experts in ascending id, each expert's rows in
 * ascending order, the weights rounded to the step's dtype first (SparseMoE.forward's index_add_).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"

#include "bf16.h"
#include "tessera_kernels.h"

static int64_t align64(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

/* The most scratch (floats) any expert's projections need for n rows. */
static int64_t expert_scratch(const moe_t *moe, int64_t n) {
    int64_t most = 0;
    for (int64_t e = 0; e < moe->num_experts; e++) {
        const int64_t a = linear_scratch_floats(&moe->gate_up[e], n), b = linear_scratch_floats(&moe->down[e], n);
        most = a > most ? a : most;
        most = b > most ? b : most;
    }
    return most;
}

/* Bytes of workspace moe_forward needs for M rows of H: logits, choices and weights, a row index
 * and weight per routed row, the rows gathered for an expert and its output, its [gate | up] and
 * activation (at float32's width), and its kernels' scratch. */
int64_t moe_workspace_bytes(const moe_t *moe, int64_t M, int64_t H) {
    const int64_t E = moe->num_experts, K = moe->top_k, F = moe->ffn;
    return align64(4 * M * E) + align64(8 * M * K) + align64(4 * M * K) + align64(8 * M) + align64(4 * M) +
           2 * align64(4 * M * H) + align64(4 * M * 2 * F) + align64(4 * M * F) + align64(4 * expert_scratch(moe, M));
}

/* Each row's router logits (float32: x @ router^T + bias, the experts in parallel), its top k experts
 * in descending order of logit (the lower id first among equal ones) and their routing weights: the
 * softmax over the chosen logits (renormalize), or the softmax over all experts taken at the chosen
 * ones, as SparseMoE.route computes them. xf: [H] floats of scratch. */
static void route(const moe_t *moe, const void *h, int64_t M, int64_t H, int bf, float *xf, float *logits,
                  int64_t *ids, float *weights) {
    const int64_t E = moe->num_experts, K = moe->top_k;
    for (int64_t r = 0; r < M; r++) {
        float *lg = logits + r * E;
        for (int64_t i = 0; i < H; i++) xf[i] = act_ld(h, r * H + i, bf);
#pragma omp parallel for schedule(static)
        for (int64_t e = 0; e < E; e++) {
            const float *w = moe->router + e * H;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < H; i++) s += xf[i] * w[i];
            lg[e] = moe->router_bias ? s + moe->router_bias[e] : s;
        }
        int64_t *id = ids + r * K;
        float *wt = weights + r * K;
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t q = 0; q < j; q++) taken |= id[q] == e;
                if (!taken && (best < 0 || lg[e] > lg[best])) best = e;
            }
            id[j] = best;
            wt[j] = lg[best];
        }
        const float mx = wt[0]; /* the largest logit of all, and of the chosen */
        float sum = 0.f;
        if (moe->renormalize) {
            for (int64_t j = 0; j < K; j++) sum += (wt[j] = expf(wt[j] - mx));
            for (int64_t j = 0; j < K; j++) wt[j] /= sum;
        } else {
            for (int64_t e = 0; e < E; e++) sum += expf(lg[e] - mx);
            for (int64_t j = 0; j < K; j++) wt[j] = expf(wt[j] - mx) / sum;
        }
    }
}

/* Expert e's gated MLP over n rows x [n][H] into y [n][H]. */
static int expert(const moe_t *moe, int64_t e, const void *x, int64_t n, void *gu, void *act, void *y, float *scratch,
                  int bf) {
    if (linear_forward(&moe->gate_up[e], x, n, gu, scratch, NULL, bf) != 0) return -1;
    if (gated_activation(moe->activation, gu, act, n, moe->ffn, moe->swiglu_limit, moe->swiglu_alpha, bf) != 0)
        return -1;
    return linear_forward(&moe->down[e], act, n, y, scratch, NULL, bf);
}

/*
 * h:         [M][H] the block's input rows (bfloat16 if is_bf16, else float32)
 * out:       [M][H] the block's output, of h's dtype (not h)
 * workspace: moe_workspace_bytes(moe, M, H) bytes
 * Returns 0, or -1 when a kernel refused its arguments.
 */
int moe_forward(const moe_t *moe, const void *h, int64_t M, int64_t H, void *out, void *workspace, int is_bf16) {
    const int bf = is_bf16;
    const int64_t E = moe->num_experts, K = moe->top_k, F = moe->ffn, es = bf ? 2 : 4;
    if (K < 1 || K > E || M < 1) return -1;
    char *p = (char *)workspace;
    float *logits = (float *)p; p += align64(4 * M * E);
    int64_t *ids = (int64_t *)p; p += align64(8 * M * K);
    float *weights = (float *)p; p += align64(4 * M * K);
    int64_t *rows = (int64_t *)p; p += align64(8 * M);
    float *row_w = (float *)p; p += align64(4 * M);
    char *xe = p; p += align64(4 * M * H);
    char *ye = p; p += align64(4 * M * H);
    char *gu = p; p += align64(4 * M * 2 * F);
    char *act = p; p += align64(4 * M * F);
    float *scratch = (float *)p;
    route(moe, h, M, H, bf, (float *)xe, logits, ids, weights);

    if (M == 1) { /* SparseMoE's one-row path: the experts in the router's order */
        for (int64_t j = 0; j < K; j++) {
            if (expert(moe, ids[j], h, 1, gu, act, ye, scratch, bf) != 0) return -1;
            for (int64_t i = 0; i < H; i++) {
                const float y = act_rnd(act_ld(ye, i, bf) * weights[j], bf);
                act_st(out, i, j ? act_ld(out, i, bf) + y : y, bf);
            }
        }
        return 0;
    }
    memset(out, 0, es * M * H);
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < K; j++)
                if (ids[r * K + j] == e) {
                    rows[n] = r;
                    row_w[n++] = act_rnd(weights[r * K + j], bf);
                }
        if (n == 0) continue;
        for (int64_t t = 0; t < n; t++) memcpy(xe + t * H * es, (const char *)h + rows[t] * H * es, es * H);
        if (expert(moe, e, xe, n, gu, act, ye, scratch, bf) != 0) return -1;
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < H; i++) {
                const int64_t at = rows[t] * H + i;
                act_st(out, at, act_ld(out, at, bf) + act_rnd(act_ld(ye, t * H + i, bf) * row_w[t], bf), bf);
            }
    }
    return 0;
}
