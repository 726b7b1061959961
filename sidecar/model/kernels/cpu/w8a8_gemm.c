/* W8A8 int8 matmul: int8 weights with one scale a row, activations quantized per token in the call.
 *
 *   q[m, k] = clamp(rint(x[m, k] / sx[m]), -128, 127),  sx[m] = max_k |x[m, k]| / 127.5 (FLT_EPSILON if 0)
 *   y[m, n] = (float)(sum_k q[m, k] * w[n, k]) * sx[m] * sw[n] + bias[n]
 *
 * The activation quantization is compressed-tensors' symmetric dynamic per-token int8 (its scale divides the
 * absolute maximum by half the code range, 255 / 2, and a zero scale becomes float32's epsilon); the quotient
 * is a true float32 division rounded to nearest even, as torch computes it. The sums are int32 and exact
 * (|q|, |w|
 * <= 128, so K up to 2^17 cannot overflow); the only roundings are the int32 -> float32 conversion and the
 * two products, in that order, so the result equals the torch reference that computes the same steps.
 *
 * Products: both operands span the full [-128, 127] range (the format's symmetric rounding produces -128), so
 * the u8 x s8 product of vpmaddubsw with the sign trick (|a|, sign(b, a)) does not apply: sign(-128) wraps.
 * The codes are widened to int16 instead and multiplied in pairs with vpmaddwd (16 exact products into 8
 * int32 lanes), or vpdpwssd where the CPU has AVX-VNNI / AVX-512 VNNI (the same products, accumulated in the
 * same instruction). The weight stays int8 in memory and is widened per use. (Where the sign trick would
 * apply it would not be faster: vpmaddubsw's int16 pair sums need a vpmaddwd against ones to reach int32, so
 * 32 products take two multiplier instructions either way.)
 *
 * Weight layout (``w8a8_gemm.pack``): rows padded to a multiple of 16 with zeros, K padded to an even Kp with
 * zeros; panels of 16 rows, each panel two blocks of 8 rows, each block [Kp / 2][8 rows][2 codes] (the pair
 * of codes k = 2p, 2p + 1 of each row side by side), blocks of a panel consecutive. Scales: float32 [Np].
 */
#include "vec.h"
#include "matmul_args.h"
#include "matmul_store.h"
#include <float.h>
#include <stdlib.h>

/* A register tile is MR activation rows x NR weight rows: 2 * MR int32 accumulators, the panel's two widened
 * weight vectors, a broadcast and a product in the 16 ymm registers of AVX2 (more rows spill accumulators to
 * the stack, and every step then waits on a store and its reload). */
#define MR 4         /* activation rows of a register tile */
#define NR 16        /* weight rows of a panel (two blocks of 8) */
#define MB (12 * MR) /* at most this many activation rows a block (every panel of a chunk passes over it) */
#define BLOCK_BYTES (160 << 10) /* a block's int16 codes fill at most this much of the L2 */
#define CHUNK_BYTES (192 << 10) /* and a chunk's panels this much */
#define SERIAL_MACS (1 << 22)   /* products below this many multiply-adds run on the calling thread */

static int round_up(int a, int b) {
    return (a + b - 1) / b * b;
}

static float load_x(const void* x, int x_bf16, int64_t i) {
    return x_bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
}

#if defined(__AVX2__)
/* x[i .. i + 7] as float32. */
static inline __m256 load_x8(const void* x, int x_bf16, int64_t i) {
    if (!x_bf16) return _mm256_loadu_ps((const float*)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* Row m of x quantized into q (Kp int16, zero beyond K); returns its scale. The vector loop takes the same
 * steps as the scalar tail (a NaN is skipped by the maximum), so every code is the same whichever computes
 * it. */
static float quantize_row(const void* x, int x_bf16, int m, int K, int Kp, int16_t* q) {
    const int64_t base = (int64_t)m * K;
    float amax = 0.f;
    int k = 0;
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 vmax = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8)
        vmax = _mm256_max_ps(_mm256_andnot_ps(sign, load_x8(x, x_bf16, base + k)), vmax);
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
#endif
    for (int t = k; t < K; t++) {
        const float v = fabsf(load_x(x, x_bf16, base + t));
        amax = v > amax ? v : amax;
    }
    float s = amax / 127.5f;
    if (s == 0.f) s = FLT_EPSILON;
    k = 0;
#if defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
    for (; k + 8 <= K; k += 8) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(load_x8(x, x_bf16, base + k), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        _mm_storeu_si128((__m128i*)(q + k),
                         _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1)));
    }
#endif
    for (; k < K; k++) {
        float r = nearbyintf(load_x(x, x_bf16, base + k) / s);
        r = r < -128.f ? -128.f : (r > 127.f ? 127.f : r);
        q[k] = (int16_t)r;
    }
    for (k = K; k < Kp; k++) q[k] = 0;
    return s;
}

/* Rows of a block of activations: a multiple of MR, at most MB, whose codes fit BLOCK_BYTES. */
static int block_rows(int Kp) {
    const int rows = (int)(BLOCK_BYTES / ((int64_t)Kp * 2)) / MR * MR;
    return rows < MR ? MR : (rows > MB ? MB : rows);
}

/* Panels of a chunk: as many as fit CHUNK_BYTES, at least one, at most 8. */
static int chunk_panels(int64_t panel_bytes) {
    const int n = (int)(CHUNK_BYTES / panel_bytes);
    return n < 1 ? 1 : (n > 8 ? 8 : n);
}

/* int32 sums of mr (<= MR, a constant where inlined) rows of q (row stride Kp) against one panel of NR weight
 * rows, into acc[mr][NR]. */
static inline __attribute__((always_inline)) void tile_sums(const int16_t* q, int Kp, const int8_t* panel,
                                                            int32_t* acc, const int mr) {
    const int pairs = Kp / 2;
#if defined(__AVX2__)
    __m256i c[MR][2];
    for (int i = 0; i < mr; i++) c[i][0] = c[i][1] = _mm256_setzero_si256();
    const int8_t* b0 = panel;
    const int8_t* b1 = panel + (int64_t)pairs * 16;
    for (int p = 0; p < pairs; p++) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b0 + p * 16)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b1 + p * 16)));
        for (int i = 0; i < mr; i++) {
            int32_t two;
            memcpy(&two, q + (int64_t)i * Kp + 2 * p, 4);
            const __m256i a = _mm256_set1_epi32(two);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            c[i][0] = _mm256_dpwssd_epi32(c[i][0], a, w0);
            c[i][1] = _mm256_dpwssd_epi32(c[i][1], a, w1);
#elif defined(__AVXVNNI__)
            c[i][0] = _mm256_dpwssd_avx_epi32(c[i][0], a, w0);
            c[i][1] = _mm256_dpwssd_avx_epi32(c[i][1], a, w1);
#else
            c[i][0] = _mm256_add_epi32(c[i][0], _mm256_madd_epi16(a, w0));
            c[i][1] = _mm256_add_epi32(c[i][1], _mm256_madd_epi16(a, w1));
#endif
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_si256((__m256i*)(acc + i * NR), c[i][0]);
        _mm256_storeu_si256((__m256i*)(acc + i * NR + 8), c[i][1]);
    }
#else
    for (int i = 0; i < mr * NR; i++) acc[i] = 0;
    for (int h = 0; h < 2; h++) {
        const int8_t* b = panel + (int64_t)h * pairs * 16;
        for (int p = 0; p < pairs; p++)
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < 8; j++)
                    acc[i * NR + h * 8 + j] +=
                            (int32_t)q[(int64_t)i * Kp + 2 * p] * b[p * 16 + 2 * j] +
                            (int32_t)q[(int64_t)i * Kp + 2 * p + 1] * b[p * 16 + 2 * j + 1];
    }
#endif
}

/* tile_sums for 1..MR rows, each with its own register tile. */
static void sums_rows(const int16_t* q, int Kp, const int8_t* panel, int32_t* acc, int rows) {
    switch (rows) {
        case 1:
            tile_sums(q, Kp, panel, acc, 1);
            break;
        case 2:
            tile_sums(q, Kp, panel, acc, 2);
            break;
        case 3:
            tile_sums(q, Kp, panel, acc, 3);
            break;
#if MR > 4
        case 4:
            tile_sums(q, Kp, panel, acc, 4);
            break;
#endif
#if MR > 5
        case 5:
            tile_sums(q, Kp, panel, acc, 5);
            break;
#endif
        default:
            tile_sums(q, Kp, panel, acc, MR);
            break;
    }
}

/* y rows i0 .. i0 + mb - 1, columns n1 .. n1 + nb - 1 of the sums acc[mb][NR]: (float)sum * sx[m] * sw[n],
 * in that order, plus bias, stored (out: scratch of MR * NR floats). */
static void epilogue(const int32_t* acc, int mb, int nb, int i0, int n1, const float* sx, const float* sw,
                     const sidecar_matmul_args* a, float* out) {
#if defined(__AVX2__) && defined(VL)
    if (nb == NR) {
        const __m256 w0 = _mm256_loadu_ps(sw + n1), w1 = _mm256_loadu_ps(sw + n1 + 8);
        for (int i = 0; i < mb; i++) {
            const __m256 s = _mm256_set1_ps(sx[i0 + i]);
            const __m256i* c = (const __m256i*)(acc + i * NR);
            _mm256_storeu_ps(out,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(c)), s), w0));
            _mm256_storeu_ps(
                    out + 8,
                    _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(c + 1)), s), w1));
            const int64_t at = (int64_t)(i0 + i) * a->N + n1;
            for (int j = 0; j < NR; j += 4)
                store_four(out + j, a->bias, a->bias_bf16, n1 + j, a->y, at + j, a->out == 1);
        }
        return;
    }
#endif
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) out[i * nb + j] = (float)acc[i * NR + j] * sx[i0 + i] * sw[n1 + j];
    store_tile(out, mb, nb, i0, n1, a->N, a->bias, a->bias_bf16, a->y, a->out == 1);
}

/* Whether this build multiplies with VNNI (1), AVX2 (2) or plain C (0). */
int sidecar_w8a8_isa(void) {
#if defined(__AVX2__) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 1;
#elif defined(__AVX2__)
    return 2;
#else
    return 0;
#endif
}

/* Per-token quantization alone (the reference the tests hold the product's first step to): x [M, K] (bf16
 * where x_bf16, else float32) -> q int8 [M, K], scales float32 [M]. */
void sidecar_w8a8_quantize(const void* x, int x_bf16, int M, int K, void* q, void* scales) {
    const int Kp = round_up(K, 2);
#pragma omp parallel
    {
        int16_t* row = malloc(sizeof(int16_t) * (size_t)Kp);
#pragma omp for
        for (int m = 0; m < M; m++) {
            if (!row) continue;
            ((float*)scales)[m] = quantize_row(x, x_bf16, m, K, Kp, row);
            for (int k = 0; k < K; k++) ((int8_t*)q)[(int64_t)m * K + k] = (int8_t)row[k];
        }
        free(row);
    }
}

/* a->x: [M, K] bf16 or float32 (x_bf16); a->w: the packed codes (layout above); a->scales: float32 [Np];
 * a->bias: [N] float32 or bf16 (bias_bf16) or NULL; a->y: [M, N] float32, or bf16 where out is 1 (rounded
 * once). Returns 0, or 2 when out of memory. */
int sidecar_w8a8_matmul(const sidecar_matmul_args* a) {
    const int M = a->M, N = a->N, K = a->K, Kp = round_up(K, 2), Np = round_up(N, NR);
    const int panels = Np / NR;
    const int64_t panel_bytes = (int64_t)NR * Kp;
    const size_t q_bytes = (sizeof(int16_t) * (size_t)M * (size_t)Kp + 63) / 64 * 64;
    int16_t* q = aligned_alloc(64, q_bytes);
    float* sx = malloc(sizeof(float) * (size_t)M);
    if (!q || !sx) {
        free(q);
        free(sx);
        return 2;
    }
    /* A product of a few million multiply-adds takes tens of microseconds on one core: less than waking and
     * joining a team costs. */
    const int nthreads = a->nthreads < 1 || (int64_t)M * N * K < SERIAL_MACS ? 1 : a->nthreads;
#pragma omp parallel for num_threads(nthreads)
    for (int m = 0; m < M; m++) sx[m] = quantize_row(a->x, a->x_bf16, m, K, Kp, q + (int64_t)m * Kp);
    const float* sw = (const float*)a->scales;
    /* Work items are (chunk of panels, block of rows) pairs that threads take as they come free (a core
     * another process holds slows its thread alone, and no barrier waits on it; a prefill's few panels
     * still split evenly between the threads). An item passes every panel of its chunk over its block of
     * rows, whose codes stay in the core's L2 meanwhile. */
    const int mbr = block_rows(Kp), chunk = chunk_panels(panel_bytes);
    const int chunks = (panels + chunk - 1) / chunk, blocks = (M + mbr - 1) / mbr;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int item = 0; item < chunks * blocks; item++) {
        int32_t acc[MR * NR];
        float out[MR * NR];
        const int c = item / blocks, m0 = item % blocks * mbr;
        const int p1 = (c + 1) * chunk < panels ? (c + 1) * chunk : panels;
        const int m1 = m0 + mbr < M ? m0 + mbr : M;
        for (int pn = c * chunk; pn < p1; pn++) {
            const int n1 = pn * NR, nb = N - n1 < NR ? N - n1 : NR;
            for (int i0 = m0; i0 < m1; i0 += MR) {
                const int mb = m1 - i0 < MR ? m1 - i0 : MR;
                sums_rows(q + (int64_t)i0 * Kp, Kp, (const int8_t*)a->w + pn * panel_bytes, acc, mb);
                epilogue(acc, mb, nb, i0, n1, sx, sw, a, out);
            }
        }
    }
    free(q);
    free(sx);
    return 0;
}
