/* bf16 and int8 matmul for prefill-sized batches on AVX2 CPUs: outer products of weights widened to float32
 * (exact) and activations broadcast from memory, in the order of bf16_gemv's dot products (its tiled path
 * from OUTER_ROWS rows on calls tiled_outer over the tiled layout; int8_gemm.c calls it over int8 codes with
 * one scale a row). Built only on the AVX2 path (OUTER_PATH): a CPU with AVX-512 BF16 has its own kernels.
 * The including source sets the loop alignment (align-loops=64) before including this header. */
#ifndef SIDECAR_OUTER_AVX2_H
#define SIDECAR_OUTER_AVX2_H
#include <omp.h>
#include <stdlib.h>

#include "vec.h"
#include "matmul_store.h"

#define NT 4 /* weight rows a tile of bf16_gemv's tiled layout holds */

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512BF16__) && defined(__AVX512F__))
#define OUTER_PATH 1
#define MT_WIDE    6 /* activation rows a panel of the outer products holds (see tiled_outer) */

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

/* bf16_gemv's batches of OUTER_ROWS rows and more, as outer products: the same sums in the same order as its
 * dot products (dot_tile), with weights and activations rearranged so that every FMA takes a vector of 8
 * outputs' weights and one activation broadcast from memory. Dot products over half tiles (6 x 2 register
 * tiles) loaded an activation vector for every two FMAs and ran below the core's FMA rate; here a register
 * tile is up to 6 activation rows x 16 weight rows (12 accumulators, one vector of 16 bf16 weights widened
 * into two, one broadcast) and runs at the FMA rate.
 *
 * The order: the sum for output n is kept as 8 partial sums s_l (l = 0..7), s_l accumulating, for each
 * 16-value block b of K in turn, the products at k = 16b + 2l and then 16b + 2l + 1 -- lane l of dot_tile's
 * accumulators -- and the 8 are added as bf16_gemv.c's sum4_256 adds the lanes. So a step of the tile is one
 * k (values k of 16 weight rows, one vector), and the steps of s_l are the k above in order: weights and
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
 * path (int8_gemm.c). Rows go in chunks (their panels in the layout above); blocks of groups go to whichever
 * thread is free; for each pass over K a thread converts its block's weights, then every panel passes over
 * them, lane by lane (the lane's activations stay in L1 while the block's weights for it stream from L2),
 * reading the source of its next pass or block ahead (struct prefetch); a panel's accumulators (8 lanes x 12
 * vectors a group) wait in memory between lanes and passes. */
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

#endif
