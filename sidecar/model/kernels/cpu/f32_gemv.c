/* float32 matmul over a plain weight, for the one float32 layer held plain: a tied output head, whose table
 * the embedding lookups read too.
 *
 *   y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]      x, w, y float32 [M, K] / [N, K] / [M, N]; K % 16 == 0
 *
 * oneDNN's packed float32 GEMM, on the head's packed copy, streams a vocab-sized head below the memory's rate
 * at a few rows. Here weight rows go in tiles of 4, split across threads, each
 * tile passing once over every panel of up to 3 activation rows while it sits in L1 (so the weight is read
 * from memory once per call at any batch size), prefetched two tiles ahead. Each output is FMAs over its
 * row's lanes in one fixed order, then one fixed tree over the lanes: a row's result does not depend on its
 * batch.
 */
#include <omp.h>
#include <stdlib.h>

#include "vec.h"

#define NT 4
#define MT 3

#ifdef VL
static inline __attribute__((always_inline)) void dot_tile(const float* x, const float* w, int64_t K,
                                                           const int MB, const int NB, float* out) {
    vf acc[MT][NT];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = v_zero();
    const char* ahead = (const char*)(w + 2 * NB * K);
    for (int64_t k = 0; k < K; k += 16) {
        for (int j = 0; j < NB; j++) _mm_prefetch(ahead + 4 * (j * K + k), _MM_HINT_T0);
        for (int h = 0; h < 16; h += VL)
            for (int j = 0; j < NB; j++) {
                const vf wv = v_load(w + j * K + k + h);
                for (int i = 0; i < MB; i++) acc[i][j] = v_fma(wv, v_load(x + i * K + k + h), acc[i][j]);
            }
    }
    for (int i = 0; i < MB; i++) {
        if (NB == NT) {
            v_sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], out + i * NB);
        } else {
            float four[NT];
            v_sum4(acc[i][0], acc[i][0], acc[i][0], acc[i][0], four);
            out[i * NB] = four[0];
        }
    }
}
#endif

/* bias: [N] float32 or NULL. Returns 0; 1 on a CPU without AVX2 + FMA (or AVX-512), or K not a multiple
 * of 16. */
int sidecar_f32_matmul(const float* x, const float* w, const float* bias, float* y, int M, int N, int K,
                       int nthreads) {
#ifdef VL
    if (K % 16) return 1;
    nthreads = nthreads < 1 ? 1 : nthreads;
    const int tiles = (N + NT - 1) / NT;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int n0 = t * NT;
        const int nb = N - n0 >= NT ? NT : 1;
        for (int n1 = n0; n1 < n0 + NT && n1 < N; n1 += nb) {
            const float* wr = w + (int64_t)n1 * K;
            float acc[MT * NT];
            for (int m0 = 0; m0 < M; m0 += MT) {
                const float* xb = x + (int64_t)m0 * K;
                const int mb = M - m0 < MT ? M - m0 : MT;
                switch (mb * 8 + nb) {
                    case 1 * 8 + NT:
                        dot_tile(xb, wr, K, 1, NT, acc);
                        break;
                    case 2 * 8 + NT:
                        dot_tile(xb, wr, K, 2, NT, acc);
                        break;
                    case 3 * 8 + NT:
                        dot_tile(xb, wr, K, 3, NT, acc);
                        break;
                    case 1 * 8 + 1:
                        dot_tile(xb, wr, K, 1, 1, acc);
                        break;
                    case 2 * 8 + 1:
                        dot_tile(xb, wr, K, 2, 1, acc);
                        break;
                    default:
                        dot_tile(xb, wr, K, 3, 1, acc);
                        break;
                }
                for (int i = 0; i < mb; i++)
                    for (int j = 0; j < nb; j++)
                        y[(int64_t)(m0 + i) * N + n1 + j] = acc[i * nb + j] + (bias ? bias[n1 + j] : 0.f);
            }
        }
    }
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
    return 1;
#endif
}

int sidecar_f32_supported(void) {
#ifdef VL
    return VL;
#else
    return 0;
#endif
}
