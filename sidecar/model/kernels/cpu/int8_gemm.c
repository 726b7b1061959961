/* int8 weight-only matmul for prefill-sized batches on AVX2 CPUs:
 *
 *   y[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n] + bias[n]      x bf16 or float32 [M, K], w int8 codes [N,
 * K]
 *
 * The AVX2 outer products of outer_avx2.h (bf16_gemv's prefill path) over the codes: a block of groups of
 * weight rows is converted to bf16 in the thread's buffer (exactly: the codes are small integers), so a
 * prefill over int8 weights runs at bf16's pace instead of torch's packed int8 kernel's. The sums are float32
 * in the order of bf16_gemv's every path. An AVX-512 BF16 build has no such path (its caller takes amx_gemm's
 * int8 product or torch's kernel); int8_gemv.c holds the decode-sized products.
 */
#include "vec.h"
#include "matmul_args.h"

/* Loops start on 64-byte boundaries, as in bf16_gemv.c (the outer-product loops' speed moves with them). */
#pragma GCC optimize("align-loops=64")

#include "outer_avx2.h"

/* Whether this build has the path: 1 (AVX2 + FMA without AVX-512 BF16), else 0. */
int sidecar_int8_gemm_supported(void) {
#ifdef OUTER_PATH
    return 1;
#else
    return 0;
#endif
}

#ifdef OUTER_PATH
/* x: bf16, or float32 where x_bf16 is 0 (each value as it is: no rounding); scales: float32 [N], one a row;
 * bias, y, out as sidecar_bf16_matmul. Returns 0; 1 without the path or when K is not a multiple of 32; 2
 * when out of memory. */
int sidecar_int8_matmul_wide(const sidecar_matmul_args* a) {
    if (a->K % 32 || a->M < 1) return 1;
    return tiled_outer(a->x, !a->x_bf16, NULL, a->w, a->scales, a->bias, a->y, a->M, a->N, a->K,
                       a->nthreads < 1 ? 1 : a->nthreads, a->bias_bf16, a->out);
}
#else
int sidecar_int8_matmul_wide(const sidecar_matmul_args* a) {
    (void)a;
    return 1;
}
#endif
