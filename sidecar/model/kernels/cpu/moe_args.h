/* The argument struct of the grouped expert entry points (int8_gemv.c, int4_gemv.c, bf16_gemv.c), mirrored by
 * ``moe_experts.MoeArgs``, and the steps they share around their products.
 *
 * A sparse block's routed sum for T rows of k experts each: slot s = t * k + j runs expert ids[s] on row t,
 *   gu[s]  = x[t] @ gate_up[e].T                 rounded to x's dtype (the layer's output)
 *   act[s] = silu(gu[s, :I]) * gu[s, I:]          as norm_act.c's silu_mul computes it, in x's dtype
 *   out[s] = act[s] @ down[e].T                   rounded to x's dtype
 *   y[t]   = sum_j round(out[t * k + j] * w[t * k + j])   in x's dtype, j ascending, each add rounded
 * which is moe.py's reference order (the slots' products, then one add at a time in x's dtype). */
#ifndef SIDECAR_MOE_ARGS_H
#define SIDECAR_MOE_ARGS_H

#include <stdint.h>

typedef struct {
    const void* x;          /* [T, H] rows, bf16 where x_bf16 else float32 */
    const int64_t* ids;     /* [T, k] each row's experts */
    const void* weights;    /* [T, k] routing weights, bf16 where weights_bf16 else float32 */
    const int64_t* gate_up; /* [E] addresses of the experts' gate/up weights ([2 I, H], gate rows first) */
    const int64_t* gate_up_scales; /* [E] addresses of their scales (the kernel's layout; bf16: unused) */
    const int64_t* down;           /* [E] addresses of the down weights ([H, I]) */
    const int64_t* down_scales;    /* [E] addresses of their scales */
    void* y;                       /* [T, H] the routed sum, x's dtype */
    int T, k, E, H, I;
    int nthreads;
    int x_bf16;       /* 1: x, the products and y are bf16 (else float32) */
    int weights_bf16; /* 1: weights are bf16 (else float32) */
    int group_size;   /* int4: values a scale covers */
    int block_n;      /* int4: rows a block of torch's packed layout holds (32 or 64) */
    int split;        /* int4: 1 where a block's nibbles split low rows / high rows */
    int tiled;        /* bf16: 1 where the weights are in bf16_gemv's tiled layout (else plain rows) */
} sidecar_moe_args;

int sidecar_moe_args_size(void) {
    return (int)sizeof(sidecar_moe_args);
}

/* 0 when every id names an expert, else 1 (nothing is computed then). */
static int moe_ids_ok(const sidecar_moe_args* a) {
    for (int s = 0; s < a->T * a->k; s++)
        if (a->ids[s] < 0 || a->ids[s] >= a->E) return 1;
    return 0;
}

/* act = silu(gu[:I]) * gu[I:] for one slot, in the dtype (0 float32, 1 bf16): the same vector and scalar
 * steps, over the same columns, as sidecar_silu_mul, so the bits are its. */
static void moe_silu_row(const void* gu, void* act, int inter, int dtype) {
    int i = 0;
#ifdef VL
    for (; i + VL <= inter; i += VL) {
        const vf s = v_dt_round(vsilu(v_dt_load(gu, i, dtype)), dtype);
        v_dt_store(act, i, v_mul(s, v_dt_load(gu, (size_t)inter + i, dtype)), dtype);
    }
#endif
    for (; i < inter; i++) {
        const float s = dt_round(silu1(dt_load(gu, i, dtype)), dtype);
        dt_store(act, i, s * dt_load(gu, (size_t)inter + i, dtype), dtype);
    }
}

/* y[t, h0:h1] = the weighted sum of row t's slots out [T * k, H] (x's dtype), in moe.py's order: vectors of
 * columns make the same float operations per column as the scalar loop (products and adds, each rounded to
 * the dtype), so the bits are its. */
static void moe_weighted_sum(const sidecar_moe_args* a, const void* out, int t, int h0, int h1) {
    const int dt = a->x_bf16, k = a->k;
    int h = h0;
#ifdef VL
    for (; h + VL <= h1; h += VL) {
        vf acc = v_zero();
        for (int j = 0; j < k; j++) {
            const int64_t s = (int64_t)t * k + j;
            const vf w = v_set1(dt_load(a->weights, s, a->weights_bf16));
            const vf v = v_dt_round(v_mul(v_dt_load(out, s * a->H + h, dt), w), dt);
            acc = j ? v_dt_round(v_add(acc, v), dt) : v;
        }
        v_dt_store(a->y, (int64_t)t * a->H + h, acc, dt);
    }
#endif
    for (; h < h1; h++) {
        float acc = 0.f;
        for (int j = 0; j < k; j++) {
            const int64_t s = (int64_t)t * k + j;
            const float w = dt_load(a->weights, s, a->weights_bf16);
            const float v = dt_round(dt_load(out, s * a->H + h, dt) * w, dt);
            acc = j ? dt_round(acc + v, dt) : v;
        }
        dt_store(a->y, (int64_t)t * a->H + h, acc, dt);
    }
}

#endif
