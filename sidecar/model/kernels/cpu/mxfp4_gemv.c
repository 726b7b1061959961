/* MXFP4 (OCP microscaling FP4) matmul straight from the codes gpt-oss checkpoints ship: no weight is ever
 * held wider than its 4-bit code.
 *
 *   y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]      w[n, k] = e2m1(code[n, k]) * 2^(scale[n, k / 32] - 127)
 *
 * w: uint8 [N, K / 2], byte j of a row holding the codes of columns 2j (low nibble) and 2j + 1 (high nibble);
 * scales: uint8 [N, K / 32], one e8m0 exponent per 32 columns; K % 32 == 0. An e2m1 code is a sign (bit 3)
 * over {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Each weight is built in float32 as (2 * e2m1, an integer in -12..12)
 * times 2^(scale - 128): a product of a small integer and a power of two, so it is the dequantized weight to
 * the bit (the reference's e2m1 * 2^(scale - 127), overflowing to infinity for the same codes). Sums are
 * float32 FMAs in one fixed order per output (two lane accumulators per row, then one fixed tree over the
 * lanes), so the result differs from a product over the dequantized weights in summation order only and a
 * row's result does not depend on its batch.
 *
 * Rows of w are split across threads; each weight row is decoded block by block for a panel of up to MT
 * activation rows, so with M rows the weight is read from memory once per call (it stays in L1 between
 * panels). AVX2 + FMA builds the vector path (pshufb looks up the doubled e2m1 values); other CPUs run the
 * plain-C loop, which forms the same weights and sums them in one lane.
 *
 * Arguments (matmul_args.h): x [M, K] float32 or bf16 (x_bf16), w, scales as above, bias [N] (bias_bf16) or
 * NULL, y [M, N] float32 or bf16 (out 0 / 1), nthreads.
 */
#include <omp.h>
#include <stdlib.h>

#include "matmul_args.h"
#include "matmul_store.h"

#define MT    4
#define BLOCK 32

/* 2^(s - 128) for every scale byte s: the block scale halved, as the weights are built from doubled e2m1
 * values. Every entry is exact (2^-128 is a float32 subnormal). */
static float half_scale[256];

__attribute__((constructor)) static void fill_scales(void) {
    for (int s = 0; s < 256; s++) half_scale[s] = ldexpf(1.0f, s - 128);
}

#if defined(__AVX2__) && defined(__FMA__)
#define MXFP4_VECTOR 256

/* The 32 weights of one block (16 code bytes, one scale) as four vectors of 8, in column order. */
static inline void decode_block(const uint8_t* codes, float hs, __m256 w[4]) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m128i bytes = _mm_loadu_si128((const __m128i*)codes);
    const __m128i even = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low));
    const __m128i odd = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    const __m128i c0 = _mm_unpacklo_epi8(even, odd); /* columns 0..15 */
    const __m128i c1 = _mm_unpackhi_epi8(even, odd); /* columns 16..31 */
    const __m256 s = _mm256_set1_ps(hs);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), s);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c0, 8))), s);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1)), s);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c1, 8))), s);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[i] = row n of w times row i of x, for the mb rows of x at xs (float32, stride K). */
static inline __attribute__((always_inline)) void dot_rows(const float* xs, const uint8_t* codes,
                                                           const uint8_t* scales, int64_t K, const int mb,
                                                           float* out) {
    __m256 a0[MT], a1[MT];
    for (int i = 0; i < mb; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / BLOCK; g++) {
        __m256 w[4];
        decode_block(codes + g * (BLOCK / 2), half_scale[scales[g]], w);
        for (int i = 0; i < mb; i++) {
            const float* xr = xs + i * K + g * BLOCK;
            a0[i] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a0[i]);
            a1[i] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a1[i]);
            a0[i] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a0[i]);
            a1[i] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a1[i]);
        }
    }
    for (int i = 0; i < mb; i++) out[i] = hsum8(_mm256_add_ps(a0[i], a1[i]));
}

static void dot_panel(const float* xs, const uint8_t* codes, const uint8_t* scales, int64_t K, int mb,
                      float* out) {
    switch (mb) {
        case 1:
            dot_rows(xs, codes, scales, K, 1, out);
            break;
        case 2:
            dot_rows(xs, codes, scales, K, 2, out);
            break;
        case 3:
            dot_rows(xs, codes, scales, K, 3, out);
            break;
        default:
            dot_rows(xs, codes, scales, K, MT, out);
            break;
    }
}
#else
#define MXFP4_VECTOR 0

/* e2m1 code -> twice its value, bit 3 the sign (the vector path's pshufb table holds the same) */
static const float DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static void dot_panel(const float* xs, const uint8_t* codes, const uint8_t* scales, int64_t K, int mb,
                      float* out) {
    for (int i = 0; i < mb; i++) {
        const float* xr = xs + i * K;
        float acc = 0.f;
        for (int64_t k = 0; k < K; k += 2) {
            const uint8_t b = codes[k / 2];
            const float hs = half_scale[scales[k / BLOCK]];
            acc += (DOUBLED[b & 15] * hs) * xr[k];
            acc += (DOUBLED[b >> 4] * hs) * xr[k + 1];
        }
        out[i] = acc;
    }
}
#endif

/* Returns 0; 1 where K is not a multiple of 32 or out is not 0 / 1; 2 where the bf16 activations' float32
 * copy cannot be allocated. */
int sidecar_mxfp4_matmul(const sidecar_matmul_args* a) {
    const int M = a->M, N = a->N, K = a->K;
    if (K % BLOCK || (a->out != 0 && a->out != 1)) return 1;
    const int nthreads = a->nthreads < 1 ? 1 : a->nthreads;
    const float* x = (const float*)a->x;
    float* widened = NULL;
    if (a->x_bf16) {
        widened = (float*)malloc((size_t)M * K * sizeof(float));
        if (!widened) return 2;
        const uint16_t* xb = (const uint16_t*)a->x;
        for (int64_t i = 0; i < (int64_t)M * K; i++) widened[i] = bf16_to_f32(xb[i]);
        x = widened;
    }
    const uint8_t* codes = (const uint8_t*)a->w;
    const uint8_t* scales = (const uint8_t*)a->scales;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t* cr = codes + (int64_t)n * (K / 2);
        const uint8_t* sr = scales + (int64_t)n * (K / BLOCK);
        float acc[MT];
        for (int m0 = 0; m0 < M; m0 += MT) {
            const int mb = M - m0 < MT ? M - m0 : MT;
            dot_panel(x + (int64_t)m0 * K, cr, sr, K, mb, acc);
            store_tile(acc, mb, 1, m0, n, N, a->bias, a->bias_bf16, a->y, a->out);
        }
    }
    free(widened);
    return 0;
}

/* 256 where the AVX2 path is built, 0 for the plain-C loop. */
int sidecar_mxfp4_vector_bits(void) {
    return MXFP4_VECTOR;
}
