/* The decoder's elementwise steps fused into one pass each, for float32 (dtype 0) and bf16 (dtype 1):
 *
 *   sidecar_silu_mul:     out[t, i] = silu(gu[t, i]) * gu[t, I + i]        (gu: the fused gate/up output)
 *   sidecar_add_rms_norm: s[t] = h[t] + delta[t] (written to hout; s = h without delta),
 *                         out[t] = w * (s[t] / sqrt(mean(s[t]^2) + eps))
 *   sidecar_add_bias:     y[t, i] += b[i], in place (rows of a product whose kernel adds no bias)
 *   sidecar_gelu_tanh_mul: out[t, i] = gelu_tanh(gu[t, i]) * gu[t, I + i]   (Gemma's GeGLU)
 *   sidecar_sigmoid_mul:  out[i] = x[i] * sigmoid(g[i])                  (a gated attention's output gate)
 *   sidecar_rms_norm_heads: x[t, j] = w * (x[t, j] / sqrt(mean(x[t, j]^2) + eps)) in place, for each head j
 *                         of each token t, head j of token t at x + t * ld + j * dim (the q or the k heads
 *                         inside a fused q/k/v projection's rows)
 *
 * Rounding follows torch's unfused ops step by step, so only the order of the float32 sums and the exp
 * differ from it: bf16 rounds silu(g) before the product, the residual sum, and the normalised row before
 * the weight multiplies it (as Hugging Face's RMSNorm does); mean(h^2) is accumulated in float32.
 * torch runs silu and the product as two passes over strided halves of gu, and the norm as five
 * (upcast, square, mean, scale, downcast) plus the weight and the residual add.
 */
#include <stdlib.h>

#include "vec.h"

/* Rows x dim from which the norm's rows are split between the threads (below, the threads' start costs more
 * than they save). A 32-row decode step of a 896-wide model is past it. */
#define PARALLEL_FROM 16384

void sidecar_silu_mul(const void* gu, void* out, int rows, int inter, int dtype, int nthreads) {
    const size_t n = (size_t)rows * inter;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 32768)
    for (int t = 0; t < rows; t++) {
        const size_t g0 = (size_t)t * 2 * inter, u0 = g0 + inter, o0 = (size_t)t * inter;
        int i = 0;
#ifdef VL
        for (; i + VL <= inter; i += VL) {
            const vf s = v_dt_round(vsilu(v_dt_load(gu, g0 + i, dtype)), dtype);
            v_dt_store(out, o0 + i, v_mul(s, v_dt_load(gu, u0 + i, dtype)), dtype);
        }
#endif
        for (; i < inter; i++) {
            const float s = dt_round(silu1(dt_load(gu, g0 + i, dtype)), dtype);
            dt_store(out, o0 + i, s * dt_load(gu, u0 + i, dtype), dtype);
        }
    }
}

/* sigmoid(g) from e = exp(-|g|) <= 1, so nothing overflows: g >= 0 ? 1 / (1 + e) : e / (1 + e) */
static inline float sigmoid1(float g) {
    const float e = expf(-fabsf(g));
    return (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

#ifdef VL
static inline vf vsigmoid(vf g) {
    const vf ng = v_min(g, v_sub(v_zero(), g));                              /* -|g| */
    const vf e = v_blend_ge0(v_add(ng, v_set1(87.0f)), v_exp(ng), v_zero()); /* v_exp stops at -87 */
    return v_div(v_blend_ge0(g, v_set1(1.0f), e), v_add(v_set1(1.0f), e));
}
#endif

/* bf16 rounds sigmoid(g) before the product, as torch's two ops do. */
void sidecar_sigmoid_mul(const void* x, const void* g, void* out, int64_t n, int dtype, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 65536)
    for (int64_t b = 0; b < n; b += 4096) {
        const int64_t end = b + 4096 < n ? b + 4096 : n;
        int64_t i = b;
#ifdef VL
        for (; i + VL <= end; i += VL) {
            const vf s = v_dt_round(vsigmoid(v_dt_load(g, i, dtype)), dtype);
            v_dt_store(out, i, v_mul(v_dt_load(x, i, dtype), s), dtype);
        }
#endif
        for (; i < end; i++)
            dt_store(out, i, dt_load(x, i, dtype) * dt_round(sigmoid1(dt_load(g, i, dtype)), dtype), dtype);
    }
}

/* gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), in torch's order of operations, 1
 * + tanh(u) included: far in the negative tail it cancels to 0 there as in torch. The vector form takes
 * vec.h's v_tanh. bf16 rounds gelu(g) before the product, as torch's two ops do. */
#define GELU_BETA  0.7978845608028654f
#define GELU_KAPPA 0.044715f
static inline float gelu_tanh1(float g) {
    const float u = GELU_BETA * (g + GELU_KAPPA * (g * g * g));
    return 0.5f * g * (1.0f + tanhf(u));
}

#ifdef VL
static inline vf vgelu_tanh(vf g) {
    const vf u = v_mul(v_set1(GELU_BETA), v_add(g, v_mul(v_set1(GELU_KAPPA), v_mul(v_mul(g, g), g))));
    return v_mul(v_mul(v_set1(0.5f), g), v_add(v_set1(1.0f), v_tanh(u)));
}
#endif

void sidecar_gelu_tanh_mul(const void* gu, void* out, int rows, int inter, int dtype, int nthreads) {
    const size_t n = (size_t)rows * inter;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 32768)
    for (int t = 0; t < rows; t++) {
        const size_t g0 = (size_t)t * 2 * inter, u0 = g0 + inter, o0 = (size_t)t * inter;
        int i = 0;
#ifdef VL
        for (; i + VL <= inter; i += VL) {
            const vf s = v_dt_round(vgelu_tanh(v_dt_load(gu, g0 + i, dtype)), dtype);
            v_dt_store(out, o0 + i, v_mul(s, v_dt_load(gu, u0 + i, dtype)), dtype);
        }
#endif
        for (; i < inter; i++) {
            const float s = dt_round(gelu_tanh1(dt_load(gu, g0 + i, dtype)), dtype);
            dt_store(out, o0 + i, s * dt_load(gu, u0 + i, dtype), dtype);
        }
    }
}

/* The arguments of sidecar_add_rms_norm (mirrored by ``AddRmsNormArgs``). */
typedef struct {
    const void* h;
    const void* delta;
    const void* w;
    void* hout;
    void* out;
    int rows;
    int dim;
    float eps;
    int dtype;
    int nthreads;
} sidecar_add_rms_norm_args;
int sidecar_add_rms_norm_args_size(void) {
    return (int)sizeof(sidecar_add_rms_norm_args);
}

void sidecar_add_rms_norm(const sidecar_add_rms_norm_args* a) {
    const void* h = a->h;
    const void* delta = a->delta;
    const void* w = a->w;
    void* hout = a->hout;
    void* out = a->out;
    int rows = a->rows;
    int dim = a->dim;
    float eps = a->eps;
    int dtype = a->dtype;
    int nthreads = a->nthreads;
    const void* s = delta ? hout : h;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((size_t)rows * dim >= PARALLEL_FROM)
    for (int t = 0; t < rows; t++) {
        const size_t r0 = (size_t)t * dim;
        float ss = 0.0f;
        int i = 0;
#ifdef VL
        vf acc = v_zero();
        for (; i + VL <= dim; i += VL) {
            vf x = v_dt_load(h, r0 + i, dtype);
            if (delta) {
                x = v_dt_round(v_add(x, v_dt_load(delta, r0 + i, dtype)), dtype);
                v_dt_store(hout, r0 + i, x, dtype);
            }
            acc = v_fma(x, x, acc);
        }
        ss = v_sum(acc);
#endif
        for (; i < dim; i++) {
            float x = dt_load(h, r0 + i, dtype);
            if (delta) {
                x = dt_round(x + dt_load(delta, r0 + i, dtype), dtype);
                dt_store(hout, r0 + i, x, dtype);
            }
            ss += x * x;
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        i = 0;
#ifdef VL
        const vf vinv = v_set1(inv);
        for (; i + VL <= dim; i += VL) {
            const vf y = v_dt_round(v_mul(v_dt_load(s, r0 + i, dtype), vinv), dtype);
            v_dt_store(out, r0 + i, v_mul(v_dt_load(w, i, dtype), y), dtype);
        }
#endif
        for (; i < dim; i++)
            dt_store(out, r0 + i, dt_load(w, i, dtype) * dt_round(dt_load(s, r0 + i, dtype) * inv, dtype),
                     dtype);
    }
}

void sidecar_add_bias(void* y, const void* b, int rows, int n, int dtype) {
    for (int t = 0; t < rows; t++) {
        const size_t r0 = (size_t)t * n;
        int i = 0;
#ifdef VL
        for (; i + VL <= n; i += VL)
            v_dt_store(y, r0 + i, v_add(v_dt_load(y, r0 + i, dtype), v_dt_load(b, i, dtype)), dtype);
#endif
        for (; i < n; i++) dt_store(y, r0 + i, dt_load(y, r0 + i, dtype) + dt_load(b, i, dtype), dtype);
    }
}

/* The arguments of sidecar_rms_norm_heads (mirrored by ``RmsNormHeadsArgs``). */
typedef struct {
    void* x;
    const void* w;
    int tokens;
    int heads;
    int dim;
    int ld;
    float eps;
    int dtype;
    int nthreads;
} sidecar_rms_norm_heads_args;
int sidecar_rms_norm_heads_args_size(void) {
    return (int)sizeof(sidecar_rms_norm_heads_args);
}

/* Each row is read whole (the sum of squares) before any of it is written, and then written where it is read,
 * element by element: in place is safe. Rounds as sidecar_add_rms_norm without a delta. */
void sidecar_rms_norm_heads(const sidecar_rms_norm_heads_args* a) {
    void* x = a->x;
    const void* w = a->w;
    const int heads = a->heads, dim = a->dim, dtype = a->dtype;
    const int n = a->tokens * heads;
#pragma omp parallel for num_threads(a->nthreads) schedule(static) if ((size_t)n * dim >= PARALLEL_FROM)
    for (int r = 0; r < n; r++) {
        const size_t r0 = (size_t)(r / heads) * a->ld + (size_t)(r % heads) * dim;
        float ss = 0.0f;
        int i = 0;
#ifdef VL
        vf acc = v_zero();
        for (; i + VL <= dim; i += VL) {
            const vf v = v_dt_load(x, r0 + i, dtype);
            acc = v_fma(v, v, acc);
        }
        ss = v_sum(acc);
#endif
        for (; i < dim; i++) {
            const float v = dt_load(x, r0 + i, dtype);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + a->eps);
        i = 0;
#ifdef VL
        const vf vinv = v_set1(inv);
        for (; i + VL <= dim; i += VL) {
            const vf y = v_dt_round(v_mul(v_dt_load(x, r0 + i, dtype), vinv), dtype);
            v_dt_store(x, r0 + i, v_mul(v_dt_load(w, i, dtype), y), dtype);
        }
#endif
        for (; i < dim; i++)
            dt_store(x, r0 + i, dt_load(w, i, dtype) * dt_round(dt_load(x, r0 + i, dtype) * inv, dtype),
                     dtype);
    }
}
