/* Paged decode attention on CPU: one query row per sequence position, reading K/V straight from the
 * paged cache (no gather into a contiguous copy, no mask tensor).
 *
 *   out[b, h, :] = softmax_j(scale * q[b, h, :] . K[j, h / rep, :]) V[j, h / rep, :],  lo_b <= j < ctx_b
 *
 * where position j of row b lives in slot tables[b, j / bs] * bs + j % bs of the cache
 * ([num_blocks, bs, nkv, hd]), rep = nh / nkv query heads share a KV head (grouped-query attention),
 * and lo_b = max(0, ctx_b - window) with a sliding window (window <= 0: none). With soft-capping (softcap >
 * 0, Gemma 2) each scaled score x becomes softcap * tanh(x / softcap) before the softmax. With sinks (not
 * NULL: [nh] float32, gpt-oss) head h's logit sinks[h] joins each of its softmaxes' denominators and weighs
 * no value: the maximum is taken over the scores and the sink, and exp(sink - max) adds to the normaliser.
 *
 * Every (row, KV head) pair is one task: its rep queries are scored against the keys in one pass
 * (each key loaded once for all of them; bf16 keys and queries as pairs of exact products summed in
 * float32 lanes by vdpbf16ps where the CPU has AVX-512 BF16, the scale applied to the finished dot
 * product), softmax in float32 with a vectorised exp, then the values are summed in float32: with
 * grouped queries (4 or more per KV head) each value is loaded once for up to QG of them, keys in order.
 * A row's result depends only on its own query and context, never on
 * which other rows share the call, so verifying k speculative tokens in one call gives bit for bit what
 * k separate decode steps give. Inputs and output are float32 (dtype 0) or bfloat16 (dtype 1; products
 * and sums still in float32, the output rounded to nearest even).
 *
 * Quantized cache (ks, vs not NULL): K/V hold int8 codes and ks/vs ([num_blocks, bs, nkv] float32) one scale
 * per token and KV head, K[j] = kq[j] * ks[j]. The codes are widened to float32 in registers; a key's scale
 * multiplies its finished dot product and a value's scale its softmax weight, so no dequantized copy exists.
 *
 * Scores (scores not NULL: [num_blocks * bs] float32, one per cache slot): each key's softmax weights, summed
 * over the rep queries of a task, are added to its slot, so a slot accumulates the attention its token
 * receives (scored KV eviction). Each task sums into a part of its own; the parts are added to the slots
 * once every task is done, by one thread, row by row and KV head by KV head: the same sums in the same
 * order on every call (rows sharing blocks -- beams, verification rows -- add to the same slots), so a
 * step and its replay leave the same bits.
 */
#include <stdlib.h>

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

/* As keys j..j+3 (of n) are scored: the keys READ_AHEAD_KEYS on, and these keys' values, toward L1. */
static inline void read_ahead(const void* kc, const void* vc, const size_t* offs, int j, int n, int hd,
                              int kvm) {
    for (int i = j; i < j + 4 && i < n; i++) {
        if (i + READ_AHEAD_KEYS < n) prefetch_row(kc, offs[i + READ_AHEAD_KEYS], hd, kvm);
        prefetch_row(vc, offs[i], hd, kvm);
    }
}

#ifdef VL
static inline vf v_kv_load(const char* p, size_t i, int kvm) {
    if (kvm == KV_INT8) return v_load_i8((const int8_t*)p + i);
    return kvm ? v_load_bf16((const uint16_t*)p + i) : v_load((const float*)p + i);
}
#endif

/* x[0..n) = cap * tanh(x * in) in place, as the kernel caps its scores (softcap_row; exported for its
 * tests). */
void sidecar_softcap_rows(float* x, int n, float in, float cap) {
    softcap_row(x, n, in, cap);
}

int sidecar_paged_attention_vector_width(void) {
#ifdef VL
    return VL;
#else
    return 1;
#endif
}

#ifdef VL
/* Queries a grouped pass over the values holds: 8 x 2 vectors of sums on AVX-512 (16 of 32 registers), 4 x 2
 * on AVX2 */
#define QG (VL == 16 ? 8 : 4)
/* From this many queries per KV head on (grouped-query attention), each value is loaded once per pass for all
 * of them instead of once per query; fewer queries keep the per-query loop, whose two chains per vector keep
 * the FMAs busy. */
#define GROUPED_VALUES 4
/* o[r][d0 .. d0 + nv * VL) = inv[r] * sum_j s[r][j] V[j][d0 ..] for R queries: keys in order, one sum per
 * lane. */
static inline __attribute__((always_inline)) void values_pass(const float* s, int n, const int R,
                                                              const int nv, const char* vc,
                                                              const size_t* offs, int d0, int kvm,
                                                              const float* inv, float* o, int hd) {
    vf acc[QG][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = v_zero();
    for (int j = 0; j < n; j++) {
        const size_t off = offs[j] + d0;
        const vf v0 = v_kv_load(vc, off, kvm);
        const vf v1 = nv > 1 ? v_kv_load(vc, off + VL, kvm) : v0;
        for (int r = 0; r < R; r++) {
            const vf w = v_set1(s[(size_t)r * n + j]);
            acc[r][0] = v_fma(w, v0, acc[r][0]);
            if (nv > 1) acc[r][1] = v_fma(w, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nv; c++)
            v_store(o + (size_t)r * hd + d0 + c * VL, v_mul(acc[r][c], v_set1(inv[r])));
}

static void values_dispatch(const float* s, int n, int R, int nv, const char* vc, const size_t* offs, int d0,
                            int kvm, const float* inv, float* o, int hd) {
#define VP(RR)                                                       \
    case RR:                                                         \
        if (nv > 1)                                                  \
            values_pass(s, n, RR, 2, vc, offs, d0, kvm, inv, o, hd); \
        else                                                         \
            values_pass(s, n, RR, 1, vc, offs, d0, kvm, inv, o, hd); \
        return;
    switch (R) {
        VP(1)
        VP(2)
        VP(3)
        VP(4)
#if VL == 16
        VP(5)
        VP(6)
        VP(7)
        VP(8)
#endif
    }
#undef VP
}
#endif

/* Whether the scores take bf16 keys and queries as they are (vdpbf16ps, attend's first branch); the float32
 * copy of the queries is then not made. */
static inline int bf16_scores(int kvm, int hd) {
#if defined(__AVX512BF16__) && VL == 16
    return kvm == 1 && hd % 32 == 0;
#else
    (void)kvm, (void)hd;
    return 0;
#endif
}

/* One (row, KV head) task. qf: the rep queries in float32, already scaled (unless bf16_scores); s: scratch
 * [rep][n]; of: [rep][hd]. Inlined per head size, so the common ones (64, 128) run with the vector count
 * known. */
static inline __attribute__((always_inline)) void attend(const float* qf, const char* kc, const char* vc,
                                                         const int64_t* table, int lo, int hi, int rep,
                                                         int nkv, int g, int hd, int bs, int kvm, float* s,
                                                         float* of, size_t* offs, const float* ks,
                                                         const float* vs, const uint16_t* qb, float scale,
                                                         float cap, float* wsum, const float* sk) {
    const int n = hi - lo;
    const size_t row = (size_t)nkv * hd; /* elements per slot */
    float invs[MAX_REP];                 /* each query's 1 / softmax normaliser */
    /* where each key of the context lives, block by block (no division per key) */
    for (int j = 0, p = lo; j < n;) {
        const size_t base = ((size_t)table[p / bs] * bs) * row + (size_t)g * hd;
        for (int slot = p % bs; slot < bs && j < n; slot++, j++, p++) offs[j] = base + (size_t)slot * row;
    }
    /* scores, four keys at a time: each key is loaded (and widened) once for all rep queries, and the
     * four dot products are reduced together; a key's score is the same arithmetic wherever it falls */
#if defined(__AVX512BF16__) && VL == 16
    if (bf16_scores(kvm, hd)) {
        /* bf16 keys and queries: pairs of exact products summed in float32 lanes (vdpbf16ps), no widening;
         * the scale multiplies the finished dot product */
        for (int j = 0; j < n; j += 4) {
            read_ahead(kc, vc, offs, j, n, hd, kvm);
            __m512bh k4[4][MAX_HD / 32];
            for (int i = 0; i < 4; i++) {
                const uint16_t* key = (const uint16_t*)kc + (j + i < n ? offs[j + i] : 0);
                for (int c = 0; c < hd / 32; c++)
                    k4[i][c] = (__m512bh)(j + i < n ? _mm512_loadu_si512((const void*)(key + c * 32))
                                                    : _mm512_setzero_si512());
            }
            for (int r = 0; r < rep; r++) {
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
                for (int i = 0; i < 4 && j + i < n; i++) s[(size_t)r * n + j + i] = sums[i] * scale;
            }
        }
    } else
#endif
#ifdef VL
        for (int j = 0; j < n; j += 4) {
            read_ahead(kc, vc, offs, j, n, hd, kvm);
            vf k4[4][MAX_HD / VL];
            for (int i = 0; i < 4; i++) {
                if (j + i >= n) {
                    for (int c = 0; c < hd / VL; c++) k4[i][c] = v_zero();
                    continue;
                }
                const size_t off = offs[j + i];
                for (int c = 0; c < hd / VL; c++) k4[i][c] = v_kv_load(kc, off + c * VL, kvm);
            }
            for (int r = 0; r < rep; r++) {
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
                    s[(size_t)r * n + j + i] = ks ? sums[i] * ks[offs[j + i] / hd] : sums[i];
            }
        }
#else
    for (int j = 0; j < n; j++) {
        const size_t off = offs[j];
        for (int r = 0; r < rep; r++) {
            float acc = 0.f;
            for (int d = 0; d < hd; d++) acc += qf[r * hd + d] * kv_load(kc, off + d, kvm);
            s[(size_t)r * n + j] = ks ? acc * ks[off / hd] : acc;
        }
    }
#endif
    /* softmax per query, then the weighted sum of values */
    for (int r = 0; r < rep; r++) {
        float* sr = s + (size_t)r * n;
        if (cap > 0.f) softcap_row(sr, n, 1.0f / cap, cap); /* the scaled scores, capped */
        float m = row_max(sr, n);
        if (sk && sk[r] > m) m = sk[r]; /* this head's sink logit joins the softmax */
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
        if (sk) total += expf(sk[r] - m);
        const float inv = invs[r] = 1.0f / total;
        if (wsum) /* the weights each key received, before a value's scale joins them */
            for (j = 0; j < n; j++) wsum[j] += sr[j] * inv;
        float* o = of + (size_t)r * hd;
        /* a value's scale joins its weight (after the normaliser was summed from the unscaled weights) */
        if (vs)
            for (j = 0; j < n; j++) sr[j] *= vs[offs[j] / hd];
#ifdef VL
        if (rep >= GROUPED_VALUES) continue; /* grouped queries: their values in one pass below */
        /* values summed in registers, even and odd keys in separate accumulators (two FMA chains) */
        vf a0[MAX_HD / VL], a1[MAX_HD / VL];
        for (int c = 0; c < hd / VL; c++) a0[c] = a1[c] = v_zero();
        for (j = 0; j + 1 < n; j += 2) {
            const size_t off0 = offs[j], off1 = offs[j + 1];
            const vf w0 = v_set1(sr[j]), w1 = v_set1(sr[j + 1]);
            for (int c = 0; c < hd / VL; c++) {
                a0[c] = v_fma(w0, v_kv_load(vc, off0 + c * VL, kvm), a0[c]);
                a1[c] = v_fma(w1, v_kv_load(vc, off1 + c * VL, kvm), a1[c]);
            }
        }
        if (j < n) {
            const size_t off0 = offs[j];
            const vf w0 = v_set1(sr[j]);
            for (int c = 0; c < hd / VL; c++) a0[c] = v_fma(w0, v_kv_load(vc, off0 + c * VL, kvm), a0[c]);
        }
        const vf vinv = v_set1(inv);
        for (int c = 0; c < hd / VL; c++) v_store(o + c * VL, v_mul(v_add(a0[c], a1[c]), vinv));
#else
        for (int d = 0; d < hd; d++) o[d] = 0.f;
        for (j = 0; j < n; j++) {
            const size_t off = offs[j];
            const float w = sr[j];
            for (int d = 0; d < hd; d++) o[d] += w * kv_load(vc, off + d, kvm);
        }
        for (int d = 0; d < hd; d++) o[d] *= inv;
#endif
    }
#ifdef VL
    if (rep >= GROUPED_VALUES) /* the values of QG queries at a time, two vectors of them per pass */
        for (int d0 = 0; d0 < hd; d0 += 2 * VL)
            for (int r0 = 0; r0 < rep; r0 += QG) {
                const int R = rep - r0 < QG ? rep - r0 : QG, nv = hd - d0 >= 2 * VL ? 2 : 1;
                values_dispatch(s + (size_t)r0 * n, n, R, nv, vc, offs, d0, kvm, invs + r0,
                                of + (size_t)r0 * hd, hd);
            }
#endif
}

/* The arguments of sidecar_paged_decode_attention (mirrored by ``PagedAttentionArgs``). */
typedef struct {
    const void* q;
    const void* kc;
    const void* vc;
    const int64_t* tables;
    const int64_t* ctx;
    void* out;
    const float* ks;
    const float* vs;
    int B;
    int nh;
    int nkv;
    int hd;
    int bs;
    int max_blocks;
    int window;
    float scale;
    int dtype;
    int nthreads;
    float softcap;      /* > 0: scores soft-capped (see above); 0: not */
    float* scores;      /* NULL, or [num_blocks * bs]: received attention added per slot */
    const float* sinks; /* NULL, or [nh]: a logit per head in its softmax's denominator (see above) */
} sidecar_paged_attention_args;
int sidecar_paged_attention_args_size(void) {
    return (int)sizeof(sidecar_paged_attention_args);
}

/* q, out: [B, nh, hd] contiguous; tables: [B, max_blocks] int64; ctx: [B] int64 (1 <= ctx <= max_blocks *
 * bs); ks, vs: NULL (K/V in q's dtype) or the scales of an int8 cache. Returns 0, 2 when out of memory, or 1
 * when the shapes are outside what this kernel handles (the caller keeps its torch path). */
int sidecar_paged_decode_attention(const sidecar_paged_attention_args* a) {
    const void* q = a->q;
    const void* kc = a->kc;
    const void* vc = a->vc;
    const int64_t* tables = a->tables;
    const int64_t* ctx = a->ctx;
    void* out = a->out;
    int B = a->B;
    int nh = a->nh;
    int nkv = a->nkv;
    int hd = a->hd;
    int bs = a->bs;
    int max_blocks = a->max_blocks;
    int window = a->window;
    float scale = a->scale;
    int dtype = a->dtype;
    int nthreads = a->nthreads;
    const float* ks = a->ks;
    const float* vs = a->vs;
    const float cap = a->softcap;
    if ((ks == NULL) != (vs == NULL)) return 1;
    const int kvm = ks ? KV_INT8 : dtype;
    if (nkv <= 0 || nh % nkv || nh / nkv > MAX_REP || hd > MAX_HD || bs <= 0) return 1;
#ifdef VL
    if (hd % VL) return 1;
#endif
    for (int b = 0; b < B; b++)
        if (ctx[b] < 1 || ctx[b] > (int64_t)max_blocks * bs) return 1;
    const int rep = nh / nkv;
    int64_t longest = 0;
    for (int b = 0; b < B; b++) longest = ctx[b] > longest ? ctx[b] : longest;
    int failed = 0;
    /* [B * nkv, longest]: task t's weights of key lo + j at parts[t * longest + j] */
    float* parts = a->scores ? (float*)malloc(sizeof(float) * (size_t)B * nkv * (size_t)longest) : NULL;
    if (a->scores && !parts) return 2;
#pragma omp parallel num_threads(nthreads)
    {
        float* s = (float*)malloc(sizeof(float) * (size_t)rep * (size_t)longest);
        float* qf = (float*)malloc(sizeof(float) * (size_t)rep * hd);
        float* of = (float*)malloc(sizeof(float) * (size_t)rep * hd);
        size_t* offs = (size_t*)malloc(sizeof(size_t) * (size_t)longest);
        if (!s || !qf || !of || !offs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < B * nkv; t++) {
            if (!s || !qf || !of || !offs) continue;
            const int b = t / nkv, g = t % nkv;
            const int hi = (int)ctx[b];
            const int lo = window > 0 && hi > window ? hi - window : 0;
            const size_t q0 = ((size_t)b * nh + (size_t)g * rep) * hd;
            if (!bf16_scores(kvm, hd))
                for (int i = 0; i < rep * hd; i++) qf[i] = scale * dt_load(q, q0 + i, dtype);
            const int64_t* table = tables + (size_t)b * max_blocks;
            const uint16_t* qb = dtype == 1 ? (const uint16_t*)q + q0 : NULL; /* bf16 queries as they came */
            const char *k8 = (const char*)kc, *v8 = (const char*)vc;
            float* wsum = parts ? parts + (size_t)t * longest : NULL;
            if (wsum)
                for (int j = 0; j < hi - lo; j++) wsum[j] = 0.f;
            const float* sk = a->sinks ? a->sinks + (size_t)g * rep : NULL; /* this KV head's query heads */
            if (hd == 64)
                attend(qf, k8, v8, table, lo, hi, rep, nkv, g, 64, bs, kvm, s, of, offs, ks, vs, qb, scale,
                       cap, wsum, sk);
            else if (hd == 128)
                attend(qf, k8, v8, table, lo, hi, rep, nkv, g, 128, bs, kvm, s, of, offs, ks, vs, qb, scale,
                       cap, wsum, sk);
            else
                attend(qf, k8, v8, table, lo, hi, rep, nkv, g, hd, bs, kvm, s, of, offs, ks, vs, qb, scale,
                       cap, wsum, sk);
            for (int i = 0; i < rep * hd; i++) dt_store(out, q0 + i, of[i], dtype);
        }
        free(s);
        free(offs);
        free(qf);
        free(of);
    }
    if (parts && !failed)
        for (int t = 0; t < B * nkv; t++) {
            const int b = t / nkv;
            const int hi = (int)ctx[b];
            const int lo = window > 0 && hi > window ? hi - window : 0;
            const int64_t* table = tables + (size_t)b * max_blocks;
            const float* w = parts + (size_t)t * longest;
            for (int p = lo; p < hi; p++) a->scores[table[p / bs] * bs + p % bs] += w[p - lo];
        }
    free(parts);
    return failed ? 2 : 0;
}
