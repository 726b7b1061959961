/* One decode step of a gated DeltaNet layer (model/deltanet.py) for n sequences, each one token, each in its
 * own state slot, float32 (dtype 0) or bf16 (dtype 1) activations over a float32 recurrent state:
 *
 *   conv:  y[c] = silu(sum_j w[c, j] * (window[c], x)[j]) for each q/k/v channel c, the window shifted by x
 *   heads: q, k L2-normed per key head (q then divided by sqrt(k_dim)); value head h reads key head
 *          h / (v_heads / k_heads); beta = sigmoid(b[h]), g = A[h] * softplus(a[h] + dt_bias[h])
 *   rule:  S = S * exp(g);  S = S + k (beta (v - S^T k))^T;  o = S^T q   (S: [k_dim, v_dim], in place)
 *   out:   norm_w * rms_norm(o) * silu(z), per value head
 *
 * Layouts: proj [n, ld] holds each row's q, k, v channels (conv_dim = 2 k_heads k_dim + v_heads v_dim) then
 * z (v_heads v_dim); b, a [n, v_heads]; conv_state [slots, conv_dim, kernel - 1] and conv_w [conv_dim,
 * kernel] in the dtype; A [v_heads] float32; dt_bias, norm_w in the dtype; state [slots, v_heads, k_dim,
 * v_dim] float32; slots [n] int64, distinct; out [n, v_heads v_dim] in the dtype.
 *
 * Rounding follows the torch reference op by op: the convolution's sum, silu, beta, o and each step of the
 * gated norm are rounded to the dtype where torch's ops are; products are rounded before they are summed
 * (no fused multiply-add), so the decayed state and its update round as torch's; only the order of the
 * float32 sums (the convolution's taps, S^T k, S^T q, the norms) and the exp/log differ from it.
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define CONV_CHUNK 512 /* channels of one row a thread convolves at a time */
#define MAX_DIM    1024

typedef struct {
    const void* proj;
    const void* b;
    const void* a;
    void* conv_state;
    const void* conv_w;
    const float* A;
    const void* dt_bias;
    const void* norm_w;
    float* state;
    const int64_t* slots;
    void* out;
    int n;
    int ld;
    int nk;
    int nv;
    int dk;
    int dv;
    int kernel;
    int nslots;
    float eps;
    int dtype;
    int nthreads;
} sidecar_deltanet_args;

int sidecar_deltanet_args_size(void) {
    return (int)sizeof(sidecar_deltanet_args);
}

/* Channels c0 .. c1 of row t: the convolution over the slot's window and x, rounded, silu, rounded, into y;
 * the window shifted to end with x. */
static void conv_rows(const sidecar_deltanet_args* a, int t, int c0, int c1, float* y) {
    const int K = a->kernel, W = K - 1, dtype = a->dtype;
    const int conv_dim = 2 * a->nk * a->dk + a->nv * a->dv;
    const size_t win0 = (size_t)a->slots[t] * conv_dim * W;
    for (int c = c0; c < c1; c++) {
        const float x = dt_load(a->proj, (size_t)t * a->ld + c, dtype);
        const size_t w0 = win0 + (size_t)c * W;
        float acc = 0.0f;
        for (int j = 0; j < W; j++)
            acc += dt_load(a->conv_w, (size_t)c * K + j, dtype) * dt_load(a->conv_state, w0 + j, dtype);
        acc += dt_load(a->conv_w, (size_t)c * K + W, dtype) * x;
        for (int j = 0; j + 1 < W; j++)
            dt_store(a->conv_state, w0 + j, dt_load(a->conv_state, w0 + j + 1, dtype), dtype);
        if (W > 0) dt_store(a->conv_state, w0 + W - 1, x, dtype);
        y[c] = dt_round(acc, dtype);
    }
    int c = c0;
#ifdef VL
    for (; c + VL <= c1; c += VL) v_store(y + c, v_dt_round(vsilu(v_load(y + c)), dtype));
#endif
    for (; c < c1; c++) y[c] = dt_round(silu1(y[c]), dtype);
}

/* x * rsqrt(sum(x^2) + 1e-6), then divided by div (1 for k) */
static void l2norm(const float* x, int d, float div, float* out) {
    float ss = 0.0f;
    for (int i = 0; i < d; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int i = 0; i < d; i++) out[i] = (x[i] * r) / div;
}

static inline float softplus1(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

/* rem[j] = sum_i (S[i, j] e) k[i] over the decayed rows */
static void recall(const float* S, int dk, int dv, float e, const float* k, float* rem) {
    for (int j = 0; j < dv; j++) rem[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        const float* row = S + (size_t)i * dv;
        int j = 0;
#ifdef VL
        const vf ve = v_set1(e), vk = v_set1(k[i]);
        for (; j + VL <= dv; j += VL)
            v_store(rem + j, v_add(v_load(rem + j), v_mul(v_mul(v_load(row + j), ve), vk)));
#endif
        for (; j < dv; j++) rem[j] += (row[j] * e) * k[i];
    }
}

/* S[i, j] = S[i, j] e + k[i] delta[j] in place; o[j] = sum_i S[i, j] q[i] over the new rows */
static void update(float* S, int dk, int dv, float e, const float* k, const float* delta, const float* q,
                   float* o) {
    for (int j = 0; j < dv; j++) o[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float* row = S + (size_t)i * dv;
        int j = 0;
#ifdef VL
        const vf ve = v_set1(e), vk = v_set1(k[i]), vq = v_set1(q[i]);
        for (; j + VL <= dv; j += VL) {
            const vf s = v_add(v_mul(v_load(row + j), ve), v_mul(vk, v_load(delta + j)));
            v_store(row + j, s);
            v_store(o + j, v_add(v_load(o + j), v_mul(s, vq)));
        }
#endif
        for (; j < dv; j++) {
            const float s = row[j] * e + k[i] * delta[j];
            row[j] = s;
            o[j] += s * q[i];
        }
    }
}

/* Value head h of row t: the rule over its state, then the gated norm into out. */
static void head_step(const sidecar_deltanet_args* a, int t, int h, const float* y) {
    const int dk = a->dk, dv = a->dv, nk = a->nk, nv = a->nv, dtype = a->dtype;
    const int kh = h / (nv / nk);
    float q[MAX_DIM], k[MAX_DIM], rem[MAX_DIM], o[MAX_DIM];
    l2norm(y + (size_t)kh * dk, dk, sqrtf((float)dk), q);
    l2norm(y + (size_t)(nk + kh) * dk, dk, 1.0f, k);
    const float* v = y + (size_t)2 * nk * dk + (size_t)h * dv;
    const size_t gi = (size_t)t * nv + h;
    const float beta = dt_round(1.0f / (1.0f + expf(-dt_load(a->b, gi, dtype))), dtype);
    const float g = a->A[h] * softplus1(dt_load(a->a, gi, dtype) + dt_load(a->dt_bias, h, dtype));
    const float e = expf(g);
    float* S = a->state + ((size_t)a->slots[t] * nv + h) * dk * dv;
    recall(S, dk, dv, e, k, rem);
    for (int j = 0; j < dv; j++) rem[j] = (v[j] - rem[j]) * beta; /* rem becomes delta */
    update(S, dk, dv, e, k, rem, q, o);
    float ss = 0.0f;
    for (int j = 0; j < dv; j++) {
        o[j] = dt_round(o[j], dtype);
        ss += o[j] * o[j];
    }
    const float r = 1.0f / sqrtf(ss / (float)dv + a->eps);
    const size_t z0 = (size_t)t * a->ld + (size_t)2 * nk * dk + (size_t)nv * dv + (size_t)h * dv;
    const size_t o0 = ((size_t)t * nv + h) * dv;
    int j = 0;
#ifdef VL
    const vf vr = v_set1(r);
    for (; j + VL <= dv; j += VL) {
        const vf hn = v_dt_round(v_mul(v_load(o + j), vr), dtype);
        const vf hw = v_dt_round(v_mul(v_dt_load(a->norm_w, j, dtype), hn), dtype);
        v_dt_store(a->out, o0 + j, v_mul(hw, vsilu(v_dt_load(a->proj, z0 + j, dtype))), dtype);
    }
#endif
    for (; j < dv; j++) {
        const float hw = dt_round(dt_load(a->norm_w, j, dtype) * dt_round(o[j] * r, dtype), dtype);
        dt_store(a->out, o0 + j, hw * silu1(dt_load(a->proj, z0 + j, dtype)), dtype);
    }
}

/* 0, or 1 when a slot is outside the state or a head size past MAX_DIM (nothing touched), 2 when out of
 * memory (nothing touched). */
int sidecar_deltanet_decode(const sidecar_deltanet_args* a) {
    const int n = a->n, nv = a->nv;
    const int conv_dim = 2 * a->nk * a->dk + nv * a->dv;
    if (a->dk > MAX_DIM || a->dv > MAX_DIM || a->nk <= 0 || nv % a->nk || a->kernel < 1) return 1;
    for (int t = 0; t < n; t++)
        if (a->slots[t] < 0 || a->slots[t] >= a->nslots) return 1;
    float* y = malloc(sizeof(float) * (size_t)n * conv_dim);
    if (y == NULL) return 2;
    const int chunks = (conv_dim + CONV_CHUNK - 1) / CONV_CHUNK;
#pragma omp parallel num_threads(a->nthreads)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < n * chunks; i++) {
            const int t = i / chunks, c0 = (i % chunks) * CONV_CHUNK;
            conv_rows(a, t, c0, c0 + CONV_CHUNK < conv_dim ? c0 + CONV_CHUNK : conv_dim,
                      y + (size_t)t * conv_dim);
        }
#pragma omp for schedule(static)
        for (int i = 0; i < n * nv; i++) head_step(a, i / nv, i % nv, y + (size_t)(i / nv) * conv_dim);
    }
    free(y);
    return 0;
}

/* The rule alone over the L tokens of one sequence's prompt chunk, float32 throughout:
 *
 *   for t in order:  S = S * exp(g[t]);  S = S + k[t] (beta[t] (v[t] - S^T k[t]))^T;  o[t] = S^T q[t]
 *
 * per value head (reading key head h / (v_heads / k_heads)). Layouts: q, k [L, k_heads, k_dim] (already
 * L2-normed, q scaled), token rows ldq, ldk floats apart; v [L, v_heads, v_dim], rows ldv apart; g (log
 * decay), beta [L, v_heads]; state [v_heads, k_dim, v_dim] in place; out [L, v_heads, v_dim]. Each column of
 * S evolves on its own (S^T k, the update and S^T q read only that column), so a thread keeps RULE_COLS
 * columns of one head in a local block that stays in L1 across all L tokens. Per column the products and sums
 * round as the decode step's (recall, update). */
#define RULE_COLS 32

typedef struct {
    const float* q;
    const float* k;
    const float* v;
    const float* g;
    const float* beta;
    float* state;
    float* out;
    int L;
    int nk;
    int nv;
    int dk;
    int dv;
    int ldq; /* floats from one token's q (k, v) to the next's: rows of a wider tensor */
    int ldk;
    int ldv;
    int nthreads;
} sidecar_deltanet_rule_args;

int sidecar_deltanet_rule_args_size(void) {
    return (int)sizeof(sidecar_deltanet_rule_args);
}

/* Columns j0 .. j0 + w of head h's S (w <= RULE_COLS, a constant in the hot call) through all L tokens. */
static inline void rule_cols(const sidecar_deltanet_rule_args* a, int h, int j0, const int w, float* Sb) {
    const int dk = a->dk, dv = a->dv, nv = a->nv, nk = a->nk, kh = h / (nv / nk);
    float* S = a->state + (size_t)h * dk * dv;
    float rem[RULE_COLS], o[RULE_COLS];
    for (int i = 0; i < dk; i++)
        for (int c = 0; c < w; c++) Sb[i * RULE_COLS + c] = S[(size_t)i * dv + j0 + c];
    for (int t = 0; t < a->L; t++) {
        const size_t th = (size_t)t * nv + h;
        const float e = expf(a->g[th]), beta = a->beta[th];
        const float* k = a->k + (size_t)t * a->ldk + (size_t)kh * dk;
        const float* q = a->q + (size_t)t * a->ldq + (size_t)kh * dk;
        const float* v = a->v + (size_t)t * a->ldv + (size_t)h * dv + j0;
        for (int c = 0; c < w; c++) rem[c] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float* row = Sb + i * RULE_COLS;
            const float ki = k[i];
            for (int c = 0; c < w; c++) {
                const float se = row[c] * e;
                row[c] = se;
                rem[c] += se * ki;
            }
        }
        for (int c = 0; c < w; c++) {
            rem[c] = (v[c] - rem[c]) * beta; /* rem becomes delta */
            o[c] = 0.0f;
        }
        for (int i = 0; i < dk; i++) {
            float* row = Sb + i * RULE_COLS;
            const float ki = k[i], qi = q[i];
            for (int c = 0; c < w; c++) {
                const float s = row[c] + ki * rem[c];
                row[c] = s;
                o[c] += s * qi;
            }
        }
        float* out = a->out + th * dv + j0;
        for (int c = 0; c < w; c++) out[c] = o[c];
    }
    for (int i = 0; i < dk; i++)
        for (int c = 0; c < w; c++) S[(size_t)i * dv + j0 + c] = Sb[i * RULE_COLS + c];
}

/* 0, or 1 when the heads do not divide or a head size is past MAX_DIM (nothing touched), 2 when out of
 * memory (nothing touched). */
int sidecar_deltanet_rule(const sidecar_deltanet_rule_args* a) {
    const int dk = a->dk, dv = a->dv, nv = a->nv;
    if (dk > MAX_DIM || dv > MAX_DIM || dk < 1 || dv < 1 || a->nk <= 0 || nv % a->nk || a->L < 0) return 1;
    if (a->ldq < a->nk * dk || a->ldk < a->nk * dk || a->ldv < nv * dv) return 1;
    const int blocks = (dv + RULE_COLS - 1) / RULE_COLS;
    int failed = 0;
#pragma omp parallel num_threads(a->nthreads)
    {
        float* Sb = malloc(sizeof(float) * (size_t)dk * RULE_COLS);
        if (Sb == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < nv * blocks; i++) {
                const int h = i / blocks, j0 = (i % blocks) * RULE_COLS;
                if (dv - j0 >= RULE_COLS)
                    rule_cols(a, h, j0, RULE_COLS, Sb);
                else
                    rule_cols(a, h, j0, dv - j0, Sb);
            }
        }
        free(Sb);
    }
    return failed ? 2 : 0;
}
