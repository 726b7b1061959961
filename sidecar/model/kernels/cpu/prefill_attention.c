/* Causal attention for a prompt segment (a whole prompt, or a chunk of one after its cached context) on CPU,
 * reading K/V in place from the paged cache:
 *
 *   out[i, h, :] = softmax_j(scale * q[i, h, :] . K[j, h / rep, :]) V[j, h / rep, :],  lo_i <= j <= p_i
 *
 * for the segment's L rows at positions p_i = start + i (start = ctx - L: the tokens cached before it),
 * where position j lives in slot table[j / bs] * bs + j % bs of the cache ([num_blocks, bs, nkv, hd]),
 * rep = nh / nkv query heads share a KV head, and lo_i = max(0, p_i + 1 - window) with a sliding window
 * (window <= 0: none, lo_i = 0). With soft-capping (softcap > 0, Gemma 2) each scaled score x becomes
 * softcap * tanh(x / softcap) before the softmax (its maximum taken over the capped scores). With sinks (not
 * NULL: [nh] float32, gpt-oss) head h's logit sinks[h] joins each of its softmaxes' denominators and weighs
 * no value, as in the decode kernel (paged_attention.c): the maximum is taken over the scores and the sink,
 * and exp(sink - max) adds to the normaliser. Sinks take the float32 path below on every CPU (the tile layout
 * does not take them).
 *
 * Why: torch's CPU SDPA runs these shapes (a few hundred rows, head size 64-128, grouped-query heads) at a
 * small fraction of the rate of the projections around it. Here the work goes in blocks that keep the vector
 * units busy:
 *  1. once per call, every KV head's keys are widened to float32 and laid out in blocks of VL keys,
 *     transposed ([hd][VL]: one vector holds one dimension of VL keys), and its values widened to rows of
 *     float32 (an int8 cache's codes times their scales, so no dequantized copy of the cache is kept);
 *  2. a task is one KV head and QB consecutive rows: its rep * QB queries (scaled by `scale` first) are
 *     scored against the keys four queries at a time, each key vector loaded once for the four (one
 *     broadcast multiply-add per dimension, no horizontal sums);
 *  3. softmax per query over its own causal range in float32 (masked keys get weight 0), then the weighted
 *     sum of value rows, four queries at a time, and the result rounded once to the output dtype.
 * Products and sums are float32 throughout (torch's bf16 SDPA rounds its softmax weights to bf16 before
 * the value product; these stay float32). A row's result depends only on its own query and keys, not on
 * which task or thread ran it.
 *
 * On CPUs with AVX-512 BF16, bf16 prompts over a bf16 cache take products of bf16 pairs instead (TILE_LAYOUT
 * below: the same tasks, the weights rounded to bf16 like torch's): AMX tile products where the CPU has AMX
 * and AVX-512 BF16 dot products where it has not.
 *
 * Quantized cache (ks, vs not NULL): K/V hold int8 codes and ks/vs ([num_blocks, bs, nkv] float32) one scale
 * per token and KV head.
 */
#include <stdlib.h>

#include "vec.h"

#if defined(__AVX512BF16__) && VL == 16
#define TILE_LAYOUT 1 /* bf16 prompts over a bf16 cache through products of bf16 pairs (see below) */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_PATH 1
#endif
#endif

#define QT          4             /* queries scored together */
#define MAX_QUERIES 256           /* queries a task holds: rep * rows */
#define MAX_SCRATCH (256LL << 20) /* bytes of widened keys and values; beyond it the caller's torch path */

int sidecar_prefill_attention_supported(void) {
#ifdef VL
    return 1;
#else
    return 0;
#endif
}

#ifdef VL
/* Element c * VL .. of token slot `off` of a cache as float32 (int8 codes times the token's scale). */
static inline vf kv_vec(const void* cache, size_t off, int kvm, const float* scales, size_t hd) {
    if (kvm == 2) return v_mul(v_load_i8((const int8_t*)cache + off), v_set1(scales[off / hd]));
    return kvm ? v_load_bf16((const uint16_t*)cache + off) : v_load((const float*)cache + off);
}

/* Scores of n4 (<= QT) queries qf[t * hd ..] against key blocks [b0, b1) of kt: s[t * sld + (b - b0) * VL +
 * i]. Two key blocks a step where there are two: eight sums in flight instead of four (four dependent chains
 * of FMAs had left the units waiting on each one's latency), each score still one sum over d in order. */
static inline __attribute__((always_inline)) void score(const float* qf, int n4, const float* kt, int b0,
                                                        int b1, int hd, float* s, size_t sld) {
    int b = b0;
    for (; b + 2 <= b1; b += 2) {
        const float* kb = kt + (size_t)b * hd * VL;
        const float* kn = kb + (size_t)hd * VL;
        vf a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
        vf c0 = v_zero(), c1 = v_zero(), c2 = v_zero(), c3 = v_zero();
        for (int d = 0; d < hd; d++) {
            const vf k = v_load(kb + (size_t)d * VL), kk = v_load(kn + (size_t)d * VL);
            const vf q0 = v_set1(qf[d]);
            a0 = v_fma(q0, k, a0);
            c0 = v_fma(q0, kk, c0);
            if (n4 > 1) {
                const vf q1 = v_set1(qf[hd + d]);
                a1 = v_fma(q1, k, a1);
                c1 = v_fma(q1, kk, c1);
            }
            if (n4 > 2) {
                const vf q2 = v_set1(qf[2 * hd + d]);
                a2 = v_fma(q2, k, a2);
                c2 = v_fma(q2, kk, c2);
            }
            if (n4 > 3) {
                const vf q3 = v_set1(qf[3 * hd + d]);
                a3 = v_fma(q3, k, a3);
                c3 = v_fma(q3, kk, c3);
            }
        }
        float* at = s + (size_t)(b - b0) * VL;
        v_store(at, a0);
        v_store(at + VL, c0);
        if (n4 > 1) {
            v_store(at + sld, a1);
            v_store(at + sld + VL, c1);
        }
        if (n4 > 2) {
            v_store(at + 2 * sld, a2);
            v_store(at + 2 * sld + VL, c2);
        }
        if (n4 > 3) {
            v_store(at + 3 * sld, a3);
            v_store(at + 3 * sld + VL, c3);
        }
    }
    for (; b < b1; b++) {
        const float* kb = kt + (size_t)b * hd * VL;
        vf a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
        for (int d = 0; d < hd; d++) {
            const vf k = v_load(kb + (size_t)d * VL);
            a0 = v_fma(v_set1(qf[d]), k, a0);
            if (n4 > 1) a1 = v_fma(v_set1(qf[hd + d]), k, a1);
            if (n4 > 2) a2 = v_fma(v_set1(qf[2 * hd + d]), k, a2);
            if (n4 > 3) a3 = v_fma(v_set1(qf[3 * hd + d]), k, a3);
        }
        float* at = s + (size_t)(b - b0) * VL;
        v_store(at, a0);
        if (n4 > 1) v_store(at + sld, a1);
        if (n4 > 2) v_store(at + 2 * sld, a2);
        if (n4 > 3) v_store(at + 3 * sld, a3);
    }
}

/* w[j] = exp(w[j] - max) for j in [lo, hi), 0 elsewhere in [0, n); returns the sum of the weights, plus
 * exp(*sink - max) with a sink logit (not NULL: it joins the maximum too). */
static inline float softmax_weights(float* w, int lo, int hi, int n, const float* sink) {
    float m = row_max(w + lo, hi - lo);
    if (sink && *sink > m) m = *sink;
    for (int j = 0; j < lo; j++) w[j] = 0.f;
    for (int j = hi; j < n; j++) w[j] = 0.f;
    const vf vm = v_set1(m);
    vf total = v_zero();
    int j = lo;
    for (; j + VL <= hi; j += VL) {
        const vf e = v_exp(v_sub(v_load(w + j), vm));
        v_store(w + j, e);
        total = v_add(total, e);
    }
    float sum = v_sum(total);
    if (j < hi) { /* the tail through the same exp, padded with lanes it discards */
        float tmp[VL];
        for (int i = 0; i < VL; i++) tmp[i] = j + i < hi ? w[j + i] - m : -87.f;
        v_store(tmp, v_exp(v_load(tmp)));
        for (int i = 0; j < hi; i++, j++) {
            w[j] = tmp[i];
            sum += w[j];
        }
    }
    if (sink) sum += expf(*sink - m);
    return sum;
}

/* o[t][:] = sum_j w[t * sld + j] vf[j][0 .. nc * VL) for j in [0, n), t < nt (value rows hd apart; nt * nc
 * accumulators <= 16). */
static inline __attribute__((always_inline)) void weigh(const float* w, size_t sld, int nt,
                                                        const float* vf_rows, int n, int hd, int nc,
                                                        vf* acc) {
    for (int i = 0; i < nt * nc; i++) acc[i] = v_zero();
    for (int j = 0; j < n; j++) {
        const float* vr = vf_rows + (size_t)j * hd;
        for (int c = 0; c < nc; c++) {
            const vf v = v_load(vr + c * VL);
            for (int t = 0; t < nt; t++) acc[t * nc + c] = v_fma(v_set1(w[t * sld + j]), v, acc[t * nc + c]);
        }
    }
}

/* One task's qn queries (query u: row r0 + u / rep of the segment, at position p0 + u / rep, head
 * g * rep + u % rep; qf scaled): scores against key blocks [b0, mblk) of the keys from `base` (kt: their
 * transposed blocks; the first b0 blocks are before every query's window), softmax over each query's causal
 * range (sk: the sink logits of the KV head's rep query heads, or NULL), weighted values (vg: their rows),
 * out rounded to dtype. Inlined per head size, so the common ones run with the vector count known. */
static inline __attribute__((always_inline)) void attend_rows(const float* qf, int qn, const float* kt,
                                                              const float* vg, float* s, size_t sld, int b0,
                                                              int mblk, int m, int r0, int p0, int base,
                                                              int rep, int window, int g, int nh,
                                                              const int hd, void* out, int dtype, float cap,
                                                              const float* sk) {
    const int nc = hd / VL;
    const int k0 = b0 * VL; /* the first key scored, s[u * sld] its score */
    int u = 0;
    for (; u + QT <= qn; u += QT) score(qf + (size_t)u * hd, QT, kt, b0, mblk, hd, s + (size_t)u * sld, sld);
    for (; u < qn; u++) score(qf + (size_t)u * hd, 1, kt, b0, mblk, hd, s + (size_t)u * sld, sld);
    float inv[MAX_QUERIES];
    for (u = 0; u < qn; u++) {
        const int p = p0 + u / rep;
        const int lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
        float* row = s + (size_t)u * sld;
        if (cap > 0.f) softcap_row(row + lo - base - k0, p + 1 - lo, 1.0f / cap, cap); /* scores scaled */
        inv[u] = 1.0f /
                 softmax_weights(row, lo - base - k0, p + 1 - base - k0, m - k0, sk ? sk + u % rep : NULL);
    }
    /* the values in slices of at most 16 vectors of dimensions (a head of more: AVX2's 256), nt queries
     * summed together: nt * ncs <= 16 accumulators; each output element is the same sum whatever its slice */
    const int ncs = nc < 16 ? nc : 16, nt = 16 / ncs > QT ? QT : 16 / ncs;
    for (int c0 = 0; c0 < nc; c0 += ncs)
        for (u = 0; u < qn;) {
            const int k = qn - u >= nt ? nt : 1;
            vf acc[16];
            const float* vk = vg + (size_t)k0 * hd + (size_t)c0 * VL;
            if (k == nt)
                weigh(s + (size_t)u * sld, sld, nt, vk, m - k0, hd, ncs, acc);
            else
                weigh(s + (size_t)u * sld, sld, 1, vk, m - k0, hd, ncs, acc);
            for (int t = 0; t < k; t++, u++) {
                const size_t at =
                        ((size_t)(r0 + u / rep) * nh + (size_t)g * rep + u % rep) * hd + (size_t)c0 * VL;
                const vf vi = v_set1(inv[u]);
                for (int c = 0; c < ncs; c++)
                    v_dt_store(out, at + c * VL, v_mul(acc[t * ncs + c], vi), dtype);
            }
        }
}
#endif

#ifdef TILE_LAYOUT
/* bf16 prompts over a bf16 cache on CPUs with AVX-512 BF16: the products of bf16 pairs, as AMX tile products
 * where the CPU has AMX (Intel Sapphire Rapids on) and the kernel grants it, else as AVX-512 BF16 dot
 * products (AMD Zen 4 and 5, Intel Cooper Lake). Keys and values are laid out once per call in 32-key chunks
 * counted from a multiple of 32 (so a key's place in its chunk, and with it every sum's order, does not
 * depend on where the segment starts): kb[g][ck][c][h][r][j][e] = K[32 ck + 16 h + j][32 c + 2 r + e]   (the
 * scores' weight tiles, 1 KiB each) vb[g][ck][t][r][d][e]    = V[32 ck + 2 r + e][16 t + d]          (the
 * value product's weight tiles) A tile row (r) is also one vector of a dot product: 16 keys' (or dimensions')
 * pair of values. A task's queries (bf16, as they came) times kb are the scores, float32; the softmax is
 * taken in float32 (the scale applied first), its weights rounded to bf16 (as torch's bf16 SDPA rounds them)
 * and multiplied with vb, the sums float32, divided by the float32 normaliser and rounded once to bf16. The
 * two forms sum in their own orders (each fixed by the layout, not by the batch): a CPU gives the same bits
 * however a prompt is split, not the other form's bits. Without AMX the dot products do twice the float32
 * path's arithmetic per instruction where a CPU issues them at the FMA's rate, and round the weights as the
 * AMX path does. */

/* Chunk ck's keys and values of KV head g (positions k_first + 32 ck ..; past ctx: zeros) into their tiles.
 */
static void layout_chunk(const uint16_t* kc, const uint16_t* vc, const int64_t* table, int bs, size_t row,
                         int g, int hd, int k_first, int ck, int ctx, uint16_t* kb, uint16_t* vb) {
    uint32_t* kd = (uint32_t*)kb;
    for (int j = 0; j < 32; j++) {
        const int p = k_first + 32 * ck + j;
        const uint16_t *kr = NULL, *vr = NULL;
        if (p >= 0 && p < ctx) {
            const size_t off = ((size_t)table[p / bs] * bs + p % bs) * row + (size_t)g * hd;
            kr = kc + off;
            vr = vc + off;
        }
        const int h = j / 16, jj = j % 16;
        for (int pr = 0; pr < hd / 2; pr++) { /* the key's pair of dimensions 2 pr, 2 pr + 1 */
            uint32_t v = 0;
            if (kr) memcpy(&v, kr + 2 * pr, 4);
            kd[(((size_t)(pr / 16) * 2 + h) * 16 + pr % 16) * 16 + jj] = v;
        }
        const int r = j / 2, e = j % 2;
        for (int d = 0; d < hd; d++) vb[(((size_t)(d / 16) * 16 + r) * 16 + d % 16) * 2 + e] = vr ? vr[d] : 0;
    }
}

/* pr[j] = exp(scale * (w[j] - max)) rounded to bf16 for j in [lo, hi) (max over that range), 0 elsewhere in
 * [0, n); returns the float32 sum of the weights before rounding. The weights are normal numbers (v_exp stops
 * at -87), which the instruction's conversion rounds to nearest even as v_store_bf16 does. */
static inline float softmax_bf16(const float* w, int lo, int hi, int n, float scale, uint16_t* pr) {
    const float m = row_max(w + lo, hi - lo);
    int j;
    memset(pr, 0, sizeof(uint16_t) * lo);
    memset(pr + hi, 0, sizeof(uint16_t) * (n - hi));
    const vf mv = v_set1(m), sv = v_set1(scale);
    vf total = v_zero();
    for (j = lo; j + VL <= hi; j += VL) {
        const vf e = v_exp(v_mul(v_sub(v_load(w + j), mv), sv));
        total = v_add(total, e);
        _mm256_storeu_si256((__m256i*)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    float sum = v_sum(total);
    if (j < hi) { /* the tail through the same exp, padded with lanes it discards */
        float tmp[VL];
        for (int i = 0; i < VL; i++) tmp[i] = j + i < hi ? (w[j + i] - m) * scale : -87.f;
        v_store(tmp, v_exp(v_load(tmp)));
        for (int i = 0; j < hi; i++, j++) {
            pr[j] = f32_to_bf16(tmp[i]);
            sum += tmp[i];
        }
    }
    return sum;
}

/* The softmax of a block's queries 0..rows-1 (query u of the task: u0 + u; past qn: rows of zero weights),
 * scores s (rows sld apart) to weights pw (rows pld apart) over the block's n keys from key k0; inv[u]: 1 /
 * the row's sum. With cap > 0 the scaled scores are soft-capped first (s is overwritten). */
static void block_weights(float* s, size_t sld, uint16_t* pw, size_t pld, int rows, int qn, int u0, int n,
                          int k0, int k_first, int p0, int rep, int window, float scale, float cap,
                          float* inv) {
    for (int u = 0; u < rows; u++) {
        uint16_t* pr = pw + (size_t)u * pld;
        if (u >= qn) {
            memset(pr, 0, sizeof(uint16_t) * n);
            continue;
        }
        const int p = p0 + (u0 + u) / rep;
        const int lo = (window > 0 && p + 1 > window ? p + 1 - window : 0) - k_first - k0,
                  hi = p + 1 - k_first - k0;
        float* w = s + (size_t)u * sld;
        if (cap > 0.f) { /* the products scaled and capped in place; the softmax takes them as they are */
            softcap_row(w + lo, hi - lo, scale / cap, cap);
            inv[u] = 1.0f / softmax_bf16(w, lo, hi, n, 1.0f, pr);
        } else
            inv[u] = 1.0f / softmax_bf16(w, lo, hi, n, scale, pr);
    }
}

/* Row u of the block (query u0 + u) times inv[u], dimensions d0..d0 + 31 of its output row, rounded to bf16;
 * o: the block's sums, rows 32 apart. */
static void block_store(const float* o, const float* inv, int qn, int u0, int rep, int g, int nh, int hd,
                        int d0, uint16_t* out) {
    for (int u = 0; u < qn; u++) {
        const int uq = u0 + u;
        const size_t at = ((size_t)(uq / rep) * nh + (size_t)g * rep + uq % rep) * hd + (size_t)d0;
        const vf vi = v_set1(inv[u]);
        v_store_bf16(out + at, v_mul(v_load(o + u * 32), vi));
        v_store_bf16(out + at + 16, v_mul(v_load(o + u * 32 + 16), vi));
    }
}

#ifdef AMX_PATH
static void amx_configure(void) { /* every tile 16 rows of 64 bytes */
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    load_tile_config(&c);
}

/* One block of a task on the tile products: qn <= 32 queries (query u: the task's u0 + u, row (u0 + u) / rep
 * of `out`, at position p0 + (u0 + u) / rep, head g * rep + (u0 + u) % rep; q16: their bf16 rows, qn rounded
 * up to 32 with zero rows), keys from chunk ck0 to ck1 of the layouts (chunk 0 starting at position k_first),
 * out rounded to bf16. s: float32 scores, rows of (ck1 - ck0) * 32 + 16 (a row's lines then fall in other
 * cache sets than the last's, where a power of two put all sixteen rows of a tile in one); pw: the weights as
 * bf16, rows of (ck1 - ck0) * 32 + 32; o: [32][32] float32. 32 queries x 32 keys (or dimensions) a step in
 * four accumulators, which keeps the tile unit busier than 16 queries in two; the same bits. */
static void amx_attend_block(const uint16_t* q16, int qn, int u0, const uint16_t* kb, const uint16_t* vb,
                             int ck0, int ck1, int k_first, int p0, int rep, int window, int g, int nh,
                             int hd, float scale, float cap, float* s, uint16_t* pw, float* o,
                             uint16_t* out) {
    const int nc = hd / 32, nt = hd / 16, two = qn > 16;
    const size_t chunk_k = (size_t)nc * 1024, chunk_v = (size_t)nt * 512; /* bf16 values per chunk */
    const int k0 = ck0 * 32, n = (ck1 - ck0) * 32;
    const size_t sld = (size_t)n + 16, pld = (size_t)n + 32;
    /* scores: 32 queries x a chunk's 32 keys in four accumulators, the queries' tiles 4 and 5, the keys' 6
     * and 7 */
    for (int ck = ck0; ck < ck1; ck++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < nc; c++) {
            const uint16_t* b = kb + (size_t)ck * chunk_k + (size_t)c * 1024;
            _tile_loadd(4, q16 + 32 * c, hd * 2);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, q16 + (size_t)16 * hd + 32 * c, hd * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        float* at = s + (size_t)(ck - ck0) * 32;
        _tile_stored(0, at, sld * 4);
        _tile_stored(1, at + 16, sld * 4);
        if (two) {
            _tile_stored(2, at + 16 * sld, sld * 4);
            _tile_stored(3, at + 16 * sld + 16, sld * 4);
        }
    }
    float inv[32];
    block_weights(s, sld, pw, pld, two ? 32 : 16, qn, u0, n, k0, k_first, p0, rep, window, scale, cap, inv);
    /* weighted values: both query tiles x two 16-dimension tiles at a time (nt is even: hd is a multiple of
     * 32) */
    for (int t0 = 0; t0 < nt; t0 += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int ck = ck0; ck < ck1; ck++) {
            const uint16_t* b = vb + (size_t)ck * chunk_v + (size_t)t0 * 512;
            _tile_loadd(4, pw + (size_t)(ck - ck0) * 32, pld * 2);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, pw + (size_t)16 * pld + (size_t)(ck - ck0) * 32, pld * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, o, 128);
        _tile_stored(1, o + 16, 128);
        _tile_stored(2, o + 16 * 32, 128);
        _tile_stored(3, o + 16 * 32 + 16, 128);
        block_store(o, inv, qn, u0, rep, g, nh, hd, t0 * 16, out);
    }
}
#endif

/* amx_attend_block's contract through dot products (q16's rows past qn are not read): the block's queries in
 * register tiles of nearly equal height (32 queries: 11, 11, 10) times each chunk's 32 keys, then times the
 * values' dimensions 32 at a time over all the block's keys. */
static void dot_attend_block(const uint16_t* q16, int qn, int u0, const uint16_t* kb, const uint16_t* vb,
                             int ck0, int ck1, int k_first, int p0, int rep, int window, int g, int nh,
                             int hd, float scale, float cap, float* s, uint16_t* pw, float* o,
                             uint16_t* out) {
    const int nc = hd / 32, nt = hd / 16, parts = (qn + DOT_ROWS - 1) / DOT_ROWS;
    const size_t chunk_k = (size_t)nc * 1024, chunk_v = (size_t)nt * 512;
    const int k0 = ck0 * 32, n = (ck1 - ck0) * 32;
    const size_t sld = (size_t)n + 16, pld = (size_t)n + 32;
    for (int ck = ck0; ck < ck1; ck++)
        for (int q = 0, i0 = 0; q < parts; q++) {
            const int h = qn / parts + (q < qn % parts);
            DOT_ROWS_OF[h](q16 + (size_t)i0 * hd, hd, kb + (size_t)ck * chunk_k, 1024, nc,
                           s + (size_t)i0 * sld + (size_t)(ck - ck0) * 32, sld, 0, NULL, 0);
            i0 += h;
        }
    float inv[32];
    block_weights(s, sld, pw, pld, qn, qn, u0, n, k0, k_first, p0, rep, window, scale, cap, inv);
    for (int t0 = 0; t0 < nt; t0 += 2) { /* nt is even: hd is a multiple of 32 */
        for (int q = 0, i0 = 0; q < parts; q++) {
            const int h = qn / parts + (q < qn % parts);
            DOT_ROWS_OF[h](pw + (size_t)i0 * pld, pld, vb + (size_t)ck0 * chunk_v + (size_t)t0 * 512, chunk_v,
                           ck1 - ck0, o + (size_t)i0 * 32, 32, 0, NULL, 0);
            i0 += h;
        }
        block_store(o, inv, qn, u0, rep, g, nh, hd, t0 * 16, out);
    }
}

/* The whole call on the tile layout (see above); the same contract as sidecar_prefill_attention. amx: the
 * tile products (the tile state granted), else the dot products. */
static int prefill_tiles(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                         uint16_t* out, int L, int ctx, int nh, int nkv, int hd, int bs, int window,
                         float scale, float cap, int nthreads, int amx) {
    (void)amx; /* a build without AMX has only the dot products */
    const int rep = nh / nkv, start = ctx - L;
    const int base = window > 0 && start + 1 > window ? start + 1 - window : 0; /* first key any row sees */
    const int k_first = base / 32 * 32, nck = (ctx - k_first + 31) / 32;
    const size_t per_k = (size_t)nck * (hd / 32) * 1024,
                 per_v = (size_t)nck * (hd / 16) * 512; /* bf16s a head */
    if ((long long)((per_k + per_v) * nkv * sizeof(uint16_t)) > MAX_SCRATCH) return 1;
    uint16_t* kb = (uint16_t*)malloc(sizeof(uint16_t) * per_k * nkv);
    uint16_t* vb = (uint16_t*)malloc(sizeof(uint16_t) * per_v * nkv);
    if (!kb || !vb) {
        free(kb);
        free(vb);
        return 2;
    }
    const int QB = rep >= 32 ? 1 : 32 / rep,
              nqb = (L + QB - 1) / QB; /* rows per task: rep * QB queries, ~32 */
    const size_t row = (size_t)nkv * hd, sld = (size_t)nck * 32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < nkv * nck; t++) {
            const int g = t / nck, ck = t % nck;
            layout_chunk(kc, vc, table, bs, row, g, hd, k_first, ck, ctx,
                         kb + g * per_k + (size_t)ck * (hd / 32) * 1024,
                         vb + g * per_v + (size_t)ck * (hd / 16) * 512);
        }
        const int nq32 = (rep * QB + 31) / 32 * 32;
        float* s = (float*)aligned_alloc(64, sizeof(float) * 32 * (sld + 16));
        uint16_t* pw = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 32 * (sld + 32));
        uint16_t* q16 = (uint16_t*)malloc(sizeof(uint16_t) * nq32 * hd);
        float* o = (float*)aligned_alloc(64, sizeof(float) * 32 * 32);
        const int ready = s && pw && q16 && o;
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
#ifdef AMX_PATH
        if (ready && amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < nkv * nqb; t++) {
            if (!ready) continue;
            const int g = t % nkv, r0 = (nqb - 1 - t / nkv) * QB; /* the longest (last rows) first */
            const int rows = L - r0 < QB ? L - r0 : QB, qn = rows * rep;
            const int p_first = start + r0, hi = p_first + rows; /* keys of the task: before hi */
            const int lo_first = window > 0 && p_first + 1 > window ? p_first + 1 - window : 0;
            for (int u = 0; u < qn; u++)
                memcpy(q16 + (size_t)u * hd,
                       q + ((size_t)(r0 + u / rep) * nh + (size_t)g * rep + u % rep) * hd,
                       sizeof(uint16_t) * hd);
            memset(q16 + (size_t)qn * hd, 0, sizeof(uint16_t) * (size_t)((qn + 31) / 32 * 32 - qn) * hd);
            const int ck0 = (lo_first - k_first) / 32, ck1 = (hi - k_first + 31) / 32;
            uint16_t* o_rows = out + (size_t)r0 * nh * hd;
            for (int u0 = 0; u0 < qn; u0 += 32) { /* the task's queries, 32 at a time */
                const int bn = qn - u0 < 32 ? qn - u0 : 32;
#ifdef AMX_PATH
                if (amx) {
                    amx_attend_block(q16 + (size_t)u0 * hd, bn, u0, kb + g * per_k, vb + g * per_v, ck0, ck1,
                                     k_first, p_first, rep, window, g, nh, hd, scale, cap, s, pw, o, o_rows);
                    continue;
                }
#endif
                dot_attend_block(q16 + (size_t)u0 * hd, bn, u0, kb + g * per_k, vb + g * per_v, ck0, ck1,
                                 k_first, p_first, rep, window, g, nh, hd, scale, cap, s, pw, o, o_rows);
            }
        }
#ifdef AMX_PATH
        if (ready && amx) _tile_release();
#endif
        free(s);
        free(pw);
        free(q16);
        free(o);
    }
    free(kb);
    free(vb);
    return failed ? 2 : 0;
}
#endif

/* The arguments of sidecar_prefill_attention (mirrored by ``PrefillAttentionArgs``). */
typedef struct {
    const void* q;
    const void* kc;
    const void* vc;
    const int64_t* table;
    void* out;
    const float* ks;
    const float* vs;
    int L;
    int ctx;
    int nh;
    int nkv;
    int hd;
    int bs;
    int window;
    float scale;
    int dtype;
    int nthreads;
    float softcap;      /* > 0: scores soft-capped (see above); 0: not */
    const float* sinks; /* NULL, or [nh]: a logit per head in its softmax's denominator (see above) */
} sidecar_prefill_attention_args;
int sidecar_prefill_attention_args_size(void) {
    return (int)sizeof(sidecar_prefill_attention_args);
}

/* q, out: [L, nh, hd] contiguous (q's dtype: 0 float32, 1 bf16; a cache of int8 codes when ks/vs are given,
 * else of q's dtype); table: the segment's blocks (at least ceil(ctx / bs)). Returns 0, 2 when out of memory,
 * or 1 when the inputs are outside what this kernel handles (the caller keeps its torch path). */
int sidecar_prefill_attention(const sidecar_prefill_attention_args* a) {
    const void* q = a->q;
    const void* kc = a->kc;
    const void* vc = a->vc;
    const int64_t* table = a->table;
    void* out = a->out;
    int L = a->L;
    int ctx = a->ctx;
    int nh = a->nh;
    int nkv = a->nkv;
    int hd = a->hd;
    int bs = a->bs;
    int window = a->window;
    float scale = a->scale;
    int dtype = a->dtype;
    int nthreads = a->nthreads;
    const float* ks = a->ks;
    const float* vs = a->vs;
    const float cap = a->softcap;
    const float* sinks = a->sinks;
#ifdef VL
    if ((ks == NULL) != (vs == NULL)) return 1;
    if (L < 1 || ctx < L || nkv <= 0 || nh % nkv || nh / nkv > MAX_QUERIES || hd % VL || hd > 256 || bs <= 0)
        return 1;
    const int kvm = ks ? 2 : dtype, rep = nh / nkv, nc = hd / VL;
#ifdef TILE_LAYOUT
#ifdef AMX_PATH
    const int amx = amx_granted();
#else
    const int amx = 0;
#endif
    if (kvm == 1 && hd % 32 == 0 && !sinks)
        return prefill_tiles((const uint16_t*)q, (const uint16_t*)kc, (const uint16_t*)vc, table,
                             (uint16_t*)out, L, ctx, nh, nkv, hd, bs, window, scale, cap, nthreads, amx);
#endif
    const int start = ctx - L;
    const int base = window > 0 && start + 1 > window ? start + 1 - window : 0; /* first key any row sees */
    const int n = ctx - base, nblk = (n + VL - 1) / VL;
    const size_t per_head = (size_t)nblk * VL * hd; /* floats of widened keys (and of values) per KV head */
    if ((long long)(2 * per_head * nkv * sizeof(float)) > MAX_SCRATCH) return 1;
    float* kt = (float*)malloc(sizeof(float) * per_head * nkv);
    float* vrows = (float*)malloc(sizeof(float) * per_head * nkv);
    if (!kt || !vrows) {
        free(kt);
        free(vrows);
        return 2;
    }
    /* rows per task: rep * QB queries, about 32 */
    const int QB = rep >= 32 ? 1 : 32 / rep;
    const int nqb = (L + QB - 1) / QB;
    const size_t row = (size_t)nkv * hd;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
/* 1. keys transposed in blocks of VL, values as rows; keys past the context are zero */
#pragma omp for schedule(static)
        for (int t = 0; t < nkv * nblk; t++) {
            const int g = t / nblk, b = t % nblk;
            float* kb = kt + (size_t)g * per_head + (size_t)b * VL * hd;
            float* vb = vrows + (size_t)g * per_head + (size_t)b * VL * hd;
            float tmp[VL * 256];
            for (int i = 0; i < VL; i++) {
                const int p = base + b * VL + i;
                if (p >= ctx) {
                    for (int c = 0; c < nc; c++) {
                        v_store(tmp + i * hd + c * VL, v_zero());
                        v_store(vb + (size_t)i * hd + c * VL, v_zero());
                    }
                    continue;
                }
                const size_t off = ((size_t)table[p / bs] * bs + p % bs) * row + (size_t)g * hd;
                for (int c = 0; c < nc; c++) {
                    v_store(tmp + i * hd + c * VL, kv_vec(kc, off + c * VL, kvm, ks, hd));
                    v_store(vb + (size_t)i * hd + c * VL, kv_vec(vc, off + c * VL, kvm, vs, hd));
                }
            }
            for (int d = 0; d < hd; d++)
                for (int i = 0; i < VL; i++) kb[d * VL + i] = tmp[i * hd + d];
        }
        /* 2-3. tasks: a KV head and QB rows, the longest (last rows) first */
        const int nq = rep * QB;
        float* qf = (float*)malloc(sizeof(float) * (size_t)nq * hd);
        float* s = (float*)malloc(sizeof(float) * (size_t)nq * nblk * VL);
        if (!qf || !s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < nkv * nqb; t++) {
            if (!qf || !s) continue;
            const int g = t % nkv, r0 = (nqb - 1 - t / nkv) * QB;
            const int rows = L - r0 < QB ? L - r0 : QB;
            const int hi = start + r0 + rows; /* keys of the task: [base, hi) at most */
            const int m = hi - base, mblk = (m + VL - 1) / VL;
            const int p_first = start + r0; /* the task's first row sees keys from lo_first */
            const int lo_first = window > 0 && p_first + 1 > window ? p_first + 1 - window : 0;
            const int b0 = (lo_first - base) / VL;
            const size_t sld = (size_t)mblk * VL;
            const int qn = rows * rep; /* query u: row r0 + u / rep, head g * rep + u % rep */
            for (int u = 0; u < qn; u++) {
                const size_t at = ((size_t)(r0 + u / rep) * nh + (size_t)g * rep + u % rep) * hd;
                for (int c = 0; c < nc; c++)
                    v_store(qf + (size_t)u * hd + c * VL,
                            v_mul(v_dt_load(q, at + c * VL, dtype), v_set1(scale)));
            }
            const float* ktg = kt + (size_t)g * per_head;
            const float* vg = vrows + (size_t)g * per_head;
            const float* sk = sinks ? sinks + (size_t)g * rep : NULL; /* this KV head's query heads */
            if (hd == 64)
                attend_rows(qf, qn, ktg, vg, s, sld, b0, mblk, m, r0, start + r0, base, rep, window, g, nh,
                            64, out, dtype, cap, sk);
            else if (hd == 128)
                attend_rows(qf, qn, ktg, vg, s, sld, b0, mblk, m, r0, start + r0, base, rep, window, g, nh,
                            128, out, dtype, cap, sk);
            else
                attend_rows(qf, qn, ktg, vg, s, sld, b0, mblk, m, r0, start + r0, base, rep, window, g, nh,
                            hd, out, dtype, cap, sk);
        }
        free(qf);
        free(s);
    }
    free(kt);
    free(vrows);
    return failed ? 2 : 0;
#else
    (void)q;
    (void)kc;
    (void)vc;
    (void)table;
    (void)out;
    (void)L;
    (void)ctx;
    (void)nh;
    (void)nkv;
    (void)hd;
    (void)bs;
    (void)window;
    (void)scale;
    (void)dtype;
    (void)nthreads;
    (void)ks;
    (void)vs;
    (void)cap;
    (void)sinks;
    return 1;
#endif
}
