/* The parts of paged_attention.c that read keys and make weights: the cache element modes and loads, the
 * read-ahead, where a context's keys live, their scores for a task's queries and each query's softmax. A
 * row's scores and weights are the same float32 operations wherever its keys fall in a pass, which is what
 * lets rows of one sequence share one (paged_attention.c's header). */
#ifndef SIDECAR_PAGED_ATTENTION_KEYS_H
#define SIDECAR_PAGED_ATTENTION_KEYS_H

#include "vec.h"

#define MAX_REP 64
#define MAX_HD  256
#define KV_INT8 2 /* kv element mode beside dtype 0 / 1: int8 codes with scales */

/* Element i of a KV cache as float32: float32, bf16 or int8 codes (the scale is applied by the caller). */
static inline float kv_load(const void* p, size_t i, int kvm) {
    return kvm == KV_INT8 ? (float)((const int8_t*)p)[i] : dt_load(p, i, kvm);
}

/* Keys are read this many ahead into L1, with each key's value as the key is scored: a head's rows are
 * strided within a block and the blocks scattered, which the hardware's prefetchers follow poorly. */
#define READ_AHEAD_KEYS 16

/* Element offset `off`'s hd elements of a cache, toward L1. */
static inline void prefetch_row(const void* cache, size_t off, int hd, int kvm) {
    const int es = kvm == KV_INT8 ? 1 : kvm ? 2 : 4;
    const char* p = (const char*)cache + off * es;
    for (int l = 0; l < hd * es; l += 64) __builtin_prefetch(p + l, 0, 3);
}

/* Whether a head's values over n keys outgrow what the caches keep between the scores and the values (a
 * quarter of a MiB): the values are then summed in chunks (paged_attention.c's sum_values) and not fetched as
 * their keys are scored, which would only have them evicted again before they are used. AVX2 builds only: the
 * AVX-512 ones keep their passes over the whole context (their accumulators fit their registers, and the
 * chunks have been timed on AVX2 machines alone). */
static inline int long_values(int n, int hd, int kvm) {
#if defined(VL) && VL == 8
    const int es = kvm == KV_INT8 ? 1 : kvm ? 2 : 4;
    return (int64_t)n * hd * es > (256 << 10);
#else
    (void)n, (void)hd, (void)kvm;
    return 0;
#endif
}

/* As keys j..j+3 (of n) are scored: the keys READ_AHEAD_KEYS on, and (values: 1) these keys' values, toward
 * L1. */
static inline void read_ahead(const void* kc, const void* vc, const size_t* offs, int j, int n, int hd,
                              int kvm, int values) {
    for (int i = j; i < j + 4 && i < n; i++) {
        if (i + READ_AHEAD_KEYS < n) prefetch_row(kc, offs[i + READ_AHEAD_KEYS], hd, kvm);
        if (values) prefetch_row(vc, offs[i], hd, kvm);
    }
}

#ifdef VL
static inline vf v_kv_load(const char* p, size_t i, int kvm) {
    if (kvm == KV_INT8) return v_load_i8((const int8_t*)p + i);
    return kvm ? v_load_bf16((const uint16_t*)p + i) : v_load((const float*)p + i);
}
#endif

/* Whether the scores take bf16 keys and queries as they are (vdpbf16ps, score_keys's first branch); the
 * float32 copy of the queries is then not made. */
static inline int bf16_scores(int kvm, int hd) {
#if defined(__AVX512BF16__) && VL == 16
    return kvm == 1 && hd % 32 == 0;
#else
    (void)kvm, (void)hd;
    return 0;
#endif
}

/* offs[j] = where context position lo + j (j < hi - lo) of KV head g lives, through `table` block by block
 * (no division per key); row: elements per slot. */
static inline void key_offsets(size_t* offs, const int64_t* table, int lo, int hi, int bs, size_t row, int g,
                               int hd) {
    const int n = hi - lo;
    for (int j = 0, p = lo; j < n;) {
        const size_t base = ((size_t)table[p / bs] * bs) * row + (size_t)g * hd;
        for (int slot = p % bs; slot < bs && j < n; slot++, j++, p++) offs[j] = base + (size_t)slot * row;
    }
}

/* s[r * ld + j] = query r's (of nq) score against the key at offs[j] (j < n), four keys at a time: each key
 * is loaded (and widened) once for all nq queries, and the four dot products are reduced together; a key's
 * score is the same arithmetic wherever it falls and whichever queries share the pass. qf: the queries in
 * float32, already scaled (unless bf16_scores: then qb, the bf16 queries as they came, and the scale
 * multiplies the finished dot product). values: the keys' values are fetched as they are scored (read_ahead).
 */
static inline __attribute__((always_inline)) void score_keys(const float* qf, const uint16_t* qb,
                                                             const char* kc, const char* vc,
                                                             const size_t* offs, int n, int nq, int hd,
                                                             int kvm, const float* ks, float scale, float* s,
                                                             size_t ld, int values) {
    (void)qb, (void)scale, (void)vc, (void)values;
#if defined(__AVX512BF16__) && VL == 16
    if (bf16_scores(kvm, hd)) {
        /* bf16 keys and queries: pairs of exact products summed in float32 lanes (vdpbf16ps), no widening */
        for (int j = 0; j < n; j += 4) {
            read_ahead(kc, vc, offs, j, n, hd, kvm, values);
            __m512bh k4[4][MAX_HD / 32];
            for (int i = 0; i < 4; i++) {
                const uint16_t* key = (const uint16_t*)kc + (j + i < n ? offs[j + i] : 0);
                for (int c = 0; c < hd / 32; c++)
                    k4[i][c] = (__m512bh)(j + i < n ? _mm512_loadu_si512((const void*)(key + c * 32))
                                                    : _mm512_setzero_si512());
            }
            for (int r = 0; r < nq; r++) {
                vf a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
                for (int c = 0; c < hd / 32; c++) {
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512((const void*)(qb + r * hd + c * 32));
                    a0 = _mm512_dpbf16_ps(a0, k4[0][c], qv);
                    a1 = _mm512_dpbf16_ps(a1, k4[1][c], qv);
                    a2 = _mm512_dpbf16_ps(a2, k4[2][c], qv);
                    a3 = _mm512_dpbf16_ps(a3, k4[3][c], qv);
                }
                float sums[4];
                v_sum4(a0, a1, a2, a3, sums);
                for (int i = 0; i < 4 && j + i < n; i++) s[(size_t)r * ld + j + i] = sums[i] * scale;
            }
        }
        return;
    }
#endif
#ifdef VL
    for (int j = 0; j < n; j += 4) {
        read_ahead(kc, vc, offs, j, n, hd, kvm, values);
        vf k4[4][MAX_HD / VL];
        for (int i = 0; i < 4; i++) {
            if (j + i >= n) {
                for (int c = 0; c < hd / VL; c++) k4[i][c] = v_zero();
                continue;
            }
            const size_t off = offs[j + i];
            for (int c = 0; c < hd / VL; c++) k4[i][c] = v_kv_load(kc, off + c * VL, kvm);
        }
        for (int r = 0; r < nq; r++) {
            vf a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
            for (int c = 0; c < hd / VL; c++) {
                const vf qv = v_load(qf + r * hd + c * VL);
                a0 = v_fma(qv, k4[0][c], a0);
                a1 = v_fma(qv, k4[1][c], a1);
                a2 = v_fma(qv, k4[2][c], a2);
                a3 = v_fma(qv, k4[3][c], a3);
            }
            float sums[4];
            v_sum4(a0, a1, a2, a3, sums);
            for (int i = 0; i < 4 && j + i < n; i++)
                s[(size_t)r * ld + j + i] = ks ? sums[i] * ks[offs[j + i] / hd] : sums[i];
        }
    }
#else
    for (int j = 0; j < n; j++) {
        const size_t off = offs[j];
        for (int r = 0; r < nq; r++) {
            float acc = 0.f;
            for (int d = 0; d < hd; d++) acc += qf[r * hd + d] * kv_load(kc, off + d, kvm);
            s[(size_t)r * ld + j] = ks ? acc * ks[off / hd] : acc;
        }
    }
#endif
}

/* One query's scores sr[0..n) (keys at offs) made its softmax weights in place: capped (cap > 0), the sink
 * logit *sink (sink not NULL) in the maximum and the normaliser, exp in float32 with a vectorised exp; wsum
 * (not NULL) takes each key's normalised weight, then a value's scale (vs not NULL) joins its weight. Returns
 * 1 / the normaliser. */
static inline __attribute__((always_inline)) float weigh(float* sr, int n, float cap, const float* sink,
                                                         float* wsum, const float* vs, const size_t* offs,
                                                         int hd) {
    if (cap > 0.f) softcap_row(sr, n, 1.0f / cap, cap); /* the scaled scores, capped */
    float m = row_max(sr, n);
    if (sink && *sink > m) m = *sink; /* this head's sink logit joins the softmax */
    float total = 0.f;
    int j = 0;
#ifdef VL
    const vf vm = v_set1(m);
    vf vt = v_zero();
    for (; j + VL <= n; j += VL) {
        vf e = v_exp(v_sub(v_load(sr + j), vm));
        v_store(sr + j, e);
        vt = v_add(vt, e);
    }
    total = v_sum(vt);
    if (j < n) { /* the tail through the same vector exp, padded with lanes it discards */
        float tmp[VL];
        for (int i = 0; i < VL; i++) tmp[i] = j + i < n ? sr[j + i] - m : -87.f;
        v_store(tmp, v_exp(v_load(tmp)));
        for (; j < n; j++) {
            sr[j] = tmp[j % VL];
            total += sr[j];
        }
    }
#else
    for (; j < n; j++) {
        sr[j] = expf(sr[j] - m);
        total += sr[j];
    }
#endif
    if (sink) total += expf(*sink - m);
    const float inv = 1.0f / total;
    if (wsum) /* the weights each key received, before a value's scale joins them */
        for (j = 0; j < n; j++) wsum[j] += sr[j] * inv;
    /* a value's scale joins its weight (after the normaliser was summed from the unscaled weights) */
    if (vs)
        for (j = 0; j < n; j++) sr[j] *= vs[offs[j] / hd];
    return inv;
}
#endif
