/* bf16 matmul for decode-sized batches on CPUs with AVX-512 BF16:
 *
 *   y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]      x, w bf16 [M, K] / [N, K]; y float32 or bf16 [M, N]
 *
 * A bf16 y is the float32 result rounded once to nearest even (what torch's bf16 linear returns); a bias
 * may be float32 or bf16.
 *
 * Pairs of bf16 products are accumulated in float32 lanes (vdpbf16ps), exactly as torch's bf16
 * matmul accumulates (in float32), only in another order. Work goes in register tiles of up to 4
 * activation rows x 4 weight rows, so each weight chunk is loaded once for every row of the batch and
 * each activation chunk once per 4 weight rows; weights are prefetched two tiles ahead, since at a
 * few rows one pass over them is the whole cost. Tiles of weight rows are split across threads.
 *
 * Tiled weights (sidecar_bf16_matmul_tiled): the same products over w held as [ceil(N/4)][K/32][4][32]
 * (4 rows' 32-value chunks side by side, the last tile padded with zero rows), so a thread reads its
 * tiles as one forward stream of 256-byte steps that the hardware prefetcher follows (near a plain
 * streaming read of the same bytes, where the plain rows' several streams fall short). Each output is the
 * same float32 arithmetic in the same order as from the plain layout, so the two give the same bits. Over
 * tiles a register tile holds up to 6 activation rows (24 accumulators), the rows of a batch go in panels of
 * equal size, and a thread's tiles in blocks that stay in L2 while every panel passes over them; the finished
 * sums of a row (one tree for every path: a row's result does not depend on the batch it came in) are stored
 * four at a time.
 *
 * On AVX2 (bf16 widened to float32), batches from OUTER_ROWS rows on take another arrangement of the same
 * sums in the same order: tiled_outer (outer products over groups of 16 weight rows converted a block at a
 * time: the decode steps of 4 rows and more, and prefill), in outer_avx2.h, which int8_gemm.c's int8 prefill
 * path shares.
 *
 * sidecar_bf16_moe (at the end): a sparse block's routed sum over bf16 experts in one call, each expert's
 * products the same dot_tile sums as its layer's own call.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"
#include "matmul_args.h"
#include "matmul_store.h"
#include "moe_args.h"

/* Loops start on 64-byte boundaries: the AVX2 outer-product loops' speed otherwise moved with unrelated
 * edits elsewhere in the file, and aligned they are not slower anywhere. */
#pragma GCC optimize("align-loops=64")

#include "outer_avx2.h" /* NT, and tiled_outer on the AVX2 path */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_PATH 512
#define MT        4 /* activation rows a register tile holds over plain rows */
/* ... and over the tiled layout: 24 accumulators, 4 weight vectors, 1 activation vector */
#define MT_TILED 6
typedef uint16_t xel; /* activations as the products read them: bf16 pairs (vdpbf16ps) */
#elif defined(__AVX2__) && defined(__FMA__)
#define BF16_PATH 2
#define MT        3 /* 12 accumulators, a weight vector and its two float32 halves: 15 of 16 registers */
#define MT_TILED  3
typedef float
        xel; /* activations widened once to float32, each 16-value block as its 8 even then 8 odd values */
#endif

/* Which path this build runs: 512 (AVX-512 BF16), 2 (AVX2 + FMA: bf16 widened to float32), 0 (none). */
int sidecar_bf16_supported(void) {
#ifdef BF16_PATH
    return BF16_PATH;
#else
    return 0;
#endif
}

#if BF16_PATH == 512
/* One-row calls over the tiled layout read two tiles ahead too, into L2 like every read-ahead here: into L1
 * the prefetches hold its few fill buffers, and the hardware prefetcher alone falls behind the stream. */
#define TILED_READ_AHEAD 1
/* out[i * NB + j] = sum_k x[i, k] * w[j, k]; K a multiple of 32. Weight row j's chunk c (values 32c..32c+31)
 * is at w + j * row_step + c * chunk_step: plain rows (row_step K, chunk_step 32, prefetched two tiles
 * ahead) or one tile of the tiled layout (row_step 32, chunk_step 32 * NT, a stream the hardware follows; a
 * one-row call reads it two tiles ahead too). */
static inline __attribute__((always_inline)) void dot_tile(const uint16_t* x, const uint16_t* w, int64_t K,
                                                           const int MB, const int NB, const int64_t row_step,
                                                           const int64_t chunk_step, const int prefetch,
                                                           float* out) {
    __m512 acc[MT_TILED][NT];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const char* ahead = prefetch ? (const char*)(w + 2 * NB * K) : NULL; /* plain rows: two tiles on */
    for (int64_t k = 0; k < K; k += 32) {
        /* NB rows x 64 bytes consumed per chunk: keep the prefetch at that pace (4 lines for NB = 4) */
        if (prefetch)
            for (int j = 0; j < NB; j++) _mm_prefetch(ahead + 2 * NB * k + 64 * j, _MM_HINT_T1);
        const uint16_t* wc = w + (k / 32) * chunk_step;
        __m512bh wv[NT];
        for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void*)(wc + j * row_step));
        for (int i = 0; i < MB; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + i * K + k));
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
        }
    }
    for (int i = 0; i < MB; i++) {
        if (NB == NT) {
            v_sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], out + i * NB);
        } else { /* the same tree (v_sum4's lanes are independent), so both layouts give the same bits */
            float four[NT];
            v_sum4(acc[i][0], acc[i][0], acc[i][0], acc[i][0], four);
            out[i * NB] = four[0];
        }
    }
}
#elif BF16_PATH == 2
#define TILED_READ_AHEAD 0 /* one-row calls leave the tiled stream to the hardware prefetcher */
/* The same contract over float32 activations in the layout ``widen_rows`` gives. A weight chunk's 16-value
 * half is one 256-bit load of eight bf16 pairs: each 32-bit lane shifted left by 16 is its even value as
 * float32, the lane with its low half masked off its odd value (both exact), so two vector operations widen
 * 16 values and each FMA pairs them with the activations' matching even or odd half. Every sum is float32
 * FMAs over exact bf16 products in one fixed order (per chunk: the even, then the odd values of its first
 * half, then of its second), whatever the batch and the layout. */
/* out[i] = sum of the 8 lanes of a_i (the AVX2 path also runs on AVX-512 CPUs without BF16, where vec.h's vf
 * is 512 bits wide) */
static inline void sum4_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
    const __m256 t01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    const __m256 t23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, 0x44), _mm256_shuffle_ps(t01, t23, 0xEE));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

static inline __attribute__((always_inline)) void dot_tile(const float* x, const uint16_t* w, int64_t K,
                                                           const int MB, const int NB, const int64_t row_step,
                                                           const int64_t chunk_step, const int prefetch,
                                                           float* out) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[MT_TILED][NT];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    const char* ahead = prefetch ? (const char*)(w + 2 * NB * K) : NULL;
    for (int64_t k = 0; k < K; k += 32) {
        if (prefetch)
            for (int j = 0; j < NB; j++) _mm_prefetch(ahead + 2 * NB * k + 64 * j, _MM_HINT_T0);
        const uint16_t* wc = w + (k / 32) * chunk_step;
        for (int h = 0; h < 32; h += 16) {
            for (int j = 0; j < NB; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(wc + j * row_step + h));
                const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int i = 0; i < MB; i++) {
                    const float* xr = x + i * K + k + h;
                    acc[i][j] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xr), acc[i][j]);
                    acc[i][j] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xr + 8), acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < MB; i++) {
        if (NB == NT) {
            sum4_256(acc[i][0], acc[i][1], acc[i][2], acc[i][3], out + i * NB);
        } else {
            float four[NT];
            sum4_256(acc[i][0], acc[i][0], acc[i][0], acc[i][0], four);
            out[i * NB] = four[0];
        }
    }
}
#endif

#ifdef BF16_PATH
#if BF16_PATH == 2
/* n bf16 values (n a multiple of 16) as float32, each 16-value block as its 8 even then its 8 odd values: the
 * order in which dot_tile widens the weights. */
static inline void widen_span(const uint16_t* x, float* xw, int64_t n) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t b = 0; b < n; b += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(x + b));
        _mm256_storeu_ps(xw + b, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        _mm256_storeu_ps(xw + b + 8, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
    }
}
#endif

/* The activations as dot_tile reads them: x itself on the AVX-512 BF16 path; on the AVX2 path a float32 copy
 * in widen_span's layout (returned in *owned, for the caller to free; NULL when it cannot be allocated). */
static const xel* widen_rows(const uint16_t* x, int M, int K, int nthreads, xel** owned) {
    *owned = NULL;
#if BF16_PATH == 512
    (void)M;
    (void)K;
    (void)nthreads;
    return x;
#else
    const int64_t n = (int64_t)M * K;
    float* xw = (float*)aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
    if (!xw) return NULL;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= (1 << 16))
    for (int64_t b = 0; b < n; b += 1024) widen_span(x + b, xw + b, n - b < 1024 ? n - b : 1024);
    *owned = xw;
    return xw;
#endif
}
#endif

/* Weight tiles a thread takes per block: the block (BLOCK_BYTES, in the L2 cache) is reused by every panel
 * of up to MT_TILED activation rows before the next block is read, so at prefill sizes each weight byte comes
 * from memory once per call; a panel (up to MT_TILED x K values) stays in L1/L2 while the block's tiles pass.
 */
#define BLOCK_BYTES (256 << 10)

#ifdef BF16_PATH
/* The finished sums of an mb-row panel over tile columns n0.. (nb of them valid), plus bias, stored in y. */
static inline void store_sums(const float* acc, int mb, int nb, int m0, int n0, int N, const void* bias,
                              int bias_bf16, void* y, int out_bf16) {
    if (nb == NT) {
        for (int i = 0; i < mb; i++)
            store_four(acc + i * NT, bias, bias_bf16, n0, y, (int64_t)(m0 + i) * N + n0, out_bf16);
        return;
    }
    float valid[MT_TILED * NT]; /* a padded last tile: its valid columns (mb <= MT_TILED) */
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) valid[i * nb + j] = acc[i * NT + j];
    store_tile(valid, mb, nb, m0, n0, N, bias, bias_bf16, y, out_bf16);
}
#endif

/* y = x @ w.T + bias with w in the tiled layout; arguments and returns as sidecar_bf16_matmul (2 also when
 * the prefill paths' buffers cannot be allocated). */
int sidecar_bf16_matmul_tiled(const sidecar_matmul_args* a) {
    const uint16_t* x = a->x;
    const uint16_t* wt = a->w;
    const void* bias = a->bias;
    void* y = a->y;
    int M = a->M;
    int N = a->N;
    int K = a->K;
    int nthreads = a->nthreads;
    int bias_bf16 = a->bias_bf16;
    int out_bf16 = a->out;
#ifdef BF16_PATH
    if (K % 32) return 1;
    nthreads = nthreads < 1 ? 1 : nthreads;
#ifdef OUTER_PATH
    if (M >= OUTER_ROWS)
        return tiled_outer(x, 0, wt, NULL, NULL, bias, y, M, N, K, nthreads, bias_bf16, out_bf16);
#endif
    xel* owned;
    const xel* xa = widen_rows(x, M, K, nthreads, &owned);
    if (!xa) return 2;
    const int tiles = (N + NT - 1) / NT;
    int per_block = (int)(BLOCK_BYTES / ((int64_t)NT * K * 2));
    per_block = per_block < 1 ? 1 : per_block;
    /* panels of equal size (32 rows over 6-row tiles: 6, 6, 5, 5, 5, 5), none far below a full register tile
     */
    const int panels = (M + MT_TILED - 1) / MT_TILED;
#pragma omp parallel num_threads(nthreads)
    {
        /* each thread a contiguous range of tiles: one forward stream over its weights */
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int t_begin = (int)((int64_t)tiles * me / nt), t_end = (int)((int64_t)tiles * (me + 1) / nt);
        float acc[MT_TILED * NT];
        for (int b0 = t_begin; b0 < t_end; b0 += per_block) {
            const int b1 = b0 + per_block < t_end ? b0 + per_block : t_end;
            for (int p = 0, m0 = 0; p < panels; p++) {
                const int mb = M / panels + (p < M % panels);
                const xel* xb = xa + (int64_t)m0 * K;
                for (int t = b0; t < b1; t++) {
                    const int n0 = t * NT, nb = N - n0 < NT ? N - n0 : NT;
                    const uint16_t* wr = wt + (int64_t)t * NT * K;
                    switch (mb) {
                        case 1:
                            dot_tile(xb, wr, K, 1, NT, 32, 32 * NT, TILED_READ_AHEAD, acc);
                            break;
                        case 2:
                            dot_tile(xb, wr, K, 2, NT, 32, 32 * NT, 0, acc);
                            break;
#if MT_TILED > 3
                        case 3:
                            dot_tile(xb, wr, K, 3, NT, 32, 32 * NT, 0, acc);
                            break;
                        case 4:
                            dot_tile(xb, wr, K, 4, NT, 32, 32 * NT, 0, acc);
                            break;
                        case 5:
                            dot_tile(xb, wr, K, 5, NT, 32, 32 * NT, 0, acc);
                            break;
                        default:
                            dot_tile(xb, wr, K, 6, NT, 32, 32 * NT, 0, acc);
                            break;
#else
                        default:
                            dot_tile(xb, wr, K, 3, NT, 32, 32 * NT, 0, acc);
                            break;
#endif
                    }
                    store_sums(acc, mb, nb, m0, n0, N, bias, bias_bf16, y, out_bf16);
                }
                m0 += mb;
            }
        }
    }
    free(owned);
    return 0;
#else
    (void)x;
    (void)wt;
    (void)bias;
    (void)y;
    (void)M;
    (void)N;
    (void)K;
    (void)nthreads;
    (void)bias_bf16;
    (void)out_bf16;
    return 1;
#endif
}

/* bias: [N] (float32, or bf16 when bias_bf16) or NULL; y: float32, or bf16 when out_bf16. K must be a
 * multiple of 32. Returns 0; 1 on a CPU without either path (or K not a multiple of 32); 2 when the AVX2
 * path's float32 copy of x cannot be allocated. */
int sidecar_bf16_matmul(const sidecar_matmul_args* a) {
    const uint16_t* x = a->x;
    const uint16_t* w = a->w;
    const void* bias = a->bias;
    void* y = a->y;
    int M = a->M;
    int N = a->N;
    int K = a->K;
    int nthreads = a->nthreads;
    int bias_bf16 = a->bias_bf16;
    int out_bf16 = a->out;
#ifdef BF16_PATH
    if (K % 32) return 1;
    nthreads = nthreads < 1 ? 1 : nthreads;
    xel* owned;
    const xel* xa = widen_rows(x, M, K, nthreads, &owned);
    if (!xa) return 2;
    const int tiles = (N + NT - 1) / NT;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int n0 = t * NT;
        const int nb = N - n0 >= NT ? NT : 1;
        for (int n1 = n0; n1 < n0 + NT && n1 < N; n1 += nb) {
            const uint16_t* wr = w + (int64_t)n1 * K;
            float acc[MT * NT];
            for (int m0 = 0; m0 < M; m0 += MT) {
                const xel* xb = xa + (int64_t)m0 * K;
                const int mb = M - m0 < MT ? M - m0 : MT;
                switch (mb * 8 + nb) {
                    case 1 * 8 + NT:
                        dot_tile(xb, wr, K, 1, NT, K, 32, 1, acc);
                        break;
                    case 2 * 8 + NT:
                        dot_tile(xb, wr, K, 2, NT, K, 32, 1, acc);
                        break;
                    case 3 * 8 + NT:
                        dot_tile(xb, wr, K, 3, NT, K, 32, 1, acc);
                        break;
#if MT > 3
                    case 4 * 8 + NT:
                        dot_tile(xb, wr, K, 4, NT, K, 32, 1, acc);
                        break;
#endif
                    case 1 * 8 + 1:
                        dot_tile(xb, wr, K, 1, 1, K, 32, 1, acc);
                        break;
                    case 2 * 8 + 1:
                        dot_tile(xb, wr, K, 2, 1, K, 32, 1, acc);
                        break;
#if MT > 3
                    case 3 * 8 + 1:
                        dot_tile(xb, wr, K, 3, 1, K, 32, 1, acc);
                        break;
                    default:
                        dot_tile(xb, wr, K, 4, 1, K, 32, 1, acc);
                        break;
#else
                    default:
                        dot_tile(xb, wr, K, 3, 1, K, 32, 1, acc);
                        break;
#endif
                }
                store_tile(acc, mb, nb, m0, n1, N, bias, bias_bf16, y, out_bf16);
            }
        }
    }
    free(owned);
    return 0;
#else
    (void)x;
    (void)w;
    (void)bias;
    (void)y;
    (void)M;
    (void)N;
    (void)K;
    (void)nthreads;
    (void)bias_bf16;
    (void)out_bf16;
    return 1;
#endif
}

/* ===== A sparse block's routed sum over bf16 experts (moe_args.h) =====
 *
 * The experts' weights are bf16 rows [N, K] held plain or in the tiled layout (a->tiled), without biases; x
 * and every product are bf16. The step's slots are grouped by expert (experts ascending, each one's slots
 * ascending), so each picked expert's weights pass once per step with all of its slots in the same register
 * tiles (panels of up to MT_TILED rows). Each output is dot_tile's float32 sum for its row (which does not
 * depend on the panel the row came in, nor on the layout), stored as the layer's call stores it, rounded once
 * to bf16: the bits the expert's layer gives (sidecar_bf16_matmul_tiled or sidecar_bf16_matmul) for any batch
 * of its rows. One parallel region: the slots' rows gathered (widened on the AVX2 path), every picked
 * expert's gate/up tiles, each slot's silu * up, every picked expert's down tiles, then the weighted sums by
 * column. */
#ifdef BF16_PATH
#if MT_TILED > 3
#define MB_CASES(CALL) \
    case 2:            \
        CALL(2);       \
        break;         \
    case 3:            \
        CALL(3);       \
        break;         \
    case 4:            \
        CALL(4);       \
        break;         \
    case 5:            \
        CALL(5);       \
        break;         \
    default:           \
        CALL(6);       \
        break;
#else
#define MB_CASES(CALL) \
    case 2:            \
        CALL(2);       \
        break;         \
    default:           \
        CALL(3);       \
        break;
#endif

/* y rows dst[0..M) (N wide, bf16) = the M rows of xa [M, K] times an expert's weight w [N, K] over tile t
 * (output rows NT t.., plain rows or tiled), in panels of equal size as the tiled entry point's. */
static void moe_tile(const xel* xa, int M, const uint16_t* w, int tiled, int N, int K, int t, const int* dst,
                     uint16_t* y) {
    const int n0 = t * NT, nb = N - n0 < NT ? N - n0 : NT, panels = (M + MT_TILED - 1) / MT_TILED;
    float acc[MT_TILED * NT];
    for (int p = 0, m0 = 0; p < panels; p++) {
        const int mb = M / panels + (p < M % panels);
        const xel* xb = xa + (int64_t)m0 * K;
        if (tiled) {
            const uint16_t* wr = w + (int64_t)t * NT * K;
#define TILED_DOT(MB) dot_tile(xb, wr, K, MB, NT, 32, 32 * NT, 0, acc)
            switch (mb) {
                case 1:
                    dot_tile(xb, wr, K, 1, NT, 32, 32 * NT, TILED_READ_AHEAD, acc);
                    break;
                    MB_CASES(TILED_DOT)
            }
            for (int i = 0; i < mb; i++) store_sums(acc + i * NT, 1, nb, dst[m0 + i], n0, N, NULL, 0, y, 1);
        } else if (nb == NT) { /* plain rows: a whole tile, as sidecar_bf16_matmul reads it */
            const uint16_t* wr = w + (int64_t)n0 * K;
#define PLAIN_DOT(MB) dot_tile(xb, wr, K, MB, NT, K, 32, 1, acc)
            switch (mb) {
                case 1:
                    PLAIN_DOT(1);
                    break;
                    MB_CASES(PLAIN_DOT)
            }
            for (int i = 0; i < mb; i++) store_tile(acc + i * NT, 1, NT, dst[m0 + i], n0, N, NULL, 0, y, 1);
        } else { /* the last rows of a plain weight, one at a time */
            for (int n1 = n0; n1 < N; n1++) {
                const uint16_t* wr = w + (int64_t)n1 * K;
#define ROW_DOT(MB) dot_tile(xb, wr, K, MB, 1, K, 32, 1, acc)
                switch (mb) {
                    case 1:
                        ROW_DOT(1);
                        break;
                        MB_CASES(ROW_DOT)
                }
                for (int i = 0; i < mb; i++) store_tile(acc + i, 1, 1, dst[m0 + i], n1, N, NULL, 0, y, 1);
            }
        }
        m0 += mb;
    }
}

/* One row of n bf16 values as dot_tile reads activations: widened (AVX2 path) or copied. */
static inline void moe_row(const uint16_t* x, xel* xa, int n) {
#if BF16_PATH == 2
    widen_span(x, xa, n);
#else
    memcpy(xa, x, (size_t)n * 2);
#endif
}

/* The slots grouped by expert: order[p] is the slot at place p (ids ascending, slots ascending within an id),
 * the u-th picked expert (ids[order[first[u]]]) holds places first[u]..first[u + 1]. Returns how many experts
 * were picked. */
static int moe_group(const int64_t* ids, int S, int* order, int* first) {
    for (int s = 0; s < S; s++) { /* insertion sort: a step holds few slots */
        int p = s;
        for (; p > 0 && ids[order[p - 1]] > ids[s]; p--) order[p] = order[p - 1];
        order[p] = s;
    }
    int u = 0;
    for (int p = 0; p < S; p++)
        if (!p || ids[order[p]] != ids[order[p - 1]]) first[u++] = p;
    first[u] = S;
    return u;
}
#endif

/* Returns 0, 1 for an expert id out of range, 2 when out of memory, 3 for what it does not take (a float32 x,
 * widths that are not multiples of 32, a build without either path). */
int sidecar_bf16_moe(const sidecar_moe_args* a) {
#ifdef BF16_PATH
    const int T = a->T, k = a->k, S = a->T * a->k, H = a->H, I = a->I, tiled = a->tiled;
    if (!a->x_bf16 || H <= 0 || I <= 0 || H % 32 || I % 32 || T <= 0 || k <= 0) return 3;
    if (moe_ids_ok(a)) return 1;
    int* order = (int*)malloc(sizeof(int) * (3 * (size_t)S + 1));
    /* the down products' activations widened apart on the AVX2 path (read as they are on AVX-512 BF16) */
    const size_t xg_bytes = (size_t)S * H * sizeof(xel), aw_bytes = BF16_PATH == 2 ? (size_t)S * I * 4 : 0;
    char* buf = (char*)aligned_alloc(64, (xg_bytes + aw_bytes + (size_t)S * (3 * I + H) * 2 + 63) / 64 * 64);
    if (!order || !buf) {
        free(order);
        free(buf);
        return 2;
    }
    int* place = order + S; /* [S] place p's own index: where a gate/up row goes */
    int* first = place + S; /* [U + 1] */
    for (int p = 0; p < S; p++) place[p] = p;
    const int U = moe_group(a->ids, S, order, first);
    xel* xg = (xel*)buf;                                   /* [S, H] the slots' rows, by place */
    uint16_t* gu = (uint16_t*)(buf + xg_bytes + aw_bytes); /* [S, 2 I] gate/up, by place */
    uint16_t* act = gu + (size_t)S * 2 * I;                /* [S, I] silu(gate) * up, by place */
#if BF16_PATH == 2
    float* aw = (float*)(buf + xg_bytes); /* [S, I] act widened, by place */
    const xel* acts = aw;
#else
    const xel* acts = act;
#endif
    uint16_t* out = act + (size_t)S * I; /* [S, H] the down products, by slot */
    const uint16_t* x = (const uint16_t*)a->x;
    const int gu_tiles = (2 * I + NT - 1) / NT, dn_tiles = (H + NT - 1) / NT, chunks = (H + 63) / 64;
    const int nthreads = a->nthreads < 1 ? 1 : a->nthreads;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int p = 0; p < S; p++) moe_row(x + (size_t)(order[p] / k) * H, xg + (size_t)p * H, H);
#pragma omp for schedule(static)
        for (int item = 0; item < U * gu_tiles; item++) {
            const int u = item / gu_tiles, p0 = first[u];
            const uint16_t* w = (const uint16_t*)(intptr_t)a->gate_up[a->ids[order[p0]]];
            moe_tile(xg + (size_t)p0 * H, first[u + 1] - p0, w, tiled, 2 * I, H, item % gu_tiles, place + p0,
                     gu);
        }
#pragma omp for schedule(static)
        for (int p = 0; p < S; p++) {
            moe_silu_row(gu + (size_t)p * 2 * I, act + (size_t)p * I, I, 1);
#if BF16_PATH == 2
            widen_span(act + (size_t)p * I, aw + (size_t)p * I, I);
#endif
        }
#pragma omp for schedule(static)
        for (int item = 0; item < U * dn_tiles; item++) {
            const int u = item / dn_tiles, p0 = first[u];
            const uint16_t* w = (const uint16_t*)(intptr_t)a->down[a->ids[order[p0]]];
            moe_tile(acts + (size_t)p0 * I, first[u + 1] - p0, w, tiled, H, I, item % dn_tiles, order + p0,
                     out);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < T * chunks; item++) {
            const int t = item / chunks, h0 = (item % chunks) * 64;
            moe_weighted_sum(a, out, t, h0, h0 + 64 < H ? h0 + 64 : H);
        }
    }
    free(order);
    free(buf);
    return 0;
#else
    (void)a;
    return 3;
#endif
}
