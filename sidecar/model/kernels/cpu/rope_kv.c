/* Rotary embedding of q and k straight out of the fused qkv projection, and the new K/V written into the
 * paged cache, in one pass (float32: dtype 0, bf16: dtype 1):
 *
 *   q_out[t, h]          = rope(q[t, h])                 for the nh query heads
 *   k_cache[slots[t], g] = rope(k[t, g]), v_cache[slots[t], g] = v[t, g]   for the nkv KV heads
 *   k_out[t, g]          = rope(k[t, g])                 when k_out is given (prompt rows attend to it)
 *
 * where qkv rows are [q heads | k heads | v heads] of hd values each, and over a head's first rot channels
 * (rot = hd, or fewer: partial rotary, the rest passing through unchanged)
 *   rope(x)[i] = x[i] * cos[t, i] + x[(i + rot/2) % rot] * sin[t, i]     (cos, sin: [T, rot])
 * with rotate-half's sign already folded into sin (its first half negated), as the model's torch path
 * computes it: each product rounded to the dtype, then the sum (no fused multiply-add: built with
 * -ffp-contract=off), so the results are bit for bit the torch path's.
 *
 * Quantized cache (ks, vs not NULL): kc / vc hold int8 codes and ks / vs ([slots, nkv] float32) a scale per
 * token and KV head. Each K row (after rope, rounded to the dtype) and V row is stored as
 *   s = max|x| / 127 (1 when that is not > 0),  code = round_half_even(x / s) clamped to [-127, 127],
 * the same float32 operations as kv_quant.quantize, so the codes and scales are the torch path's bit for bit.
 */
#include <stdlib.h>

#include "vec.h"

/* One head: x at src[0..hd), written to dst (and dst2 when not NULL); its first rot channels rotated. */
static inline void rope_head(const void* src, size_t s0, const void* cs, const void* sn, size_t c0, void* dst,
                             size_t d0, void* dst2, size_t e0, int hd, int rot, int dtype) {
    const int half = rot / 2;
    /* past the rotary channels: copied (a dtype value round-trips exactly) */
    for (int c = rot; c < hd; c++) {
        const float x = dt_load(src, s0 + c, dtype);
        dt_store(dst, d0 + c, x, dtype);
        if (dst2) dt_store(dst2, e0 + c, x, dtype);
    }
    int i = 0;
#ifdef VL
    if (half % VL == 0) {
        for (; i < half; i += VL) {
            const vf lo = v_dt_load(src, s0 + i, dtype), hi = v_dt_load(src, s0 + half + i, dtype);
            const vf lo_c = v_dt_round(v_mul(lo, v_dt_load(cs, c0 + i, dtype)), dtype);
            const vf hi_s = v_dt_round(v_mul(hi, v_dt_load(sn, c0 + i, dtype)), dtype);
            const vf hi_c = v_dt_round(v_mul(hi, v_dt_load(cs, c0 + half + i, dtype)), dtype);
            const vf lo_s = v_dt_round(v_mul(lo, v_dt_load(sn, c0 + half + i, dtype)), dtype);
            const vf out_lo = v_dt_round(v_add(lo_c, hi_s), dtype),
                     out_hi = v_dt_round(v_add(hi_c, lo_s), dtype);
            v_dt_store(dst, d0 + i, out_lo, dtype);
            v_dt_store(dst, d0 + half + i, out_hi, dtype);
            if (dst2) {
                v_dt_store(dst2, e0 + i, out_lo, dtype);
                v_dt_store(dst2, e0 + half + i, out_hi, dtype);
            }
        }
        return;
    }
#endif
    for (; i < rot; i++) {
        const int j = i < half ? i + half : i - half;
        const float a = dt_round(dt_load(src, s0 + i, dtype) * dt_load(cs, c0 + i, dtype), dtype);
        const float b = dt_round(dt_load(src, s0 + j, dtype) * dt_load(sn, c0 + i, dtype), dtype);
        dt_store(dst, d0 + i, a + b, dtype);
        if (dst2) dt_store(dst2, e0 + i, a + b, dtype);
    }
}

/* One row of hd values (src, dtype) -> int8 codes at dst and its scale at *scale. */
static inline void quantize_row(const void* src, size_t s0, int dtype, int8_t* dst, float* scale, int hd) {
    float amax = 0.f;
    for (int i = 0; i < hd; i++) {
        const float a = fabsf(dt_load(src, s0 + i, dtype));
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f;
    if (!(s > 0.f)) s = 1.0f;
    for (int i = 0; i < hd; i++) {
        float c = nearbyintf(dt_load(src, s0 + i, dtype) / s);
        c = c > 127.f ? 127.f : (c < -127.f ? -127.f : c);
        dst[i] = (int8_t)c;
    }
    *scale = s;
}

/* The arguments of sidecar_rope_store_kv (mirrored by ``RopeKvArgs``). */
typedef struct {
    const void* qkv;
    const void* cs;
    const void* sn;
    const int64_t* slots;
    void* kc;
    void* vc;
    void* q_out;
    void* k_out;
    float* ks;
    float* vs;
    int T;
    int nh;
    int nkv;
    int hd;
    int dtype;
    int nthreads;
    int rot; /* rotary channels of a head (even, <= hd) */
} sidecar_rope_kv_args;
int sidecar_rope_kv_args_size(void) {
    return (int)sizeof(sidecar_rope_kv_args);
}

void sidecar_rope_store_kv(const sidecar_rope_kv_args* a) {
    const void* qkv = a->qkv;
    const void* cs = a->cs;
    const void* sn = a->sn;
    const int64_t* slots = a->slots;
    void* kc = a->kc;
    void* vc = a->vc;
    void* q_out = a->q_out;
    void* k_out = a->k_out;
    int T = a->T;
    int nh = a->nh;
    int nkv = a->nkv;
    int hd = a->hd;
    int dtype = a->dtype;
    int nthreads = a->nthreads;
    float* ks = a->ks;
    float* vs = a->vs;
    const int rot = a->rot;
    const size_t row = (size_t)(nh + 2 * nkv) * hd, kv_row = (size_t)nkv * hd;
    const size_t esize = dtype ? 2 : 4;
/* split between the threads from ~15 tokens of a 1,152-wide qkv row: a decode step of many rows no longer
 * leaves a core waiting */
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((size_t)T * row >= 16384)
    for (int t = 0; t < T; t++) {
        const size_t r0 = (size_t)t * row, c0 = (size_t)t * rot, slot = (size_t)slots[t] * kv_row;
        for (int h = 0; h < nh; h++)
            rope_head(qkv, r0 + (size_t)h * hd, cs, sn, c0, q_out, ((size_t)t * nh + h) * hd, NULL, 0, hd,
                      rot, dtype);
        if (ks) { /* quantized cache: rope(k) through a row buffer in the dtype, then codes and scales */
            float buf[512]; /* hd <= 256 values of the dtype (the wrapper checks) */
            const size_t srow = (size_t)slots[t] * nkv;
            for (int g = 0; g < nkv; g++) {
                rope_head(qkv, r0 + (size_t)(nh + g) * hd, cs, sn, c0, buf, 0, k_out,
                          (size_t)t * kv_row + (size_t)g * hd, hd, rot, dtype);
                quantize_row(buf, 0, dtype, (int8_t*)kc + slot + (size_t)g * hd, ks + srow + g, hd);
                quantize_row(qkv, r0 + (size_t)(nh + nkv + g) * hd, dtype,
                             (int8_t*)vc + slot + (size_t)g * hd, vs + srow + g, hd);
            }
            continue;
        }
        for (int g = 0; g < nkv; g++)
            rope_head(qkv, r0 + (size_t)(nh + g) * hd, cs, sn, c0, kc, slot + (size_t)g * hd, k_out,
                      (size_t)t * kv_row + (size_t)g * hd, hd, rot, dtype);
        memcpy((char*)vc + slot * esize, (const char*)qkv + (r0 + (size_t)(nh + nkv) * hd) * esize,
               kv_row * esize);
    }
}
