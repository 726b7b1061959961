/* The index of each float32 row's largest value, as torch.argmax(dim=-1) gives it: the first index of the
 * largest value, a NaN counting as larger than any number (the row's first NaN where it has one). The
 * sampler's greedy pick over a [rows, vocabulary] block of logits: torch's reduction runs well below the
 * memory's speed; this one reads the block once at that speed and finds the index in the row's cached
 * values. Rows are shared between the threads; with
 * fewer rows than threads each row goes in spans, merged in order. */
#include <stdlib.h>

#include "vec.h"

typedef struct {
    float max;
    int64_t at;     /* first index of max */
    int64_t nan_at; /* first NaN's index, -1 for none */
} part;

/* x[i0..i1), i1 > i0 */
static part scan(const float* x, int64_t i0, int64_t i1) {
    part p = {-INFINITY, i0, -1};
    int64_t i = i0;
    int nan = 0;
    float best = -INFINITY;
#ifdef VL
    vf m = v_set1(-INFINITY);
    for (; i + VL <= i1; i += VL) {
        const vf v = v_load(x + i);
        if (v_nan_mask(v)) {
            nan = 1;
            break;
        }
        m = v_max(m, v);
    }
    best = v_max_lanes(m);
#endif
    for (; i < i1 && !nan; i++) {
        if (x[i] != x[i])
            nan = 1;
        else if (x[i] > best)
            best = x[i];
    }
    if (nan) { /* rare: the first NaN from the span's start */
        for (int64_t j = i0; j < i1; j++)
            if (x[j] != x[j]) {
                p.nan_at = j;
                return p;
            }
    }
    p.max = best;
    int64_t j = i0; /* no NaN: some value equals best (-inf when all are) */
#ifdef VL
    const vf b = v_set1(best);
    for (; j + VL <= i1; j += VL) {
        const int hit = v_eq_mask(v_load(x + j), b);
        if (hit) {
            p.at = j + __builtin_ctz(hit);
            return p;
        }
    }
#endif
    for (; j < i1; j++)
        if (x[j] == best) {
            p.at = j;
            break;
        }
    return p;
}

/* out[r] for rows r < rows of x (row r at x + r * stride, n values, n >= 1). Returns 0, 1 for bad arguments,
 * 2 out of memory. */
int sidecar_row_argmax(const float* x, int64_t rows, int64_t n, int64_t stride, int64_t* out, int nthreads) {
    if (rows < 0 || n < 1 || stride < n) return 1;
    if (rows == 0) return 0;
    if (nthreads < 1) nthreads = 1;
    int64_t spans = rows >= nthreads ? 1 : (nthreads + rows - 1) / rows;
    if (spans > n / 4096) spans = n / 4096 > 1 ? n / 4096 : 1; /* a span worth a thread */
    part* parts = malloc(sizeof(part) * (size_t)(rows * spans));
    if (!parts) return 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * n >= (1 << 16))
    for (int64_t s = 0; s < rows * spans; s++) {
        const int64_t r = s / spans, k = s % spans;
        parts[s] = scan(x + r * stride, n * k / spans, n * (k + 1) / spans);
    }
    for (int64_t r = 0; r < rows; r++) {
        part best = parts[r * spans];
        for (int64_t k = 1; k < spans && best.nan_at < 0; k++) {
            const part q = parts[r * spans + k];
            if (q.nan_at >= 0 || q.max > best.max) best = q; /* ties keep the earlier span */
        }
        out[r] = best.nan_at >= 0 ? best.nan_at : best.at;
    }
    free(parts);
    return 0;
}
