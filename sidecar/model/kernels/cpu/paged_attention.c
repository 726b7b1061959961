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
 * grouped queries (4 or more per KV head) each value is loaded once for up to QG of them, keys in order. Over
 * a long context (AVX2 builds) the values are summed in chunks of keys that stay in L1 while every pass over
 * the head's vectors and queries reads them, the partial sums carried from chunk to chunk: the same float32
 * operations in the same order as one pass over the whole context.
 *
 * A call with fewer (row, KV head) tasks than threads over a long context (a single sequence whose KV heads
 * are fewer than the threads) splits each task across the threads instead (run_split): its scores by ranges
 * of keys, its values by slices of the head's elements, the same operations as the task run alone.
 *
 * Rows of one sequence share a pass over their context: consecutive rows whose contexts grow by one and read
 * the same blocks (the rows verifying k speculative tokens, a short prompt segment after a cached context)
 * form a group (row_groups), and a (group, KV head) task loads each key and each value once for the rep
 * queries of all its rows. Each row keeps its own context: its causal end (its context length) and its
 * window's start. A row's result depends only on its own query and context, never on which other rows share
 * the call or its task: a grouped row's scores, softmax and value sums are the same float32 operations in the
 * same order as alone (the keys scored with the same arithmetic, the softmax over the row's own keys from its
 * own first, each query's value sums split over the same keys as the one-row path splits them), so verifying
 * k speculative tokens in one call gives bit for bit what k separate decode steps give. Inputs and output are
 * float32 (dtype 0) or bfloat16 (dtype 1; products and sums still in float32, the output rounded to nearest
 * even).
 *
 * Quantized cache (ks, vs not NULL): K/V hold int8 codes and ks/vs ([num_blocks, bs, nkv] float32) one scale
 * per token and KV head, K[j] = kq[j] * ks[j]. The codes are widened to float32 in registers; a key's scale
 * multiplies its finished dot product and a value's scale its softmax weight, so no dequantized copy exists.
 *
 * Scores (scores not NULL: [num_blocks * bs] float32, one per cache slot): each key's softmax weights, summed
 * over a row's rep queries of a KV head, are added to its slot, so a slot accumulates the attention its token
 * receives (scored KV eviction). Each (row, KV head) sums into a part of its own (a grouped task into one
 * per row, as the rows' own tasks would); the parts are added to the slots
 * once every task is done, by one thread, row by row and KV head by KV head: the same sums in the same
 * order on every call (rows sharing blocks -- beams, verification rows -- add to the same slots), so a
 * step and its replay leave the same bits.
 */
#include <stdlib.h>

#include "paged_attention_keys.h"

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

/* Queries a ranged pass holds with two sums each: 6 x 2 x 2 vectors of sums on AVX-512, 3 x 2 x 2 on AVX2
 * (with the two of a key's value and the weight, within the registers) */
#define QG2 (VL == 16 ? 6 : 3)
/* Key j (of the union of R queries' ranges, s: [R][n]) added to sum k of each query whose range [qlo, qhi)
 * holds it (every: all of them do), its value loaded once for all. */
static inline __attribute__((always_inline)) void ranged_key(vf (*acc)[2][2], const float* s, int n,
                                                             const int* qlo, const int* qhi, const int R,
                                                             const int nv, const int k, const char* vc,
                                                             const size_t* offs, int d0, int kvm, int j,
                                                             int every) {
    const size_t off = offs[j] + d0;
    const vf v0 = v_kv_load(vc, off, kvm);
    const vf v1 = nv > 1 ? v_kv_load(vc, off + VL, kvm) : v0;
    for (int r = 0; r < R; r++) {
        if (!every && (j < qlo[r] || j >= qhi[r])) continue;
        const vf w = v_set1(s[(size_t)r * n + j]);
        acc[r][k][0] = v_fma(w, v0, acc[r][k][0]);
        if (nv > 1) acc[r][k][1] = v_fma(w, v1, acc[r][k][1]);
    }
}
/* o[r][d0 .. d0 + nv * VL) = inv[r] * sum_{qlo[r] <= j < qhi[r]} s[r][j] V[j][d0 ..] for R queries of one
 * pass (sum_values), each value loaded once for all of them, and each query's sums made as one row alone
 * makes them: with sums = 1 its keys in order into one sum per lane; with sums = 2 the keys at even and at
 * odd distances from qlo[r] into two, added even + odd at the end. Keys go in pairs from an even index, the
 * first of a pair to sum 0: a query starting at an odd index finds its even keys in sum 1. This call takes
 * the keys [c0, c1) of that sequence (c0 even): its sums start from zero at the first chunk (first) and
 * otherwise from o (sum 0) and o2 (sum 1), where a chunk that is not the last (last) leaves them; the last
 * writes the result to o. */
static inline __attribute__((always_inline)) void ranged_pass(const float* s, int n, const int* qlo,
                                                              const int* qhi, const int R, const int nv,
                                                              const int sums, const char* vc,
                                                              const size_t* offs, int d0, int kvm,
                                                              const float* inv, float* o, float* o2, int hd,
                                                              int c0, int c1, int first, int last, int pf) {
    vf acc[QG][2][2]; /* [query][sum][vector] */
    int lo = n, hi = 0, all_lo = 0, all_hi = n;
    for (int r = 0; r < R; r++) {
        for (int k = 0; k < sums; k++)
            for (int c = 0; c < nv; c++)
                acc[r][k][c] = first ? v_zero() : v_load((k ? o2 : o) + (size_t)r * hd + d0 + c * VL);
        lo = qlo[r] < lo ? qlo[r] : lo;
        hi = qhi[r] > hi ? qhi[r] : hi;
        all_lo = qlo[r] > all_lo ? qlo[r] : all_lo;
        all_hi = qhi[r] < all_hi ? qhi[r] : all_hi;
    }
    lo = lo > c0 ? lo & ~1 : c0;
    hi = hi < c1 ? hi : c1;
    const int es = kvm == KV_INT8 ? 1 : kvm ? 2 : 4;
    for (int j = lo; j < hi; j += 2) {
        if (pf && j + pf + 1 < n) { /* this pass's part of the values pf keys on */
            __builtin_prefetch(vc + (offs[j + pf] + d0) * es, 0, 3);
            __builtin_prefetch(vc + (offs[j + pf + 1] + d0) * es, 0, 3);
        }
        if (j >= all_lo && j + 2 <= all_hi && j + 2 <= hi) { /* a pair every query takes: no checks */
            ranged_key(acc, s, n, qlo, qhi, R, nv, 0, vc, offs, d0, kvm, j, 1);
            ranged_key(acc, s, n, qlo, qhi, R, nv, sums - 1, vc, offs, d0, kvm, j + 1, 1);
            continue;
        }
        ranged_key(acc, s, n, qlo, qhi, R, nv, 0, vc, offs, d0, kvm, j, j >= all_lo && j < all_hi);
        if (j + 1 < hi)
            ranged_key(acc, s, n, qlo, qhi, R, nv, sums - 1, vc, offs, d0, kvm, j + 1,
                       j + 1 >= all_lo && j + 1 < all_hi);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nv; c++) {
            float* at = o + (size_t)r * hd + d0 + c * VL;
            if (!last) {
                v_store(at, acc[r][0][c]);
                if (sums == 2) v_store(o2 + (size_t)r * hd + d0 + c * VL, acc[r][1][c]);
                continue;
            }
            vf sum = acc[r][0][c];
            if (sums == 2)
                sum = qlo[r] & 1 ? v_add(acc[r][1][c], acc[r][0][c]) : v_add(acc[r][0][c], acc[r][1][c]);
            v_store(at, v_mul(sum, v_set1(inv[r])));
        }
}

static void ranged_values(const float* s, int n, const int* qlo, const int* qhi, int R, int nv, int sums,
                          const char* vc, const size_t* offs, int d0, int kvm, const float* inv, float* o,
                          float* o2, int hd, int c0, int c1, int first, int last, int pf) {
#define RP(RR, SUMS)                                                                                         \
    case RR:                                                                                                 \
        if (nv > 1)                                                                                          \
            ranged_pass(s, n, qlo, qhi, RR, 2, SUMS, vc, offs, d0, kvm, inv, o, o2, hd, c0, c1, first, last, \
                        pf);                                                                                 \
        else                                                                                                 \
            ranged_pass(s, n, qlo, qhi, RR, 1, SUMS, vc, offs, d0, kvm, inv, o, o2, hd, c0, c1, first, last, \
                        pf);                                                                                 \
        return;
    if (sums == 2) switch (R) {
            RP(1, 2)
            RP(2, 2)
            RP(3, 2)
#if VL == 16
            RP(4, 2)
            RP(5, 2)
            RP(6, 2)
#endif
        }
    if (sums == 2) return; /* R <= QG2 */
    switch (R) {
        RP(1, 1)
        RP(2, 1)
        RP(3, 1)
        RP(4, 1)
#if VL == 16
        RP(5, 1)
        RP(6, 1)
        RP(7, 1)
        RP(8, 1)
#endif
    }
#undef RP
}

/* Keys a chunk of the values' passes over a long context (long_values): their values (VALUE_CHUNK rows of hd
 * elements) stay in L1 while every pass over the head's vectors and queries reads them, where passes over the
 * whole context would bring the values in from memory once each. Even, so that a chunk starts a pair of keys
 * (ranged_pass). */
#define VALUE_CHUNK 64

/* of[i][d_lo..d_hi) = the weighted values of query i (of nq) over its keys [qlo[i], qhi[i]) (s: [nq][n] the
 * weights, invs: each query's 1 / normaliser), sums = 2 for grouped-query counts below GROUPED_VALUES (two
 * chains a vector, each value loaded once for QG2 queries), else 1 (one chain, QG queries a pass). Over a
 * long context the keys go in chunks, each chunk's values read for every vector and query while the next
 * chunk's are fetched, the partial sums carried in of and of2; a query's arithmetic does not depend on the
 * chunks or on the other queries of its pass (ranged_pass). */
static void sum_values(const float* s, int n, const int* qlo, const int* qhi, int nq, int rep, const char* vc,
                       const size_t* offs, int hd, int kvm, const float* invs, float* of, float* of2,
                       int d_lo, int d_hi, int ahead) {
    const int sums = rep < GROUPED_VALUES ? 2 : 1, per = sums == 2 ? QG2 : QG;
    int lo = n, hi = 0;
    for (int i = 0; i < nq; i++) {
        lo = qlo[i] < lo ? qlo[i] : lo;
        hi = qhi[i] > hi ? qhi[i] : hi;
    }
    const int chunk = long_values(n, hd, kvm) ? VALUE_CHUNK : n + 2;
    for (int c0 = lo & ~1; c0 < hi; c0 += chunk) {
        const int c1 = c0 + chunk < hi ? c0 + chunk : hi;
        for (int d0 = d_lo; d0 < d_hi; d0 += 2 * VL)
            for (int r0 = 0; r0 < nq; r0 += per) {
                const int R = nq - r0 < per ? nq - r0 : per, nv = hd - d0 >= 2 * VL ? 2 : 1;
                ranged_values(s + (size_t)r0 * n, n, qlo + r0, qhi + r0, R, nv, sums, vc, offs, d0, kvm,
                              invs + r0, of + (size_t)r0 * hd, of2 + (size_t)r0 * hd, hd, c0, c1,
                              c0 == (lo & ~1), c1 == hi, r0 == 0 ? (chunk < n ? chunk : ahead) : 0);
            }
    }
}
#endif

/* One (row, KV head) task. qf: the rep queries in float32, already scaled (unless bf16_scores); s: scratch
 * [rep][n]; of, of2: [rep][hd]. Inlined per head size, so the common ones (64, 128) run with the vector count
 * known. */
static inline __attribute__((always_inline)) void attend(const float* qf, const char* kc, const char* vc,
                                                         const int64_t* table, int lo, int hi, int rep,
                                                         int nkv, int g, int hd, int bs, int kvm, float* s,
                                                         float* of, float* of2, size_t* offs, const float* ks,
                                                         const float* vs, const uint16_t* qb, float scale,
                                                         float cap, float* wsum, const float* sk) {
    const int n = hi - lo, chunked = long_values(n, hd, kvm);
    float invs[MAX_REP]; /* each query's 1 / softmax normaliser */
    key_offsets(offs, table, lo, hi, bs, (size_t)nkv * hd, g, hd);
    score_keys(qf, qb, kc, vc, offs, n, rep, hd, kvm, ks, scale, s, n, !chunked);
    /* softmax per query, then the weighted sum of values */
    for (int r = 0; r < rep; r++)
        invs[r] = weigh(s + (size_t)r * n, n, cap, sk ? sk + r : NULL, wsum, vs, offs, hd);
#ifdef VL
    if (chunked) { /* the values in chunks: sum_values, the same sums as the loops below */
        int qlo[MAX_REP], qhi[MAX_REP];
        for (int r = 0; r < rep; r++) qlo[r] = 0, qhi[r] = n;
        sum_values(s, n, qlo, qhi, rep, rep, vc, offs, hd, kvm, invs, of, of2, 0, hd, 0);
        return;
    }
#endif
    (void)of2;
    /* a context the caches hold: one row's own loops, which cost less there than sum_values' passes */
    for (int r = 0; r < rep; r++) {
        const float* sr = s + (size_t)r * n;
        const float inv = invs[r];
        float* o = of + (size_t)r * hd;
        int j;
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

#ifdef VL
/* One (group, KV head) task (see the header): row r of the G rows attends to positions [lo[r], hi[r]) (lo and
 * hi non-decreasing), every row's through `table`; qf / qb: the rows' queries one after another (rep each),
 * s: scratch [G * rep][hi[G - 1] - lo[0]], of: [G * rep][hd], wsum[r]: row r's part of the scores or NULL.
 * The keys of the union of the contexts are scored once for all G * rep queries (a key past a row's context
 * is scored and never used), each query's softmax runs over its own row's keys (their scores at the same
 * offsets from its start as in attend), and ranged_values sums each query's values as attend would. */
static inline __attribute__((always_inline)) void attend_group(
        const float* qf, const uint16_t* qb, const char* kc, const char* vc, const int64_t* table,
        const int* lo, const int* hi, int G, int rep, int nkv, int g, int hd, int bs, int kvm, float* s,
        float* of, float* of2, size_t* offs, const float* ks, const float* vs, float scale, float cap,
        float* const* wsum, const float* sk) {
    const int first = lo[0], n = hi[G - 1] - first, nq = G * rep;
    float invs[MAX_REP];
    int qlo[MAX_REP], qhi[MAX_REP]; /* each query's keys, from the union's first */
    key_offsets(offs, table, first, hi[G - 1], bs, (size_t)nkv * hd, g, hd);
    score_keys(qf, qb, kc, vc, offs, n, nq, hd, kvm, ks, scale, s, n, !long_values(n, hd, kvm));
    for (int r = 0; r < G; r++)
        for (int h = 0; h < rep; h++) {
            const int i = r * rep + h, a = lo[r] - first;
            qlo[i] = a;
            qhi[i] = hi[r] - first;
            invs[i] = weigh(s + (size_t)i * n + a, hi[r] - lo[r], cap, sk ? sk + h : NULL, wsum[r], vs,
                            offs + a, hd);
        }
    sum_values(s, n, qlo, qhi, nq, rep, vc, offs, hd, kvm, invs, of, of2, 0, hd, 0);
}
#endif

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

/* The cache's element mode (dtype, or KV_INT8), or -1 when the shapes are outside what this kernel handles.
 */
static int kv_mode(const sidecar_paged_attention_args* a) {
    if ((a->ks == NULL) != (a->vs == NULL)) return -1;
    if (a->nkv <= 0 || a->nh % a->nkv || a->nh / a->nkv > MAX_REP || a->hd > MAX_HD || a->bs <= 0) return -1;
#ifdef VL
    if (a->hd % VL) return -1;
#endif
    for (int b = 0; b < a->B; b++)
        if (a->ctx[b] < 1 || a->ctx[b] > (int64_t)a->max_blocks * a->bs) return -1;
    return a->ks ? KV_INT8 : a->dtype;
}

/* The first position row b attends to. */
static inline int row_lo(const sidecar_paged_attention_args* a, int b) {
    const int hi = (int)a->ctx[b];
    return a->window > 0 && hi > a->window ? hi - a->window : 0;
}

/* Splits the rows into groups that share a pass over their context (see the header): starts[i] is group i's
 * first row, starts[n] = B; returns n. Row b joins the group of the row before it when its context is one
 * longer and its blocks are the group's first row's from that row's first position to its own last (so the
 * blocks of the group's last row serve every row), while the group holds at most MAX_REP queries per KV head
 * and at most B * nkv / nthreads rows: a small call keeps a task for every thread (a single verification step
 * on many threads stays one row a task). Without vectors no rows are grouped. */
static int row_groups(const sidecar_paged_attention_args* a, int* starts) {
    int most = 1;
#ifdef VL
    const int share = a->B * a->nkv / (a->nthreads > 0 ? a->nthreads : 1);
    most = MAX_REP / (a->nh / a->nkv);
    most = share < most ? share : most;
#endif
    int n = 0;
    for (int b = 0; b < a->B; b++) {
        const int s0 = n ? starts[n - 1] : 0;
        int joins = n && b - s0 < most && a->ctx[b] == a->ctx[b - 1] + 1;
        const int64_t *t0 = a->tables + (size_t)s0 * a->max_blocks,
                      *tb = a->tables + (size_t)b * a->max_blocks;
        for (int i = row_lo(a, s0) / a->bs; joins && i <= (int)((a->ctx[b] - 1) / a->bs); i++)
            joins = t0[i] == tb[i];
        if (!joins) starts[n++] = b;
    }
    starts[n] = a->B;
    return n;
}

/* The row groups the kernel forms for these arguments, into starts [B + 1] (for the tests); -1 when the
 * kernel would refuse them. */
int sidecar_paged_attention_groups(const sidecar_paged_attention_args* a, int* starts) {
    return kv_mode(a) < 0 ? -1 : row_groups(a, starts);
}

/* A task's scratch: scores [queries][longest], the queries in float32 and bf16 (grouped rows' bf16 scores),
 * the outputs, key offsets [longest]. */
typedef struct {
    float* s;
    float* qf;
    uint16_t* qb;
    float* of;
    float* of2; /* the values' second sums between chunks (sum_values) */
    size_t* offs;
} scratch;

/* Rows b0 .. b0 + G - 1 (one group), KV head g. */
static void run_task(const sidecar_paged_attention_args* a, int b0, int G, int g, int kvm, float* parts,
                     int64_t longest, const scratch* w) {
    const int nh = a->nh, nkv = a->nkv, hd = a->hd, bs = a->bs, rep = nh / nkv, dtype = a->dtype;
    const char *kc = (const char*)a->kc, *vc = (const char*)a->vc;
    const float* sk = a->sinks ? a->sinks + (size_t)g * rep : NULL; /* this KV head's query heads */
    const float cap = a->softcap, scale = a->scale;
    int lo[MAX_REP], hi[MAX_REP];
    float* wsum[MAX_REP];
    for (int r = 0; r < G; r++) {
        const int b = b0 + r;
        const size_t q0 = ((size_t)b * nh + (size_t)g * rep) * hd, at = (size_t)r * rep * hd;
        lo[r] = row_lo(a, b);
        hi[r] = (int)a->ctx[b];
        if (!bf16_scores(kvm, hd))
            for (int i = 0; i < rep * hd; i++) w->qf[at + i] = scale * dt_load(a->q, q0 + i, dtype);
        else if (G > 1) /* a group's bf16 queries side by side */
            for (int i = 0; i < rep * hd; i++) w->qb[at + i] = ((const uint16_t*)a->q)[q0 + i];
        wsum[r] = parts ? parts + ((size_t)b * nkv + g) * longest : NULL;
        if (wsum[r])
            for (int j = 0; j < hi[r] - lo[r]; j++) wsum[r][j] = 0.f;
    }
    if (G == 1) {
        const int64_t* table = a->tables + (size_t)b0 * a->max_blocks;
        const size_t q0 = ((size_t)b0 * nh + (size_t)g * rep) * hd;
        const uint16_t* qb = dtype == 1 ? (const uint16_t*)a->q + q0 : NULL; /* bf16 queries as they came */
        if (hd == 64)
            attend(w->qf, kc, vc, table, lo[0], hi[0], rep, nkv, g, 64, bs, kvm, w->s, w->of, w->of2, w->offs,
                   a->ks, a->vs, qb, scale, cap, wsum[0], sk);
        else if (hd == 128)
            attend(w->qf, kc, vc, table, lo[0], hi[0], rep, nkv, g, 128, bs, kvm, w->s, w->of, w->of2,
                   w->offs, a->ks, a->vs, qb, scale, cap, wsum[0], sk);
        else
            attend(w->qf, kc, vc, table, lo[0], hi[0], rep, nkv, g, hd, bs, kvm, w->s, w->of, w->of2, w->offs,
                   a->ks, a->vs, qb, scale, cap, wsum[0], sk);
    }
#ifdef VL
    else {
        const int64_t* table = a->tables + (size_t)(b0 + G - 1) * a->max_blocks; /* see row_groups */
        if (hd == 64)
            attend_group(w->qf, w->qb, kc, vc, table, lo, hi, G, rep, nkv, g, 64, bs, kvm, w->s, w->of,
                         w->of2, w->offs, a->ks, a->vs, scale, cap, wsum, sk);
        else if (hd == 128)
            attend_group(w->qf, w->qb, kc, vc, table, lo, hi, G, rep, nkv, g, 128, bs, kvm, w->s, w->of,
                         w->of2, w->offs, a->ks, a->vs, scale, cap, wsum, sk);
        else
            attend_group(w->qf, w->qb, kc, vc, table, lo, hi, G, rep, nkv, g, hd, bs, kvm, w->s, w->of,
                         w->of2, w->offs, a->ks, a->vs, scale, cap, wsum, sk);
    }
#endif
    for (int r = 0; r < G; r++) {
        const size_t q0 = ((size_t)(b0 + r) * nh + (size_t)g * rep) * hd, at = (size_t)r * rep * hd;
        for (int i = 0; i < rep * hd; i++) dt_store(a->out, q0 + i, w->of[at + i], dtype);
    }
}

#ifdef VL
/* Few tasks for the threads (a single sequence's step: as many tasks as KV heads): each task's work is split
 * where its arithmetic allows, in three rounds over all tasks with a barrier between them: the scores by
 * ranges of keys (each key's score is its own arithmetic), then each task's softmax weights (query by query,
 * in order), then the values by slices of the head's elements (each lane's sums are its own). Every float32
 * operation is the one the task gives run alone, in the same order, so the results are bit for bit the task
 * mode's. A task's state lives in a split_task. */
typedef struct {
    int b0, G, g, first, n, nq;
    const int64_t* table;
    int lo[MAX_REP], hi[MAX_REP];   /* each row's keys */
    int qlo[MAX_REP], qhi[MAX_REP]; /* each query's keys, from the union's first */
    float invs[MAX_REP];
    float* wsum[MAX_REP];
    float *s, *qf, *of, *of2;
    uint16_t* qb;
    size_t* offs;
} split_task;

/* Keys ahead whose values a values job fetches: its slice of them, which no score job fetched for it (a key's
 * score may have run on another core). */
#define SPLIT_AHEAD 16

/* Whether the call runs in rounds (above): fewer tasks than threads, so that threads would wait with nothing
 * to do, over contexts long enough (SPLIT_MIN_KEYS) to pay for the rounds' barriers and for reading the
 * values on other cores than the ones that scored their keys. */
#define SPLIT_MIN_KEYS 1024
static int split_mode(int tasks, int nthreads, int64_t longest) {
    return nthreads > 1 && tasks < nthreads && longest >= SPLIT_MIN_KEYS;
}

/* The call's tasks (groups x KV heads) in rounds; returns 0, or 2 when out of memory. */
static int run_split(const sidecar_paged_attention_args* a, const int* starts, int groups, int kvm,
                     float* parts, int64_t longest) {
    const int nh = a->nh, nkv = a->nkv, hd = a->hd, bs = a->bs, rep = nh / nkv, dtype = a->dtype;
    const int tasks = groups * nkv, bf = bf16_scores(kvm, hd);
    const char *kc = (const char*)a->kc, *vc = (const char*)a->vc;
    split_task* T = (split_task*)calloc((size_t)tasks, sizeof(split_task));
    if (!T) return 2;
    size_t floats = 0, keys = 0; /* scratch of all tasks: [nq][n] scores, three [nq][hd], offsets [n] */
    for (int t = 0; t < tasks; t++) {
        split_task* k = &T[t];
        const int i = t / nkv;
        k->b0 = starts[i], k->G = starts[i + 1] - starts[i], k->g = t % nkv, k->nq = k->G * rep;
        for (int r = 0; r < k->G; r++) {
            k->lo[r] = row_lo(a, k->b0 + r);
            k->hi[r] = (int)a->ctx[k->b0 + r];
        }
        k->first = k->lo[0], k->n = k->hi[k->G - 1] - k->first;
        k->table = a->tables + (size_t)(k->b0 + k->G - 1) * a->max_blocks; /* see row_groups */
        floats += (size_t)k->nq * ((size_t)k->n + 3 * (size_t)hd) + (size_t)k->nq * hd / 2 + 16;
        keys += (size_t)k->n;
    }
    float* fs = (float*)malloc(sizeof(float) * floats);
    size_t* offsets = (size_t*)malloc(sizeof(size_t) * keys);
    if (!fs || !offsets) {
        free(fs);
        free(offsets);
        free(T);
        return 2;
    }
    float* f = fs;
    size_t* o = offsets;
    for (int t = 0; t < tasks; t++) {
        split_task* k = &T[t];
        k->s = f, f += (size_t)k->nq * k->n;
        k->qf = f, f += (size_t)k->nq * hd;
        k->of = f, f += (size_t)k->nq * hd;
        k->of2 = f, f += (size_t)k->nq * hd;
        k->qb = (uint16_t*)f, f += (size_t)k->nq * hd / 2 + 16;
        k->offs = o, o += k->n;
    }
    /* score jobs of at least 64 keys, about four a thread */
    int64_t total = 0;
    for (int t = 0; t < tasks; t++) total += T[t].n;
    int span = (int)((total + 4 * a->nthreads - 1) / (4 * a->nthreads));
    span = span < 64 ? 64 : (span + 3) & ~3;
    int* job_start = (int*)malloc(sizeof(int) * ((size_t)tasks + 1));
    if (!job_start) {
        free(fs);
        free(offsets);
        free(T);
        return 2;
    }
    job_start[0] = 0;
    for (int t = 0; t < tasks; t++) job_start[t + 1] = job_start[t] + (T[t].n + span - 1) / span;
    const int score_jobs = job_start[tasks], slices = (hd + 2 * VL - 1) / (2 * VL);
#pragma omp parallel num_threads(a->nthreads)
    {
#pragma omp for schedule(static, 1)
        for (int t = 0; t < tasks; t++) { /* queries, weights' parts, key offsets */
            split_task* k = &T[t];
            for (int r = 0; r < k->G; r++) {
                const int b = k->b0 + r;
                const size_t q0 = ((size_t)b * nh + (size_t)k->g * rep) * hd, at = (size_t)r * rep * hd;
                for (int i = 0; i < rep * hd; i++) {
                    if (bf)
                        k->qb[at + i] = ((const uint16_t*)a->q)[q0 + i];
                    else
                        k->qf[at + i] = a->scale * dt_load(a->q, q0 + i, dtype);
                }
                k->wsum[r] = parts ? parts + ((size_t)b * nkv + k->g) * longest : NULL;
                if (k->wsum[r])
                    for (int j = 0; j < k->hi[r] - k->lo[r]; j++) k->wsum[r][j] = 0.f;
                for (int h = 0; h < rep; h++) {
                    k->qlo[r * rep + h] = k->lo[r] - k->first;
                    k->qhi[r * rep + h] = k->hi[r] - k->first;
                }
            }
            key_offsets(k->offs, k->table, k->first, k->first + k->n, bs, (size_t)nkv * hd, k->g, hd);
        }
#pragma omp for schedule(dynamic, 1)
        for (int j = 0; j < score_jobs; j++) { /* the scores, a range of one task's keys a job */
            int t = 0;
            while (job_start[t + 1] <= j) t++;
            split_task* k = &T[t];
            const int j0 = (j - job_start[t]) * span, m = k->n - j0 < span ? k->n - j0 : span;
            score_keys(k->qf, k->qb, kc, vc, k->offs + j0, m, k->nq, hd, kvm, a->ks, a->scale, k->s + j0,
                       (size_t)k->n, 0);
        }
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; t++) { /* each query's weights, in order (the weights' parts add up) */
            split_task* k = &T[t];
            const float* sk = a->sinks ? a->sinks + (size_t)k->g * rep : NULL;
            for (int r = 0; r < k->G; r++)
                for (int h = 0; h < rep; h++) {
                    const int i = r * rep + h, at = k->lo[r] - k->first;
                    k->invs[i] = weigh(k->s + (size_t)i * k->n + at, k->hi[r] - k->lo[r], a->softcap,
                                       sk ? sk + h : NULL, k->wsum[r], a->vs, k->offs + at, hd);
                }
        }
#pragma omp for schedule(dynamic, 1)
        for (int j = 0; j < tasks * slices; j++) { /* the values, a slice of the head's elements a job */
            split_task* k = &T[j / slices];
            const int d0 = (j % slices) * 2 * VL, d1 = d0 + 2 * VL < hd ? d0 + 2 * VL : hd;
            sum_values(k->s, k->n, k->qlo, k->qhi, k->nq, rep, vc, k->offs, hd, kvm, k->invs, k->of, k->of2,
                       d0, d1, SPLIT_AHEAD);
        }
#pragma omp for schedule(static, 1)
        for (int t = 0; t < tasks; t++) {
            const split_task* k = &T[t];
            for (int r = 0; r < k->G; r++) {
                const size_t q0 = ((size_t)(k->b0 + r) * nh + (size_t)k->g * rep) * hd,
                             at = (size_t)r * rep * hd;
                for (int i = 0; i < rep * hd; i++) dt_store(a->out, q0 + i, k->of[at + i], dtype);
            }
        }
    }
    free(job_start);
    free(fs);
    free(offsets);
    free(T);
    return 0;
}
#endif

/* q, out: [B, nh, hd] contiguous; tables: [B, max_blocks] int64; ctx: [B] int64 (1 <= ctx <= max_blocks *
 * bs); ks, vs: NULL (K/V in q's dtype) or the scales of an int8 cache. Returns 0, 2 when out of memory, or 1
 * when the shapes are outside what this kernel handles (the caller keeps its torch path). */
int sidecar_paged_decode_attention(const sidecar_paged_attention_args* a) {
    const int kvm = kv_mode(a);
    if (kvm < 0) return 1;
    const int B = a->B, nkv = a->nkv, hd = a->hd, rep = a->nh / nkv;
    int64_t longest = 0;
    for (int b = 0; b < B; b++) longest = a->ctx[b] > longest ? a->ctx[b] : longest;
    int* starts = (int*)malloc(sizeof(int) * ((size_t)B + 1));
    if (!starts) return 2;
    const int groups = row_groups(a, starts);
    int most = 1; /* rows in the largest group */
    for (int i = 0; i < groups; i++)
        most = starts[i + 1] - starts[i] > most ? starts[i + 1] - starts[i] : most;
    const size_t nq = (size_t)most * rep; /* queries of the largest task */
    int failed = 0;
    /* [B * nkv, longest]: row b's KV head g's weights of key lo + j at parts[(b * nkv + g) * longest + j] */
    float* parts = a->scores ? (float*)malloc(sizeof(float) * (size_t)B * nkv * (size_t)longest) : NULL;
    if (a->scores && !parts) {
        free(starts);
        return 2;
    }
#ifdef VL
    if (split_mode(groups * nkv, a->nthreads, longest))
        failed = run_split(a, starts, groups, kvm, parts, longest) != 0;
    else
#endif
#pragma omp parallel num_threads(a->nthreads)
    {
        scratch w = {
                .s = (float*)malloc(sizeof(float) * nq * (size_t)longest),
                .qf = (float*)malloc(sizeof(float) * nq * hd),
                .qb = most > 1 && bf16_scores(kvm, hd) ? (uint16_t*)malloc(sizeof(uint16_t) * nq * hd) : NULL,
                .of = (float*)malloc(sizeof(float) * nq * hd),
                .of2 = (float*)malloc(sizeof(float) * nq * hd),
                .offs = (size_t*)malloc(sizeof(size_t) * (size_t)longest),
        };
        const int ok =
                w.s && w.qf && w.of && w.of2 && w.offs && (w.qb || !(most > 1 && bf16_scores(kvm, hd)));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < groups * nkv; t++) {
            if (!ok) continue;
            const int i = t / nkv;
            run_task(a, starts[i], starts[i + 1] - starts[i], t % nkv, kvm, parts, longest, &w);
        }
        free(w.s);
        free(w.qf);
        free(w.qb);
        free(w.of);
        free(w.of2);
        free(w.offs);
    }
    if (parts && !failed)
        for (int t = 0; t < B * nkv; t++) {
            const int b = t / nkv;
            const int hi = (int)a->ctx[b], lo = row_lo(a, b);
            const int64_t* table = a->tables + (size_t)b * a->max_blocks;
            const float* w = parts + (size_t)t * longest;
            for (int p = lo; p < hi; p++) a->scores[table[p / a->bs] * a->bs + p % a->bs] += w[p - lo];
        }
    free(parts);
    free(starts);
    return failed ? 2 : 0;
}
