/* Weight-only int4 matmul for decode-sized batches on CPU (up to a few dozen activation rows).
 *
 *   y[m, n] = sum_g sum_{k in g} x[m, k] * ((q[n, k] - 8) * s[g, n] + z[g, n])
 *           = sum_g ( s[g, n] * sum_{k in g} x[m, k] q[n, k]  +  (z[g, n] - 8 s[g, n]) * sum_{k in g} x[m, k] )
 *
 * x float32 [M, K]; q the 4-bit codes in torch's packed CPU layout (uint8, see below), read in
 * place so the weights are stored once; sz bf16 [G, Np, 2] (scale, zero) for G groups of gs
 * columns; y float32 [M, Np]. The codes are widened to float and multiplied with the float32
 * activations (no rounding of x), summed per group in float32, then scaled.
 *
 * Packed layout, rows in blocks of BN (64 or 32, torch picks by its own CPU capability):
 *  - a full block holds BN / 2 bytes per column k, one k after the other; "split" blocks keep
 *    row j of the block in the low nibble of byte j and row BN / 2 + j in its high nibble,
 *    "interleaved" blocks keep rows 2j and 2j + 1 in byte j (low, high);
 *  - the last R = Np % BN rows (a multiple of 16) form an interleaved block of R rows.
 * The wrapper (int4_gemv.py) checks torch's layout against this once before using the kernel.
 *
 * Output rows are handled in tiles of 16 (one 512-bit vector of floats, two 256-bit ones). A
 * block's rows are split across threads; each 16-byte chunk of codes is widened once for up to
 * MB activation rows, so one pass reads each weight byte once, which is what bounds decode.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "int4_gemv needs AVX2 and FMA"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512 V16;
#define VECTOR_BITS 512
#define MB_MAX 4
static inline V16 v_zero(void) { return _mm512_setzero_ps(); }
/* 16 codes (bytes 0..15) as 16 floats */
static inline V16 v_codes(__m128i c) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c)); }
static inline V16 v_fma_x(V16 w, const float* x, V16 acc) { return _mm512_fmadd_ps(w, _mm512_set1_ps(*x), acc); }
static inline V16 v_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void v_store(float* p, V16 v) { _mm512_storeu_ps(p, v); }
/* 16 (scale, zero) bf16 pairs -> scale and zero - 8 * scale as floats */
static inline void v_scales(const uint16_t* sz, V16* s, V16* zp) {
    __m512i v = _mm512_loadu_si512((const void*)sz);
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    V16 z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    *zp = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), *s, z);
}
/* tot + s * acc + zp * xs */
static inline V16 v_fold(V16 tot, V16 s, V16 acc, V16 zp, float xs) {
    return _mm512_fmadd_ps(s, acc, _mm512_fmadd_ps(zp, _mm512_set1_ps(xs), tot));
}
#define SPLIT64_TILES 4 /* a 64-row split block in one pass */
#else
typedef struct { __m256 a, b; } V16;
#define VECTOR_BITS 256
#define MB_MAX 2
static inline V16 v_zero(void) { V16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
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
static inline V16 v_load(const float* p) { V16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline void v_store(float* p, V16 v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
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
#define SPLIT64_TILES 2 /* 16 registers: a 64-row split block in two passes (low, high nibbles) */
#endif

/* What one pass over a block decodes for each k: T tiles of 16 rows. */
enum { SPLIT64_ALL, SPLIT64_LO, SPLIT64_HI, SPLIT32_ALL, INTERLEAVED_1 };

static inline __attribute__((always_inline)) void decode(const uint8_t* p, const int kind, __m128i* c) {
    if (kind == INTERLEAVED_1) {  /* 8 bytes: rows 2j (low nibble), 2j + 1 (high) */
        __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
        c[0] = _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x000F)),
                            _mm_and_si128(_mm_slli_epi16(b, 4), _mm_set1_epi16(0x0F00)));
    } else if (kind == SPLIT32_ALL) {  /* 16 bytes: rows j (low nibble), 16 + j (high) */
        __m128i v = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(0x0F);
        c[0] = _mm_and_si128(v, m);
        c[1] = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    } else {  /* 32 bytes: rows j (low nibble), 32 + j (high) */
        __m256i v = _mm256_loadu_si256((const __m256i*)p), m = _mm256_set1_epi8(0x0F);
        if (kind != SPLIT64_HI) {
            __m256i lo = _mm256_and_si256(v, m);
            c[0] = _mm256_castsi256_si128(lo);
            c[1] = _mm256_extracti128_si256(lo, 1);
        }
        if (kind != SPLIT64_LO) {
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
            c[kind == SPLIT64_HI ? 0 : 2] = _mm256_castsi256_si128(hi);
            c[kind == SPLIT64_HI ? 1 : 3] = _mm256_extracti128_si256(hi, 1);
        }
    }
}

static inline int tiles_of(int kind) {
    return kind == SPLIT64_ALL ? 4 : (kind == INTERLEAVED_1 ? 1 : 2);
}

/* acc[i][t] = sum over kn columns of x[i, k] * code[tile t, k] for the MB rows i of x (row stride
 * K). MB and kind are compile-time constants at every call site, so acc stays in registers. */
static inline __attribute__((always_inline)) void group_dot(const uint8_t* w, int stride, const int kind,
                                                            const float* x, int K, int kn, const int MB,
                                                            V16 acc[MB_MAX][4]) {
    const int T = tiles_of(kind);
    __m128i c[4];
    for (int i = 0; i < MB; i++)
        for (int t = 0; t < T; t++) acc[i][t] = v_zero();
    for (int k = 0; k < kn; k++) {
        decode(w + (int64_t)k * stride, kind, c);
        for (int t = 0; t < T; t++) {
            V16 f = v_codes(c[t]);
            for (int i = 0; i < MB; i++) acc[i][t] = v_fma_x(f, x + (int64_t)i * K + k, acc[i][t]);
        }
    }
}

#define ROWS_CHUNK 32 /* activation rows whose outputs one block keeps at once */

/* One pass over a block: tot[i][16 t ...] for rows i < mc of x, output tiles t of the pass.
 * w: the block's codes at the pass's byte offset; sz: (scale, zero) of the pass's first row in
 * group 0; xs: per-row group sums [mc][G]. */
static inline __attribute__((always_inline)) void block_pass(const uint8_t* w, int stride, const int kind,
                                                             const uint16_t* sz, int np, const float* x,
                                                             const float* xs, int K, int G, int gs, int mc,
                                                             float tot[ROWS_CHUNK][64]) {
    const int T = tiles_of(kind);
    V16 acc[MB_MAX][4], s[4], zp[4];
    for (int g = 0; g < G; g++) {
        for (int t = 0; t < T; t++) v_scales(sz + 2 * ((int64_t)g * np + 16 * t), &s[t], &zp[t]);
        const uint8_t* wg = w + (int64_t)g * gs * stride;
        for (int m0 = 0; m0 < mc; m0 += MB_MAX) {
            const float* xg = x + (int64_t)m0 * K + (int64_t)g * gs;
            int mb = mc - m0 < MB_MAX ? mc - m0 : MB_MAX;
            switch (mb) {  /* constant row counts, so each case keeps its accumulators in registers */
                case 1: group_dot(wg, stride, kind, xg, K, gs, 1, acc); break;
#if MB_MAX >= 2
                case 2: group_dot(wg, stride, kind, xg, K, gs, 2, acc); break;
#endif
#if MB_MAX >= 3
                case 3: group_dot(wg, stride, kind, xg, K, gs, 3, acc); break;
#endif
#if MB_MAX >= 4
                case 4: group_dot(wg, stride, kind, xg, K, gs, 4, acc); break;
#endif
                default: break;
            }
            for (int i = 0; i < mb; i++) {
                float xsum = xs[(int64_t)(m0 + i) * G + g];
                for (int t = 0; t < T; t++) {
                    float* o = &tot[m0 + i][16 * t];
                    v_store(o, v_fold(v_load(o), s[t], acc[i][t], zp[t], xsum));
                }
            }
        }
    }
}

static void block_pass_split64_all(const uint8_t* w, int stride, const uint16_t* sz, int np, const float* x,
                                   const float* xs, int K, int G, int gs, int mc, float tot[ROWS_CHUNK][64]) {
    block_pass(w, stride, SPLIT64_ALL, sz, np, x, xs, K, G, gs, mc, tot);
}
static void block_pass_split64_lo(const uint8_t* w, int stride, const uint16_t* sz, int np, const float* x,
                                  const float* xs, int K, int G, int gs, int mc, float tot[ROWS_CHUNK][64]) {
    block_pass(w, stride, SPLIT64_LO, sz, np, x, xs, K, G, gs, mc, tot);
}
static void block_pass_split64_hi(const uint8_t* w, int stride, const uint16_t* sz, int np, const float* x,
                                  const float* xs, int K, int G, int gs, int mc, float tot[ROWS_CHUNK][64]) {
    block_pass(w, stride, SPLIT64_HI, sz, np, x, xs, K, G, gs, mc, tot);
}
static void block_pass_split32(const uint8_t* w, int stride, const uint16_t* sz, int np, const float* x,
                               const float* xs, int K, int G, int gs, int mc, float tot[ROWS_CHUNK][64]) {
    block_pass(w, stride, SPLIT32_ALL, sz, np, x, xs, K, G, gs, mc, tot);
}
static void block_pass_interleaved(const uint8_t* w, int stride, const uint16_t* sz, int np, const float* x,
                                   const float* xs, int K, int G, int gs, int mc, float tot[ROWS_CHUNK][64]) {
    block_pass(w, stride, INTERLEAVED_1, sz, np, x, xs, K, G, gs, mc, tot);
}

/* One block of rows [n0, n0 + rows) for activation rows [0, mc): outputs into tot. */
static void run_block(const uint8_t* wb, int rows, int split, const uint16_t* sz, int np, const float* x,
                      const float* xs, int K, int G, int gs, int mc, float tot[ROWS_CHUNK][64]) {
    const int stride = rows / 2;
    for (int i = 0; i < mc; i++) memset(tot[i], 0, sizeof tot[i]);
    if (split && rows == 64) {
        if (SPLIT64_TILES == 4) {
            block_pass_split64_all(wb, stride, sz, np, x, xs, K, G, gs, mc, tot);
        } else {  /* tot columns of the high pass: rows 32..63 */
            float hi[ROWS_CHUNK][64];
            block_pass_split64_lo(wb, stride, sz, np, x, xs, K, G, gs, mc, tot);
            for (int i = 0; i < mc; i++) memset(hi[i], 0, sizeof hi[i]);
            block_pass_split64_hi(wb, stride, sz + 64, np, x, xs, K, G, gs, mc, hi);
            for (int i = 0; i < mc; i++) memcpy(&tot[i][32], hi[i], sizeof(float) * 32);
        }
    } else if (split && rows == 32) {
        block_pass_split32(wb, stride, sz, np, x, xs, K, G, gs, mc, tot);
    } else {  /* interleaved: one 16-row tile (8 bytes per k) at a time */
        for (int t = 0; t < rows / 16; t++) {
            float part[ROWS_CHUNK][64];
            for (int i = 0; i < mc; i++) memset(part[i], 0, sizeof part[i]);
            block_pass_interleaved(wb + 8 * t, stride, sz + 32 * t, np, x, xs, K, G, gs, mc, part);
            for (int i = 0; i < mc; i++) memcpy(&tot[i][16 * t], part[i], sizeof(float) * 16);
        }
    }
}

/* The vector width this build uses: 512 or 256 bits. */
int sidecar_int4_vector_bits(void) { return VECTOR_BITS; }

/* x float32 [M, K]; w packed codes for np rows (np % 16 == 0) and K columns (K % gs == 0,
 * K even); sz bf16 [K / gs, np, 2]; y float32 [M, np]; xs scratch float [M, K / gs];
 * block_n 64 or 32; split 1 for split full blocks, 0 for interleaved ones.
 * Returns 0, or -1 for arguments it does not handle (nothing written). */
int sidecar_int4_matmul(const float* x, const uint8_t* w, const uint16_t* sz, float* y, float* xs,
                        int M, int np, int K, int gs, int block_n, int split, int nthreads) {
    if (M < 0 || np % 16 || gs <= 0 || K % gs || K % 2 || (block_n != 64 && block_n != 32))
        return -1;
    const int G = K / gs;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int k = 0; k < gs; k++) s += x[(int64_t)m * K + (int64_t)g * gs + k];
            xs[(int64_t)m * G + g] = s;
        }
    const int nfull = np / block_n, tail = np % block_n;
    const int nblocks = nfull + (tail ? 1 : 0);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const int n0 = b * block_n, rows = b < nfull ? block_n : tail;
        const uint8_t* wb = w + (int64_t)n0 * (K / 2);
        float tot[ROWS_CHUNK][64];
        for (int m0 = 0; m0 < M; m0 += ROWS_CHUNK) {
            int mc = M - m0 < ROWS_CHUNK ? M - m0 : ROWS_CHUNK;
            run_block(wb, rows, b < nfull ? split : 0, sz + 2 * (int64_t)n0, np, x + (int64_t)m0 * K,
                      xs + (int64_t)m0 * G, K, G, gs, mc, tot);
            for (int i = 0; i < mc; i++) memcpy(y + (int64_t)(m0 + i) * np + n0, tot[i], sizeof(float) * rows);
        }
    }
    return 0;
}
