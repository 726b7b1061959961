/* Paged decode attention on CPU: one query row per sequence position, reading K/V straight from the
 * paged cache (no gather into a contiguous copy, no mask tensor).
 *
 *   out[b, h, :] = softmax_j(scale * q[b, h, :] . K[j, h / rep, :]) V[j, h / rep, :],  lo_b <= j < ctx_b
 *
 * where position j of row b lives in slot tables[b, j / bs] * bs + j % bs of the cache
 * ([num_blocks, bs, nkv, hd]), rep = nh / nkv query heads share a KV head (grouped-query attention),
 * and lo_b = max(0, ctx_b - window) with a sliding window (window <= 0: none).
 *
 * Every (row, KV head) pair is one task: its rep queries are scored against the keys in one pass
 * (each key loaded once for all of them), softmax in float32 with a vectorised exp, then the values
 * are summed in float32. A row's result depends only on its own query and context, never on which
 * other rows share the call, so verifying k speculative tokens in one call gives bit for bit what k
 * separate decode steps give. Inputs and output are float32 (dtype 0) or bfloat16 (dtype 1; products
 * and sums still in float32, the output rounded to nearest even).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
static inline vf v_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void v_store(float* p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline float v_sum(vf x) { return _mm512_reduce_add_ps(x); }
/* out[i] = sum of the lanes of a_i */
static inline void v_sum4(vf a0, vf a1, vf a2, vf a3, float* out) {
    vf t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    vf t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    vf u = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, 0x44), _mm512_shuffle_ps(t01, t23, 0xEE));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
static inline vf v_load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf v_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2(vf n) {  /* 2^n for integral n in the normal range */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
static inline vf v_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void v_store(float* p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline float v_sum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline void v_sum4(vf a0, vf a1, vf a2, vf a3, float* out) {
    vf t01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    vf t23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    vf u = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, 0x44), _mm256_shuffle_ps(t01, t23, 0xEE));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}
static inline vf v_load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf v_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

#ifdef VL
/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
 * degree-6 polynomial; below -87 the result flushes to 0. */
static inline vf v_exp(vf x) {
    x = v_max(x, v_set1(-87.0f));
    const vf n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    vf r = v_fnma(n, v_set1(0.693359375f), x);
    r = v_fnma(n, v_set1(-2.12194440e-4f), r);
    vf p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    p = v_fma(p, v_mul(r, r), v_add(r, v_set1(1.0f)));
    return v_mul(p, v_pow2(n));
}
#endif

#define MAX_REP 64
#define MAX_HD 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

int sidecar_paged_attention_vector_width(void) {
#ifdef VL
    return VL;
#else
    return 1;
#endif
}

/* One (row, KV head) task. qf: the rep queries in float32, already scaled; s: scratch [rep][n]; of: [rep][hd].
 * Inlined per head size, so the common ones (64, 128) run with the vector count known. */
static inline __attribute__((always_inline)) void attend(const float* qf, const char* kc, const char* vc, const int64_t* table, int lo, int hi,
                   int rep, int nkv, int g, int hd, int bs, int dtype, float* s, float* of,
                   size_t* offs) {
    const int n = hi - lo;
    const size_t row = (size_t)nkv * hd;  /* elements per slot */
    /* where each key of the context lives, block by block (no division per key) */
    for (int j = 0, p = lo; j < n;) {
        const size_t base = ((size_t)table[p / bs] * bs) * row + (size_t)g * hd;
        for (int slot = p % bs; slot < bs && j < n; slot++, j++, p++) offs[j] = base + (size_t)slot * row;
    }
    /* scores, four keys at a time: each key is loaded (and widened) once for all rep queries, and the
     * four dot products are reduced together; a key's score is the same arithmetic wherever it falls */
#ifdef VL
    for (int j = 0; j < n; j += 4) {
        vf k4[4][MAX_HD / VL];
        for (int i = 0; i < 4; i++) {
            if (j + i >= n) {
                for (int c = 0; c < hd / VL; c++) k4[i][c] = v_zero();
                continue;
            }
            const size_t off = offs[j + i];
            for (int c = 0; c < hd / VL; c++)
                k4[i][c] = dtype ? v_load_bf16((const uint16_t*)kc + off + c * VL) : v_load((const float*)kc + off + c * VL);
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
            for (int i = 0; i < 4 && j + i < n; i++) s[(size_t)r * n + j + i] = sums[i];
        }
    }
#else
    for (int j = 0; j < n; j++) {
        const size_t off = offs[j];
        for (int r = 0; r < rep; r++) {
            float acc = 0.f;
            for (int d = 0; d < hd; d++)
                acc += qf[r * hd + d] * (dtype ? bf16_to_f32(((const uint16_t*)kc)[off + d]) : ((const float*)kc)[off + d]);
            s[(size_t)r * n + j] = acc;
        }
    }
#endif
    /* softmax per query, then the weighted sum of values */
    for (int r = 0; r < rep; r++) {
        float* sr = s + (size_t)r * n;
        float m = sr[0];
        for (int j = 1; j < n; j++) m = sr[j] > m ? sr[j] : m;
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
        if (j < n) {  /* the tail through the same vector exp, padded with lanes it discards */
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
        const float inv = 1.0f / total;
        float* o = of + (size_t)r * hd;
#ifdef VL
        /* values summed in registers, even and odd keys in separate accumulators (two FMA chains) */
        vf a0[MAX_HD / VL], a1[MAX_HD / VL];
        for (int c = 0; c < hd / VL; c++) a0[c] = a1[c] = v_zero();
        for (j = 0; j + 1 < n; j += 2) {
            const size_t off0 = offs[j], off1 = offs[j + 1];
            const vf w0 = v_set1(sr[j]), w1 = v_set1(sr[j + 1]);
            for (int c = 0; c < hd / VL; c++) {
                a0[c] = v_fma(w0, dtype ? v_load_bf16((const uint16_t*)vc + off0 + c * VL)
                                        : v_load((const float*)vc + off0 + c * VL), a0[c]);
                a1[c] = v_fma(w1, dtype ? v_load_bf16((const uint16_t*)vc + off1 + c * VL)
                                        : v_load((const float*)vc + off1 + c * VL), a1[c]);
            }
        }
        if (j < n) {
            const size_t off0 = offs[j];
            const vf w0 = v_set1(sr[j]);
            for (int c = 0; c < hd / VL; c++)
                a0[c] = v_fma(w0, dtype ? v_load_bf16((const uint16_t*)vc + off0 + c * VL)
                                        : v_load((const float*)vc + off0 + c * VL), a0[c]);
        }
        const vf vinv = v_set1(inv);
        for (int c = 0; c < hd / VL; c++) v_store(o + c * VL, v_mul(v_add(a0[c], a1[c]), vinv));
#else
        for (int d = 0; d < hd; d++) o[d] = 0.f;
        for (j = 0; j < n; j++) {
            const size_t off = offs[j];
            const float w = sr[j];
            for (int d = 0; d < hd; d++)
                o[d] += w * (dtype ? bf16_to_f32(((const uint16_t*)vc)[off + d]) : ((const float*)vc)[off + d]);
        }
        for (int d = 0; d < hd; d++) o[d] *= inv;
#endif
    }
}

/* q, out: [B, nh, hd] contiguous; tables: [B, max_blocks] int64; ctx: [B] int64 (1 <= ctx <= max_blocks * bs).
 * Returns 0, or 1 when the shapes are outside what this kernel handles (the caller keeps its torch path). */
int sidecar_paged_decode_attention(const void* q, const void* kc, const void* vc, const int64_t* tables,
                                   const int64_t* ctx, void* out, int B, int nh, int nkv, int hd, int bs,
                                   int max_blocks, int window, float scale, int dtype, int nthreads) {
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
            for (int i = 0; i < rep * hd; i++)
                qf[i] = scale * (dtype ? bf16_to_f32(((const uint16_t*)q)[q0 + i]) : ((const float*)q)[q0 + i]);
            const int64_t* table = tables + (size_t)b * max_blocks;
            if (hd == 64) attend(qf, (const char*)kc, (const char*)vc, table, lo, hi, rep, nkv, g, 64, bs, dtype, s, of, offs);
            else if (hd == 128) attend(qf, (const char*)kc, (const char*)vc, table, lo, hi, rep, nkv, g, 128, bs, dtype, s, of, offs);
            else attend(qf, (const char*)kc, (const char*)vc, table, lo, hi, rep, nkv, g, hd, bs, dtype, s, of, offs);
            for (int i = 0; i < rep * hd; i++) {
                if (dtype) ((uint16_t*)out)[q0 + i] = f32_to_bf16(of[i]);
                else ((float*)out)[q0 + i] = of[i];
            }
        }
        free(s);
        free(offs);
        free(qf);
        free(of);
    }
    return failed ? 2 : 0;
}
