/* The sampler's counter-based uniforms (sampling_rng.uniform) in one pass: element (b, i) is
 * unit_float(fmix(keys[b] + (i + 1) * GOLDEN)), splitmix64 over unsigned 64-bit arithmetic. The torch form
 * runs a dozen int64 operators, each a pass over B x n values; the values here are the same bits: the hash is
 * exact integer arithmetic and every uniform is a cell centre (k + 0.5) * 2^-23, exact in float32. */
#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ull
#define M1     0xBF58476D1CE4E5B9ull
#define M2     0x94D049BB133111EBull

#define SPAN 4096 /* values a thread takes at a time: a one-row draw is split between the threads too */

/* out[b * n + i] for b < rows, i < n. */
int sidecar_keyed_uniform(const int64_t* keys, int64_t rows, int64_t n, float* out, int nthreads) {
    if (rows < 0 || n < 0) return 1;
    const int64_t spans = (n + SPAN - 1) / SPAN;
#pragma omp parallel for num_threads(nthreads < 1 ? 1 : nthreads) schedule(static) if (rows * n >= (1 << 15))
    for (int64_t s = 0; s < rows * spans; s++) {
        const int64_t b = s / spans, i0 = s % spans * SPAN, i1 = i0 + SPAN < n ? i0 + SPAN : n;
        const uint64_t k = (uint64_t)keys[b];
        float* o = out + b * n;
        for (int64_t i = i0; i < i1; i++) {
            uint64_t x = k + (uint64_t)(i + 1) * GOLDEN;
            x = (x ^ (x >> 30)) * M1;
            x = (x ^ (x >> 27)) * M2;
            x ^= x >> 31;
            o[i] = ((float)(int32_t)((x >> 41) & 0x7fffff) + 0.5f) * 0x1p-23f;
        }
    }
    return 0;
}
