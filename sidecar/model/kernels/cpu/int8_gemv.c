/* Weight-only int8 matmul for decode-sized batches on CPU (up to a few dozen activation rows).
 *
 *   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]      x float32 [M, K], w int8 [N, K], y float32 [M, N]
 *
 * and its grouped form (llama.cpp's Q8_0 blocks), one float scale per 32 columns of w:
 *
 *   y[m, n] = sum_g d[n, g] * sum_{k in g} x[m, k] * w[n, k]           d float32 [N, K / 32]
 *
 * Each activation row is first rounded to int16 with its own scale (absmax / q, q <= 32767
 * chosen so that no int32 lane can overflow for this K); weights are widened to int16 and
 * multiplied in pairs into int32 lanes (AVX-512 VNNI vpdpwssd, else AVX2 vpmaddwd). int16
 * activations keep up to 15 bits where the bf16 rounding around torch's packed kernel keeps 8,
 * and the integer sums are exact (the grouped form scales each group's exact int32 sum in float).
 *
 * Work goes in register tiles of up to MT activation rows x NT weight rows: each 32-column chunk
 * of a weight row is widened once for all MT activation rows, and each activation chunk is loaded
 * once for NT weight rows, so neither the weights (read once from memory, which bounds decode)
 * nor the activations (re-read from cache once per NT weight rows) cost more than their share.
 * Tiles of weight rows are split across threads.
 */
#include <stdlib.h>

#include "vec.h"
#include "matmul_args.h"
#include "moe_args.h"

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define NT 4
/* products summed per int32 lane per 32 columns: one vpdpwssd of 16 lanes x 2 */
#define LANE_PRODUCTS 2
#elif defined(__AVX2__)
#define NT            2
/* two vpmaddwd of 8 lanes x 2, added */
#define LANE_PRODUCTS 4
#else
#define NT            1
/* scalar sums are int64: never overflow */
#define LANE_PRODUCTS 0
#endif
#define MT 4

/* Largest activation code such that no int32 vector lane can overflow: a lane sums at most
 * LANE_PRODUCTS * ceil(K / 32) products of |w| <= 128 (codes span the whole int8 range: hub checkpoints'
 * symmetric 8-bit rounding reaches -128) and |x| <= q; at most 32767 (int16). A pair product of vpmaddwd
 * or vpdpwssd is at most 2 * 128 * 32767, far inside int32. */
static float activation_qmax(int K) {
    if (LANE_PRODUCTS == 0) return 32767.f;
    double chunks = (double)((K + 31) / 32);
    double q = 2147483647.0 / (128.0 * LANE_PRODUCTS * (chunks > 1 ? chunks : 1));
    return (float)(q < 32767.0 ? floor(q) : 32767.0);
}

/* x: float32, or bf16 when x_bf16 (then each row is widened into row [K] first) */
static void quantize_rows(const void* x, int x_bf16, float* row, int16_t* xq, float* xs, int M, int K,
                          float qmax) {
    for (int m = 0; m < M; m++) {
        const float* xr = (const float*)x + (int64_t)m * K;
        if (x_bf16) {
            for (int k = 0; k < K; k++) row[k] = dt_load(x, (size_t)m * K + k, 1);
            xr = row;
        }
        float amax = 0.f;
        int finite = 1;
        for (int k = 0; k < K; k++) {
            amax = fmaxf(amax, fabsf(xr[k]));
            finite &= isfinite(xr[k]);
        }
        float inv = amax > 0.f && finite ? qmax / amax : 0.f;
        /* A NaN or infinite activation makes its whole output row NaN, as a float matmul would. */
        xs[m] = !finite ? NAN : (amax > 0.f ? amax / qmax : 0.f);
        int16_t* q = xq + (int64_t)m * K;
        for (int k = 0; k < K; k++) q[k] = (int16_t)lrintf(xr[k] * inv);
    }
}

/* Integer dot products of one 32-column chunk: p[i][j] (vector lanes) for activation rows i < MB
 * (x + i * K) and weight rows j < NB (w + j * K). MB and NB are compile-time constants at every
 * call site, so the tiles stay in registers. */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
typedef __m512i lanes_t;
#define LANES_ZERO() _mm512_setzero_si512()
static inline
        __attribute__((always_inline)) void chunk_dot(const int16_t* x, const int8_t* w, int64_t K, int k,
                                                      const int MB, const int NB, lanes_t acc[MT][NT]) {
    __m512i wv[NT];
    for (int j = 0; j < NB; j++)
        wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + j * K + k)));
    for (int i = 0; i < MB; i++) {
        __m512i xv = _mm512_loadu_si512((const void*)(x + i * K + k));
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], wv[j], xv);
    }
}
static inline int64_t lanes_sum(__m512i a) {
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a)),
                                                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1))));
}
static inline __m512 lanes_fma(__m512i p, float d, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d), acc);
}
typedef __m512 flanes_t;
#define FLANES_ZERO() _mm512_setzero_ps()
static inline float flanes_sum(__m512 a) {
    return _mm512_reduce_add_ps(a);
}
#elif defined(__AVX2__)
static inline int64_t lanes_sum(__m256i a) {
    __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)),
                                    _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    return _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
}
static inline float flanes_sum(__m256 a) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}

/* AVX2 has 16 vector registers: an MT x NT tile's accumulators, its NT widened weight chunks and a pair's
 * products fit only if each pair is finished (its two vpmaddwd summed and added or folded) before the next
 * pair's products begin, and only if the accumulators are one flat array that the compiler unrolls into
 * registers (a nested [MT][NT] array stays in memory: a load and a store per pair and chunk). So the AVX2
 * tiles below are written pair by pair, t = i * NB + j; they compute the same integer sums and the same
 * float folds, in the same order, as the generic tiles after them. */
#define FLAT_TILES 1

/* w0[j], w1[j]: the 32-column chunk at k of weight row j, widened to int16 in two halves. */
#define WIDEN_CHUNK(w, K, k, NB, w0, w1)                                                              \
    _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) {                                            \
        w0[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + (int64_t)j * K + k)));      \
        w1[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + (int64_t)j * K + k + 16))); \
    }

/* The int32 lanes of one pair's 32-column products: activation row xi (at column k), weight row halves. */
static inline __m256i pair_dot(const int16_t* xi, __m256i w0, __m256i w1) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)xi)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xi + 16))));
}

/* out[i * NB + j] = sum_k x[i, k] * w[j, k], exact. Prefetch as the generic dot_tile says. */
static inline __attribute__((always_inline)) void dot_tile(const int16_t* x, const int8_t* w, int K,
                                                           const int MB, const int NB, int64_t* out) {
    __m256i acc[MT * NT], w0[NT], w1[NT];
#pragma GCC unroll 8
    for (int t = 0; t < MB * NB; t++) acc[t] = _mm256_setzero_si256();
    const char* ahead = (const char*)(w + (int64_t)2 * NB * K);
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch(ahead + 4 * k, _MM_HINT_T1);
        _mm_prefetch(ahead + 4 * k + 64, _MM_HINT_T1);
        WIDEN_CHUNK(w, K, k, NB, w0, w1)
#pragma GCC unroll 8
        for (int t = 0; t < MB * NB; t++) {
            acc[t] =
                    _mm256_add_epi32(acc[t], pair_dot(x + (int64_t)(t / NB) * K + k, w0[t % NB], w1[t % NB]));
            __asm__("" : "+x"(acc[t])); /* finished here: the next pair's products do not start early */
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < MB * NB; t++) {
        int64_t s = lanes_sum(acc[t]);
        const int16_t* xi = x + (int64_t)(t / NB) * K;
        const int8_t* wj = w + (int64_t)(t % NB) * K;
        for (int c = k; c < K; c++) s += (int64_t)xi[c] * (int64_t)wj[c];
        out[t] = s;
    }
}

/* out[i * NB + j] = sum_g d[j, g] * sum_{k in g} x[i, k] * w[j, k]; K a multiple of 32. */
static inline __attribute__((always_inline)) void dot_tile_g32(const int16_t* x, const int8_t* w,
                                                               const float* d, int K, const int MB,
                                                               const int NB, float* out) {
    __m256 acc[MT * NT], dv[NT];
    __m256i w0[NT], w1[NT];
    const int G = K / 32;
#pragma GCC unroll 8
    for (int t = 0; t < MB * NB; t++) acc[t] = _mm256_setzero_ps();
    const char* ahead = (const char*)(w + (int64_t)2 * NB * K);
    for (int k = 0; k < K; k += 32) {
        _mm_prefetch(ahead + 4 * k, _MM_HINT_T1);
        _mm_prefetch(ahead + 4 * k + 64, _MM_HINT_T1);
        WIDEN_CHUNK(w, K, k, NB, w0, w1)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) dv[j] = _mm256_broadcast_ss(d + (int64_t)j * G + (k >> 5));
#pragma GCC unroll 8
        for (int t = 0; t < MB * NB; t++) {
            __m256i p = pair_dot(x + (int64_t)(t / NB) * K + k, w0[t % NB], w1[t % NB]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dv[t % NB], acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < MB * NB; t++) out[t] = flanes_sum(acc[t]);
}
#else
typedef int64_t lanes_t;
#define LANES_ZERO()  0
static inline void chunk_dot(const int16_t* x, const int8_t* w, int64_t K, int k, const int MB, const int NB,
                             lanes_t acc[MT][NT]) {
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++)
            for (int c = 0; c < 32; c++) acc[i][j] += (int64_t)x[i * K + k + c] * (int64_t)w[j * K + k + c];
}
static inline int64_t lanes_sum(int64_t a) {
    return a;
}
static inline float lanes_fma(int64_t p, float d, float acc) {
    return acc + (float)p * d;
}
typedef float flanes_t;
#define FLANES_ZERO() 0.f
static inline float flanes_sum(float a) {
    return a;
}
#endif

#ifndef FLAT_TILES
/* out[i * NB + j] = sum_k x[i, k] * w[j, k], exact. */
static inline __attribute__((always_inline)) void dot_tile(const int16_t* x, const int8_t* w, int K,
                                                           const int MB, const int NB, int64_t* out) {
    lanes_t acc[MT][NT];
    int k = 0;
    for (int i = 0; i < MB; i++) {
        for (int j = 0; j < NB; j++) {
            acc[i][j] = LANES_ZERO();
            out[i * NB + j] = 0;
        }
    }
    /* The tiles of a thread are consecutive rows, one contiguous stretch of memory: prefetch the
     * tile after next at the pace this one is consumed (128 bytes per chunk covers NT rows), into L2: into
     * L1 the prefetches hold its few fill buffers and the kernel waits on them. */
    const char* ahead = (const char*)(w + (int64_t)2 * NB * K);
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch(ahead + 4 * k, _MM_HINT_T1);
        _mm_prefetch(ahead + 4 * k + 64, _MM_HINT_T1);
        chunk_dot(x, w, K, k, MB, NB, acc);
    }
    for (int i = 0; i < MB; i++) {
        for (int j = 0; j < NB; j++) {
            int64_t s = lanes_sum(acc[i][j]);
            for (int c = k; c < K; c++) s += (int64_t)x[(int64_t)i * K + c] * (int64_t)w[(int64_t)j * K + c];
            out[i * NB + j] = s;
        }
    }
}

/* out[i * NB + j] = sum_g d[j, g] * sum_{k in g} x[i, k] * w[j, k]; K a multiple of 32. */
static inline __attribute__((always_inline)) void dot_tile_g32(const int16_t* x, const int8_t* w,
                                                               const float* d, int K, const int MB,
                                                               const int NB, float* out) {
    flanes_t acc[MT][NT];
    const int G = K / 32;
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = FLANES_ZERO();
    const char* ahead = (const char*)(w + (int64_t)2 * NB * K); /* as in dot_tile */
    for (int k = 0; k < K; k += 32) {
        _mm_prefetch(ahead + 4 * k, _MM_HINT_T1);
        _mm_prefetch(ahead + 4 * k + 64, _MM_HINT_T1);
        lanes_t p[MT][NT];
        for (int i = 0; i < MB; i++)
            for (int j = 0; j < NB; j++) p[i][j] = LANES_ZERO();
        chunk_dot(x, w, K, k, MB, NB, p);
        for (int j = 0; j < NB; j++) {
            float dj = d[(int64_t)j * G + (k >> 5)];
            for (int i = 0; i < MB; i++) acc[i][j] = lanes_fma(p[i][j], dj, acc[i][j]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) out[i * NB + j] = flanes_sum(acc[i][j]);
}

#endif

/* Every (MB, NB) pair the drivers use, each with constant sizes. */
#define TILE_CASES(CALL)    \
    switch (mb * 8 + nb) {  \
        case 1 * 8 + NT:    \
            CALL(1, NT);    \
            break;          \
        case 2 * 8 + NT:    \
            CALL(2, NT);    \
            break;          \
        case 3 * 8 + NT:    \
            CALL(3, NT);    \
            break;          \
        case 4 * 8 + NT:    \
            CALL(4, NT);    \
            break;          \
            NB1_CASES(CALL) \
        default:            \
            CALL(4, 1);     \
            break;          \
    }
#if NT > 1
#define NB1_CASES(CALL) \
    case 1 * 8 + 1:     \
        CALL(1, 1);     \
        break;          \
    case 2 * 8 + 1:     \
        CALL(2, 1);     \
        break;          \
    case 3 * 8 + 1:     \
        CALL(3, 1);     \
        break;
#else
#define NB1_CASES(CALL)
#endif

#define X_BF16    1 /* flags: x is bf16 (else float32) */
#define Y_BF16    2 /* y is bf16, the float32 result rounded once (else float32) */
#define BIAS_BF16 4 /* bias is bf16 (else float32) */
#define GROUPED   8 /* s is the grouped form's d [N, K / 32] (else one scale per row [N]) */

/* Outputs n0 .. n0 + NT - 1 (those below N) of M activation rows (xq [M, K] int16 codes, xs [M] their
 * scales) through w [N, K] and its scales s (the per-row scale [N], or with GROUPED d [N, K / 32]); bias [N]
 * or NULL, added before the rounding of a bf16 y [M, N]. */
static inline void weight_tile(const int16_t* xq, const float* xs, const int8_t* w, const float* s,
                               const void* bias, void* y, int M, int N, int K, int n0, int flags) {
    const int grouped = (flags & GROUPED) != 0, G = K / 32;
    const int nb = N - n0 >= NT ? NT : 1;
    for (int n1 = n0; n1 < n0 + NT && n1 < N; n1 += nb) {
        const int8_t* wr = w + (int64_t)n1 * K;
        const float* dr = s + (int64_t)n1 * G;
        for (int m0 = 0; m0 < M; m0 += MT) {
            const int16_t* xb = xq + (int64_t)m0 * K;
            const int mb = M - m0 < MT ? M - m0 : MT;
            float out[MT * NT];
            if (grouped) {
#define G32_CALL(A, B) dot_tile_g32(xb, wr, dr, K, A, B, out)
                TILE_CASES(G32_CALL)
            } else {
                int64_t acc[MT * NT];
#define INT8_CALL(A, B) dot_tile(xb, wr, K, A, B, acc)
                TILE_CASES(INT8_CALL)
                for (int i = 0; i < mb * nb; i++) out[i] = (float)(double)acc[i] * s[n1 + i % nb];
            }
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++) {
                    float v = out[i * nb + j] * xs[m0 + i];
                    if (bias)
                        v += flags & BIAS_BF16 ? dt_load(bias, n1 + j, 1) : ((const float*)bias)[n1 + j];
                    const int64_t at = (int64_t)(m0 + i) * N + n1 + j;
                    if (flags & Y_BF16)
                        ((uint16_t*)y)[at] = f32_to_bf16(v);
                    else
                        ((float*)y)[at] = v;
                }
        }
    }
}

/* Both forms: s is the per-row scale [N], or with GROUPED the per-group scales d [N, K / 32]; bias [N] or
 * NULL, added before the rounding of a bf16 y. xq: scratch int16 [M, K]; xs: scratch float [M]; row: scratch
 * float [K] for a bf16 x. */
static void matmul(const void* x, const int8_t* w, const float* s, const void* bias, void* y, int16_t* xq,
                   float* xs, float* row, int M, int N, int K, int nthreads, int flags) {
    const int grouped = (flags & GROUPED) != 0;
    /* a group's lanes start from zero, so the grouped form never nears int32's range */
    quantize_rows(x, flags & X_BF16, row, xq, xs, M, K, grouped ? 32767.f : activation_qmax(K));
    const int tiles = (N + NT - 1) / NT;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) weight_tile(xq, xs, w, s, bias, y, M, N, K, t * NT, flags);
}

/* A whole linear layer in one call: y = (x @ w.T) * scale + bias with x and y float32 or bf16 and the
 * scratch allocated here (flags: X_BF16, Y_BF16, BIAS_BF16, GROUPED above). Returns 0, 1 when K does not
 * fit the grouped form, 2 when out of memory. */
int sidecar_int8_linear(const sidecar_matmul_args* a) {
    const void* x = a->x;
    const int8_t* w = a->w;
    const float* s = a->scales;
    const void* bias = a->bias;
    void* y = a->y;
    int M = a->M;
    int N = a->N;
    int K = a->K;
    int nthreads = a->nthreads;
    int flags = (a->x_bf16 ? X_BF16 : 0) | (a->out ? Y_BF16 : 0) | (a->bias_bf16 ? BIAS_BF16 : 0) |
                (a->grouped ? GROUPED : 0);
    if ((flags & GROUPED) && K % 32) return 1;
    int16_t* xq = (int16_t*)malloc(sizeof(int16_t) * (size_t)M * K);
    float* xs = (float*)malloc(sizeof(float) * ((size_t)M + K)); /* [M] scales, then a widened row [K] */
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return 2;
    }
    matmul(x, w, s, bias, y, xq, xs, xs + M, M, N, K, nthreads, flags);
    free(xq);
    free(xs);
    return 0;
}

/* A sparse block's routed sum over int8 experts with per-row scales (moe_args.h), in one parallel region:
 * the rows' codes, every slot's gate/up tiles, each slot's silu * up and its codes, every slot's down tiles,
 * then the weighted sums by column. Each slot is the one-row product the layer runs (a row's codes and
 * sums do not depend on the other rows), so the bits are the per-expert layers'. Returns 0, 1 for an
 * expert id out of range, 2 when out of memory. */
int sidecar_int8_moe(const sidecar_moe_args* a) {
    const int T = a->T, S = a->T * a->k, H = a->H, I = a->I, dt = a->x_bf16, es = dt ? 2 : 4;
    const int flags = dt ? Y_BF16 : 0;
    if (moe_ids_ok(a)) return 1;
    const size_t n_xq = (size_t)T * H + (size_t)S * I, n_f = (size_t)T + S + (size_t)(H > I ? H : I);
    int16_t* xq = (int16_t*)malloc(sizeof(int16_t) * n_xq);
    float* xs = (float*)malloc(sizeof(float) * n_f * 1 + (size_t)S * (2 * I + I + H) * es);
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return 2;
    }
    int16_t* aq = xq + (size_t)T * H; /* [S, I] the activations' codes */
    float* as = xs + T;               /* [S] their scales */
    char* gu = (char*)(xs + n_f);     /* [S, 2 I], x's dtype */
    char* act = gu + (size_t)S * 2 * I * es;
    char* out = act + (size_t)S * I * es;
    float* row = as + S;
    quantize_rows(a->x, dt, row, xq, xs, T, H, activation_qmax(H));
    const int gu_tiles = (2 * I + NT - 1) / NT, dn_tiles = (H + NT - 1) / NT;
    const float qmax_i = activation_qmax(I);
    int nthreads = a->nthreads;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int item = 0; item < S * gu_tiles; item++) {
            const int s = item / gu_tiles, e = (int)a->ids[s], t = s / a->k;
            weight_tile(xq + (size_t)t * H, xs + t, (const int8_t*)(intptr_t)a->gate_up[e],
                        (const float*)(intptr_t)a->gate_up_scales[e], NULL, gu + (size_t)s * 2 * I * es, 1,
                        2 * I, H, (item % gu_tiles) * NT, flags);
        }
#pragma omp for schedule(static)
        for (int s = 0; s < S; s++) {
            float wide[I];
            moe_silu_row(gu + (size_t)s * 2 * I * es, act + (size_t)s * I * es, I, dt);
            quantize_rows(act + (size_t)s * I * es, dt, wide, aq + (size_t)s * I, as + s, 1, I, qmax_i);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < S * dn_tiles; item++) {
            const int s = item / dn_tiles, e = (int)a->ids[s];
            weight_tile(aq + (size_t)s * I, as + s, (const int8_t*)(intptr_t)a->down[e],
                        (const float*)(intptr_t)a->down_scales[e], NULL, out + (size_t)s * H * es, 1, H, I,
                        (item % dn_tiles) * NT, flags);
        }
        const int chunks = (H + 63) / 64;
#pragma omp for schedule(static)
        for (int item = 0; item < T * chunks; item++) {
            const int t = item / chunks, h0 = (item % chunks) * 64;
            moe_weighted_sum(a, out, t, h0, h0 + 64 < H ? h0 + 64 : H);
        }
    }
    free(xq);
    free(xs);
    return 0;
}
