/* Paged decode attention on the latents of multi-head latent attention (DeepSeek V3, Mistral 4; mla.py), the
 * absorbed form: every head attends on the same cached rows, each the normed latent c (R values) and the
 * rotated key part k (P values) of one token, read in place from the paged caches lc [num_blocks, bs, R] and
 * rc [num_blocks, bs, P] through the row's block table.
 *
 *   s[b, h, j] = scale * (ql[b, h, :] . c_j + qr[b, h, :] . k_j),  0 <= j < ctx_b
 *   out[b, h, :] = sum_j softmax_j(s[b, h, :]) c_j
 *
 * ql [B, H, R] is each head's no-rope query already folded through W_UK, qr [B, H, P] its rotated part; the
 * caller maps out [B, H, R] through W_UV. The softmax is float32 with the maximum subtracted, as the torch
 * path's. Inputs and output are float32 (dtype 0) or bfloat16 (dtype 1: products and sums in float32, the
 * output rounded to nearest even).
 *
 * A task is one row and a group of up to HG of its heads (fewer when the rows are too few to keep every
 * thread busy). Scores: four cached rows at a time are widened to float32 once and scored against each head's
 * query [ql | qr]. Values: the context in tiles of KT rows, each tile read (from L2 after its first pass) for
 * QG heads and two vectors of latent channels at a time, sums in registers. A head's arithmetic is the same
 * whatever group it falls in, and a row's result depends only on its own query and context.
 *
 * Scores (scores not NULL: [num_blocks * bs] float32, one per cache slot): each row's softmax weights, summed
 * over the task's heads, are added to its slot. Each task sums into a part of its own; the parts are added to
 * the slots once every task is done, by one thread, task by task: the same sums in the same order on every
 * call with the same rows and threads, so a step and its replay leave the same bits. */
#include <stdlib.h>

#include "vec.h"

#define HG 16 /* heads a task holds at most */
#define KT 64 /* cached rows per tile of the values pass */
#ifdef VL
#define QG (VL == 16 ? 8 : 4) /* heads a values pass sums at once: QG x 2 vectors of sums in registers */
#endif

/* The arguments of sidecar_latent_decode_attention (mirrored by ``LatentAttentionArgs``). */
typedef struct {
    const void* ql;
    const void* qr;
    const void* lc;
    const void* rc;
    const int64_t* tables;
    const int64_t* ctx;
    void* out;
    float* scores; /* NULL, or [num_blocks * bs]: received attention added per slot */
    int B;
    int nh;
    int R;
    int P;
    int bs;
    int max_blocks;
    float scale;
    int dtype;
    int nthreads;
} sidecar_latent_attention_args;
int sidecar_latent_attention_args_size(void) {
    return (int)sizeof(sidecar_latent_attention_args);
}

int sidecar_latent_attention_vector_width(void) {
#ifdef VL
    return VL;
#else
    return 1;
#endif
}

/* x[0..n) of a float32 or bf16 array at element i, as float32, into y. */
static inline void widen(float* y, const void* x, size_t i, int n, int dt) {
    int d = 0;
#ifdef VL
    for (; d + VL <= n; d += VL) v_store(y + d, v_dt_load(x, i + d, dt));
#endif
    for (; d < n; d++) y[d] = dt_load(x, i + d, dt);
}

/* s[r][j] = scale * qf[r] . key j for the G heads, keys widened four at a time into kf [4][W] (W = R + P).
 * SH heads at once against the four keys: SH x 4 sums in registers, each loaded key vector used SH times.
 * A (head, key) score's arithmetic is the same whatever heads share its tile; a tail of fewer than SH heads
 * repeats its last head's query and drops those sums. */
#ifdef VL
#define SH (VL == 16 ? 4 : 2)
#else
#define SH 1
#endif
static void score(const float* qf, int G, int W, int R, int P, const void* lc, const void* rc,
                  const size_t* slot, int n, int dt, float scale, float* kf, float* s) {
    for (int j = 0; j < n; j += 4) {
        const int m = n - j < 4 ? n - j : 4;
        for (int i = 0; i < m; i++) {
            widen(kf + (size_t)i * W, lc, slot[j + i] * R, R, dt);
            widen(kf + (size_t)i * W + R, rc, slot[j + i] * P, P, dt);
        }
        for (int i = m; i < 4; i++) memset(kf + (size_t)i * W, 0, sizeof(float) * W);
        for (int r0 = 0; r0 < G; r0 += SH) {
            const float* q[SH];
            for (int h = 0; h < SH; h++) q[h] = qf + (size_t)(r0 + h < G ? r0 + h : G - 1) * W;
            float sums[SH][4];
            int d = 0;
#ifdef VL
            vf acc[SH][4];
            for (int h = 0; h < SH; h++) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = v_zero();
            for (; d + VL <= W; d += VL) {
                const vf k0 = v_load(kf + d), k1 = v_load(kf + W + d), k2 = v_load(kf + 2 * W + d),
                         k3 = v_load(kf + 3 * W + d);
                for (int h = 0; h < SH; h++) {
                    const vf qv = v_load(q[h] + d);
                    acc[h][0] = v_fma(qv, k0, acc[h][0]);
                    acc[h][1] = v_fma(qv, k1, acc[h][1]);
                    acc[h][2] = v_fma(qv, k2, acc[h][2]);
                    acc[h][3] = v_fma(qv, k3, acc[h][3]);
                }
            }
            for (int h = 0; h < SH; h++) v_sum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3], sums[h]);
#else
            for (int h = 0; h < SH; h++) sums[h][0] = sums[h][1] = sums[h][2] = sums[h][3] = 0.f;
#endif
            for (; d < W; d++)
                for (int h = 0; h < SH; h++)
                    for (int i = 0; i < 4; i++) sums[h][i] += q[h][d] * kf[(size_t)i * W + d];
            for (int h = 0; h < SH && r0 + h < G; h++)
                for (int i = 0; i < m; i++) s[(size_t)(r0 + h) * n + j + i] = sums[h][i] * scale;
        }
    }
}

/* s[r] (n scores) replaced by exp(s - max); returns 1 / their sum. */
static float softmax_row(float* s, int n) {
    const float m = row_max(s, n);
    float total = 0.f;
    int j = 0;
#ifdef VL
    const vf vm = v_set1(m);
    vf vt = v_zero();
    for (; j + VL <= n; j += VL) {
        const vf e = v_exp(v_sub(v_load(s + j), vm));
        v_store(s + j, e);
        vt = v_add(vt, e);
    }
    total = v_sum(vt);
    if (j < n) { /* the tail through the same vector exp, padded with lanes it discards */
        float tmp[VL];
        for (int i = 0; i < VL; i++) tmp[i] = j + i < n ? s[j + i] - m : -87.f;
        v_store(tmp, v_exp(v_load(tmp)));
        for (int i = 0; j < n; i++, j++) total += s[j] = tmp[i];
    }
#else
    for (; j < n; j++) total += s[j] = expf(s[j] - m);
#endif
    return 1.0f / total;
}

#ifdef VL
/* o[r][d0 .. d0 + nv VL) += sum_{j in [j0, j1)} s[r][j] c_j[d0 ..] for Q heads, sums in registers. */
static inline __attribute__((always_inline)) void values_tile(const float* s, int n, const int Q,
                                                              const void* lc, const size_t* slot, int j0,
                                                              int j1, int d0, int nv, int R, int dt,
                                                              float* o) {
    vf acc[QG][2];
    for (int r = 0; r < Q; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = v_load(o + (size_t)r * R + d0 + c * VL);
    for (int j = j0; j < j1; j++) {
        const size_t off = slot[j] * R + d0;
        const vf c0 = v_dt_load(lc, off, dt), c1 = nv > 1 ? v_dt_load(lc, off + VL, dt) : c0;
        for (int r = 0; r < Q; r++) {
            const vf w = v_set1(s[(size_t)r * n + j]);
            acc[r][0] = v_fma(w, c0, acc[r][0]);
            if (nv > 1) acc[r][1] = v_fma(w, c1, acc[r][1]);
        }
    }
    for (int r = 0; r < Q; r++)
        for (int c = 0; c < nv; c++) v_store(o + (size_t)r * R + d0 + c * VL, acc[r][c]);
}
#endif

/* o[r] = sum_j s[r][j] c_j for the G heads (R channels each). */
static void values(const float* s, int n, int G, const void* lc, const size_t* slot, int R, int dt,
                   float* o) {
    memset(o, 0, sizeof(float) * (size_t)G * R);
    for (int j0 = 0; j0 < n; j0 += KT) {
        const int j1 = n - j0 < KT ? n : j0 + KT;
#ifdef VL
        for (int d0 = 0; d0 < R; d0 += 2 * VL)
            for (int r0 = 0, nv = R - d0 >= 2 * VL ? 2 : 1; r0 < G; r0 += QG) {
                const float* sr = s + (size_t)r0 * n;
                float* orow = o + (size_t)r0 * R;
                switch (G - r0 < QG ? G - r0 : QG) {
#define VP(Q)                                                         \
    case Q:                                                           \
        values_tile(sr, n, Q, lc, slot, j0, j1, d0, nv, R, dt, orow); \
        break;
                    VP(1)
                    VP(2)
                    VP(3)
                    VP(4)
#if VL == 16
                    VP(5)
                    VP(6)
                    VP(7)
                    VP(8)
#endif
#undef VP
                }
            }
#else
        for (int r = 0; r < G; r++)
            for (int j = j0; j < j1; j++)
                for (int d = 0; d < R; d++)
                    o[(size_t)r * R + d] += s[(size_t)r * n + j] * dt_load(lc, slot[j] * R + d, dt);
#endif
    }
}

/* ql, out: [B, nh, R], qr: [B, nh, P] contiguous; tables: [B, max_blocks] int64; ctx: [B] int64 (1 <= ctx <=
 * max_blocks * bs). Returns 0, 2 when out of memory, or 1 when the shapes are outside what this kernel
 * handles (the caller keeps its torch path). */
int sidecar_latent_decode_attention(const sidecar_latent_attention_args* a) {
    const int B = a->B, nh = a->nh, R = a->R, P = a->P, bs = a->bs, dt = a->dtype, W = R + P;
    if (nh < 1 || R < 1 || P < 0 || bs < 1 || (dt != 0 && dt != 1)) return 1;
#ifdef VL
    if (R % VL) return 1;
#endif
    int64_t longest = 0;
    for (int b = 0; b < B; b++) {
        if (a->ctx[b] < 1 || a->ctx[b] > (int64_t)a->max_blocks * bs) return 1;
        longest = a->ctx[b] > longest ? a->ctx[b] : longest;
    }
    int G = nh < HG ? nh : HG; /* heads per task: halved while the tasks are fewer than two per thread */
    while (G > 1 && B * ((nh + G - 1) / G) < 2 * a->nthreads) G = (G + 1) / 2;
    const int groups = (nh + G - 1) / G;
    int failed = 0;
    /* [B * groups, longest]: task t's summed weights of key j at parts[t * longest + j] */
    float* parts = a->scores ? (float*)malloc(sizeof(float) * (size_t)B * groups * (size_t)longest) : NULL;
    if (a->scores && !parts) return 2;
#pragma omp parallel num_threads(a->nthreads)
    {
        float* s = (float*)malloc(sizeof(float) * (size_t)G * longest);
        float* qf = (float*)malloc(sizeof(float) * (size_t)G * W);
        float* kf = (float*)malloc(sizeof(float) * 4 * (size_t)W);
        float* of = (float*)malloc(sizeof(float) * (size_t)G * R);
        size_t* slot = (size_t*)malloc(sizeof(size_t) * longest);
        const int ok = s && qf && kf && of && slot;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < B * groups; t++) {
            if (!ok) continue;
            const int b = t / groups, h0 = (t % groups) * G, g = nh - h0 < G ? nh - h0 : G,
                      n = (int)a->ctx[b];
            const int64_t* table = a->tables + (size_t)b * a->max_blocks;
            for (int j = 0; j < n; j++) slot[j] = (size_t)table[j / bs] * bs + j % bs;
            for (int r = 0; r < g; r++) {
                const size_t h = (size_t)b * nh + h0 + r;
                widen(qf + (size_t)r * W, a->ql, h * R, R, dt);
                widen(qf + (size_t)r * W + R, a->qr, h * P, P, dt);
            }
            score(qf, g, W, R, P, a->lc, a->rc, slot, n, dt, a->scale, kf, s);
            float inv[HG];
            for (int r = 0; r < g; r++) {
                float* sr = s + (size_t)r * n;
                inv[r] = softmax_row(sr, n);
                for (int j = 0; j < n; j++) sr[j] *= inv[r];
            }
            if (parts)
                for (int j = 0; j < n; j++) {
                    float w = 0.f;
                    for (int r = 0; r < g; r++) w += s[(size_t)r * n + j];
                    parts[(size_t)t * longest + j] = w;
                }
            values(s, n, g, a->lc, slot, R, dt, of);
            for (int r = 0; r < g; r++)
                for (int d = 0; d < R; d++)
                    dt_store(a->out, ((size_t)b * nh + h0 + r) * R + d, of[(size_t)r * R + d], dt);
        }
        free(s);
        free(qf);
        free(kf);
        free(of);
        free(slot);
    }
    if (parts && !failed)
        for (int t = 0; t < B * groups; t++) {
            const int b = t / groups, n = (int)a->ctx[b];
            const int64_t* table = a->tables + (size_t)b * a->max_blocks;
            const float* w = parts + (size_t)t * longest;
            for (int j = 0; j < n; j++) a->scores[(size_t)table[j / bs] * bs + j % bs] += w[j];
        }
    free(parts);
    return failed ? 2 : 0;
}
