/* The parts of a gated DeltaNet prompt chunk (model/deltanet_prefill.py) around the recurrence
 * (deltanet_step.c's sidecar_deltanet_rule), over one sequence's L tokens, float32 (dtype 0) or bf16 (dtype
 * 1) activations:
 *
 *   conv:  y[t, c] = silu(sum_j w[c, j] x[t - W + j, c]), W = kernel - 1, the inputs before the chunk taken
 *          from the sequence's window (or zeros at its start), the window left holding the chunk's last W
 *          inputs; optionally q and k L2-normed per head (q then divided by sqrt(k_dim)), as the rule reads
 *          them, into float32 rows.
 *   gate:  out[t, h] = norm_w * rms_norm(o[t, h]) * silu(z[t, h]) per value head, from the rule's float32
 *          output o.
 *
 * Rounding follows the torch reference op by op: the convolution's sum is rounded to the dtype once, silu's
 * result again (torch's bf16 silu), o to the dtype before the norm, the normed value and its product with
 * the weight each to the dtype. The convolution's sum runs tap by tap from the oldest input, each product
 * added with one rounding (a fused multiply-add), which is the order and the rounding of torch's float32
 * depthwise convolution on CPU (oneDNN's); the start-up self-check holds the sums to its bits. Only silu's
 * exp and the order of the norms' float32 sums differ from torch.
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define CONV_ROWS 16 /* tokens one task convolves */

typedef struct {
    const void* x;      /* [L, ld] in the dtype: the chunk's q, k, v channels in columns 0 .. conv_dim */
    void* window;       /* [conv_dim, kernel - 1] in the dtype: the inputs before the chunk; left the last */
    const void* conv_w; /* [conv_dim, kernel] in the dtype */
    float* y;           /* [L, conv_dim] float32 */
    int L;
    int ld;
    int conv_dim;
    int kernel;
    int start; /* 1: the sequence's first chunk (zeros before it; the window is not read) */
    int act;   /* 1: silu and the norms; 0: the convolution's sums alone, unrounded (the self-check's) */
    int nk;    /* the first 2 nk dk channels are nk q heads then nk k heads of dk; nk 0: no norms */
    int dk;
    int dtype;
    int nthreads;
} sidecar_deltanet_conv_args;

int sidecar_deltanet_conv_args_size(void) {
    return (int)sizeof(sidecar_deltanet_conv_args);
}

/* x * rsqrt(sum(x^2) + 1e-6), then divided by div (1 for k), in place */
static void l2norm_inplace(float* x, int d, float div) {
    float ss = 0.0f;
    for (int i = 0; i < d; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int i = 0; i < d; i++) x[i] = (x[i] * r) / div;
}

/* Row t of y. pre: [W, conv_dim] float32, the W inputs before the chunk (zeros at a start); wt: [kernel,
 * conv_dim] float32, the taps transposed. */
static void conv_row(const sidecar_deltanet_conv_args* a, int t, const float* pre, const float* wt) {
    const int K = a->kernel, W = K - 1, C = a->conv_dim, dtype = a->dtype;
    float* y = a->y + (size_t)t * C;
    int c = 0;
#ifdef VL
    for (; c + VL <= C; c += VL) {
        vf acc = v_zero();
        for (int j = 0; j < K; j++) {
            const int s = t - W + j;
            const vf in = s >= 0 ? v_dt_load(a->x, (size_t)s * a->ld + c, dtype)
                                 : v_load(pre + (size_t)(s + W) * C + c);
            acc = v_fma(v_load(wt + (size_t)j * C + c), in, acc);
        }
        if (a->act) acc = v_dt_round(vsilu(v_dt_round(acc, dtype)), dtype);
        v_store(y + c, acc);
    }
#endif
    for (; c < C; c++) {
        float acc = 0.0f;
        for (int j = 0; j < K; j++) {
            const int s = t - W + j;
            const float in =
                    s >= 0 ? dt_load(a->x, (size_t)s * a->ld + c, dtype) : pre[(size_t)(s + W) * C + c];
            acc = fmaf(wt[(size_t)j * C + c], in, acc);
        }
        y[c] = a->act ? dt_round(silu1(dt_round(acc, dtype)), dtype) : acc;
    }
    if (!a->act) return;
    const float qdiv = sqrtf((float)a->dk);
    for (int h = 0; h < 2 * a->nk; h++) l2norm_inplace(y + (size_t)h * a->dk, a->dk, h < a->nk ? qdiv : 1.0f);
}

/* 0, or 1 when the arguments are out of range (nothing touched), 2 when out of memory (nothing touched). */
int sidecar_deltanet_conv(const sidecar_deltanet_conv_args* a) {
    const int K = a->kernel, W = K - 1, C = a->conv_dim, L = a->L, dtype = a->dtype;
    if (K < 1 || C < 1 || L < 0 || a->ld < C || a->nk < 0 || (a->nk && (a->dk < 1 || 2 * a->nk * a->dk > C)))
        return 1;
    float* pre = malloc(sizeof(float) * ((size_t)W * C + (size_t)K * C + 1));
    if (pre == NULL) return 2;
    float* wt = pre + (size_t)W * C;
    for (int c = 0; c < C; c++) {
        for (int j = 0; j < K; j++) wt[(size_t)j * C + c] = dt_load(a->conv_w, (size_t)c * K + j, dtype);
        for (int j = 0; j < W; j++)
            pre[(size_t)j * C + c] = a->start ? 0.0f : dt_load(a->window, (size_t)c * W + j, dtype);
    }
    const int tasks = (L + CONV_ROWS - 1) / CONV_ROWS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->nthreads)
    for (int i = 0; i < tasks; i++) {
        const int t1 = (i + 1) * CONV_ROWS < L ? (i + 1) * CONV_ROWS : L;
        for (int t = i * CONV_ROWS; t < t1; t++) conv_row(a, t, pre, wt);
    }
    /* the window: the last W inputs, from the chunk or (a chunk shorter than W) the window's own, also at a
     * start (as the torch form keeps them); copied bits */
    for (int c = 0; c < C; c++)
        for (int j = 0; j < W; j++) {
            const int s = L - W + j;
            if (s >= 0) /* else the old window's input L + j (> j: not yet overwritten), kept */
                dt_store(a->window, (size_t)c * W + j, dt_load(a->x, (size_t)s * a->ld + c, dtype), dtype);
            else
                dt_store(a->window, (size_t)c * W + j, dt_load(a->window, (size_t)c * W + L + j, dtype),
                         dtype);
        }
    free(pre);
    return 0;
}

typedef struct {
    const float* o;     /* [L, nv, dv] float32: the rule's output */
    const void* z;      /* [L, ldz] in the dtype: the output gate's nv dv channels in columns 0 .. nv dv */
    const void* norm_w; /* [dv] in the dtype */
    void* out;          /* [L, ldo] in the dtype */
    int L;
    int ldz;
    int ldo;
    int nv;
    int dv;
    float eps;
    int dtype;
    int nthreads;
} sidecar_deltanet_gate_args;

int sidecar_deltanet_gate_args_size(void) {
    return (int)sizeof(sidecar_deltanet_gate_args);
}

/* Value head h of token t: the gated norm of its output into out (as deltanet_step.c's decode step). */
static void gate_head(const sidecar_deltanet_gate_args* a, int t, int h) {
    const int dv = a->dv, dtype = a->dtype;
    const float* o = a->o + ((size_t)t * a->nv + h) * dv;
    float ss = 0.0f;
    for (int j = 0; j < dv; j++) {
        const float r = dt_round(o[j], dtype);
        ss += r * r;
    }
    const float r = 1.0f / sqrtf(ss / (float)dv + a->eps);
    const size_t z0 = (size_t)t * a->ldz + (size_t)h * dv, o0 = (size_t)t * a->ldo + (size_t)h * dv;
    int j = 0;
#ifdef VL
    const vf vr = v_set1(r);
    for (; j + VL <= dv; j += VL) {
        const vf hn = v_dt_round(v_mul(v_dt_round(v_load(o + j), dtype), vr), dtype);
        const vf hw = v_dt_round(v_mul(v_dt_load(a->norm_w, j, dtype), hn), dtype);
        v_dt_store(a->out, o0 + j, v_mul(hw, vsilu(v_dt_load(a->z, z0 + j, dtype))), dtype);
    }
#endif
    for (; j < dv; j++) {
        const float hn = dt_round(dt_round(o[j], dtype) * r, dtype);
        const float hw = dt_round(dt_load(a->norm_w, j, dtype) * hn, dtype);
        dt_store(a->out, o0 + j, hw * silu1(dt_load(a->z, z0 + j, dtype)), dtype);
    }
}

/* 0, or 1 when the arguments are out of range (nothing touched). */
int sidecar_deltanet_gate(const sidecar_deltanet_gate_args* a) {
    const int n = a->L * a->nv;
    if (a->L < 0 || a->nv < 1 || a->dv < 1 || a->ldz < a->nv * a->dv || a->ldo < a->nv * a->dv) return 1;
#pragma omp parallel for schedule(static) num_threads(a->nthreads)
    for (int i = 0; i < n; i++) gate_head(a, i / a->nv, i % a->nv);
    return 0;
}
