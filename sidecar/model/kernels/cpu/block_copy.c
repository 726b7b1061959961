/* Many independent byte spans copied at once: the pieces of KV blocks moving between the pool and the
 * offload tiers' host buffers. dst[i], src[i]: addresses; len[i]: bytes. The spans must not overlap. */
#include <stdint.h>
#include <string.h>

int sidecar_copy_spans(const int64_t* dst, const int64_t* src, const int64_t* len, int64_t n, int nthreads) {
    for (int64_t i = 0; i < n; i++)
        if (len[i] < 0) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; i++)
        memcpy((void*)(intptr_t)dst[i], (const void*)(intptr_t)src[i], (size_t)len[i]);
    return 0;
}
