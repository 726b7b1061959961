/* Weight-only int8 matmul for decode-sized batches on CPU (up to a few dozen activation rows).
 *
 *   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]      x float32 [M, K], w int8 [N, K], y float32 [M, N]
 *
 * Each activation row is first rounded to int16 with its own scale (absmax / q, q <= 32767
 * chosen so that no int32 lane can overflow for this K); weights are widened to int16 and
 * multiplied in pairs into int32 lanes (AVX-512 VNNI vpdpwssd, else AVX2 vpmaddwd). int16
 * activations keep up to 15 bits where the bf16 rounding around torch's packed kernel keeps 8,
 * and the integer sums are exact. Rows of w are split across threads; each weight chunk is
 * widened once for up to four activation rows, and one pass reads each weight byte once, which
 * is what bounds decode: memory bandwidth.
 */
#include <math.h>
#include <stdint.h>
#include <immintrin.h>

/* Lanes are summed in int64: each lane stays within int32 (see activation_qmax), the whole
 * dot product need not. */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
static inline int64_t hsum_wide(__m512i a) {
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a)),
                                                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1))));
}
#elif defined(__AVX2__)
static inline int64_t hsum_wide(__m256i a) {
    __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)),
                                    _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    return _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
}
#endif

/* out[i] = sum_k x[i * K + k] * w[k] for the MB activation rows i < MB: each weight chunk is
 * widened once and used for every row. MB is a compile-time constant at every call site. */
static inline __attribute__((always_inline)) void dot_rows(const int16_t* x, const int8_t* w, int K,
                                                           const int MB, int64_t* out) {
    int k = 0;
    for (int i = 0; i < MB; i++) out[i] = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    __m512i a0[4], a1[4];
    for (int i = 0; i < MB; i++) a0[i] = a1[i] = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
        __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k)));
        __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k + 32)));
        for (int i = 0; i < MB; i++) {
            const int16_t* xr = x + (int64_t)i * K + k;
            a0[i] = _mm512_dpwssd_epi32(a0[i], w0, _mm512_loadu_si512((const void*)xr));
            a1[i] = _mm512_dpwssd_epi32(a1[i], w1, _mm512_loadu_si512((const void*)(xr + 32)));
        }
    }
    for (int i = 0; i < MB; i++) out[i] = hsum_wide(a0[i]) + hsum_wide(a1[i]);
#elif defined(__AVX2__)
    __m256i a0[4], a1[4];
    for (int i = 0; i < MB; i++) a0[i] = a1[i] = _mm256_setzero_si256();
    for (; k + 32 <= K; k += 32) {
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k)));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k + 16)));
        for (int i = 0; i < MB; i++) {
            const int16_t* xr = x + (int64_t)i * K + k;
            a0[i] = _mm256_add_epi32(a0[i], _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)xr)));
            a1[i] = _mm256_add_epi32(a1[i], _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xr + 16))));
        }
    }
    for (int i = 0; i < MB; i++) out[i] = hsum_wide(a0[i]) + hsum_wide(a1[i]);
#endif
    for (; k < K; k++)
        for (int i = 0; i < MB; i++) out[i] += (int64_t)x[(int64_t)i * K + k] * (int64_t)w[k];
}

/* Largest activation code such that no int32 vector lane can overflow: a lane sums at most
 * K / 16 products of |w| <= 127 and |x| <= q (AVX2: 8 lanes x 2 products per 32 columns;
 * AVX-512: half that), so q <= (2^31 - 1) * 16 / (127 K); at most 32767 (int16). */
static float activation_qmax(int K) {
    double q = 2147483647.0 * 16.0 / (127.0 * (double)(K > 16 ? K : 16));
    return (float)(q < 32767.0 ? floor(q) : 32767.0);
}

static void quantize_rows(const float* x, int16_t* xq, float* xs, int M, int K, float qmax);

/* xq: scratch int16 [M, K]; xs: scratch float [M]. Returns 0. */
int sidecar_int8_matmul(const float* x, const int8_t* w, const float* scale, float* y, int16_t* xq,
                        float* xs, int M, int N, int K, int nthreads) {
    quantize_rows(x, xq, xs, M, K, activation_qmax(K));
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t* wr = w + (int64_t)n * K;
        int64_t acc[4];
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int16_t* xb = xq + (int64_t)m0 * K;
            int mb = M - m0 < 4 ? M - m0 : 4;
            switch (mb) {  /* constant row counts, so each case keeps its accumulators in registers */
                case 1: dot_rows(xb, wr, K, 1, acc); break;
                case 2: dot_rows(xb, wr, K, 2, acc); break;
                case 3: dot_rows(xb, wr, K, 3, acc); break;
                default: dot_rows(xb, wr, K, 4, acc); break;
            }
            for (int i = 0; i < mb; i++)
                y[(int64_t)(m0 + i) * N + n] = (float)(double)acc[i] * xs[m0 + i] * scale[n];
        }
    }
    return 0;
}

/* Grouped variant (llama.cpp's Q8_0 blocks): w int8 [N, K] with one float scale per 32 columns,
 * d [N, K / 32], K a multiple of 32:
 *
 *   y[m, n] = sum_g d[n, g] * sum_{k in g} x[m, k] * w[n, k]
 *
 * Each group's integer dot product is exact in int32 (32 products of |w| <= 127, |x| <= 32767)
 * and is scaled in float32 lanes, so the weights are exactly the dequantized Q8_0 values. */
static inline __attribute__((always_inline)) void dot_rows_g32(const int16_t* x, const int8_t* w, const float* d,
                                                               int K, const int MB, float* out) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    __m512 acc[4];
    for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k)));
        __m512 dg = _mm512_set1_ps(d[k >> 5]);
        for (int i = 0; i < MB; i++) {
            __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0,
                                            _mm512_loadu_si512((const void*)(x + (int64_t)i * K + k)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dg, acc[i]);
        }
    }
    for (int i = 0; i < MB; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
#elif defined(__AVX2__)
    __m256 acc[4];
    for (int i = 0; i < MB; i++) acc[i] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k)));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k + 16)));
        __m256 dg = _mm256_set1_ps(d[k >> 5]);
        for (int i = 0; i < MB; i++) {
            const int16_t* xr = x + (int64_t)i * K + k;
            __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)xr)),
                                         _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xr + 16))));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dg, acc[i]);
        }
    }
    for (int i = 0; i < MB; i++) {
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        out[i] = _mm_cvtss_f32(t);
    }
#else
    for (int i = 0; i < MB; i++) {
        float a = 0.f;
        for (int k = 0; k < K; k += 32) {
            int32_t p = 0;
            for (int j = 0; j < 32; j++) p += (int32_t)x[(int64_t)i * K + k + j] * (int32_t)w[k + j];
            a += (float)p * d[k >> 5];
        }
        out[i] = a;
    }
#endif
}

static void quantize_rows(const float* x, int16_t* xq, float* xs, int M, int K, float qmax) {
    for (int m = 0; m < M; m++) {
        const float* xr = x + (int64_t)m * K;
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

/* K must be a multiple of 32. xq: scratch int16 [M, K]; xs: scratch float [M]. Returns 0. */
int sidecar_int8g32_matmul(const float* x, const int8_t* w, const float* d, float* y, int16_t* xq,
                           float* xs, int M, int N, int K, int nthreads) {
    if (K % 32) return 1;
    quantize_rows(x, xq, xs, M, K, 32767.f);
    const int G = K / 32;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t* wr = w + (int64_t)n * K;
        const float* dr = d + (int64_t)n * G;
        float acc[4];
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int16_t* xb = xq + (int64_t)m0 * K;
            int mb = M - m0 < 4 ? M - m0 : 4;
            switch (mb) {
                case 1: dot_rows_g32(xb, wr, dr, K, 1, acc); break;
                case 2: dot_rows_g32(xb, wr, dr, K, 2, acc); break;
                case 3: dot_rows_g32(xb, wr, dr, K, 3, acc); break;
                default: dot_rows_g32(xb, wr, dr, K, 4, acc); break;
            }
            for (int i = 0; i < mb; i++) y[(int64_t)(m0 + i) * N + n] = acc[i] * xs[m0 + i];
        }
    }
    return 0;
}
