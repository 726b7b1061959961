/* Vector primitives shared by our CPU kernels: one float32 vector type `vf` of VL lanes over AVX-512 or
 * AVX2 + FMA (VL undefined on other CPUs: callers keep a plain-C path), bf16 <-> float32 conversions
 * (round to nearest even, as torch rounds), exp for non-positive arguments, and element access over
 * float32 or bf16 arrays by a dtype flag. */
#ifndef SIDECAR_VEC_H
#define SIDECAR_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
static inline vf v_load(const float* p) {
    return _mm512_loadu_ps(p);
}
static inline void v_store(float* p, vf x) {
    _mm512_storeu_ps(p, x);
}
static inline vf v_set1(float x) {
    return _mm512_set1_ps(x);
}
static inline vf v_fma(vf a, vf b, vf c) {
    return _mm512_fmadd_ps(a, b, c);
}
static inline vf v_zero(void) {
    return _mm512_setzero_ps();
}
static inline vf v_add(vf a, vf b) {
    return _mm512_add_ps(a, b);
}
static inline vf v_sub(vf a, vf b) {
    return _mm512_sub_ps(a, b);
}
static inline vf v_mul(vf a, vf b) {
    return _mm512_mul_ps(a, b);
}
static inline float v_sum(vf x) {
    return _mm512_reduce_add_ps(x);
}
/* out[i] = sum of the lanes of a_i */
static inline void v_sum4(vf a0, vf a1, vf a2, vf a3, float* out) {
    vf t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    vf t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    vf u = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, 0x44), _mm512_shuffle_ps(t01, t23, 0xEE));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
static inline vf v_load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vf v_load_i8(const int8_t* p) { /* VL int8 codes widened to float32 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline vf v_max(vf a, vf b) {
    return _mm512_max_ps(a, b);
}
static inline vf v_min(vf a, vf b) {
    return _mm512_min_ps(a, b);
}
static inline vf v_div(vf a, vf b) {
    return _mm512_div_ps(a, b);
}
/* per lane: g >= 0 ? a : b */
static inline vf v_blend_ge0(vf g, vf a, vf b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
static inline vf v_fnma(vf a, vf b, vf c) {
    return _mm512_fnmadd_ps(a, b, c);
}
static inline vf v_round(vf x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* x * 2^n for integral n in the normal range: one instruction here, the same bits as the AVX2 form below (x
 * times 2^n built from its exponent bits), checked over every float32 argument of v_exp from -100 to 1 */
static inline vf v_scale2(vf x, vf n) {
    return _mm512_scalef_ps(x, n);
}
/* bit i set where lane i of x is a NaN */
static inline int v_nan_mask(vf x) {
    return (int)_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
}
/* bit i set where lane i of a equals lane i of b (neither a NaN) */
static inline int v_eq_mask(vf a, vf b) {
    return (int)_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ);
}
/* the largest lane of x, which holds no NaN */
static inline float v_max_lanes(vf x) {
    return _mm512_reduce_max_ps(x);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
static inline vf v_load(const float* p) {
    return _mm256_loadu_ps(p);
}
static inline void v_store(float* p, vf x) {
    _mm256_storeu_ps(p, x);
}
static inline vf v_set1(float x) {
    return _mm256_set1_ps(x);
}
static inline vf v_fma(vf a, vf b, vf c) {
    return _mm256_fmadd_ps(a, b, c);
}
static inline vf v_zero(void) {
    return _mm256_setzero_ps();
}
static inline vf v_add(vf a, vf b) {
    return _mm256_add_ps(a, b);
}
static inline vf v_sub(vf a, vf b) {
    return _mm256_sub_ps(a, b);
}
static inline vf v_mul(vf a, vf b) {
    return _mm256_mul_ps(a, b);
}
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
    return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vf v_load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf v_max(vf a, vf b) {
    return _mm256_max_ps(a, b);
}
static inline vf v_min(vf a, vf b) {
    return _mm256_min_ps(a, b);
}
static inline vf v_div(vf a, vf b) {
    return _mm256_div_ps(a, b);
}
static inline vf v_blend_ge0(vf g, vf a, vf b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
}
static inline vf v_fnma(vf a, vf b, vf c) {
    return _mm256_fnmadd_ps(a, b, c);
}
static inline vf v_round(vf x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vf v_pow2(vf n) { /* 2^n for integral n in the normal range */
    return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf v_scale2(vf x, vf n) {
    return _mm256_mul_ps(x, v_pow2(n));
}
static inline int v_nan_mask(vf x) {
    return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
static inline int v_eq_mask(vf a, vf b) {
    return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ));
}
static inline float v_max_lanes(vf x) {
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, x);
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    return best;
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
    return v_scale2(p, n);
}
/* tanh(x) within a few float32 ulp of libm's: below |x| = 0.625 an odd polynomial (Cephes' tanhf
 * coefficients), from there (1 - e) / (1 + e) with e = exp(-2|x|) <= 1 (no overflow; past |x| = 43.5, where
 * v_exp stops, that is 1 to the last bit), with x's sign. A NaN stays a NaN. */
static inline vf v_tanh(vf x) {
    const vf ax = v_max(x, v_sub(v_zero(), x));
    const vf z = v_mul(x, x);
    vf p = v_set1(-5.70498872745e-3f);
    p = v_fma(p, z, v_set1(2.06390887954e-2f));
    p = v_fma(p, z, v_set1(-5.37397155531e-2f));
    p = v_fma(p, z, v_set1(1.33314422036e-1f));
    p = v_fma(p, z, v_set1(-3.33332819422e-1f));
    const vf small = v_fma(v_mul(p, z), x, x);
    const vf e = v_exp(v_mul(ax, v_set1(-2.0f)));
    const vf big = v_div(v_sub(v_set1(1.0f), e), v_add(v_set1(1.0f), e));
    const vf sbig = v_blend_ge0(x, big, v_sub(v_zero(), big));
    return v_blend_ge0(v_sub(ax, v_set1(0.625f)), sbig, small);
}
#endif

/* Attention logit soft-capping (Gemma 2) of x[0..n): x[j] = cap * tanh(x[j] * in), with `in` = 1 / cap for
 * scores already scaled, or scale / cap for raw dot products. */
static inline void softcap_row(float* x, int n, float in, float cap) {
    int j = 0;
#ifdef VL
    const vf vi = v_set1(in), vc = v_set1(cap);
    for (; j + VL <= n; j += VL) v_store(x + j, v_mul(v_tanh(v_mul(v_load(x + j), vi)), vc));
    if (j < n) { /* the tail through the same tanh, padded with lanes it discards */
        float tmp[VL];
        for (int i = 0; i < VL; i++) tmp[i] = j + i < n ? x[j + i] : 0.f;
        v_store(tmp, v_mul(v_tanh(v_mul(v_load(tmp), vi)), vc));
        for (int i = 0; j < n; i++, j++) x[j] = tmp[i];
    }
#else
    for (; j < n; j++) x[j] = cap * tanhf(x[j] * in);
#endif
}

/* The largest of x[0..n), n >= 1, as the scalar loop `m = x[j] > m ? x[j] : m` from m = x[0] finds it (a NaN
 * past x[0] passed over, one at x[0] kept), a vector at a time: that loop, one dependent compare per score,
 * was a large share of both attention kernels' time. */
static inline float row_max(const float* x, int n) {
    float m = x[0];
    int j = 0;
#ifdef VL
    if (n >= VL) {
        vf a = v_set1(m);
        for (; j + VL <= n; j += VL) a = v_max(v_load(x + j), a); /* max(new, a): a where new is NaN */
        float lanes[VL];
        v_store(lanes, a);
        for (int i = 0; i < VL; i++) m = lanes[i] > m ? lanes[i] : m;
    }
#endif
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

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

#ifdef VL
/* Each lane rounded to bf16 (nearest even; a NaN stays a NaN) and kept as float32. */
static inline vf v_round_bf16(vf x) {
#if VL == 16
    const __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(
            u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
#else
    const __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_add_epi32(
            u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
#endif
}

/* VL lanes rounded to bf16 and stored as 16-bit values. */
static inline void v_store_bf16(uint16_t* p, vf x) {
#if VL == 16
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(v_round_bf16(x)), 16);
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
#else
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(v_round_bf16(x)), 16);
    _mm_storeu_si128((__m128i*)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
#endif
}
#endif

/* silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1 so that nothing overflows (norm_act's silu_mul,
 * and the AMX matmul's gate/up epilogue, which must give the same bits) */
static inline float silu1(float g) {
    const float e = expf(-fabsf(g));
    return g * (g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

#ifdef VL
static inline vf vsilu(vf g) {
    const vf ng = v_min(g, v_sub(v_zero(), g));                              /* -|g| */
    const vf e = v_blend_ge0(v_add(ng, v_set1(87.0f)), v_exp(ng), v_zero()); /* v_exp stops at -87 */
    const vf num = v_blend_ge0(g, v_set1(1.0f), e);                          /* g >= 0 ? 1 : e */
    return v_mul(g, v_div(num, v_add(v_set1(1.0f), e)));
}
#endif

/* Elements of a float32 (dtype 0) or bf16 (dtype 1) array, handled as float32: load element i, round x
 * to the dtype and back (identity for float32), store x rounded to the dtype. */
static inline float dt_load(const void* p, size_t i, int dtype) {
    return dtype ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline float dt_round(float x, int dtype) {
    return dtype ? bf16_to_f32(f32_to_bf16(x)) : x;
}

static inline void dt_store(void* p, size_t i, float x, int dtype) {
    if (dtype)
        ((uint16_t*)p)[i] = f32_to_bf16(x);
    else
        ((float*)p)[i] = x;
}

#ifdef VL
/* The same, VL elements at a time. */
static inline vf v_dt_load(const void* p, size_t i, int dtype) {
    return dtype ? v_load_bf16((const uint16_t*)p + i) : v_load((const float*)p + i);
}

static inline vf v_dt_round(vf x, int dtype) {
    return dtype ? v_round_bf16(x) : x;
}

static inline void v_dt_store(void* p, size_t i, vf x, int dtype) {
    if (dtype)
        v_store_bf16((uint16_t*)p + i, x);
    else
        v_store((float*)p + i, x);
}
#endif

#if defined(__AVX512BF16__) && VL == 16
/* One block of a dot-product register tile (the AVX-512 BF16 paths of amx_gemm.c and prefill_attention.c):
 * rows 0..MR-1 of x (lda bf16 values apart) times a block of the tile layout (w: 16 vectors of 16 outputs'
 * pairs of values, then the next 16 outputs' 512 values on), added to the sums: a[i][h] += w's vector r of
 * half h . (x[i][2 r], x[i][2 r + 1]) for r in order. Inlined into a function per height, the sums stay in
 * registers. */
static inline __attribute__((always_inline)) void dot_block(__m512 (*a)[2], const uint16_t* x, size_t lda,
                                                            const uint16_t* w, const int MR) {
    for (int r = 0; r < 16; r++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(w + r * 32));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(w + 512 + r * 32));
        for (int i = 0; i < MR; i++) {
            uint32_t pair;
            memcpy(&pair, x + (size_t)i * lda + 2 * r, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            a[i][0] = _mm512_dpbf16_ps(a[i][0], w0, xv);
            a[i][1] = _mm512_dpbf16_ps(a[i][1], w1, xv);
        }
    }
}

#define DOT_ROWS 12 /* rows a dot-product register tile holds: 12 x 32 outputs, 24 accumulators */

/* Rows x.. (MR <= DOT_ROWS, lda bf16 values apart) times blocks 0..nb-1 of a tile layout (block b at w + b *
 * bstride, its pairs of x at x + 32 b), dot_block after dot_block: out[i][0..31] (rows ldo apart) = the sums,
 * from out's own values where `acc` (else from zero); `per` cache lines from `ahead` on read into L2 a block.
 */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t* x, size_t lda, const uint16_t* w,
                                                           size_t bstride, int nb, float* out, size_t ldo,
                                                           int acc, const char* ahead, int per,
                                                           const int MR) {
    __m512 a[DOT_ROWS][2];
    for (int i = 0; i < MR; i++) {
        a[i][0] = acc ? _mm512_loadu_ps(out + (size_t)i * ldo) : _mm512_setzero_ps();
        a[i][1] = acc ? _mm512_loadu_ps(out + (size_t)i * ldo + 16) : _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        if (per) {
            for (int l = 0; l < per; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
            ahead += 64 * per;
        }
        dot_block(a, x + (size_t)b * 32, lda, w + (size_t)b * bstride, MR);
    }
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(out + (size_t)i * ldo, a[i][0]);
        _mm512_storeu_ps(out + (size_t)i * ldo + 16, a[i][1]);
    }
}

/* each height its own function, so that the accumulators stay in registers (inside a caller's loop the
 * compiler spills them); DOT_ROWS_OF[h] runs h rows (unused in a file without a dot-product path: dropped
 * there) */
#define DOT_ROWS_FN(MR)                                                                           \
    static __attribute__((noinline, unused)) void dot_rows_##MR(                                  \
            const uint16_t* x, size_t lda, const uint16_t* w, size_t bstride, int nb, float* out, \
            size_t ldo, int acc, const char* ahead, int per) {                                    \
        dot_rows(x, lda, w, bstride, nb, out, ldo, acc, ahead, per, MR);                          \
    }
DOT_ROWS_FN(1)
DOT_ROWS_FN(2)
DOT_ROWS_FN(3)
DOT_ROWS_FN(4)
DOT_ROWS_FN(5)
DOT_ROWS_FN(6)
DOT_ROWS_FN(7)
DOT_ROWS_FN(8)
DOT_ROWS_FN(9)
DOT_ROWS_FN(10)
DOT_ROWS_FN(11)
DOT_ROWS_FN(12)
#undef DOT_ROWS_FN

typedef void (*dot_rows_fn)(const uint16_t*, size_t, const uint16_t*, size_t, int, float*, size_t, int,
                            const char*, int);
static const dot_rows_fn DOT_ROWS_OF[DOT_ROWS + 1] __attribute__((unused)) = {
        NULL,       dot_rows_1, dot_rows_2, dot_rows_3,  dot_rows_4,  dot_rows_5, dot_rows_6,
        dot_rows_7, dot_rows_8, dot_rows_9, dot_rows_10, dot_rows_11, dot_rows_12};
#endif

/* AMX (Intel Sapphire Rapids on): the tile configuration register's layout (palette 1), and whether the
 * kernel grants this process the tile state (asked once per library; Linux 5.16+). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Loads a tile configuration. Through an asm operand that reads the whole struct: with _tile_loadconfig, GCC
 * 12 was seen to drop the stores that fill the struct's rows and columns (a configuration with none: the load
 * faults, SIGILL, where no self-check can catch it). */
static inline void load_tile_config(const tile_config* c) {
    __asm__ volatile("ldtilecfg %0" : : "m"(*c));
}

static inline int amx_granted(void) {
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}
#endif

#endif
