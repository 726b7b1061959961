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
 * time: the decode steps of 4 rows and more, and prefill; the int8 prefill path too).
 */
#include <omp.h>
#include <stdlib.h>

#include "vec.h"
#include "matmul_args.h"

/* Loops start on 64-byte boundaries: the AVX2 outer-product loops' speed otherwise moved with unrelated
 * edits elsewhere in the file, and aligned they are not slower anywhere. */
#pragma GCC optimize("align-loops=64")

#define NT 4

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

#define MT_WIDE 6 /* activation rows a panel of the outer products holds (see tiled_outer) */
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

/* Four finished sums (one row of a full tile) plus bias, stored at y + at: float32, or rounded to bf16 as
 * f32_to_bf16 rounds (nearest even; a NaN stays a NaN). */
static inline void store_four(const float* sums, const void* bias, int bias_bf16, int n1, void* y, int64_t at,
                              int out_bf16) {
    __m128 v = _mm_loadu_ps(sums);
    if (bias)
        v = _mm_add_ps(v, bias_bf16 ? _mm_castsi128_ps(_mm_slli_epi32(
                                              _mm_cvtepu16_epi32(_mm_loadl_epi64(
                                                      (const __m128i*)((const uint16_t*)bias + n1))),
                                              16))
                                    : _mm_loadu_ps((const float*)bias + n1));
    if (!out_bf16) {
        _mm_storeu_ps((float*)y + at, v);
        return;
    }
    const __m128i u = _mm_castps_si128(v);
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7fff),
                                               _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1))));
    r = _mm_blendv_epi8(r, _mm_or_si128(u, _mm_set1_epi32(0x400000)),
                        _mm_castps_si128(_mm_cmpunord_ps(v, v)));
    r = _mm_srli_epi32(r, 16);
    _mm_storel_epi64((__m128i*)((uint16_t*)y + at), _mm_packus_epi32(r, r));
}
#endif

/* acc (mb x nb finished sums) plus bias, stored at rows m0.., columns n1.. of y. */
static inline void store_tile(const float* acc, int mb, int nb, int m0, int n1, int N, const void* bias,
                              int bias_bf16, void* y, int out_bf16) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            const float b = !bias       ? 0.f
                            : bias_bf16 ? bf16_to_f32(((const uint16_t*)bias)[n1 + j])
                                        : ((const float*)bias)[n1 + j];
            const float v = acc[i * nb + j] + b;
            const int64_t at = (int64_t)(m0 + i) * N + n1 + j;
            if (out_bf16)
                ((uint16_t*)y)[at] = f32_to_bf16(v);
            else
                ((float*)y)[at] = v;
        }
}

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

#if BF16_PATH == 2
/* Rows of a chunk: their float32 activations (CHUNK_BYTES at most) stay in the L3 cache while every block of
 * the weights passes over them (activations read again from memory for each block slow the products). */
#define CHUNK_BYTES       (2 << 20)
#define BLOCKS_PER_THREAD 8

/* Units (tiles, or groups of weight rows) a block of at most block_bytes, unit_bytes each, and at least
 * BLOCKS_PER_THREAD blocks a thread: blocks go to whichever thread is free (the cores of a shared machine run
 * at unequal speeds: an even split leaves the faster one waiting). */
static int units_per_block(int units, int64_t unit_bytes, int64_t block_bytes, int nthreads) {
    const int fair = (units + nthreads * BLOCKS_PER_THREAD - 1) / (nthreads * BLOCKS_PER_THREAD);
    int per = (int)(block_bytes / unit_bytes);
    per = per > fair ? fair : per;
    return per < 1 ? 1 : per;
}

/* Rows of a chunk over K: CHUNK_BYTES of float32 activations, whole panels of MT_WIDE rows, at least one. */
static int chunk_rows(int K) {
    const int mc = (int)(CHUNK_BYTES / ((int64_t)K * 4) / MT_WIDE * MT_WIDE);
    return mc < MT_WIDE ? MT_WIDE : mc;
}

/* A chunk's float32 activations: a buffer of the calling thread of at least n values, kept for its next call
 * (a fresh one of megabytes would be new zeroed pages every call); NULL when it cannot be allocated. */
static float* chunk_buffer(int64_t n) {
    static __thread float* buf = NULL;
    static __thread int64_t cap = 0;
    if (n > cap) {
        free(buf);
        cap = 0;
        if (!(buf = (float*)aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64)))) return NULL;
        cap = n;
    }
    return buf;
}

/* Batches of OUTER_ROWS rows and more again, as outer products: the same sums in the same order, with
 * weights and activations rearranged so that every FMA takes a vector of 8 outputs' weights and one
 * activation broadcast from memory. Dot products over half tiles (6 x 2 register tiles) loaded an activation
 * vector for every two FMAs and ran below the core's FMA rate; here a register tile is up to 6 activation
 * rows x 16 weight rows (12 accumulators, one vector of 16 bf16 weights widened into two, one broadcast) and
 * runs at the FMA rate.
 *
 * The order: the sum for output n is kept as 8 partial sums s_l (l = 0..7), s_l accumulating, for each
 * 16-value block b of K in turn, the products at k = 16b + 2l and then 16b + 2l + 1 -- lane l of dot_tile's
 * accumulators -- and the 8 are added as sum4_256 adds the lanes. So a step of the tile is one k
 * (values k of 16 weight rows, one vector), and the steps of s_l are the k above in order: weights and
 * activations are laid out lane by lane:
 *   weights, for a group of 16 rows (4 tiles) over a pass [k0, k1): [l][b][k & 1][16 rows], as bf16,
 * converted a block of groups at a time into a buffer of the thread, where every panel of the rows passes
 * over them; the rows in the order 0-3, 8-11, 4-7, 12-15, so that widening the low and the high half of each
 * 128-bit lane (unpack with zeros) gives rows 0-7 and 8-15; activations, each row as float32 (a bf16 value
 * widened exactly) in the order [l][K / 16][k & 1]. */
/* From this many rows on (below, converting a block of weights costs more than the outer products save) */
#define OUTER_ROWS 4
#define KC_OUTER   1024 /* values of K a pass: a lane's activations for a panel (<= 3 KiB) stay in L1 */
/* a thread's converted weights, in L2 beside the tiles they come from */
#define OUTER_BLOCK_BYTES (192 << 10)
#define GR                16 /* weight rows a group */

/* 16 rows of 16 bf16 values (r[i]: row i) transposed: r[k] becomes value k of the 16 rows, row i at element
 * i. */
static inline void transpose16(__m256i r[16]) {
    __m256i t[16], u[16];
    for (int j = 0; j < 8; j++) { /* t[j]: rows 2j, 2j+1 at k 0-3 (each 128-bit lane: + 8); t[8 + j]: k 4-7 */
        t[j] = _mm256_unpacklo_epi16(r[2 * j], r[2 * j + 1]);
        t[8 + j] = _mm256_unpackhi_epi16(r[2 * j], r[2 * j + 1]);
    }
    for (int h = 0; h < 2; h++) /* u[q + 4m]: rows 4q..4q+3 at k 2m, 2m+1 (+ 8) */
        for (int q = 0; q < 4; q++) {
            u[q + 8 * h] = _mm256_unpacklo_epi32(t[2 * q + 8 * h], t[2 * q + 1 + 8 * h]);
            u[q + 8 * h + 4] = _mm256_unpackhi_epi32(t[2 * q + 8 * h], t[2 * q + 1 + 8 * h]);
        }
    for (int m = 0; m < 4; m++) /* t[2k + half]: rows 8 half .. 8 half + 7 at k (+ 8) */
        for (int hq = 0; hq < 2; hq++) {
            t[4 * m + hq] = _mm256_unpacklo_epi64(u[2 * hq + 4 * m], u[2 * hq + 1 + 4 * m]);
            t[4 * m + 2 + hq] = _mm256_unpackhi_epi64(u[2 * hq + 4 * m], u[2 * hq + 1 + 4 * m]);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm256_permute2x128_si256(t[2 * k], t[2 * k + 1], 0x20);
        r[k + 8] = _mm256_permute2x128_si256(t[2 * k], t[2 * k + 1], 0x31);
    }
}

/* The row a group's position i holds (see above: widening then gives rows 0-7 and 8-15 in order). */
static inline int outer_row(int i) {
    return (i & 3) | ((i & 4) << 1) | ((i & 8) >> 1);
}

/* Group g of the weights over [k0, k1) in the layout above, at out: from the tiled layout (wt; tiles past the
 * last are zero rows) or from int8 codes w [N, K] (wq; exact in bf16; rows past N are zeros). */
static void group_to_lanes(const uint16_t* wt, const int8_t* wq, int N, int64_t K, int g, int64_t k0,
                           int64_t k1, uint16_t* out) {
    const int tiles = (N + NT - 1) / NT;
    const int64_t nbk = (k1 - k0) / 16;
    for (int64_t b = 0; b < nbk; b++) {
        const int64_t k = k0 + 16 * b;
        __m256i r[16];
        for (int i = 0; i < GR; i++) {
            const int n = g * GR + outer_row(i);
            if (wq) {
                if (n >= N) {
                    r[i] = _mm256_setzero_si256();
                    continue;
                }
                const __m128i c = _mm_loadu_si128((const __m128i*)(wq + (int64_t)n * K + k));
                const __m256 flo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
                const __m256 fhi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
                const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(flo), 16);
                const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(fhi), 16);
                r[i] = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
            } else {
                const int t = n / NT;
                r[i] = t >= tiles ? _mm256_setzero_si256()
                                  : _mm256_loadu_si256((const __m256i*)(wt + (int64_t)t * NT * K +
                                                                        k / 32 * (32 * NT) + (n % NT) * 32 +
                                                                        k % 32));
            }
        }
        transpose16(r);
        for (int j = 0; j < 16; j++) /* value j of the block: lane j / 2, step j & 1 */
            _mm256_store_si256((__m256i*)(out + (((j / 2) * nbk + b) * 2 + (j & 1)) * GR), r[j]);
    }
}

/* group_to_lanes for a group whose 4 tiles all exist, from the tiled layout: each 16 x 16 block as two 8 x 8
 * transposes within the 128-bit lanes, lane 0 over rows 0-3 and 8-11, lane 1 over rows 4-7 and 12-15 (the
 * order above), so that no value crosses lanes and the 8 vectors in flight stay in registers. */
static void group_to_lanes_tiled(const uint16_t* wt, int64_t K, int g, int64_t k0, int64_t k1,
                                 uint16_t* out) {
    const int64_t nbk = (k1 - k0) / 16;
    const uint16_t* lo[8]; /* the rows of lane 0 (i: position i of that lane), then those of lane 1 */
    const uint16_t* hi[8];
    for (int i = 0; i < 8; i++) {
        const int r0 = (i & 3) | ((i & 4) << 1), r1 = r0 + 4; /* row n: tile 4g + n / 4, its row n % 4 */
        lo[i] = wt + (int64_t)(4 * g + r0 / 4) * NT * K + k0 * NT + (r0 % 4) * 32;
        hi[i] = wt + (int64_t)(4 * g + r1 / 4) * NT * K + k0 * NT + (r1 % 4) * 32;
    }
    for (int64_t b = 0; b < nbk; b++) {
        const int64_t off = (b >> 1) * (32 * NT) + (b & 1) * 16; /* block b: half b & 1 of chunk b / 2 */
        for (int h = 0; h < 2; h++) {                            /* values 8h .. 8h + 7 of the block */
            __m256i a[8], t[8];
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_inserti128_si256(
                        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(lo[i] + off + 8 * h))),
                        _mm_loadu_si128((const __m128i*)(hi[i] + off + 8 * h)), 1);
            for (int j = 0; j < 4; j++) { /* t[2j], t[2j + 1]: positions 2j, 2j + 1 at values 0-3, 4-7 */
                t[2 * j] = _mm256_unpacklo_epi16(a[2 * j], a[2 * j + 1]);
                t[2 * j + 1] = _mm256_unpackhi_epi16(a[2 * j], a[2 * j + 1]);
            }
            for (int q = 0; q < 2; q++) { /* a[4q + m]: positions 4q .. 4q + 3 at values 2m, 2m + 1 */
                a[4 * q + 0] = _mm256_unpacklo_epi32(t[4 * q + 0], t[4 * q + 2]);
                a[4 * q + 1] = _mm256_unpackhi_epi32(t[4 * q + 0], t[4 * q + 2]);
                a[4 * q + 2] = _mm256_unpacklo_epi32(t[4 * q + 1], t[4 * q + 3]);
                a[4 * q + 3] = _mm256_unpackhi_epi32(t[4 * q + 1], t[4 * q + 3]);
            }
            for (int m = 0; m < 4; m++) { /* t[v]: value v, all 8 positions */
                t[2 * m] = _mm256_unpacklo_epi64(a[m], a[m + 4]);
                t[2 * m + 1] = _mm256_unpackhi_epi64(a[m], a[m + 4]);
            }
            for (int v = 0; v < 8; v++) {
                const int j = 8 * h + v; /* value j of the block: lane j / 2, step j & 1 */
                _mm256_store_si256((__m256i*)(out + (((j / 2) * nbk + b) * 2 + (j & 1)) * GR), t[v]);
            }
        }
    }
}

/* Row r of x (bf16, or float32 when x_f32) in the activations' layout above, at out: the pair of values of
 * lane l in block b at out + (l * K / 16 + b) * 2. */
static void row_to_lanes(const void* x, int x_f32, int64_t r, int64_t K, float* out) {
    const int64_t nbk = K / 16;
    for (int64_t b = 0; b < nbk; b++) {
        __m256 v[2];
        for (int h = 0; h < 2; h++)
            v[h] = x_f32 ? _mm256_loadu_ps((const float*)x + r * K + 16 * b + 8 * h)
                         : _mm256_castsi256_ps(_mm256_slli_epi32(
                                   _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                           (const __m128i*)((const uint16_t*)x + r * K + 16 * b + 8 * h))),
                                   16));
        for (int h = 0; h < 2; h++) {
            const __m128 lo = _mm256_castps256_ps128(v[h]), hi = _mm256_extractf128_ps(v[h], 1);
            _mm_storel_pi((__m64*)(out + ((4 * h + 0) * nbk + b) * 2), lo);
            _mm_storeh_pi((__m64*)(out + ((4 * h + 1) * nbk + b) * 2), lo);
            _mm_storel_pi((__m64*)(out + ((4 * h + 2) * nbk + b) * 2), hi);
            _mm_storeh_pi((__m64*)(out + ((4 * h + 3) * nbk + b) * 2), hi);
        }
    }
}

/* steps steps of one lane of an MB-row panel over one group: acc[i * 2 + h] (rows 8h..8h+7 of the group) from
 * zero (when zero) or as they are, continued with the products of w (16 bf16 a step) and row i's activations
 * (xp + i * K, one a step). */
static inline __attribute__((always_inline)) void outer_lane(const float* xp, int64_t K, const uint16_t* w,
                                                             int64_t steps, int zero, const int MB,
                                                             __m256* acc) {
    const __m256i z = _mm256_setzero_si256();
    __m256 a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11;
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = _mm256_setzero_ps();
#define OUTER_LOAD(i, lo, hi) \
    if (MB > i && !zero) {    \
        lo = acc[2 * i];      \
        hi = acc[2 * i + 1];  \
    }
    OUTER_LOAD(0, a0, a1)
    OUTER_LOAD(1, a2, a3)
    OUTER_LOAD(2, a4, a5)
    OUTER_LOAD(3, a6, a7)
    OUTER_LOAD(4, a8, a9)
    OUTER_LOAD(5, a10, a11)
    for (int64_t s = 0; s < steps; s++, w += GR, xp++) {
        const __m256i v = _mm256_load_si256((const __m256i*)w);
        const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
        const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
#define OUTER_FMA(i, l, h)                                 \
    if (MB > i) {                                          \
        const __m256 xv = _mm256_broadcast_ss(xp + i * K); \
        l = _mm256_fmadd_ps(lo, xv, l);                    \
        h = _mm256_fmadd_ps(hi, xv, h);                    \
    }
        OUTER_FMA(0, a0, a1)
        OUTER_FMA(1, a2, a3)
        OUTER_FMA(2, a4, a5)
        OUTER_FMA(3, a6, a7)
        OUTER_FMA(4, a8, a9)
        OUTER_FMA(5, a10, a11)
    }
#define OUTER_SAVE(i, lo, hi) \
    if (MB > i) {             \
        acc[2 * i] = lo;      \
        acc[2 * i + 1] = hi;  \
    }
    OUTER_SAVE(0, a0, a1)
    OUTER_SAVE(1, a2, a3)
    OUTER_SAVE(2, a4, a5)
    OUTER_SAVE(3, a6, a7)
    OUTER_SAVE(4, a8, a9)
    OUTER_SAVE(5, a10, a11)
}

#define OUTER_LANE(MB)                                                                                   \
    static __attribute__((noinline)) void outer_lane_##MB(const float* xp, int64_t K, const uint16_t* w, \
                                                          int64_t steps, int zero, __m256* acc) {        \
        outer_lane(xp, K, w, steps, zero, MB, acc);                                                      \
    }
OUTER_LANE(1)
OUTER_LANE(2)
OUTER_LANE(3)
OUTER_LANE(4)
OUTER_LANE(5)
OUTER_LANE(6)

/* 8 float32 sums as bf16, rounded as f32_to_bf16 rounds (nearest even; a NaN stays a NaN), in the 8 low
 * 16-bit halves of the 32-bit lanes. */
static inline __m256i round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i r = _mm256_add_epi32(
            u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    return _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                                                _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))),
                             16);
}

/* A panel's finished sums over group g (acc: 8 lanes of MT_WIDE * 2 vectors), added as sum4_256 adds the
 * lanes, times the row scale (codes), plus bias, stored in rows m0.. of y: a whole group's 16 columns 8 at a
 * time (the same operations on each value as store_four's), the last group's by tiles. */
static void outer_store(const __m256* acc, int mb, int g, int m0, int N, const float* scale, const void* bias,
                        int bias_bf16, void* y, int out_bf16) {
    const int n0 = g * GR;
    __m256 sc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()},
           bs[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < 2 && n0 + GR <= N; h++) {
        sc[h] = scale ? _mm256_loadu_ps(scale + n0 + 8 * h) : _mm256_setzero_ps();
        bs[h] = !bias       ? _mm256_setzero_ps()
                : bias_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                              (const __m128i*)((const uint16_t*)bias + n0 + 8 * h))),
                                      16))
                            : _mm256_loadu_ps((const float*)bias + n0 + 8 * h);
    }
    for (int i = 0; i < mb; i++) {
        float sums[GR];
        __m256 v[2];
        for (int h = 0; h < 2; h++) {
            const __m256* a = acc + i * 2 + h;
            const int L = MT_WIDE * 2;
            v[h] = _mm256_add_ps(
                    _mm256_add_ps(_mm256_add_ps(a[0], a[2 * L]), _mm256_add_ps(a[L], a[3 * L])),
                    _mm256_add_ps(_mm256_add_ps(a[4 * L], a[6 * L]), _mm256_add_ps(a[5 * L], a[7 * L])));
        }
        if (n0 + GR <= N) {
            const int64_t at = (int64_t)(m0 + i) * N + n0;
            for (int h = 0; h < 2; h++) {
                if (scale) v[h] = _mm256_mul_ps(v[h], sc[h]);
                if (bias) v[h] = _mm256_add_ps(v[h], bs[h]);
                if (!out_bf16) _mm256_storeu_ps((float*)y + at + 8 * h, v[h]);
            }
            if (out_bf16)
                _mm256_storeu_si256((__m256i*)((uint16_t*)y + at),
                                    _mm256_permute4x64_epi64(
                                            _mm256_packus_epi32(round8_bf16(v[0]), round8_bf16(v[1])), 0xD8));
            continue;
        }
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(sums + 8 * h, v[h]);
        for (int t = 0; t < GR / NT; t++) {
            const int n1 = n0 + t * NT;
            if (n1 >= N) break;
            const int nb = N - n1 < NT ? N - n1 : NT;
            if (scale)
                for (int j = 0; j < nb; j++) sums[t * NT + j] *= scale[n1 + j];
            if (nb == NT)
                store_four(sums + t * NT, bias, bias_bf16, n1, y, (int64_t)(m0 + i) * N + n1, out_bf16);
            else
                store_tile(sums + t * NT, 1, nb, m0 + i, n1, N, bias, bias_bf16, y, out_bf16);
        }
    }
}

/* The source of a block's weights over [k0, k1) (its groups' tiles, or int8 rows): read into L2 a few cache
 * lines at a time while the panels pass over the block before it, so that converting it does not wait on
 * memory. One
 * contiguous range a tile, or a row of codes. */
struct prefetch {
    const char *at, *end; /* the next line to read, the end of the current range */
    int unit, units;      /* the current range, ranges in all (done when unit == units) */
    int64_t lines;        /* lines in all, about (for the share read before each lane of a panel) */
    const uint16_t* wt;
    const int8_t* wq;
    int64_t K, k0, k1;
    int u0;
};

static void prefetch_range(struct prefetch* p) {
    const char* start;
    if (p->wt) { /* tile u0 + unit: [K / 32][4][32] values, a pass's part of it contiguous */
        start = (const char*)(p->wt + (int64_t)(p->u0 + p->unit) * NT * p->K + p->k0 * NT);
        p->end = start + (p->k1 - p->k0) * NT * 2;
    } else { /* row u0 + unit of the codes */
        start = (const char*)(p->wq + (int64_t)(p->u0 + p->unit) * p->K + p->k0);
        p->end = start + (p->k1 - p->k0);
    }
    p->at = (const char*)((uintptr_t)start & ~(uintptr_t)63);
}

/* Nothing to read (g0 == g1) leaves p done. */
static void prefetch_init(struct prefetch* p, const uint16_t* wt, const int8_t* wq, int N, int64_t K, int g0,
                          int g1, int64_t k0, int64_t k1) {
    p->wt = wt, p->wq = wq, p->K = K, p->k0 = k0, p->k1 = k1, p->unit = 0;
    if (wq) {
        p->u0 = g0 * GR;
        p->units = (g1 * GR < N ? g1 * GR : N) - p->u0;
        p->lines = (int64_t)p->units * ((k1 - k0 + 63) / 64 + 1);
    } else {
        const int tiles = (N + NT - 1) / NT;
        p->u0 = g0 * (GR / NT);
        p->units = (g1 * (GR / NT) < tiles ? g1 * (GR / NT) : tiles) - p->u0;
        p->lines = (int64_t)p->units * ((k1 - k0) * NT * 2 / 64);
    }
    if (p->units <= 0)
        p->units = 0;
    else
        prefetch_range(p);
}

static inline void prefetch_some(struct prefetch* p, int64_t lines) {
    for (; lines > 0 && p->unit < p->units; lines--) {
        _mm_prefetch(p->at, _MM_HINT_T1);
        if ((p->at += 64) >= p->end && ++p->unit < p->units) prefetch_range(p);
    }
}

/* The loops over outer_lane, for sidecar_bf16_matmul_tiled from OUTER_ROWS rows on and for the int8 prefill
 * path. Rows go in chunks (their panels in the layout above); blocks of groups go to whichever thread is
 * free; for each pass over K a thread converts its block's weights, then every panel passes over them, lane
 * by lane (the lane's activations stay in L1 while the block's weights for it stream from L2), reading the
 * source of its next pass or block ahead (struct prefetch); a panel's accumulators (8 lanes x 12 vectors a
 * group) wait in memory between lanes and passes. */
static int tiled_outer(const void* x, int x_f32, const uint16_t* wt, const int8_t* wq, const float* scale,
                       const void* bias, void* y, int M, int N, int K, int nthreads, int bias_bf16,
                       int out_bf16) {
    const int groups = (N + GR - 1) / GR, tiles = (N + NT - 1) / NT;
    const int64_t kc = K <= KC_OUTER ? K : KC_OUTER;
    const int per_block = units_per_block(groups, (int64_t)GR * kc * 2, OUTER_BLOCK_BYTES, nthreads);
    const int blocks = (groups + per_block - 1) / per_block, mc = chunk_rows(K);
    const int chunk_panels = ((M < mc ? M : mc) + MT_WIDE - 1) / MT_WIDE;
    const int64_t per_group = 8 * MT_WIDE * 2; /* accumulators of a (panel, group) */
    const int64_t acc_per = (kc < K ? chunk_panels : 1) * per_block * per_group;
    float* const xa = chunk_buffer((int64_t)(M < mc ? M : mc) * K);
    if (!xa) return 2;
    const int64_t wbuf_per = (int64_t)per_block * GR * kc;
    __m256* acc_all = (__m256*)aligned_alloc(32, (size_t)(acc_per * nthreads * sizeof(__m256)));
    uint16_t* wbuf_all = (uint16_t*)aligned_alloc(64, (size_t)((wbuf_per * nthreads * 2 + 63) / 64 * 64));
    int* claims = (int*)calloc((size_t)((M + mc - 1) / mc), sizeof(int));
    if (!acc_all || !wbuf_all || !claims) {
        free(acc_all);
        free(wbuf_all);
        free(claims);
        return 2;
    }
#pragma omp parallel num_threads(nthreads)
    {
        __m256* const accs = acc_all + acc_per * omp_get_thread_num();
        uint16_t* const wbuf = wbuf_all + wbuf_per * omp_get_thread_num();
        for (int c0 = 0; c0 < M; c0 += mc) {
            const int rows = M - c0 < mc ? M - c0 : mc;
            const int panels = (rows + MT_WIDE - 1) / MT_WIDE; /* of equal size, as over the narrow tiles */
/* (the implied barrier: the chunk is whole before any thread reads it) */
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) row_to_lanes(x, x_f32, c0 + r, K, xa + (int64_t)r * K);
            /* blocks go to whichever thread asks first; a thread asks for its next block before this one (not
             * near the end: holding a block while the other thread waits would cost more), so that it can
             * read that block's weights ahead at every chunk size */
            int* const claim = &claims[c0 / mc];
            int blk = __atomic_fetch_add(claim, 1, __ATOMIC_RELAXED);
            while (blk < blocks) {
                const int nxt = __atomic_load_n(claim, __ATOMIC_RELAXED) < blocks - nthreads
                                        ? __atomic_fetch_add(claim, 1, __ATOMIC_RELAXED)
                                        : -1;
                const int g0 = blk * per_block, g1 = g0 + per_block < groups ? g0 + per_block : groups;
                for (int64_t k0 = 0; k0 < K; k0 += kc) {
                    const int64_t k1 = k0 + kc < K ? k0 + kc : K, steps = (k1 - k0) / 8;
                    for (int g = g0; g < g1; g++) {
                        uint16_t* const out = wbuf + (g - g0) * GR * kc;
                        if (!wq && 4 * g + 3 < tiles)
                            group_to_lanes_tiled(wt, K, g, k0, k1, out);
                        else
                            group_to_lanes(wt, wq, N, K, g, k0, k1, out);
                    }
                    /* ahead: the block's next pass, else the next block's first */
                    struct prefetch pf = {.unit = 0, .units = 0, .lines = 0};
                    if (k1 < K)
                        prefetch_init(&pf, wt, wq, N, K, g0, g1, k1, k1 + kc < K ? k1 + kc : K);
                    else if (nxt >= 0 && nxt < blocks)
                        prefetch_init(&pf, wt, wq, N, K, nxt * per_block,
                                      (nxt + 1) * per_block < groups ? (nxt + 1) * per_block : groups, 0, kc);
                    const int64_t calls = (int64_t)panels * 8 * (g1 - g0);
                    const int64_t quota = (pf.lines + calls - 1) / calls;
                    for (int p = 0, m0 = 0; p < panels; p++) {
                        const int mb = rows / panels + (p < rows % panels);
                        const float* xp = xa + (int64_t)m0 * K + k0 / 8;
                        __m256* pa = accs + (kc < K ? p : 0) * per_block * per_group;
                        for (int l = 0; l < 8; l++)
                            for (int g = g0; g < g1; g++) {
                                const float* xl = xp + (int64_t)l * (K / 8);
                                const uint16_t* wl = wbuf + (g - g0) * GR * kc + l * steps * GR;
                                __m256* a = pa + (g - g0) * per_group + l * MT_WIDE * 2;
                                if (pf.unit < pf.units) prefetch_some(&pf, quota);
                                switch (mb) {
                                    case 1:
                                        outer_lane_1(xl, K, wl, steps, k0 == 0, a);
                                        break;
                                    case 2:
                                        outer_lane_2(xl, K, wl, steps, k0 == 0, a);
                                        break;
                                    case 3:
                                        outer_lane_3(xl, K, wl, steps, k0 == 0, a);
                                        break;
                                    case 4:
                                        outer_lane_4(xl, K, wl, steps, k0 == 0, a);
                                        break;
                                    case 5:
                                        outer_lane_5(xl, K, wl, steps, k0 == 0, a);
                                        break;
                                    default:
                                        outer_lane_6(xl, K, wl, steps, k0 == 0, a);
                                        break;
                                }
                            }
                        if (k1 == K)
                            for (int g = g0; g < g1; g++)
                                outer_store(pa + (g - g0) * per_group, mb, g, c0 + m0, N, scale, bias,
                                            bias_bf16, y, out_bf16);
                        m0 += mb;
                    }
                }
                blk = nxt >= 0 ? nxt : __atomic_fetch_add(claim, 1, __ATOMIC_RELAXED);
            }
/* every thread is done with the chunk before the next is packed */
#pragma omp barrier
        }
    }
    free(claims);
    free(acc_all);
    free(wbuf_all);
    return 0;
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
#if BF16_PATH == 2
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

/* y = (x @ w.T) * scale + bias for int8 codes w [N, K] with one float32 scale a row: the AVX2 prefill path
 * above (tiled_outer) over the codes (a block of groups converted to bf16 in the thread's buffer, exactly:
 * the codes are small integers), so a prefill over int8 weights runs at bf16's pace instead of torch's packed
 * int8 kernel's. x: bf16, or float32 when x_f32 (each value as it is: no rounding);
 * bias, y as sidecar_bf16_matmul. The sums are float32 in the order of every path here. Returns 0; 1 without
 * the AVX2 path (an AVX-512 build has none: its caller keeps torch's kernel) or when K is not a multiple of
 * 32; 2 when out of memory. */
int sidecar_int8_matmul_wide(const sidecar_matmul_args* a) {
    const void* x = a->x;
    int x_f32 = !a->x_bf16;
    const int8_t* w = a->w;
    const float* scale = a->scales;
    const void* bias = a->bias;
    void* y = a->y;
    int M = a->M;
    int N = a->N;
    int K = a->K;
    int nthreads = a->nthreads;
    int bias_bf16 = a->bias_bf16;
    int out_bf16 = a->out;
#if defined(BF16_PATH) && BF16_PATH == 2
    if (K % 32 || M < 1) return 1;
    return tiled_outer(x, x_f32, NULL, w, scale, bias, y, M, N, K, nthreads < 1 ? 1 : nthreads, bias_bf16,
                       out_bf16);
#else
    (void)x;
    (void)x_f32;
    (void)w;
    (void)scale;
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
