/* Rotary embedding of q and k straight out of the fused qkv projection, and the new K/V written into the
 * paged cache, in one pass (float32: dtype 0, bf16: dtype 1):
 *
 *   q_out[t, h]          = rope(q[t, h])                 for the nh query heads
 *   k_cache[slots[t], g] = rope(k[t, g]), v_cache[slots[t], g] = v[t, g]   for the nkv KV heads
 *   k_out[t, g]          = rope(k[t, g])                 when k_out is given (prompt rows attend to it)
 *
 * where qkv rows are [q heads | k heads | v heads] of hd values each, and
 *   rope(x)[i] = x[i] * cos[t, i] + x[(i + hd/2) % hd] * sin[t, i]
 * with rotate-half's sign already folded into sin (its first half negated), as the model's torch path
 * computes it: each product rounded to the dtype, then the sum (no fused multiply-add: built with
 * -ffp-contract=off), so the results are bit for bit the torch path's.
 */
#include <stdlib.h>

#include "vec.h"

static inline float ld(const void* p, size_t i, int dtype) {
    return dtype ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline float rnd(float x, int dtype) { return dtype ? bf16_to_f32(f32_to_bf16(x)) : x; }

static inline void st(void* p, size_t i, float x, int dtype) {
    if (dtype) ((uint16_t*)p)[i] = f32_to_bf16(x);
    else ((float*)p)[i] = x;
}

#ifdef VL
static inline vf vld(const void* p, size_t i, int dtype) {
    return dtype ? v_load_bf16((const uint16_t*)p + i) : v_load((const float*)p + i);
}

static inline vf vrnd(vf x, int dtype) { return dtype ? v_round_bf16(x) : x; }

static inline void vst(void* p, size_t i, vf x, int dtype) {
    if (dtype) v_store_bf16((uint16_t*)p + i, x);
    else v_store((float*)p + i, x);
}
#endif

/* One head: x at src[0..hd), written to dst (and dst2 when not NULL). */
static inline void rope_head(const void* src, size_t s0, const void* cs, const void* sn, size_t c0, void* dst,
                             size_t d0, void* dst2, size_t e0, int hd, int dtype) {
    const int half = hd / 2;
    int i = 0;
#ifdef VL
    if (half % VL == 0) {
        for (; i < half; i += VL) {
            const vf lo = vld(src, s0 + i, dtype), hi = vld(src, s0 + half + i, dtype);
            const vf out_lo = vrnd(v_add(vrnd(v_mul(lo, vld(cs, c0 + i, dtype)), dtype),
                                         vrnd(v_mul(hi, vld(sn, c0 + i, dtype)), dtype)), dtype);
            const vf out_hi = vrnd(v_add(vrnd(v_mul(hi, vld(cs, c0 + half + i, dtype)), dtype),
                                         vrnd(v_mul(lo, vld(sn, c0 + half + i, dtype)), dtype)), dtype);
            vst(dst, d0 + i, out_lo, dtype);
            vst(dst, d0 + half + i, out_hi, dtype);
            if (dst2) {
                vst(dst2, e0 + i, out_lo, dtype);
                vst(dst2, e0 + half + i, out_hi, dtype);
            }
        }
        return;
    }
#endif
    for (; i < hd; i++) {
        const int j = i < half ? i + half : i - half;
        const float a = rnd(ld(src, s0 + i, dtype) * ld(cs, c0 + i, dtype), dtype);
        const float b = rnd(ld(src, s0 + j, dtype) * ld(sn, c0 + i, dtype), dtype);
        st(dst, d0 + i, a + b, dtype);
        if (dst2) st(dst2, e0 + i, a + b, dtype);
    }
}

void sidecar_rope_store_kv(const void* qkv, const void* cs, const void* sn, const int64_t* slots, void* kc,
                           void* vc, void* q_out, void* k_out, int T, int nh, int nkv, int hd, int dtype,
                           int nthreads) {
    const size_t row = (size_t)(nh + 2 * nkv) * hd, kv_row = (size_t)nkv * hd;
    const size_t esize = dtype ? 2 : 4;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((size_t)T * row >= 65536)
    for (int t = 0; t < T; t++) {
        const size_t r0 = (size_t)t * row, c0 = (size_t)t * hd, slot = (size_t)slots[t] * kv_row;
        for (int h = 0; h < nh; h++)
            rope_head(qkv, r0 + (size_t)h * hd, cs, sn, c0, q_out, ((size_t)t * nh + h) * hd, NULL, 0, hd, dtype);
        for (int g = 0; g < nkv; g++)
            rope_head(qkv, r0 + (size_t)(nh + g) * hd, cs, sn, c0, kc, slot + (size_t)g * hd, k_out,
                      (size_t)t * kv_row + (size_t)g * hd, hd, dtype);
        memcpy((char*)vc + slot * esize, (const char*)qkv + (r0 + (size_t)(nh + nkv) * hd) * esize, kv_row * esize);
    }
}
