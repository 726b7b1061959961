/* Weight-only int4 matmul on CPU, made for decode steps (a few activation rows), fine for prefill chunks.
 *
 *   y[m, n] = sum_g sum_{k in g} x[m, k] * ((q[n, k] - 8) * s[g, n] + z[g, n])
 *
 * x float32 or bf16 [M, K]; q the 4-bit codes in torch's packed CPU layout (uint8, see below),
 * read in place so the weights are stored once; sz bf16 [G, Np, 2] (scale, zero) for G groups of
 * gs columns; y float32 or bf16 [M, Np].
 *
 * Packed layout, rows in blocks of BN (64 or 32, torch picks by its own CPU capability):
 *  - a full block holds BN / 2 bytes per column k, one k after the other; "split" blocks keep
 *    row j of the block in the low nibble of byte j and row BN / 2 + j in its high nibble,
 *    "interleaved" blocks keep rows 2j and 2j + 1 in byte j (low, high);
 *  - the last R = Np % BN rows (a multiple of 16) form an interleaved block of R rows.
 * The wrapper (int4_gemv.py) checks torch's layout against this once before using the kernel.
 *
 * Two ways to the dot products, by instruction set:
 *  - AVX-512 with VNNI and VBMI: each activation row is rounded to 16-bit integers with one scale
 *    per group (d = absmax / 32639), split into a high and a low signed byte (x = 256 h + l),
 *    and multiplied with the codes as bytes, four columns per 32-bit lane (vpdpbusd; vpermt2b
 *    gathers each row's four codes). Integer sums are exact; a group adds
 *    s * d * (sum q x - 8 sum x) + z * sum x, the last with the float32 activations.
 *  - AVX2 without AVX-512: the same 16-bit activation codes and the same exact integer sums, from
 *    vpmaddubsw: a 32-byte vector holds 16 rows' codes of two adjacent columns side by side (unpacked
 *    from the layout), multiplied with a column pair of high or low activation bytes; the 16-bit pair
 *    sums of 8 column pairs (at most 8 * 2 * 15 * 128 = 30720) are summed as 16-bit, then widened to
 *    32 bits: about half the instructions per code of the float path. Split blocks of 32 rows (torch's
 *    layout with AVX2) pair column k with k + 2 instead (group_quads): their bytes interleave within
 *    128-bit lanes, with no lane-crossing shuffle per column pair. That is for calls of
 *    one row (a plain decode step); from 2 rows on (speculative verification, batched decode, prefill:
 *    panel_group) a group's codes are decoded once per block to int16 and multiplied with whole 16-bit
 *    activation pairs (vpmaddwd: 16 products a vector into exact 32-bit sums, twice the rate of float32
 *    FMAs), up to 3 rows sharing each code vector, the same integers either way (calls of 2 rows decode
 *    each column pair in registers instead, fused_group: storing a decoded group costs more than decoding
 *    it). Activations are rounded to their codes with vectors, their float sum in column order.
 *  - otherwise (AVX-512 without VNNI and VBMI): codes are widened to float and multiplied with
 *    the float32 activations, a group adds s * sum q x + (z - 8 s) * sum x.
 * Output rows go in tiles of 16; blocks of rows (and chunks of 32 activation rows) are split across
 * threads; each chunk of codes is decoded once for one or more activation rows, and one pass reads
 * each weight byte once, which is what bounds decode.
 */
#include <omp.h>
#include <stdlib.h>

#include "vec.h"
#include "matmul_args.h"
#include "moe_args.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "int4_gemv needs AVX2 and FMA"
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define INT_DOT 1
#elif !defined(__AVX512F__)
#define INT_DOT 2 /* AVX2 only: the same 16-bit activations, bytes multiplied in pairs (vpmaddubsw) */
#else
#define INT_DOT 0
#endif

#define ROWS_CHUNK 32    /* activation rows whose outputs one block keeps at once */
#define XQ_MAX     32639 /* 16-bit activation codes whose high and low bytes are both int8 */
#define PANEL_MIN  2     /* AVX2: activation rows from which a call takes the panels (see panel_group) */
#define XB_QUADS   16    /* AVX2, panels 0: bytes a row and column of group_quads' activation vectors */

/* What one pass over a block decodes (the tiles of 16 rows it covers). */
enum { SPLIT64_ALL, SPLIT64_LO, SPLIT64_HI, SPLIT32_ALL, INTERLEAVED_1 };
static inline int tiles_of(int kind) {
    return kind == SPLIT64_ALL ? 4 : (kind == INTERLEAVED_1 ? 1 : 2);
}

/* Per call: the activations and what every group needs of them. */
typedef struct {
    const float* x;      /* [M, K] (float path; a float32 copy when the caller's are bf16) */
    const uint16_t* x16; /* [M, K] the caller's activations when they are bf16, else NULL */
    int8_t* xb;     /* [M, 2, K]: high bytes, then low bytes of the 16-bit codes (integer path). With AVX2,
                     * xb_row * K bytes a row, pairs of columns as int32 (a float broadcast makes a vector of
                     * them, where an integer broadcast from memory is several times slower): high bytes
                     * then low bytes, a pair's two bytes twice (panels 0), or the int16 codes (panels 1);
                     * with panels 0 the quads of group_quads follow: XB_QUADS bytes a column */
    float* d;       /* [M, G] code scale (integer path) */
    int32_t* xqsum; /* [M, G] sum of the codes (integer path) */
    float* xsum;    /* [M, G] sum of x */
    int K, G, gs;
    int panels; /* AVX2: the call has PANEL_MIN rows or more (xb holds int16 codes, pairs as int32) */
    int xb_row; /* bytes of xb per row and column: 4 + XB_QUADS for AVX2's byte pairs and quads, else 2 */
} Act;

#if INT_DOT == 1
static inline __m512 load_x16(const float* x, const uint16_t* x16, int k) { /* 16 activations as floats */
    if (x16 == NULL) return _mm512_loadu_ps(x + k);
    __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x16 + k)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
#endif

#if INT_DOT == 2
static inline __m256 load8_x(const float* x, const uint16_t* x16, int k) { /* 8 activations as floats */
    if (x16 == NULL) return _mm256_loadu_ps(x + k);
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x16 + k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
#endif

static void prepare_group(const Act* a, int m, int g) {
    const int64_t off = (int64_t)m * a->K + (int64_t)g * a->gs, mg = (int64_t)m * a->G + g;
    const float* x = a->x + off;
    const uint16_t* x16 = a->x16 ? a->x16 + off : NULL;
#if INT_DOT == 1
    __m512 sum = _mm512_setzero_ps(), amax = sum, bad = sum;
    for (int k = 0; k < a->gs; k += 16) {
        __m512 v = load_x16(x, x16, k);
        sum = _mm512_add_ps(sum, v);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        bad = _mm512_add_ps(bad, _mm512_mul_ps(v, _mm512_setzero_ps())); /* NaN once any x is not finite */
    }
    a->xsum[mg] = _mm512_reduce_add_ps(sum);
    float mx = _mm512_reduce_max_ps(amax);
    int finite = _mm512_reduce_add_ps(bad) == 0.f;
    /* A NaN or infinite activation makes its whole output row NaN, as a float matmul would. */
    __m512 inv = _mm512_set1_ps(finite && mx > 0.f ? (float)XQ_MAX / mx : 0.f);
    a->d[mg] = !finite ? NAN : (mx > 0.f ? mx / (float)XQ_MAX : 0.f);
    int8_t* hi = a->xb + (int64_t)m * a->xb_row * a->K + (int64_t)g * a->gs;
    int8_t* lo = hi + a->K;
    __m512i qsum = _mm512_setzero_si512();
    for (int k = 0; k < a->gs; k += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_x16(x, x16, k), inv)); /* nearest */
        __m512i l = _mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24);             /* q = 256 h + l */
        _mm_storeu_si128((__m128i*)(lo + k), _mm512_cvtepi32_epi8(l));
        _mm_storeu_si128((__m128i*)(hi + k),
                         _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(q, l), 8)));
        qsum = _mm512_add_epi32(qsum, q);
    }
    a->xqsum[mg] = _mm512_reduce_add_epi32(qsum);
#elif INT_DOT == 2
    /* the sum in column order, one value after the other (the float rounding of the scalar loop) */
    float sum = 0.f;
    for (int k = 0; k < a->gs; k++) sum += x16 ? bf16_to_f32(x16[k]) : x[k];
    a->xsum[mg] = sum;
    const __m256 sign = _mm256_set1_ps(-0.f), zero = _mm256_setzero_ps();
    __m256 amax = zero, bad = zero;
    for (int k = 0; k < a->gs; k += 8) {
        const __m256 v = load8_x(x, x16, k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
        bad = _mm256_add_ps(bad, _mm256_mul_ps(v, zero)); /* NaN once any x is not finite */
    }
    float lanes[8], bads[8], mx = 0.f;
    int finite = 1;
    _mm256_storeu_ps(lanes, amax);
    _mm256_storeu_ps(bads, bad);
    for (int j = 0; j < 8; j++) {
        mx = fmaxf(mx, lanes[j]);
        finite &= bads[j] == 0.f;
    }
    const float inv = finite && mx > 0.f ? (float)XQ_MAX / mx : 0.f;
    a->d[mg] = !finite ? NAN : (mx > 0.f ? mx / (float)XQ_MAX : 0.f);
    uint32_t* hi = (uint32_t*)(a->xb + (int64_t)m * a->xb_row * a->K) + (int64_t)g * a->gs / 2;
    uint32_t* lo = hi + a->K / 2;
    const __m256 vinv = _mm256_set1_ps(inv);
    /* per 128-bit lane of bytes l0-3 h0-3: the pairs (l0 l1) (l2 l3), each twice, then the same of h */
    const __m256i twice = _mm256_setr_epi8(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 0, 1, 0, 1, 2, 3,
                                           2, 3, 4, 5, 4, 5, 6, 7, 6, 7);
    __m256i qsum = _mm256_setzero_si256();
    for (int k = 0; k < a->gs; k += 16) { /* gs % 16 == 0 */
        __m256i q[2];
        for (int j = 0; j < 2; j++) { /* nearest even, as lrintf */
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8_x(x, x16, k + 8 * j), vinv));
            qsum = _mm256_add_epi32(qsum, q[j]);
        }
        if (a->panels) { /* the codes of columns k, k + 1 as int16, one int32 a pair */
            _mm256_storeu_si256((__m256i*)(hi + k / 2),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
            continue;
        }
        for (int j = 0; j < 2; j++) { /* q = 256 h + l (l a signed byte): a pair's two bytes twice */
            const __m256i l = _mm256_srai_epi32(_mm256_slli_epi32(q[j], 24), 24);
            const __m256i h = _mm256_srai_epi32(_mm256_sub_epi32(q[j], l), 8);
            const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(l, h), _mm256_setzero_si256());
            /* quarters: l pairs of columns 0-3, h of 0-3, l of 4-7, h of 4-7 -> l of 0-7, then h of 0-7 */
            const __m256i r = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, twice), 0xD8);
            _mm_storeu_si128((__m128i*)(lo + (k + 8 * j) / 2), _mm256_castsi256_si128(r));
            _mm_storeu_si128((__m128i*)(hi + (k + 8 * j) / 2), _mm256_extracti128_si256(r, 1));
        }
    }
    if (!a->panels) { /* group_quads' vectors a 4 columns k..k+3: high bytes, then low ones, each 16 bytes of
                       * the pair (k, k + 2) then 16 bytes of the pair (k + 1, k + 3), from the pairs above
                       * (8 bytes a 4 columns: k, k + 1, k, k + 1, k + 2, k + 3, k + 2, k + 3) */
        const __m256i quad = _mm256_setr_epi8(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 1, 5, 1, 5, 1,
                                              5, 1, 5, 1, 5, 1, 5, 1, 5, 1, 5);
        __m256i* v = (__m256i*)(a->xb + (int64_t)m * a->xb_row * a->K + 4 * (int64_t)a->K) +
                     (int64_t)g * a->gs / 2;
        for (int k = 0; k < a->gs; k += 4, v += 2) {
            int64_t ph, pl;
            memcpy(&ph, hi + k / 2, 8);
            memcpy(&pl, lo + k / 2, 8);
            v[0] = _mm256_shuffle_epi8(_mm256_set1_epi64x(ph), quad);
            v[1] = _mm256_shuffle_epi8(_mm256_set1_epi64x(pl), quad);
        }
    }
    int32_t qs[8];
    _mm256_storeu_si256((__m256i*)qs, qsum);
    a->xqsum[mg] = qs[0] + qs[1] + qs[2] + qs[3] + qs[4] + qs[5] + qs[6] + qs[7];
#else
    if (x16 != NULL) /* the float path reads float32 activations: a->x is the scratch copy */
        for (int k = 0; k < a->gs; k += 8) {
            __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x16 + k)));
            _mm256_storeu_ps((float*)x + k, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
    __m256 sum = _mm256_setzero_ps();
    for (int k = 0; k < a->gs; k += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(x + k));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    a->xsum[mg] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
}

#if INT_DOT == 1
/* ---------------------------------------------------------------- integer path (AVX-512 VNNI) */
#define V_LANES           16
#define SPLIT64_IN_HALVES 0 /* all 64 rows of a split block in one pass */

/* vpermb / vpermt2b indices gathering four columns of a row into each 32-bit lane, by layout */
typedef struct {
    __m512i split64_rows0, split64_rows16, split32, interleaved, nibble;
} Idx;

static void make_idx(Idx* idx) {
    uint8_t a[64], b[64], c[64], d[64];
    for (int r = 0; r < 16; r++)
        for (int j = 0; j < 4; j++) {             /* byte 4r + j of a tile: row r, column k + j */
            a[4 * r + j] = (uint8_t)(32 * j + r); /* two zmm: columns k, k+1 | k+2, k+3 */
            b[4 * r + j] = (uint8_t)(32 * j + r + 16);
            c[4 * r + j] = (uint8_t)(16 * j + r);                   /* one zmm: columns k .. k+3 */
            d[4 * r + j] = (uint8_t)(32 * (r % 2) + 8 * j + r / 2); /* low | high nibbles */
        }
    idx->split64_rows0 = _mm512_loadu_si512(a);
    idx->split64_rows16 = _mm512_loadu_si512(b);
    idx->split32 = _mm512_loadu_si512(c);
    idx->interleaved = _mm512_loadu_si512(d);
    idx->nibble = _mm512_set1_epi8(0x0F);
}

/* The codes of columns k .. k+3 for the pass's tiles: byte 4r + j of c[t] is row 16 t + r, column k + j. */
static inline __attribute__((always_inline)) void decode4(const uint8_t* p, int stride, const int kind,
                                                          const Idx* idx, __m512i* c) {
    const __m512i m = idx->nibble;
    if (kind == INTERLEAVED_1) {
        int64_t q[4];
        for (int j = 0; j < 4; j++) memcpy(&q[j], p + (int64_t)j * stride, 8);
        __m256i v = _mm256_set_epi64x(q[3], q[2], q[1], q[0]);
        __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
        c[0] = _mm512_permutexvar_epi8(idx->interleaved, _mm512_and_si512(both, m));
    } else if (kind == SPLIT32_ALL) {
        __m512i v = _mm512_loadu_si512((const void*)p);
        c[0] = _mm512_permutexvar_epi8(idx->split32, _mm512_and_si512(v, m));
        c[1] = _mm512_permutexvar_epi8(idx->split32, _mm512_and_si512(_mm512_srli_epi16(v, 4), m));
    } else {
        __m512i v0 = _mm512_loadu_si512((const void*)p), v1 = _mm512_loadu_si512((const void*)(p + 64));
        int t = 0;
        if (kind != SPLIT64_HI) {
            __m512i l0 = _mm512_and_si512(v0, m), l1 = _mm512_and_si512(v1, m);
            c[t++] = _mm512_permutex2var_epi8(l0, idx->split64_rows0, l1);
            c[t++] = _mm512_permutex2var_epi8(l0, idx->split64_rows16, l1);
        }
        if (kind != SPLIT64_LO) {
            __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m);
            __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m);
            c[t++] = _mm512_permutex2var_epi8(h0, idx->split64_rows0, h1);
            c[t++] = _mm512_permutex2var_epi8(h0, idx->split64_rows16, h1);
        }
    }
}

/* acc += the four products of unsigned bytes u and signed bytes b in each 32-bit lane (vpdpbusd).
 * In assembly so that the accumulator stays in its register: the intrinsic makes some
 * compilers copy it around every instruction. */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i u, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(b));
    return acc;
}

static inline __m512i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* (scale, zero) of 16 rows as floats */
static inline void load_scales(const uint16_t* sz, __m512* s, __m512* z) {
    __m512i v = _mm512_loadu_si512((const void*)sz);
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* tot[i][16 t ..] += s d (sum q x - 8 sum x) + z sum x for activation row i and group g, from the
 * two halves of sum q x - 8 sum x (high and low activation bytes; lo starts at -8 sum x). */
static inline __attribute__((always_inline)) void fold(const Act* a, int i, int g, const int T,
                                                       const __m512i* hi, const __m512i* lo, const __m512* s,
                                                       const __m512* z, float (*tot)[64]) {
    int64_t mg = (int64_t)i * a->G + g;
    __m512 dx = _mm512_set1_ps(a->d[mg]), xs = _mm512_set1_ps(a->xsum[mg]);
    for (int t = 0; t < T; t++) {
        __m512i q = _mm512_add_epi32(_mm512_slli_epi32(hi[t], 8), lo[t]);
        float* o = &tot[i][16 * t];
        __m512 acc = _mm512_fmadd_ps(z[t], xs, _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_mul_ps(s[t], dx), _mm512_cvtepi32_ps(q), acc));
    }
}

/* One group for R (1 or 2) activation rows from row i: codes decoded straight into the dot products.
 * pf, when not NULL: codes further on, fetched into L2 meanwhile (the hardware prefetcher stops at page
 * boundaries; a group's codes are a page or less). Into L2, not L1, whose few fill buffers the prefetches
 * would hold. */
static inline __attribute__((always_inline)) void group_direct(const uint8_t* w, int stride, const int kind,
                                                               const Idx* idx, const Act* a, int i,
                                                               const int R, int g, const uint16_t* szg,
                                                               float (*tot)[64], const uint8_t* pf) {
    const int T = tiles_of(kind);
    /* One row alternates between two sets of sums (the rows' sums are the two sets with R = 2), so
     * that enough independent sums are in flight to hide the latency of vpdpbusd. */
    __m512i hi[2][4], lo[2][4], c[4];
    for (int r = 0; r < 2; r++) {
        __m512i q8 = _mm512_set1_epi32(r < R ? -8 * a->xqsum[(int64_t)(i + r) * a->G + g] : 0);
        for (int t = 0; t < T; t++) {
            hi[r][t] = _mm512_setzero_si512();
            lo[r][t] = q8;
        }
    }
    const int8_t* xh = a->xb + (int64_t)i * 2 * a->K + (int64_t)g * a->gs;
    for (int k = 0; k < a->gs; k += 8) /* gs % 8 == 0 */
        for (int u = 0; u < 2; u++) {
            if (pf) {
                _mm_prefetch((const char*)(pf + (int64_t)(k + 4 * u) * stride), _MM_HINT_T1);
                _mm_prefetch((const char*)(pf + (int64_t)(k + 4 * u) * stride + 64), _MM_HINT_T1);
            }
            decode4(w + (int64_t)(k + 4 * u) * stride, stride, kind, idx, c);
            for (int r = 0; r < R; r++) {
                const int8_t* xr = xh + (int64_t)r * 2 * a->K + k + 4 * u;
                __m512i bh = bcast4(xr), bl = bcast4(xr + a->K);
                const int set = R == 2 ? r : u;
                for (int t = 0; t < T; t++) {
                    hi[set][t] = dpbusd(hi[set][t], c[t], bh);
                    lo[set][t] = dpbusd(lo[set][t], c[t], bl);
                }
            }
        }
    if (R == 1)
        for (int t = 0; t < T; t++) {
            hi[0][t] = _mm512_add_epi32(hi[0][t], hi[1][t]);
            lo[0][t] = _mm512_add_epi32(lo[0][t], lo[1][t]);
        }
    __m512 sc[4], ze[4];
    for (int t = 0; t < T; t++) load_scales(szg + 32 * t, &sc[t], &ze[t]);
    for (int r = 0; r < R; r++) fold(a, i + r, g, T, hi[r], lo[r], sc, ze, tot);
}

#define PASS_ARGS                                                                                   \
    const uint8_t *w, int stride, const Idx *idx, const uint16_t *sz, int np, const Act *a, int mc, \
            float (*tot)[64]
#define PREFETCH_BYTES 8192 /* how far ahead of the codes being read the next ones are fetched */
/* One pass over a block: all groups, activation rows [0, mc), the kind's tiles into tot[.][0 ..).
 * Rows go in pairs, each pair decoding the group's codes again (from L1). */
static inline __attribute__((always_inline)) void block_pass(PASS_ARGS, const int kind) {
    for (int g = 0; g < a->G; g++) {
        const uint8_t* wg = w + (int64_t)g * a->gs * stride;
        const uint16_t* szg = sz + 2 * (int64_t)g * np;
        const uint8_t* next = wg + PREFETCH_BYTES; /* past the last group: the next block */
        for (int j = 0; j < 4; j++) /* the next block's scales: one stream per group, too many to detect */
            _mm_prefetch((const char*)(szg + 2 * 64 + 32 * j), _MM_HINT_T0);
        for (int i = 0; i + 1 < mc; i += 2)
            group_direct(wg, stride, kind, idx, a, i, 2, g, szg, tot, i ? NULL : next);
        if (mc % 2) group_direct(wg, stride, kind, idx, a, mc - 1, 1, g, szg, tot, mc > 1 ? NULL : next);
    }
}
#elif INT_DOT == 2
/* ---------------------------------------------------------------- integer path (AVX2) */
#define V_LANES           8
#define SPLIT64_IN_HALVES 1 /* 16 registers: a 64-row split block in two passes (low, high nibbles) */
typedef struct {
    __m256i nibble, pairs, pairs16_lo, pairs16_hi;
} Idx;

static void make_idx(Idx* idx) {
    idx->nibble = _mm256_set1_epi8(0x0F);
    /* within each 128-bit lane of bytes 0..7 (column k) and 8..15 (column k+1): rows 0-3 (lo) or 4-7 (hi) of
     * the lane as int16 pairs (k, k + 1), the high bytes zero */
    int8_t p16[2][32];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 32; j++) {
            const int r = 4 * h + (j % 16) / 4, b = j % 4;
            p16[h][j] = (int8_t)(b % 2 ? -128 : (b == 0 ? r : 8 + r));
        }
    idx->pairs16_lo = _mm256_loadu_si256((const __m256i*)p16[0]);
    idx->pairs16_hi = _mm256_loadu_si256((const __m256i*)p16[1]);
    /* within each 128-bit lane: bytes 0..7 (column k) and 8..15 (column k+1) interleaved */
    idx->pairs = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3,
                                  11, 4, 12, 5, 13, 6, 14, 7, 15);
}

/* 16 codes of column k (rows 0..15 in order) of an interleaved block: byte j holds rows 2j, 2j + 1 */
static inline __m128i interleaved16(const uint8_t* p) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
    return _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x000F)),
                        _mm_and_si128(_mm_slli_epi16(b, 4), _mm_set1_epi16(0x0F00)));
}

/* The codes of columns k and k + 1 for the pass's tiles: bytes 2r, 2r + 1 of u[t] are row 16 t + r of
 * column k, k + 1 (rows counted from the pass's first row). */
static inline __attribute__((always_inline)) void decode_pair(const uint8_t* p, int stride, const int kind,
                                                              const Idx* idx, __m256i* u) {
    const __m256i m = idx->nibble;
    if (kind == INTERLEAVED_1) {
        const __m128i c0 = interleaved16(p), c1 = interleaved16(p + stride);
        u[0] = _mm256_set_m128i(_mm_unpackhi_epi8(c0, c1), _mm_unpacklo_epi8(c0, c1));
    } else if (kind == SPLIT32_ALL) { /* 16 bytes a column: rows j (low nibble), 16 + j (high); k + 1 next */
        const __m256i v = _mm256_loadu_si256((const __m256i*)p);
        const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
        u[0] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(lo, 0xD8), idx->pairs);
        u[1] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(hi, 0xD8), idx->pairs);
    } else { /* 32 bytes a column: rows j (low nibble), 32 + j (high); one pass takes one nibble */
        __m256i c0 = _mm256_loadu_si256((const __m256i*)p),
                c1 = _mm256_loadu_si256((const __m256i*)(p + stride));
        if (kind == SPLIT64_HI) {
            c0 = _mm256_srli_epi16(c0, 4);
            c1 = _mm256_srli_epi16(c1, 4);
        }
        c0 = _mm256_and_si256(c0, m);
        c1 = _mm256_and_si256(c1, m);
        /* rows 0-7 | 16-23, then 8-15 | 24-31 */
        const __m256i a = _mm256_unpacklo_epi8(c0, c1), b = _mm256_unpackhi_epi8(c0, c1);
        u[0] = _mm256_permute2x128_si256(a, b, 0x20);
        u[1] = _mm256_permute2x128_si256(a, b, 0x31);
    }
}

static inline __m256i bcast2(const uint32_t* p) { /* a pair of activation bytes (twice in *p) 16 times */
    return _mm256_castps_si256(_mm256_broadcast_ss((const float*)p));
}

/* One group for the R (1 or 2) activation rows from row i, the codes of each column pair decoded once for
 * them: tot[i + r][16 t ..] += s d (sum q x - 8 sum x) + z sum x, the integer sums exact, folded as the
 * AVX-512 path folds them. */
static inline __attribute__((always_inline)) void group_pairs(const uint8_t* w, int stride, const int kind,
                                                              const Idx* idx, const Act* a, int i,
                                                              const int R, int g, const uint16_t* szg,
                                                              float (*tot)[64]) {
    const int T = kind == INTERLEAVED_1 ? 1 : 2;
    /* 32-bit sums of the even and the odd rows of each tile (vpmaddwd with (f, 0) / (0, f) picks one row of a
     * pair of 16-bit lanes and scales it: 256 for the high bytes' sums, 1 for the low ones') */
    const __m256i hi_even = _mm256_set1_epi32(256), hi_odd = _mm256_set1_epi32(256 << 16);
    const __m256i lo_even = _mm256_set1_epi32(1), lo_odd = _mm256_set1_epi32(1 << 16);
    __m256i even[2][2], odd[2][2], u[2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) even[r][t] = odd[r][t] = _mm256_setzero_si256();
    const uint32_t* xh[2];
    for (int r = 0; r < R; r++)
        xh[r] = (const uint32_t*)(a->xb + (int64_t)(i + r) * a->xb_row * a->K) + (int64_t)g * a->gs / 2;
    for (int k0 = 0; k0 < a->gs; k0 += 16) { /* gs % 16 == 0 */
        __m256i h16[2][2], l16[2][2];
        for (int r = 0; r < 2; r++)
            for (int t = 0; t < 2; t++) h16[r][t] = l16[r][t] = _mm256_setzero_si256();
        for (int k = k0; k < k0 + 16; k += 2) {
            decode_pair(w + (int64_t)k * stride, stride, kind, idx, u);
            for (int r = 0; r < R; r++) {
                const __m256i bh = bcast2(xh[r] + k / 2), bl = bcast2(xh[r] + a->K / 2 + k / 2);
                for (int t = 0; t < T; t++) {
                    h16[r][t] = _mm256_add_epi16(h16[r][t], _mm256_maddubs_epi16(u[t], bh));
                    l16[r][t] = _mm256_add_epi16(l16[r][t], _mm256_maddubs_epi16(u[t], bl));
                }
                /* the sums pinned to registers after each row's step (else the compiler spills one and the
                 * loop waits on memory) */
                __asm__("" : "+x"(h16[r][0]), "+x"(h16[r][1]), "+x"(l16[r][0]), "+x"(l16[r][1]));
            }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) {
                even[r][t] =
                        _mm256_add_epi32(even[r][t], _mm256_add_epi32(_mm256_madd_epi16(h16[r][t], hi_even),
                                                                      _mm256_madd_epi16(l16[r][t], lo_even)));
                odd[r][t] =
                        _mm256_add_epi32(odd[r][t], _mm256_add_epi32(_mm256_madd_epi16(h16[r][t], hi_odd),
                                                                     _mm256_madd_epi16(l16[r][t], lo_odd)));
            }
    }
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int r = 0; r < R; r++) {
        const int64_t mg = (int64_t)(i + r) * a->G + g;
        const __m256 dx = _mm256_set1_ps(a->d[mg]), xs = _mm256_set1_ps(a->xsum[mg]);
        const __m256i q8 = _mm256_set1_epi32(-8 * a->xqsum[mg]);
        for (int t = 0; t < T; t++) {
            const __m256i lo4 = _mm256_unpacklo_epi32(even[r][t], odd[r][t]),
                          hi4 = _mm256_unpackhi_epi32(even[r][t], odd[r][t]);
            const __m256i rows[2] = {_mm256_permute2x128_si256(lo4, hi4, 0x20),
                                     _mm256_permute2x128_si256(lo4, hi4, 0x31)};
            for (int h = 0; h < 2; h++) { /* rows 16 t + 8 h .. + 7 */
                const __m256i v =
                        _mm256_loadu_si256((const __m256i*)(szg + 32 * t + 16 * h)); /* (scale, zero) pairs */
                const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 ze = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                float* o = &tot[i + r][16 * t + 8 * h];
                const __m256 acc = _mm256_fmadd_ps(ze, xs, _mm256_loadu_ps(o));
                const __m256 q = _mm256_cvtepi32_ps(_mm256_add_epi32(rows[h], q8));
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_mul_ps(sc, dx), q, acc));
            }
        }
    }
}

#define QUADS_AHEAD 8192 /* how far ahead of the codes group_quads reads the next ones are fetched */
/* Split blocks of 32 rows for the R (1 or 2) activation rows from row i, without crossing 128-bit lanes: the
 * 32 bytes of columns k, k + 1 and those of k + 2, k + 3 interleave in-lane (vpunpck{l,h}bw) into code pairs
 * (k, k + 2) in the low lane and (k + 1, k + 3) in the high one, rows 0-7 (low bytes) or 8-15 (high bytes)
 * of a nibble's tile, multiplied with prepare_group's quads, whose lanes hold those pairs of activation
 * bytes. Word j of a lane sums row j of its own two columns; the two lanes are added once a group. The
 * integer sums are group_pairs' exact integers and are folded into tot the same way, so the outputs are
 * bit for bit group_pairs'. pf, when not NULL: codes further on, fetched meanwhile, a line for each line read
 * (the hardware prefetcher stops at page boundaries). */
static inline __attribute__((always_inline)) void group_quads(const uint8_t* w, const Act* a, int i,
                                                              const int R, int g, const uint16_t* szg,
                                                              float (*tot)[64], const uint8_t* pf) {
    const __m256i m = _mm256_set1_epi8(0x0F), lo_hi = _mm256_set1_epi32(1 | 256 << 16);
    const int H = R == 1 ? 2 : 1; /* nibbles a pass: both for one row, one after the other for two */
    const __m256i* xq[2];
    for (int r = 0; r < R; r++)
        xq[r] = (const __m256i*)(a->xb + (int64_t)(i + r) * a->xb_row * a->K + 4 * (int64_t)a->K) +
                (int64_t)g * a->gs / 2;
    for (int n0 = 0; n0 < 2; n0 += H) {
        /* s03/s47[r][v]: row i + r's 32-bit sums of u[v]'s rows 0-3 (words 0-3 of each lane) and 4-7, kept in
         * memory (the asm below makes them addressable and reread): in registers they would push the 16-bit
         * sums of the loop out of them */
        __m256i s03[2][4] __attribute__((aligned(32))), s47[2][4] __attribute__((aligned(32)));
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 2 * H; v++) s03[r][v] = s47[r][v] = _mm256_setzero_si256();
        __asm__ volatile("" : : "r"(s03), "r"(s47) : "memory");
        for (int k0 = 0; k0 < a->gs; k0 += 32) {
            /* 16-bit sums of one product each 4 columns: at most 8 * 2 * 15 * 128 = 30720 for 32 columns */
            const int span = a->gs - k0 < 32 ? a->gs - k0 : 32; /* gs % 16 == 0 */
            __m256i h16[2][4], l16[2][4];
            for (int r = 0; r < 2; r++)
                for (int v = 0; v < 4; v++) h16[r][v] = l16[r][v] = _mm256_setzero_si256();
            const uint8_t* wk = w + (int64_t)k0 * 16;
            const uint8_t* pk = pf != NULL && n0 == 0 ? pf + (int64_t)k0 * 16 : NULL;
            const __m256i* xk[2] = {xq[0] + k0 / 2, xq[R - 1] + k0 / 2};
            for (int k = 0; k < span; k += 4, wk += 64, xk[0] += 2, xk[1] += 2) {
                if (pk != NULL) {
                    _mm_prefetch((const char*)pk, _MM_HINT_T1);
                    pk += 64;
                }
                const __m256i c01 = _mm256_loadu_si256((const __m256i*)wk);
                const __m256i c23 = _mm256_loadu_si256((const __m256i*)(wk + 32));
                const __m256i b0 = _mm256_unpacklo_epi8(c01, c23), b1 = _mm256_unpackhi_epi8(c01, c23);
                __m256i u[4];
                for (int hh = 0; hh < H; hh++) { /* the low nibbles: rows 0-15, the high ones: rows 16-31 */
                    const int high = n0 + hh;
                    u[2 * hh] = _mm256_and_si256(high ? _mm256_srli_epi16(b0, 4) : b0, m);
                    u[2 * hh + 1] = _mm256_and_si256(high ? _mm256_srli_epi16(b1, 4) : b1, m);
                }
                for (int r = 0; r < R; r++) {
                    const __m256i bh = _mm256_load_si256(xk[r]), bl = _mm256_load_si256(xk[r] + 1);
                    for (int v = 0; v < 2 * H; v++) {
                        h16[r][v] = _mm256_add_epi16(h16[r][v], _mm256_maddubs_epi16(u[v], bh));
                        l16[r][v] = _mm256_add_epi16(l16[r][v], _mm256_maddubs_epi16(u[v], bl));
                    }
                    /* the sums pinned to registers (see group_pairs) */
                    if (H == 2)
                        __asm__(""
                                : "+x"(h16[r][0]), "+x"(h16[r][1]), "+x"(h16[r][2]), "+x"(h16[r][3]),
                                  "+x"(l16[r][0]), "+x"(l16[r][1]), "+x"(l16[r][2]), "+x"(l16[r][3]));
                    else
                        __asm__("" : "+x"(h16[r][0]), "+x"(h16[r][1]), "+x"(l16[r][0]), "+x"(l16[r][1]));
                }
            }
            for (int r = 0; r < R;
                 r++) /* word pairs (low, high) of a row: low + 256 high, exact in 32 bits */
                for (int v = 0; v < 2 * H; v++) {
                    s03[r][v] = _mm256_add_epi32(
                            s03[r][v], _mm256_madd_epi16(_mm256_unpacklo_epi16(l16[r][v], h16[r][v]), lo_hi));
                    s47[r][v] = _mm256_add_epi32(
                            s47[r][v], _mm256_madd_epi16(_mm256_unpackhi_epi16(l16[r][v], h16[r][v]), lo_hi));
                }
            __asm__ volatile("" : : "r"(s03), "r"(s47) : "memory");
        }
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
        for (int r = 0; r < R; r++) { /* as group_pairs folds its sums */
            const int64_t mg = (int64_t)(i + r) * a->G + g;
            const __m256 dx = _mm256_set1_ps(a->d[mg]), xs = _mm256_set1_ps(a->xsum[mg]);
            const __m256i q8 = _mm256_set1_epi32(-8 * a->xqsum[mg]);
            for (int v = 0; v < 2 * H; v++) { /* rows 16 t + 8 h .. + 7 */
                const int t = n0 + v / 2, h = v % 2;
                const __m256i rows = _mm256_add_epi32(_mm256_permute2x128_si256(s03[r][v], s47[r][v], 0x20),
                                                      _mm256_permute2x128_si256(s03[r][v], s47[r][v], 0x31));
                const __m256i sv = _mm256_loadu_si256((const __m256i*)(szg + 32 * t + 16 * h));
                const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(sv, 16));
                const __m256 ze = _mm256_castsi256_ps(_mm256_and_si256(sv, high));
                float* o = &tot[i + r][16 * t + 8 * h];
                const __m256 acc = _mm256_fmadd_ps(ze, xs, _mm256_loadu_ps(o));
                const __m256 q = _mm256_cvtepi32_ps(_mm256_add_epi32(rows, q8));
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_mul_ps(sc, dx), q, acc));
            }
        }
    }
}

/* From PANEL_MIN activation rows on (prefill chunks, batched decode steps) the codes are used as 16-bit
 * integers: a block decodes a group's codes once (a vector of 8 rows' code pairs (k, k + 1) as int16 pairs),
 * and panels of up to PANEL_ROWS activation rows multiply them with a row's 16-bit activation pair (vpmaddwd:
 * exact 32-bit sums, no splitting into bytes, no 16-bit partial sums to widen), every sum of a step in a
 * register (3 rows x 2 tiles x 2 vectors). A call's rows go in panels of equal size give or take a row (4
 * rows as 2 + 2, 5 as 3 + 2), each panel one more pass over the decoded group in L1. The integer sums are the
 * same exact integers as group_pairs' and the fold into tot the same float operations, so a row's outputs do
 * not depend on its batch. */
#define PANEL_ROWS  3

static inline __attribute__((always_inline)) void decode_group(const uint8_t* w, int stride, const int kind,
                                                               const Idx* idx, int gs, __m256i* ub) {
    const int T = kind == INTERLEAVED_1 ? 1 : 2;
    if (kind ==
        SPLIT32_ALL) { /* rows 0-3 | 8-11, then 4-7 | 12-15 of each tile (panel_group puts them back) */
#pragma GCC unroll 4
        for (int k = 0; k < gs; k += 2) {
            const __m256i v =
                    _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i*)(w + (int64_t)k * 16)),
                                             0xD8); /* lanes: rows 0-7, then 8-15 of columns k, k + 1 */
            const __m256i c[2] = {_mm256_and_si256(v, idx->nibble),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), idx->nibble)};
            for (int t = 0; t < 2; t++) {
                ub[(k + t) * 2] = _mm256_shuffle_epi8(c[t], idx->pairs16_lo);
                ub[(k + t) * 2 + 1] = _mm256_shuffle_epi8(c[t], idx->pairs16_hi);
            }
        }
        return;
    }
    for (int k = 0; k < gs; k += 2) {
        __m256i u[2];
        decode_pair(w + (int64_t)k * stride, stride, kind, idx, u);
        for (int t = 0; t < T; t++) { /* rows 0-7, then 8-15 of tile t */
            ub[(k / 2 * T + t) * 2] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u[t]));
            ub[(k / 2 * T + t) * 2 + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u[t], 1));
        }
    }
}

/* tot[i0 + i][16 t ..] += s d (sum q x - 8 sum x) + z sum x for the MB rows from i0 and group g, from the
 * panel's exact sums sums[i][t][h] (rows 8h .. 8h + 7 of tile t, in decode_group's order of rows). */
static inline __attribute__((always_inline)) void panel_fold(__m256i (*sums)[2][2], const int kind,
                                                             const Act* a, int i0, int g, const int MB,
                                                             const uint16_t* szg, float (*tot)[64]) {
    const int T = kind == INTERLEAVED_1 ? 1 : 2;
    if (kind ==
        SPLIT32_ALL) /* decode_group's order of rows: 0-3 | 8-11 and 4-7 | 12-15 back to 0-7 and 8-15 */
        for (int i = 0; i < MB; i++)
            for (int t = 0; t < T; t++) {
                const __m256i a0 = sums[i][t][0], a1 = sums[i][t][1];
                sums[i][t][0] = _mm256_permute2x128_si256(a0, a1, 0x20);
                sums[i][t][1] = _mm256_permute2x128_si256(a0, a1, 0x31);
            }
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 dx[PANEL_ROWS], xs[PANEL_ROWS];
    __m256i q8[PANEL_ROWS];
    for (int i = 0; i < MB; i++) {
        const int64_t mg = (int64_t)(i0 + i) * a->G + g;
        dx[i] = _mm256_set1_ps(a->d[mg]);
        xs[i] = _mm256_set1_ps(a->xsum[mg]);
        q8[i] = _mm256_set1_epi32(-8 * a->xqsum[mg]);
    }
    /* the group's scales once for the panel's rows; each row folded as group_pairs folds its sums */
    for (int t = 0; t < T; t++)
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(szg + 32 * t + 16 * h));
            const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 ze = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            for (int i = 0; i < MB; i++) {
                float* o = &tot[i0 + i][16 * t + 8 * h];
                const __m256 acc = _mm256_fmadd_ps(ze, xs[i], _mm256_loadu_ps(o));
                const __m256 q = _mm256_cvtepi32_ps(_mm256_add_epi32(sums[i][t][h], q8[i]));
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_mul_ps(sc, dx[i]), q, acc));
            }
        }
}

/* tot[i0 + i][16 t ..] += s d (sum q x - 8 sum x) + z sum x for the MB rows from i0, over one group whose
 * codes decode_group left in ub. Every sum of a panel stays in a register (MB rows x T tiles x 2 vectors, up
 * to 12), the codes read as memory operands of vpmaddwd; the column pairs go UNROLL_PAIRS a loop iteration
 * (gs / 2 is a multiple of 8), so the loop's own instructions are not paid per pair. */
#define UNROLL_PAIRS 8
static inline __attribute__((always_inline)) void panel_group(const __m256i* ub, const int kind, const Act* a,
                                                              int i0, int g, const int MB,
                                                              const uint16_t* szg, float (*tot)[64]) {
    const int T = kind == INTERLEAVED_1 ? 1 : 2;
    const int64_t row = (int64_t)a->xb_row * a->K / 4; /* floats of xb a row */
    /* row i's activation pairs, read with a float broadcast (see Act) */
    const float* xp0 = (const float*)(a->xb + (int64_t)i0 * a->xb_row * a->K) + g * a->gs / 2;
    const float *xp1 = xp0 + (MB > 1 ? row : 0), *xp2 = xp0 + (MB > 2 ? 2 * row : 0);
    /* s<i><t><h>: row i's sums over rows 8h .. 8h + 7 of tile t (named, each row's pinned after its step:
     * otherwise the compiler computes all products first and spills the sums) */
    __m256i s000, s001, s010, s011, s100, s101, s110, s111, s200, s201, s210, s211;
    s000 = s001 = s010 = s011 = s100 = s101 = s110 = s111 = s200 = s201 = s210 = s211 =
            _mm256_setzero_si256();
    const __m256i* u = ub;
    for (int j0 = 0; j0 < a->gs / 2;
         j0 += UNROLL_PAIRS, xp0 += UNROLL_PAIRS, xp1 += UNROLL_PAIRS, xp2 += UNROLL_PAIRS) {
#pragma GCC unroll 8
        for (int j = 0; j < UNROLL_PAIRS; j++, u += 2 * T) {
#define PANEL_STEP(i, a0, a1, b0, b1)                                          \
    if (MB > i) {                                                              \
        const __m256i x = _mm256_castps_si256(_mm256_broadcast_ss(xp##i + j)); \
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(u[0], x));                 \
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(u[1], x));                 \
        if (T > 1) {                                                           \
            b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(u[2], x));             \
            b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(u[3], x));             \
        }                                                                      \
        __asm__("" : "+x"(a0), "+x"(a1), "+x"(b0), "+x"(b1));                  \
    }
            PANEL_STEP(0, s000, s001, s010, s011)
            PANEL_STEP(1, s100, s101, s110, s111)
            PANEL_STEP(2, s200, s201, s210, s211)
#undef PANEL_STEP
        }
    }
    __m256i sums[PANEL_ROWS][2][2] = {
            {{s000, s001}, {s010, s011}}, {{s100, s101}, {s110, s111}}, {{s200, s201}, {s210, s211}}};
    panel_fold(sums, kind, a, i0, g, MB, szg, tot);
}

/* panel_group for split blocks of 32 rows without the round trip of decode_group's vectors through memory:
 * each column pair's codes are decoded in registers (decode_group's instructions, its order of rows) and
 * multiplied at once with the MB (1 or 2) rows' activation pairs. Writing the decoded group out (four 32-byte
 * stores a column pair) costs more than decoding it, so calls of up to FUSED_MAX rows take this way; from 3
 * rows on, decoding once into ub for all panels costs less than decoding again for each (a panel of this kind
 * cannot hold a third row's sums in the 16 registers). The sums are panel_group's exact integers, folded by
 * panel_fold, so the outputs are bit for bit panel_group's. */
#define FUSED_MAX 2
static inline __attribute__((always_inline)) void fused_group(const uint8_t* w, const Idx* idx, const Act* a,
                                                              int i0, int g, const int MB,
                                                              const uint16_t* szg, float (*tot)[64]) {
    const int64_t row = (int64_t)a->xb_row * a->K / 4; /* floats of xb a row */
    const float* xp0 = (const float*)(a->xb + (int64_t)i0 * a->xb_row * a->K) + g * a->gs / 2;
    const float* xp1 = xp0 + (MB > 1 ? row : 0);
    __m256i s000, s001, s010, s011, s100, s101, s110, s111;
    s000 = s001 = s010 = s011 = s100 = s101 = s110 = s111 = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < a->gs / 2; j++) { /* columns 2j, 2j + 1 */
        const __m256i v =
                _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i*)(w + (int64_t)j * 32)), 0xD8);
        const __m256i c0 = _mm256_and_si256(v, idx->nibble);
        const __m256i u0 = _mm256_shuffle_epi8(c0, idx->pairs16_lo),
                      u1 = _mm256_shuffle_epi8(c0, idx->pairs16_hi);
        const __m256i x0 = _mm256_castps_si256(_mm256_broadcast_ss(xp0 + j));
        s000 = _mm256_add_epi32(s000, _mm256_madd_epi16(u0, x0));
        s001 = _mm256_add_epi32(s001, _mm256_madd_epi16(u1, x0));
        if (MB > 1) {
            const __m256i x1 = _mm256_castps_si256(_mm256_broadcast_ss(xp1 + j));
            s100 = _mm256_add_epi32(s100, _mm256_madd_epi16(u0, x1));
            s101 = _mm256_add_epi32(s101, _mm256_madd_epi16(u1, x1));
        }
        const __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), idx->nibble);
        const __m256i u2 = _mm256_shuffle_epi8(c1, idx->pairs16_lo),
                      u3 = _mm256_shuffle_epi8(c1, idx->pairs16_hi);
        s010 = _mm256_add_epi32(s010, _mm256_madd_epi16(u2, x0));
        s011 = _mm256_add_epi32(s011, _mm256_madd_epi16(u3, x0));
        if (MB > 1) {
            const __m256i x1 = _mm256_castps_si256(_mm256_broadcast_ss(xp1 + j));
            s110 = _mm256_add_epi32(s110, _mm256_madd_epi16(u2, x1));
            s111 = _mm256_add_epi32(s111, _mm256_madd_epi16(u3, x1));
        }
        __asm__(""
                : "+x"(s000), "+x"(s001), "+x"(s010), "+x"(s011), "+x"(s100), "+x"(s101), "+x"(s110),
                  "+x"(s111));
    }
    const __m256i z = _mm256_setzero_si256();
    __m256i sums[PANEL_ROWS][2][2] = {
            {{s000, s001}, {s010, s011}}, {{s100, s101}, {s110, s111}}, {{z, z}, {z, z}}};
    panel_fold(sums, SPLIT32_ALL, a, i0, g, MB, szg, tot);
}

#define PASS_ARGS                                                                                   \
    const uint8_t *w, int stride, const Idx *idx, const uint16_t *sz, int np, const Act *a, int mc, \
            float (*tot)[64]
/* One pass over a block: all groups, activation rows [0, mc); calls of fewer than PANEL_MIN rows decode the
 * codes straight into the dot products (group_quads, group_pairs: written for pairs of rows too, which no
 * call takes while PANEL_MIN is 2), from there on split blocks of 32 rows decode a group's codes in registers
 * for up to FUSED_MAX rows (fused_group), else once into ub for all panels (panel_group). The panels fetch
 * the codes ahead as group_quads does: a block's codes span pages, where the hardware prefetcher stops. */
static inline __attribute__((always_inline)) void block_pass(PASS_ARGS, const int kind) {
    __m256i ub[512] __attribute__((aligned(32))); /* a group's decoded codes: gs / 2 pairs x 2 tiles x 2 */
    for (int g = 0; g < a->G; g++) {
        const uint8_t* wg = w + (int64_t)g * a->gs * stride;
        const uint16_t* szg = sz + 2 * (int64_t)g * np;
        if (!a->panels && kind == SPLIT32_ALL) {
            /* the next block's scales of this group: one stream per group, too many for the hardware to
             * follow */
            _mm_prefetch((const char*)(szg + 2 * 32), _MM_HINT_T0);
            _mm_prefetch((const char*)(szg + 2 * 32 + 32), _MM_HINT_T0);
            const uint8_t* next = wg + QUADS_AHEAD; /* past the last group: the next block */
            for (int i = 0; i + 1 < mc; i += 2) group_quads(wg, a, i, 2, g, szg, tot, i ? NULL : next);
            if (mc % 2) group_quads(wg, a, mc - 1, 1, g, szg, tot, mc > 1 ? NULL : next);
            continue;
        }
        if (!a->panels) {
            for (int i = 0; i + 1 < mc; i += 2) group_pairs(wg, stride, kind, idx, a, i, 2, g, szg, tot);
            if (mc % 2) group_pairs(wg, stride, kind, idx, a, mc - 1, 1, g, szg, tot);
            continue;
        }
        if (kind == SPLIT32_ALL) { /* as the quads path: the codes further on and the next block's scales */
            _mm_prefetch((const char*)(szg + 2 * 32), _MM_HINT_T0);
            _mm_prefetch((const char*)(szg + 2 * 32 + 32), _MM_HINT_T0);
            for (int o = 0; o < a->gs * 16; o += 64)
                _mm_prefetch((const char*)(wg + QUADS_AHEAD + o), _MM_HINT_T1);
            if (mc <= FUSED_MAX) {
                for (int i = 0; i + 1 < mc; i += 2) fused_group(wg, idx, a, i, g, 2, szg, tot);
                if (mc % 2) fused_group(wg, idx, a, mc - 1, g, 1, szg, tot);
                continue;
            }
        }
        decode_group(wg, stride, kind, idx, a->gs, ub);
        const int panels = (mc + PANEL_ROWS - 1) / PANEL_ROWS;
        for (int p = 0, i0 = 0; p < panels; p++) { /* panels of equal size, give or take a row */
            const int mb = mc / panels + (p < mc % panels);
            switch (mb) { /* constant row counts keep the sums in registers */
                case 1:
                    panel_group(ub, kind, a, i0, g, 1, szg, tot);
                    break;
                case 2:
                    panel_group(ub, kind, a, i0, g, 2, szg, tot);
                    break;
                default:
                    panel_group(ub, kind, a, i0, g, 3, szg, tot);
                    break;
            }
            i0 += mb;
        }
    }
}
#else
/* ---------------------------------------------------------------- float path (AVX-512F without VNNI/VBMI) */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define V_LANES           16
#define SPLIT64_IN_HALVES 0
#define MB_ROWS           4 /* activation rows whose sums stay in registers */
typedef __m512 V16;
static inline V16 v16_zero(void) {
    return _mm512_setzero_ps();
}
static inline V16 v_codes(__m128i c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
} /* 16 codes */
static inline V16 v_fma_x(V16 w, const float* x, V16 acc) {
    return _mm512_fmadd_ps(w, _mm512_set1_ps(*x), acc);
}
static inline V16 v16_load(const float* p) {
    return _mm512_loadu_ps(p);
}
static inline void v16_store(float* p, V16 v) {
    _mm512_storeu_ps(p, v);
}
/* 16 (scale, zero) bf16 pairs -> scale and zero - 8 * scale as floats */
static inline void v_scales(const uint16_t* sz, V16* s, V16* zp) {
    __m512i v = _mm512_loadu_si512((const void*)sz);
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    V16 z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    *zp = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), *s, z);
}
static inline V16 v_fold(V16 tot, V16 s, V16 acc, V16 zp, float xs) { /* tot + s acc + zp xs */
    return _mm512_fmadd_ps(s, acc, _mm512_fmadd_ps(zp, _mm512_set1_ps(xs), tot));
}
#else
#define V_LANES           8
#define SPLIT64_IN_HALVES 1 /* 16 registers: a 64-row split block in two passes (low, high nibbles) */
#define MB_ROWS           2
typedef struct {
    __m256 a, b;
} V16;
static inline V16 v16_zero(void) {
    V16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return r;
}
static inline V16 v_codes(__m128i c) {
    V16 r = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)),
             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(c, c)))};
    return r;
}
static inline V16 v_fma_x(V16 w, const float* x, V16 acc) {
    __m256 b = _mm256_broadcast_ss(x);
    V16 r = {_mm256_fmadd_ps(w.a, b, acc.a), _mm256_fmadd_ps(w.b, b, acc.b)};
    return r;
}
static inline V16 v16_load(const float* p) {
    V16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return r;
}
static inline void v16_store(float* p, V16 v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}
static inline void v_scales(const uint16_t* sz, V16* s, V16* zp) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256 eight = _mm256_set1_ps(8.f);
    __m256i v0 = _mm256_loadu_si256((const __m256i*)sz), v1 = _mm256_loadu_si256((const __m256i*)(sz + 16));
    s->a = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    s->b = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    zp->a = _mm256_fnmadd_ps(eight, s->a, _mm256_castsi256_ps(_mm256_and_si256(v0, hi)));
    zp->b = _mm256_fnmadd_ps(eight, s->b, _mm256_castsi256_ps(_mm256_and_si256(v1, hi)));
}
static inline V16 v_fold(V16 tot, V16 s, V16 acc, V16 zp, float xs) {
    __m256 b = _mm256_set1_ps(xs);
    V16 r = {_mm256_fmadd_ps(s.a, acc.a, _mm256_fmadd_ps(zp.a, b, tot.a)),
             _mm256_fmadd_ps(s.b, acc.b, _mm256_fmadd_ps(zp.b, b, tot.b))};
    return r;
}
#endif
typedef int Idx; /* unused here */
static void make_idx(Idx* idx) {
    *idx = 0;
}

/* The codes of column k for the pass's tiles: byte r of c[t] is row 16 t + r. */
static inline __attribute__((always_inline)) void decode1(const uint8_t* p, const int kind, __m128i* c) {
    if (kind == INTERLEAVED_1) { /* 8 bytes: rows 2j (low nibble), 2j + 1 (high) */
        __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
        c[0] = _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x000F)),
                            _mm_and_si128(_mm_slli_epi16(b, 4), _mm_set1_epi16(0x0F00)));
    } else if (kind == SPLIT32_ALL) { /* 16 bytes: rows j (low nibble), 16 + j (high) */
        __m128i v = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(0x0F);
        c[0] = _mm_and_si128(v, m);
        c[1] = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    } else { /* 32 bytes: rows j (low nibble), 32 + j (high) */
        __m256i v = _mm256_loadu_si256((const __m256i*)p), m = _mm256_set1_epi8(0x0F);
        int t = 0;
        if (kind != SPLIT64_HI) {
            __m256i lo = _mm256_and_si256(v, m);
            c[t++] = _mm256_castsi256_si128(lo);
            c[t++] = _mm256_extracti128_si256(lo, 1);
        }
        if (kind != SPLIT64_LO) {
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
            c[t++] = _mm256_castsi256_si128(hi);
            c[t++] = _mm256_extracti128_si256(hi, 1);
        }
    }
}

static inline __attribute__((always_inline)) void group_rows(const uint8_t* w, int stride, const int kind,
                                                             const Act* a, int i0, int g, const int MB,
                                                             const uint16_t* szg, float (*tot)[64]) {
    const int T = tiles_of(kind);
    V16 acc[4][4];
    __m128i c[4];
    for (int i = 0; i < MB; i++)
        for (int t = 0; t < T; t++) acc[i][t] = v16_zero();
    const float* x = a->x + (int64_t)i0 * a->K + (int64_t)g * a->gs;
    for (int k = 0; k < a->gs; k++) {
        decode1(w + (int64_t)k * stride, kind, c);
        for (int t = 0; t < T; t++) {
            V16 f = v_codes(c[t]);
            for (int i = 0; i < MB; i++) acc[i][t] = v_fma_x(f, x + (int64_t)i * a->K + k, acc[i][t]);
        }
    }
    V16 s[4], zp[4]; /* loaded here, not held in registers through the loop above */
    for (int t = 0; t < T; t++) v_scales(szg + 32 * t, &s[t], &zp[t]);
    for (int i = 0; i < MB; i++) {
        float xs = a->xsum[(int64_t)(i0 + i) * a->G + g];
        for (int t = 0; t < T; t++) {
            float* o = &tot[i0 + i][16 * t];
            v16_store(o, v_fold(v16_load(o), s[t], acc[i][t], zp[t], xs));
        }
    }
}

#define PASS_ARGS                                                                                   \
    const uint8_t *w, int stride, const Idx *idx, const uint16_t *sz, int np, const Act *a, int mc, \
            float (*tot)[64]
static inline __attribute__((always_inline)) void block_pass(PASS_ARGS, const int kind) {
    (void)idx;
    for (int g = 0; g < a->G; g++) {
        const uint8_t* wg = w + (int64_t)g * a->gs * stride;
        const uint16_t* szg = sz + 2 * (int64_t)g * np;
        for (int i0 = 0; i0 < mc; i0 += MB_ROWS) {
            switch (mc - i0 < MB_ROWS ? mc - i0
                                      : MB_ROWS) { /* constant row counts keep the sums in registers */
                case 1:
                    group_rows(wg, stride, kind, a, i0, g, 1, szg, tot);
                    break;
                case 2:
                    if (MB_ROWS >= 2) group_rows(wg, stride, kind, a, i0, g, 2, szg, tot);
                    break;
                case 3:
                    if (MB_ROWS >= 3) group_rows(wg, stride, kind, a, i0, g, 3, szg, tot);
                    break;
                default:
                    if (MB_ROWS >= 4) group_rows(wg, stride, kind, a, i0, g, 4, szg, tot);
                    break;
            }
        }
    }
}
#endif

/* ---------------------------------------------------------------- shared driver */
static void pass_split64_all(PASS_ARGS) {
    block_pass(w, stride, idx, sz, np, a, mc, tot, SPLIT64_ALL);
}
static void pass_split64_lo(PASS_ARGS) {
    block_pass(w, stride, idx, sz, np, a, mc, tot, SPLIT64_LO);
}
static void pass_split64_hi(PASS_ARGS) {
    block_pass(w, stride, idx, sz, np, a, mc, tot, SPLIT64_HI);
}
static void pass_split32(PASS_ARGS) {
    block_pass(w, stride, idx, sz, np, a, mc, tot, SPLIT32_ALL);
}
static void pass_interleaved(PASS_ARGS) {
    block_pass(w, stride, idx, sz, np, a, mc, tot, INTERLEAVED_1);
}

/* One block of `rows` rows for activation rows [0, mc) of a: outputs into tot[.][0 .. rows). */
static void run_block(const uint8_t* wb, int rows, int split, const Idx* idx, const uint16_t* sz, int np,
                      const Act* a, int mc, float tot[ROWS_CHUNK][64]) {
    const int stride = rows / 2;
    float part[ROWS_CHUNK][64];
    for (int i = 0; i < mc; i++) memset(tot[i], 0, sizeof tot[i]);
    if (split && rows == 64) {
        if (!SPLIT64_IN_HALVES) {
            pass_split64_all(wb, stride, idx, sz, np, a, mc, tot);
        } else { /* rows 0..31 from the low nibbles, then 32..63 from the high ones */
            pass_split64_lo(wb, stride, idx, sz, np, a, mc, tot);
            for (int i = 0; i < mc; i++) memset(part[i], 0, sizeof part[i]);
            pass_split64_hi(wb, stride, idx, sz + 64, np, a, mc, part);
            for (int i = 0; i < mc; i++) memcpy(&tot[i][32], part[i], sizeof(float) * 32);
        }
    } else if (split && rows == 32) {
        pass_split32(wb, stride, idx, sz, np, a, mc, tot);
    } else { /* interleaved: one 16-row tile (8 bytes per column) at a time */
        for (int t = 0; t < rows / 16; t++) {
            for (int i = 0; i < mc; i++) memset(part[i], 0, sizeof part[i]);
            pass_interleaved(wb + 8 * t, stride, idx, sz + 32 * t, np, a, mc, part);
            for (int i = 0; i < mc; i++) memcpy(&tot[i][16 * t], part[i], sizeof(float) * 16);
        }
    }
}

/* n floats (n % 16 == 0) to bf16, rounded to nearest even as torch does; NaN stays NaN. */
static void store_bf16(uint16_t* out, const float* in, int n) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF);
    const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    for (int j = 0; j < n; j += 16) {
        __m256i r[2];
        for (int h = 0; h < 2; h++) {
            __m256i u = _mm256_loadu_si256((const __m256i*)(in + j + 8 * h));
            __m256i up = _mm256_add_epi32(
                    u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
            __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
            r[h] = _mm256_srli_epi32(_mm256_blendv_epi8(up, quiet, nan), 16);
        }
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
        _mm256_storeu_si256((__m256i*)(out + j), packed);
    }
}

/* The vector width this build uses: 512 or 256 bits. */
int sidecar_int4_vector_bits(void) {
    return V_LANES * 32;
}
/* 1 (AVX-512 VNNI) or 2 (AVX2) when this build rounds activations to 16 bits (the integer paths), 0 when it
 * keeps them float32. */
int sidecar_int4_integer_dot(void) {
    return INT_DOT;
}

/* x [M, K], float32, or bf16 when x_bf16; y [M, np], float32, or bf16 when y_bf16; w packed codes
 * for np rows (np % 16 == 0) and K columns (K % gs == 0, gs % 16 == 0, gs <= 256); sz bf16
 * [K / gs, np, 2]; block_n 64 or 32; split 1 for split full blocks, 0 for interleaved ones.
 * Returns 0, -1 for arguments it does not handle, -2 when out of memory (nothing written then). */
int sidecar_int4_matmul(const sidecar_matmul_args* args) {
    const void* x = args->x;
    const uint8_t* w = args->w;
    const uint16_t* sz = args->scales;
    void* y = args->y;
    int M = args->M;
    int np = args->N;
    int K = args->K;
    int gs = args->group_size;
    int block_n = args->block_n;
    int split = args->split;
    int x_bf16 = args->x_bf16;
    int y_bf16 = args->out;
    int nthreads = args->nthreads;
    if (M < 0 || np % 16 || gs <= 0 || gs > 256 || gs % 16 || K % gs || (block_n != 64 && block_n != 32))
        return -1;
    if (M == 0) return 0;
    const int G = K / gs;
    const int panels = INT_DOT == 2 && M >= PANEL_MIN;
    Act a = {(const float*)x, x_bf16 ? (const uint16_t*)x : NULL,        NULL, NULL, NULL, NULL, K, G, gs,
             panels,          INT_DOT == 2 && !panels ? 4 + XB_QUADS : 2};
    const size_t xcopy = !INT_DOT && x_bf16 ? (size_t)M * K * 4 : 0; /* float copy for the float path */
    char* scratch = malloc(xcopy + (size_t)M * G * 12 + (INT_DOT ? (size_t)M * a.xb_row * K : 0) + 64);
    if (scratch == NULL) return -2;
    if (xcopy) a.x = (const float*)scratch;
    a.xsum = (float*)(scratch + xcopy);
    a.d = a.xsum + (size_t)M * G;
    a.xqsum = (int32_t*)(a.d + (size_t)M * G);
    /* 64-byte aligned: with K % 16 == 0, so are group_quads' activation vectors (whole cache lines) */
    a.xb = (int8_t*)(((uintptr_t)(a.xqsum + (size_t)M * G) + 63) & ~(uintptr_t)63);
    Idx idx;
    make_idx(&idx);
    const int nfull = np / block_n, tail = np % block_n;
    const int nblocks = nfull + (tail ? 1 : 0), nchunks = (M + ROWS_CHUNK - 1) / ROWS_CHUNK;
    const int block_major = (int64_t)M * K * (INT_DOT ? 2 : 4) <= (256 << 10);
    const int prepare_alone = (int64_t)M * K <= 16384; /* a few microseconds: not worth a barrier */
    if (prepare_alone)
        for (int mg = 0; mg < M * G; mg++) prepare_group(&a, mg / G, mg % G);
    if (nthreads > nblocks * nchunks) nthreads = nblocks * nchunks;
#pragma omp parallel num_threads(nthreads)
    {
        if (!prepare_alone) {
#pragma omp for schedule(static)
            for (int mg = 0; mg < M * G; mg++) prepare_group(&a, mg / G, mg % G);
        }
/* Work items: a block of rows for a chunk of activation rows, a thread's items consecutive.
 * While all activations fit in L2, a block's chunks go one after the other (its codes stay
 * in cache); beyond that, a chunk's blocks (its activations stay in cache). */
#pragma omp for schedule(static)
        for (int item = 0; item < nblocks * nchunks; item++) {
            const int b = block_major ? item / nchunks : item % nblocks;
            const int m0 = (block_major ? item % nchunks : item / nblocks) * ROWS_CHUNK;
            const int n0 = b * block_n, rows = b < nfull ? block_n : tail;
            const int mc = M - m0 < ROWS_CHUNK ? M - m0 : ROWS_CHUNK;
            float tot[ROWS_CHUNK][64];
            Act am = a; /* the activation rows from m0 */
            am.x = a.x + (int64_t)m0 * K;
            am.xb = a.xb + (int64_t)m0 * a.xb_row * K;
            am.d = a.d + (int64_t)m0 * G;
            am.xqsum = a.xqsum + (int64_t)m0 * G;
            am.xsum = a.xsum + (int64_t)m0 * G;
            run_block(w + (int64_t)n0 * (K / 2), rows, b < nfull ? split : 0, &idx, sz + 2 * (int64_t)n0, np,
                      &am, mc, tot);
            for (int i = 0; i < mc; i++) {
                const int64_t at = (int64_t)(m0 + i) * np + n0;
                if (y_bf16)
                    store_bf16((uint16_t*)y + at, tot[i], rows);
                else
                    memcpy((float*)y + at, tot[i], sizeof(float) * rows);
            }
        }
    }
    free(scratch);
    return 0;
}

/* One slot's product: y [np] (x's dtype) = the Act's row m through the packed codes w [np, K / 2] and their
 * bf16 scales and zeros sz [G, np, 2], block by block as sidecar_int4_matmul runs a one-row call. */
static void slot_block(const Act* a, int m, const uint8_t* w, const uint16_t* sz, int np, int b, int block_n,
                       int split, const Idx* idx, void* y, int y_bf16) {
    const int nfull = np / block_n, tail = np % block_n, K = a->K, G = a->G;
    const int n0 = b * block_n, rows = b < nfull ? block_n : tail;
    float tot[ROWS_CHUNK][64];
    Act am = *a;
    am.x = a->x + (int64_t)m * K;
    am.x16 = a->x16 ? a->x16 + (int64_t)m * K : NULL;
    am.xb = a->xb + (int64_t)m * a->xb_row * K;
    am.d = a->d + (int64_t)m * G;
    am.xqsum = a->xqsum + (int64_t)m * G;
    am.xsum = a->xsum + (int64_t)m * G;
    run_block(w + (int64_t)n0 * (K / 2), rows, b < nfull ? split : 0, idx, sz + 2 * (int64_t)n0, np, &am, 1,
              tot);
    if (y_bf16)
        store_bf16((uint16_t*)y + n0, tot[0], rows);
    else
        memcpy((float*)y + n0, tot[0], sizeof(float) * rows);
}

/* The scratch bytes of moe_act's Act. */
static size_t moe_act_bytes(int M, int K, int gs) {
    return (size_t)M * (K / gs) * 12 + (size_t)M * (4 + XB_QUADS) * K + 128;
}

/* An Act over M rows of K values (x's dtype) with its scratch from *p, advanced past it. */
static Act moe_act(const void* x, int x_bf16, int M, int K, int gs, char** p) {
    Act a = {.x = (const float*)x,
             .x16 = x_bf16 ? (const uint16_t*)x : NULL,
             .K = K,
             .G = K / gs,
             .gs = gs,
             .panels = 0,
             .xb_row = INT_DOT == 2 ? 4 + XB_QUADS : 2};
    const size_t mg = (size_t)M * a.G;
    a.xsum = (float*)*p;
    a.d = a.xsum + mg;
    a.xqsum = (int32_t*)(a.d + mg);
    /* 64-byte aligned, as sidecar_int4_matmul's: group_quads' activation vectors are whole cache lines */
    a.xb = (int8_t*)(((uintptr_t)(a.xqsum + mg) + 63) & ~(uintptr_t)63);
    *p = (char*)(a.xb + (size_t)M * a.xb_row * K + 64);
    return a;
}

/* What every step of sidecar_int4_moe reads and writes: the rows' and the slots' activation codes, the slots'
 * gate/up products gu [S, 2 I], their silu * up act [S, I] and down products out [S, H], x's dtype. */
typedef struct {
    const sidecar_moe_args* a;
    const Act *ax, *aa;
    const Idx* idx;
    char *gu, *act, *out;
    int gu_blocks, dn_blocks, es;
} MoeSteps;

static void moe_gate_up(const MoeSteps* m, int s, int b) { /* slot s's gate/up block b */
    const sidecar_moe_args* a = m->a;
    const int e = (int)a->ids[s];
    slot_block(m->ax, s / a->k, (const uint8_t*)(intptr_t)a->gate_up[e],
               (const uint16_t*)(intptr_t)a->gate_up_scales[e], 2 * a->I, b, a->block_n, a->split, m->idx,
               m->gu + (size_t)s * 2 * a->I * m->es, a->x_bf16);
}

static void moe_silu_codes(const MoeSteps* m, int s) { /* slot s's silu * up and its activation codes */
    const sidecar_moe_args* a = m->a;
    moe_silu_row(m->gu + (size_t)s * 2 * a->I * m->es, m->act + (size_t)s * a->I * m->es, a->I, a->x_bf16);
    for (int g = 0; g < m->aa->G; g++) prepare_group(m->aa, s, g);
}

static void moe_down(const MoeSteps* m, int s, int b) { /* slot s's down block b */
    const sidecar_moe_args* a = m->a;
    const int e = (int)a->ids[s];
    slot_block(m->aa, s, (const uint8_t*)(intptr_t)a->down[e], (const uint16_t*)(intptr_t)a->down_scales[e],
               a->H, b, a->block_n, a->split, m->idx, m->out + (size_t)s * a->H * m->es, a->x_bf16);
}

/* A sparse block's routed sum over int4 experts (moe_args.h) in one parallel region, each slot the one-row
 * product sidecar_int4_matmul computes (its codes from its row alone): the rows' codes, then each slot's
 * gate/up blocks, its silu * up and their codes and its down blocks, then the weighted sums by column. Where
 * the threads can share the slots evenly, each runs whole slots (as many as every other), with no barrier
 * between a slot's steps; else every slot's gate/up blocks, every slot's silu * up, every slot's down blocks
 * are each split across the threads, a barrier after each. Every slot's outputs are the same either way.
 * gate_up / down: packed codes; their scales: bf16 scales and zeros [G, N, 2]; 2 I and H multiples of 16.
 * Returns 0, 1 for an expert id out of range, 2 when out of memory, 3 for arguments it does not handle (a
 * build without the integer path, a group size or width that does not fit). */
int sidecar_int4_moe(const sidecar_moe_args* a) {
    const int T = a->T, S = a->T * a->k, H = a->H, I = a->I, dt = a->x_bf16, es = dt ? 2 : 4;
    const int gs = a->group_size, block_n = a->block_n;
    if (!INT_DOT || gs <= 0 || gs > 256 || gs % 16 || H % gs || I % gs || H % 16 || (2 * I) % 16 ||
        (block_n != 64 && block_n != 32))
        return 3;
    if (moe_ids_ok(a)) return 1;
    const size_t bytes = moe_act_bytes(T, H, gs) + moe_act_bytes(S, I, gs) + (size_t)S * (3 * I + H) * es;
    char* scratch = malloc(bytes);
    if (scratch == NULL) return 2;
    char* p = scratch;
    const Act ax = moe_act(a->x, dt, T, H, gs, &p);
    char* gu = p; /* [S, 2 I], x's dtype */
    char* act = gu + (size_t)S * 2 * I * es;
    char* out = act + (size_t)S * I * es;
    p = out + (size_t)S * H * es;
    const Act aa = moe_act(act, dt, S, I, gs, &p);
    Idx idx;
    make_idx(&idx);
    const int gu_blocks = (2 * I + block_n - 1) / block_n, dn_blocks = (H + block_n - 1) / block_n;
    const MoeSteps m = {a, &ax, &aa, &idx, gu, act, out, gu_blocks, dn_blocks, es};
    const int Gx = H / gs, chunks = (H + 63) / 64;
#pragma omp parallel num_threads(a->nthreads)
    {
#pragma omp for schedule(static)
        for (int mg = 0; mg < T * Gx; mg++) prepare_group(&ax, mg / Gx, mg % Gx);
        if (S % omp_get_num_threads() == 0) {
#pragma omp for schedule(static)
            for (int s = 0; s < S; s++) {
                for (int b = 0; b < gu_blocks; b++) moe_gate_up(&m, s, b);
                moe_silu_codes(&m, s);
                for (int b = 0; b < dn_blocks; b++) moe_down(&m, s, b);
            }
        } else {
#pragma omp for schedule(static)
            for (int item = 0; item < S * gu_blocks; item++)
                moe_gate_up(&m, item / gu_blocks, item % gu_blocks);
#pragma omp for schedule(static)
            for (int s = 0; s < S; s++) moe_silu_codes(&m, s);
#pragma omp for schedule(static)
            for (int item = 0; item < S * dn_blocks; item++) moe_down(&m, item / dn_blocks, item % dn_blocks);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < T * chunks; item++) {
            const int t = item / chunks, h0 = (item % chunks) * 64;
            moe_weighted_sum(a, out, t, h0, h0 + 64 < H ? h0 + 64 : H);
        }
    }
    free(scratch);
    return 0;
}

/* ---------------------------------------------------------------- grouped experts for batched steps */

/* The scratch bytes of grouped_act's Act. */
static size_t grouped_act_bytes(int M, int K, int gs) {
    return (size_t)M * (K / gs) * 12 + (size_t)M * 2 * K + 128;
}

/* An Act over M rows of K values (x's dtype; x NULL for rows filled by grouped_copy_row) in the layout
 * sidecar_int4_matmul gives calls of PANEL_MIN rows or more (AVX2: the int16 codes of the panels; AVX-512:
 * high and low bytes, as for every call), its scratch from *p, advanced past it. */
static Act grouped_act(const void* x, int x_bf16, int M, int K, int gs, char** p) {
    Act a = {.x = (const float*)x,
             .x16 = x_bf16 ? (const uint16_t*)x : NULL,
             .K = K,
             .G = K / gs,
             .gs = gs,
             .panels = INT_DOT == 2,
             .xb_row = 2};
    const size_t mg = (size_t)M * a.G;
    a.xsum = (float*)*p;
    a.d = a.xsum + mg;
    a.xqsum = (int32_t*)(a.d + mg);
    a.xb = (int8_t*)(((uintptr_t)(a.xqsum + mg) + 63) & ~(uintptr_t)63);
    *p = (char*)(a.xb + (size_t)M * 2 * K + 64);
    return a;
}

/* Row t of src's prepared activations (codes, scale, sums) as row r of dst (same K and group size). */
static void grouped_copy_row(const Act* src, int t, const Act* dst, int r) {
    const int64_t row = (int64_t)src->xb_row * src->K, G = src->G;
    memcpy(dst->xb + r * row, src->xb + t * row, (size_t)row);
    memcpy(dst->d + r * G, src->d + t * G, sizeof(float) * G);
    memcpy(dst->xqsum + r * G, src->xqsum + t * G, sizeof(int32_t) * G);
    memcpy(dst->xsum + r * G, src->xsum + t * G, sizeof(float) * G);
}

/* Block b of one expert's projection (packed codes w [np, K / 2], bf16 scales and zeros sz [G, np, 2]) for
 * its n activation rows r0 .. r0 + n - 1 of a, in chunks of ROWS_CHUNK rows as sidecar_int4_matmul runs an
 * n-row call: outputs (x's dtype) into row dst[r] of y [., np] for activation row r, or row r where dst is
 * NULL. */
static void grouped_block(const Act* a, int r0, int n, const uint8_t* w, const uint16_t* sz, int np, int b,
                          int block_n, int split, const Idx* idx, void* y, const int* dst, int y_bf16) {
    const int nfull = np / block_n, tail = np % block_n, K = a->K, G = a->G;
    const int n0 = b * block_n, rows = b < nfull ? block_n : tail;
    for (int m0 = 0; m0 < n; m0 += ROWS_CHUNK) {
        const int mc = n - m0 < ROWS_CHUNK ? n - m0 : ROWS_CHUNK;
        const int64_t r = r0 + m0;
        float tot[ROWS_CHUNK][64];
        Act am = *a; /* the integer paths read the prepared rows alone */
        am.x = NULL;
        am.x16 = NULL;
        am.xb = a->xb + r * a->xb_row * K;
        am.d = a->d + r * G;
        am.xqsum = a->xqsum + r * G;
        am.xsum = a->xsum + r * G;
        run_block(w + (int64_t)n0 * (K / 2), rows, b < nfull ? split : 0, idx, sz + 2 * (int64_t)n0, np, &am,
                  mc, tot);
        for (int i = 0; i < mc; i++) {
            const int64_t at = (int64_t)(dst ? dst[r + i] : r + i) * np + n0;
            if (y_bf16)
                store_bf16((uint16_t*)y + at, tot[i], rows);
            else
                memcpy((float*)y + at, tot[i], sizeof(float) * rows);
        }
    }
}

/* The scratch bytes of a grouped call over T rows of a's k experts each (a's widths, group size and dtype):
 * the rows' codes, each slot's codes, products and silu * up codes, the slots' order. */
static size_t grouped_bytes(const sidecar_moe_args* a, int T) {
    const size_t S = (size_t)T * a->k, es = a->x_bf16 ? 2 : 4;
    const int gs = a->group_size;
    return grouped_act_bytes(T, a->H, gs) + grouped_act_bytes((int)S, a->H, gs) +
           grouped_act_bytes((int)S, a->I, gs) + S * (3 * (size_t)a->I + a->H) * es +
           sizeof(int) * ((size_t)a->E + 1 + 4 * S) + 64;
}

/* The bytes a row adds to a grouped call's scratch (T, x and the tables unused): callers bound a call's
 * scratch by its rows. 0 for a group size the kernel does not take. */
int64_t sidecar_int4_moe_grouped_row_bytes(const sidecar_moe_args* a) {
    if (a->group_size <= 0 || a->H % a->group_size || a->I % a->group_size || a->k < 1) return 0;
    return (int64_t)(grouped_bytes(a, 2) - grouped_bytes(a, 1));
}

/* The grouped kernel's scratch is kept between calls, grown to the largest call's, so that steps of many rows
 * reuse its pages rather than fault in a fresh allocation at every block; a call that finds it held by
 * another
 * (*own set) allocates its own. NULL when out of memory. */
static char* kept_scratch;
static size_t kept_bytes;
static int kept_busy;

static char* grouped_scratch(size_t bytes, int* own) {
    if (!__atomic_exchange_n(&kept_busy, 1, __ATOMIC_ACQUIRE)) {
        if (kept_bytes < bytes) {
            free(kept_scratch);
            kept_scratch = malloc(bytes);
            kept_bytes = kept_scratch != NULL ? bytes : 0;
        }
        if (kept_scratch != NULL) {
            *own = 0;
            return kept_scratch;
        }
        __atomic_store_n(&kept_busy, 0, __ATOMIC_RELEASE);
    }
    *own = 1;
    return malloc(bytes);
}

static void grouped_release(char* scratch, int own) {
    if (own)
        free(scratch);
    else
        __atomic_store_n(&kept_busy, 0, __ATOMIC_RELEASE);
}

/* A sparse block's routed sum over int4 experts (moe_args.h) for steps of many rows, in one parallel region,
 * each picked expert's weights read once for all of its slots: the slots ordered by expert (a counting sort,
 * slots ascending within an expert, as the per-expert loop gathers its rows), the rows' codes, each slot's
 * codes copied to its place in that order, each picked expert's gate/up blocks over its slots' rows, each
 * slot's silu * up and its codes, the down blocks likewise, the weighted sums by column. Each expert's
 * products are those of sidecar_int4_matmul on its rows (a call of that many rows: the same chunks and
 * kernels; an expert of one row takes the panels, whose integer sums and folds equal the one-row call's), so
 * the result equals the per-expert loop's bit for bit. Arguments and returns as sidecar_int4_moe's. */
int sidecar_int4_moe_grouped(const sidecar_moe_args* a) {
    const int T = a->T, S = a->T * a->k, H = a->H, I = a->I, E = a->E, dt = a->x_bf16, es = dt ? 2 : 4;
    const int gs = a->group_size, block_n = a->block_n;
    if (!INT_DOT || gs <= 0 || gs > 256 || gs % 16 || H % gs || I % gs || H % 16 || (2 * I) % 16 ||
        (block_n != 64 && block_n != 32) || T < 1 || a->k < 1)
        return 3;
    if (moe_ids_ok(a)) return 1;
    int own;
    char* scratch = grouped_scratch(grouped_bytes(a, T), &own);
    if (scratch == NULL) return 2;
    char* p = scratch;
    const Act ax = grouped_act(a->x, dt, T, H, gs, &p); /* the step's rows */
    const Act as =
            grouped_act(NULL, dt, S, H, gs, &p); /* their codes again, a row per slot in expert order */
    char* gu = p;                                /* [S, 2 I] x's dtype, expert order */
    char* act = gu + (size_t)S * 2 * I * es;     /* [S, I] x's dtype, expert order */
    char* out = act + (size_t)S * I * es;        /* [S, H] x's dtype, slot order */
    p = out + (size_t)S * H * es;
    const Act aa = grouped_act(act, dt, S, I, gs, &p);
    int* start = (int*)p;       /* [E + 1] each expert's first place in the order */
    int* order = start + E + 1; /* [S] the slot at each place */
    int* first = order + S;     /* [jobs] the first place of each picked expert */
    int* count = first + S;     /* [jobs] its slots */
    int* expert = count + S;    /* [jobs] its id */
    memset(start, 0, sizeof(int) * ((size_t)E + 1));
    for (int s = 0; s < S; s++) start[a->ids[s] + 1]++;
    int jobs = 0;
    for (int e = 0; e < E; e++) {
        if (start[e + 1]) {
            first[jobs] = start[e];
            count[jobs] = start[e + 1];
            expert[jobs++] = e;
        }
        start[e + 1] += start[e];
    }
    for (int s = 0; s < S; s++)
        order[start[a->ids[s]]++] = s; /* start[e]: now the end of expert e's places */
    Idx idx;
    make_idx(&idx);
    const int gu_blocks = (2 * I + block_n - 1) / block_n, dn_blocks = (H + block_n - 1) / block_n;
    const int Gx = H / gs, Ga = I / gs, chunks = (H + 63) / 64, k = a->k;
#pragma omp parallel num_threads(a->nthreads)
    {
#pragma omp for schedule(static)
        for (int mg = 0; mg < T * Gx; mg++) prepare_group(&ax, mg / Gx, mg % Gx);
#pragma omp for schedule(static)
        for (int r = 0; r < S; r++) grouped_copy_row(&ax, order[r] / k, &as, r);
#pragma omp for schedule(static)
        for (int item = 0; item < jobs * gu_blocks; item++) {
            const int j = item / gu_blocks, e = expert[j];
            grouped_block(&as, first[j], count[j], (const uint8_t*)(intptr_t)a->gate_up[e],
                          (const uint16_t*)(intptr_t)a->gate_up_scales[e], 2 * I, item % gu_blocks, block_n,
                          a->split, &idx, gu, NULL, dt);
        }
#pragma omp for schedule(static)
        for (int r = 0; r < S; r++) {
            moe_silu_row(gu + (size_t)r * 2 * I * es, act + (size_t)r * I * es, I, dt);
            for (int g = 0; g < Ga; g++) prepare_group(&aa, r, g);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < jobs * dn_blocks; item++) {
            const int j = item / dn_blocks, e = expert[j];
            grouped_block(&aa, first[j], count[j], (const uint8_t*)(intptr_t)a->down[e],
                          (const uint16_t*)(intptr_t)a->down_scales[e], H, item % dn_blocks, block_n,
                          a->split, &idx, out, order, dt);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < T * chunks; item++) {
            const int t = item / chunks, h0 = (item % chunks) * 64;
            moe_weighted_sum(a, out, t, h0, h0 + 64 < H ? h0 + 64 : H);
        }
    }
    grouped_release(scratch, own);
    return 0;
}
