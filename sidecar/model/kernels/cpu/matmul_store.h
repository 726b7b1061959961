/* The matrix product kernels' last step: finished float32 sums plus bias, stored as float32 or rounded once
 * to bf16 (nearest even, as f32_to_bf16 rounds; a NaN stays a NaN). */
#ifndef SIDECAR_MATMUL_STORE_H
#define SIDECAR_MATMUL_STORE_H
#include "vec.h"

#ifdef VL
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

#endif
