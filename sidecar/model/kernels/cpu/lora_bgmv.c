/* The low-rank update of LoRA adapters, one adapter per row, added in place to a projection's output:
 *
 *   out[t, offs[j]:offs[j+1]] += B_{s,j} (A_{s,j} x[t])      for each listed row t, its slot s, part j < n
 *
 * float32 throughout. ``at`` holds each slot's A transposed, [S, K, ldr]: part j's rank rows at columns
 * j*R..j*R+R-1, zero where the adapter's rank is below R and in the padding up to ``ldr`` (a multiple of
 * 16). ``bt`` holds B transposed, [S, n, R, N], part j's rows nonzero only over that part's output columns,
 * which are the only ones read. Only the listed rows are touched (base-model rows are not listed), so a row
 * costs its own adapter's rank-R products, whatever the other rows of the batch use.
 *
 * The caller lists the rows grouped by slot. Up to MT consecutive rows of one slot form a tile that reads
 * each weight chunk once for all its rows; tiles are split across threads. Every output element is summed
 * in one fixed order (fused multiply-adds over k, then over the rank) whatever the tile size, so a row's
 * result does not depend on the batch around it.
 */
#include <stdlib.h>

#include "vec.h"

#define MT   4  /* rows per tile */
#define CB   64 /* output columns accumulated in registers at a time */
#define RMAX 1024

#ifdef VL
/* y[i * ldr + r] = sum_k x[i, k] * as[k, r] for r in [r0, r0 + W) (W 16 or 32: whole vectors) */
static inline __attribute__((always_inline)) void shrink(const float* const* xs, int K, const float* as,
                                                         int ldr, int r0, const int MB, const int W,
                                                         float* y) {
    vf acc[MT][32 / VL];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < W / VL; c++) acc[i][c] = v_zero();
    for (int k = 0; k < K; k++) {
        const float* a = as + (int64_t)k * ldr + r0;
        for (int i = 0; i < MB; i++) {
            const vf xv = v_set1(xs[i][k]);
            for (int c = 0; c < W / VL; c++) acc[i][c] = v_fma(xv, v_load(a + c * VL), acc[i][c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < W / VL; c++) v_store(y + i * ldr + r0 + c * VL, acc[i][c]);
}

/* out_i[c0 + c] += sum_r y[i * ldr + r] * b[r, c0 + c] for c < W (W = CB: whole vectors) */
static inline __attribute__((always_inline)) void expand_block(const float* y, int ldr, const float* b, int R,
                                                               int N, int c0, const int MB,
                                                               float* const* outs) {
    vf acc[MT][CB / VL];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < CB / VL; c++) acc[i][c] = v_zero();
    for (int r = 0; r < R; r++) {
        const float* br = b + (int64_t)r * N + c0;
        for (int i = 0; i < MB; i++) {
            const vf yv = v_set1(y[i * ldr + r]);
            for (int c = 0; c < CB / VL; c++) acc[i][c] = v_fma(yv, v_load(br + c * VL), acc[i][c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < CB / VL; c++)
            v_store(outs[i] + c0 + c * VL, v_add(v_load(outs[i] + c0 + c * VL), acc[i][c]));
}
#else
static inline void shrink(const float* const* xs, int K, const float* as, int ldr, int r0, const int MB,
                          const int W, float* y) {
    float acc[MT][32];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < W; c++) acc[i][c] = 0.f;
    for (int k = 0; k < K; k++) {
        const float* a = as + (int64_t)k * ldr + r0;
        for (int i = 0; i < MB; i++)
            for (int c = 0; c < W; c++) acc[i][c] = fmaf(xs[i][k], a[c], acc[i][c]);
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < W; c++) y[i * ldr + r0 + c] = acc[i][c];
}
#endif

/* expand_block's sums for the W < CB columns at a part's end (and every block without vectors): each output
 * one fused multiply-add a rank, in the same order, so the bits do not depend on the block it falls in. */
static inline void expand_tail(const float* y, int ldr, const float* b, int R, int N, int c0, const int MB,
                               const int W, float* const* outs) {
    float acc[MT][CB];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < W; c++) acc[i][c] = 0.f;
    for (int r = 0; r < R; r++) {
        const float* br = b + (int64_t)r * N + c0;
        for (int i = 0; i < MB; i++) {
            const float yv = y[i * ldr + r];
            for (int c = 0; c < W; c++) acc[i][c] = fmaf(yv, br[c], acc[i][c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < W; c++) outs[i][c0 + c] += acc[i][c];
}

#ifndef VL
static inline void expand_block(const float* y, int ldr, const float* b, int R, int N, int c0, const int MB,
                                float* const* outs) {
    expand_tail(y, ldr, b, R, N, c0, MB, CB, outs);
}
#endif

static void tile(const float* const* xs, float* const* outs, const int MB, const float* as, const float* bs,
                 const int32_t* offs, int n, int R, int K, int N, int ldr) {
    float y[MT * RMAX];
    for (int r0 = 0; r0 < ldr; r0 += 32) {
        const int wide = ldr - r0 >= 32;
        switch (MB * 2 + wide) {
            case 2:
                shrink(xs, K, as, ldr, r0, 1, 16, y);
                break;
            case 3:
                shrink(xs, K, as, ldr, r0, 1, 32, y);
                break;
            case 4:
                shrink(xs, K, as, ldr, r0, 2, 16, y);
                break;
            case 5:
                shrink(xs, K, as, ldr, r0, 2, 32, y);
                break;
            case 6:
                shrink(xs, K, as, ldr, r0, 3, 16, y);
                break;
            case 7:
                shrink(xs, K, as, ldr, r0, 3, 32, y);
                break;
            case 8:
                shrink(xs, K, as, ldr, r0, 4, 16, y);
                break;
            default:
                shrink(xs, K, as, ldr, r0, 4, 32, y);
                break;
        }
    }
    for (int j = 0; j < n; j++) {
        const float* b = bs + (int64_t)j * R * N;
        for (int c0 = offs[j]; c0 < offs[j + 1]; c0 += CB) {
            const int w = offs[j + 1] - c0;
            if (w >= CB) {
                switch (MB) {
                    case 1:
                        expand_block(y + j * R, ldr, b, R, N, c0, 1, outs);
                        break;
                    case 2:
                        expand_block(y + j * R, ldr, b, R, N, c0, 2, outs);
                        break;
                    case 3:
                        expand_block(y + j * R, ldr, b, R, N, c0, 3, outs);
                        break;
                    default:
                        expand_block(y + j * R, ldr, b, R, N, c0, 4, outs);
                        break;
                }
            } else {
                expand_tail(y + j * R, ldr, b, R, N, c0, MB, w, outs);
            }
        }
    }
}

/* The arguments of sidecar_lora_apply (mirrored by ``LoraArgs``). */
typedef struct {
    const float* x;
    const float* at;
    const float* bt;
    const int64_t* rows;
    const int64_t* slots;
    const int32_t* offs;
    float* out;
    int nrows;
    int n;
    int R;
    int K;
    int N;
    int ldr;
    int nthreads;
} sidecar_lora_args;
int sidecar_lora_args_size(void) {
    return (int)sizeof(sidecar_lora_args);
}

/* Returns 0, or 1 when the shapes are outside what the kernel handles (ldr not a multiple of 16 or too wide).
 */
int sidecar_lora_apply(const sidecar_lora_args* a) {
    const float* x = a->x;
    const float* at = a->at;
    const float* bt = a->bt;
    const int64_t* rows = a->rows;
    const int64_t* slots = a->slots;
    const int32_t* offs = a->offs;
    float* out = a->out;
    int nrows = a->nrows;
    int n = a->n;
    int R = a->R;
    int K = a->K;
    int N = a->N;
    int ldr = a->ldr;
    int nthreads = a->nthreads;
    if (ldr % 16 || ldr > RMAX || n * R > ldr) return 1;
    int* starts = malloc(sizeof(int) * (nrows + 1));
    if (!starts) return 1;
    int ntiles = 0;
    for (int i = 0; i < nrows; i++)
        if (i == 0 || slots[i] != slots[i - 1] || i - starts[ntiles - 1] == MT) starts[ntiles++] = i;
    starts[ntiles] = nrows;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (ntiles > 1)
    for (int t = 0; t < ntiles; t++) {
        const int i0 = starts[t], mb = starts[t + 1] - starts[t];
        const float* xs[MT];
        float* outs[MT];
        for (int i = 0; i < mb; i++) {
            xs[i] = x + rows[i0 + i] * (int64_t)K;
            outs[i] = out + rows[i0 + i] * (int64_t)N;
        }
        const int64_t s = slots[i0];
        tile(xs, outs, mb, at + s * (int64_t)K * ldr, bt + s * (int64_t)n * R * N, offs, n, R, K, N, ldr);
    }
    free(starts);
    return 0;
}
