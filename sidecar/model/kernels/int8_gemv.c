/* Weight-only int8 matmul for a few activation rows (batch-1 decode on CPU).
 *
 *   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]      x float32 [M, K], w int8 [N, K], y float32 [M, N]
 *
 * Each activation row is first rounded to int16 with its own scale (absmax / q, q <= 32767
 * chosen so that no int32 lane can overflow for this K); weights are widened to int16 and
 * multiplied in pairs into int32 lanes (AVX-512 VNNI vpdpwssd, else AVX2 vpmaddwd). int16
 * activations keep up to 15 bits where the bf16 rounding around torch's packed kernel keeps 8,
 * and the integer sums are exact. Rows of w are split across threads; one pass reads each
 * weight byte once, which is what bounds decode: memory bandwidth.
 */
#include <math.h>
#include <stdint.h>
#include <immintrin.h>

/* Lanes are summed in int64: each lane stays within int32 (see activation_qmax), the whole
 * dot product need not. */
static int64_t dot_i16_i8(const int16_t* x, const int8_t* w, int K) {
    int k = 0;
    int64_t s = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
        __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k)));
        __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k + 32)));
        a0 = _mm512_dpwssd_epi32(a0, w0, _mm512_loadu_si512((const void*)(x + k)));
        a1 = _mm512_dpwssd_epi32(a1, w1, _mm512_loadu_si512((const void*)(x + k + 32)));
    }
    __m512i wide = _mm512_add_epi64(
        _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a0)),
                         _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a0, 1))),
        _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a1)),
                         _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a1, 1))));
    s = _mm512_reduce_add_epi64(wide);
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (; k + 32 <= K; k += 32) {
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k)));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k + 16)));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)(x + k))));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(x + k + 16))));
    }
    __m256i wide = _mm256_add_epi64(
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a0)),
                         _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a0, 1))),
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a1)),
                         _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a1, 1))));
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    s = _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
#endif
    for (; k < K; k++) s += (int64_t)x[k] * (int64_t)w[k];
    return s;
}

/* Largest activation code such that no int32 vector lane can overflow: a lane sums at most
 * K / 16 products of |w| <= 127 and |x| <= q (AVX2: 8 lanes x 2 products per 32 columns;
 * AVX-512: half that), so q <= (2^31 - 1) * 16 / (127 K); at most 32767 (int16). */
static float activation_qmax(int K) {
    double q = 2147483647.0 * 16.0 / (127.0 * (double)(K > 16 ? K : 16));
    return (float)(q < 32767.0 ? floor(q) : 32767.0);
}

/* xq: scratch int16 [M, K]; xs: scratch float [M]. Returns 0. */
int sidecar_int8_matmul(const float* x, const int8_t* w, const float* scale, float* y, int16_t* xq,
                        float* xs, int M, int N, int K, int nthreads) {
    const float qmax = activation_qmax(K);
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
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t* wr = w + (int64_t)n * K;
        for (int m = 0; m < M; m++)
            y[(int64_t)m * N + n] = (float)(double)dot_i16_i8(xq + (int64_t)m * K, wr, K) * xs[m] * scale[n];
    }
    return 0;
}
