/* bf16 matmul on CPUs with AMX (Intel Sapphire Rapids and later), for every batch size (and, on CPUs with
 * AVX-512 BF16 but no AMX, the same layout and loops through dot products: DOT_PATH below):
 *
 *   y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]      x bf16 [M, K], w bf16 [N, K]; y float32 or bf16 [M, N]
 *
 * The weight is held in the layout AMX's tile products read (``amx_gemm.pack``): groups of 32 output rows,
 * each group as its K / 32 chunks in order, each chunk two 1 KiB tiles (the group's rows 0-15, then 16-31)
 * whose tile row r holds, for each of the 16 output rows, the pair of values 2r, 2r + 1 of the chunk:
 *
 *   wp[g][c][h][r][j][e] = w[32 g + 16 h + j][32 c + 2 r + e]      [ceil(N / 32)][K / 32][2][16][16][2]
 *
 * (rows past N are zeros). A thread takes a contiguous run of groups, so it reads its weights as one forward
 * stream. Register tiles: 2 x 2 float32 accumulators (32 activation rows x 32 output rows), 2 activation
 * tiles (16 rows x 32 values each, loaded from x in place), 2 weight tiles; each k step is 4 tile products.
 * Every output is the float32 sum of its 16 pair products per chunk (as the tile product forms it) over the
 * chunks in order, then the bias, then one rounding to bf16 when asked: a row's result does not depend on the
 * other rows of its batch.
 *
 * Why own the kernel: at decode sizes the product is a stream of the weights, and oneDNN's packed GEMM reads
 * them well below the memory's speed; at prefill sizes the tile products keep pace with it. One layout then
 * serves every batch size, where oneDNN's packed copy and the tiled one for small batches held each weight
 * twice.
 *
 * Up to 64 rows the weights pass once, in order, read ahead READ_AHEAD bytes into L2. Larger batches go in
 * blocks of rows whose activations (about BLOCK_BYTES) stay in L2 while the thread's groups pass over them; a
 * group's chunks go in k blocks of KC (16 KiB, held in L1 while every 32-row panel of the block multiplies
 * with them, the panels' sums kept in memory between k blocks), and each panel reads its share of the next k
 * block into L2 as it goes, so the weights arrive before they are multiplied. Where rows are too long for a
 * block of SLAB_ROWS to fit (K > 2,048: the down projection), blocks of SLAB_ROWS go in slabs of chunks
 * (SLAB_BYTES of activations), the sums of every panel in every group of the thread kept between slabs, so
 * the weights pass once per slab rather than once per block of rows.
 *
 * Weight-only int8 (sidecar_amx_int8_matmul) runs the same loops over int8_gemv's plain codes: each thread
 * widens a group's k block to bf16 tiles (exact) once for every panel of the row block, and the epilogue
 * multiplies by the row's scale.
 *
 * Weight-only int4 (sidecar_amx_int4_matmul, AMX only) reads torch's packed CPU layout in place (int4_gemv.c
 * has it) and widens a k block's codes to the bf16 values code - 8 (exact) in the same tiles. A quantization
 * group (gs values, gs / 32 chunks) has its own scale and zero per output row, so its tile products start
 * from zero and are folded into the panel's sums as sums * scale + zero * (the row's sum of the group's
 * activations), in order of the groups, two groups a pass over the sums; each fold is issued between the next
 * groups' tile products: the widening and the folds are vector work the tile unit would otherwise wait
 * for.
 *
 * The file in sections: the path this build runs; what both paths share (the stores, the weights' sources);
 * weight-only codes widened to bf16 tiles; the AMX tile path; the AVX-512 BF16 dot-product path; the loops
 * both run (a function a level: call, thread, group, k block, panel); the entry points. Each path's section
 * defines the same few names (multiply_panel, tiles_configure, tiles_release, path_id,
 * PANEL_READS_NEXT_GROUP), and a kind of codes the build lacks has stubs that are never called (its entry
 * point refuses), so the loops hold no preprocessor branches. */
#include <omp.h>
#include <stdlib.h>

#include "vec.h"
#include "matmul_args.h"

/* ===== The path this build runs ===== */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define AMX_PATH 1
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
/* no AMX: the same layout and loops, each panel's products as AVX-512 BF16 dot products */
#define DOT_PATH 1
#endif
#if defined(AMX_PATH) || defined(DOT_PATH)
#define TILE_LAYOUT 1
#endif
/* Weight-only codes: int8 wherever bf16 conversions are (AVX-512 BF16), int4 with AMX and byte permutes */
#if defined(TILE_LAYOUT) && defined(__AVX512BF16__)
#define INT8_PATH 1
#else
#define INT8_PATH 0
#endif
#if defined(AMX_PATH) && defined(__AVX512VBMI__)
#define INT4_PATH 1
#else
#define INT4_PATH 0
#endif

#ifdef TILE_LAYOUT
/* ===== Shared by both paths: blocking, outputs, the weights' sources ===== */
#define BLOCK_BYTES (1 << 20)
/* Weight bytes read ahead into L2 while a k step's tiles are multiplied, for panels of more than 16 rows
 * (fewer rows leave the stream to the hardware prefetcher, as fast there). */
#define READ_AHEAD 2048
#define SLAB_ROWS  256       /* rows a block of long rows holds */
#define SLAB_BYTES (1 << 19) /* a slab's activations (SLAB_ROWS rows of its chunks) */
/* Outputs of this many bytes or more are streamed past the caches (stream_row): a head's logits are read
 * once, later, and would evict the weights' stream. */
#define STREAM_BYTES (8 << 20)
#define KC 8 /* chunks a k block holds: a group's 16 KiB of them stay in L1 while the block's panels pass */

/* Output modes: float32, bf16, or float32 holding the values rounded to bf16 (the bf16 output widened, in the
 * same pass: a model's logits). */
#define OUT_F32         0
#define OUT_BF16        1
#define OUT_F32_OF_BF16 2

static inline void out_store(void* y, size_t at, vf v, int out) {
    v_dt_store(y, at, out == OUT_F32_OF_BF16 ? v_round_bf16(v) : v, out == OUT_BF16);
}

/* 32 outputs of a row (whole cache lines, 64-byte aligned) written around the caches: an output too large to
 * stay in them (a model's logits) is not first read in line by line. */
static inline void stream_row(void* y, size_t at, vf v0, vf v1, int out) {
    if (out == OUT_BF16) {
        const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(v_round_bf16(v0)), 16);
        const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(v_round_bf16(v1)), 16);
        _mm512_stream_si512((__m512i*)((uint16_t*)y + at),
                            _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                               _mm512_cvtepi32_epi16(hi), 1));
        return;
    }
    if (out == OUT_F32_OF_BF16) {
        v0 = v_round_bf16(v0);
        v1 = v_round_bf16(v1);
    }
    _mm512_stream_ps((float*)y + at, v0);
    _mm512_stream_ps((float*)y + at + 16, v1);
}

/* Rows ra..rb-1 of a panel's finished sums (buf: [32][32] float32) plus bias, stored in rows m0 + ra.. and
 * columns n0.. of y (streamed where `stream`: whole rows of 32 then start on cache lines). */
static void store_panel(const float* buf, int ra, int rb, int m0, int n0, int N, const void* bias,
                        int bias_bf16, const float* scales, void* y, int out, int stream) {
    const int nc = N - n0 < 32 ? N - n0 : 32;
    vf b0 = v_zero(), b1 = v_zero(), s0 = v_set1(1.f), s1 = s0;
    if (bias && nc == 32) {
        b0 = v_dt_load(bias, (size_t)n0, bias_bf16);
        b1 = v_dt_load(bias, (size_t)n0 + 16, bias_bf16);
    }
    if (scales && nc == 32) {
        s0 = v_load(scales + n0);
        s1 = v_load(scales + n0 + 16);
    }
    for (int r = ra; r < rb; r++) {
        const float* s = buf + r * 32;
        const size_t at = (size_t)(m0 + r) * N + n0;
        const vf v0 = scales ? v_mul(v_load(s), s0) : v_load(s);
        const vf v1 = scales ? v_mul(v_load(s + 16), s1) : v_load(s + 16);
        if (nc == 32 && stream) {
            stream_row(y, at, v_add(v0, b0), v_add(v1, b1), out);
            continue;
        }
        if (nc == 32) {
            out_store(y, at, v_add(v0, b0), out);
            out_store(y, at + 16, v_add(v1, b1), out);
            continue;
        }
        for (int j = 0; j < nc; j++) {
            const float v = (scales ? s[j] * scales[n0 + j] : s[j]) +
                            (bias ? dt_load(bias, (size_t)n0 + j, bias_bf16) : 0.f);
            dt_store(y, at + j, out == OUT_F32_OF_BF16 ? dt_round(v, 1) : v, out == OUT_BF16);
        }
    }
}

/* The same for a gate/up projection held in pairs (see sidecar_amx_bf16_gate_up): the group's first half is
 * gate outputs 16 g.., its second the matching up outputs I + 16 g..; stored in those columns of y [M, 2 I],
 * or with silu, out[m, 16 g + j] = bf16(bf16(silu(gate)) * up) from the bf16-rounded gate and up, as
 * norm_act's silu_mul computes it from their stored values (y [M, I] bf16). */
static void store_pairs(const float* buf, int ra, int rb, int m0, int g, int I, const void* bias,
                        int bias_bf16, void* y, int out, int silu) {
    const size_t c0 = (size_t)16 * g;
    const vf bg = bias ? v_dt_load(bias, c0, bias_bf16) : v_zero();
    const vf bu = bias ? v_dt_load(bias, (size_t)I + c0, bias_bf16) : v_zero();
    for (int r = ra; r < rb; r++) {
        const vf gv = v_add(v_load(buf + r * 32), bg), uv = v_add(v_load(buf + r * 32 + 16), bu);
        if (silu) {
            const vf act = v_round_bf16(vsilu(v_round_bf16(gv)));
            v_store_bf16((uint16_t*)y + (size_t)(m0 + r) * I + c0, v_mul(act, v_round_bf16(uv)));
        } else {
            out_store(y, (size_t)(m0 + r) * 2 * I + c0, gv, out);
            out_store(y, (size_t)(m0 + r) * 2 * I + I + c0, uv, out);
        }
    }
}

/* Where a product's weights come from: the packed bf16 layout (wp), or codes widened a k block at a time --
 * int8 [N, K] with per-row scales (w8), or int4 in torch's packed CPU layout (w4: blocks of bn rows, split or
 * interleaved nibbles) with bf16 (scale, zero) pairs sz [K / gs][N][2] per group of gs values (a multiple of
 * 32). */
typedef struct {
    const uint16_t* wp;
    const int8_t* w8;
    const float* scales;
    const uint8_t* w4;
    const uint16_t* sz;
    int gs, bn, split;
} weights;

/* Where a product's outputs go (see store_panel, store_pairs). */
typedef struct {
    void* y;
    const void* bias;
    const float* scales; /* int8 codes' per-row scales (NULL for bf16 weights): sum * scale, then the bias */
    int N, bias_bf16, out, pairs, silu, stream;
} outputs;

/* A finished panel whose outputs are being stored (rows done.. of mr; mr 0: none): its stores and their
 * arithmetic (bias, rounding, silu) run between the next panel's tile products, which the AMX unit computes
 * meanwhile, where one after the other they left it idle. */
typedef struct {
    const float* buf;
    int mr, m0, g, done;
} pending;

static inline void store_rows(const outputs* o, pending* p, int upto) {
    upto = upto < p->mr ? upto : p->mr;
    if (p->done >= upto) return;
    if (o->pairs)
        store_pairs(p->buf, p->done, upto, p->m0, p->g, o->pairs, o->bias, o->bias_bf16, o->y, o->out,
                    o->silu);
    else
        store_panel(p->buf, p->done, upto, p->m0, 32 * p->g, o->N, o->bias, o->bias_bf16, o->scales, o->y,
                    o->out, o->stream);
    p->done = upto;
}

/* ===== Weight-only codes widened to bf16 tiles ===== */
#if INT8_PATH
/* r[0..15], 16 rows of 16 32-bit elements, transposed in place. */
static inline void transpose16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Chunks k0..k1 of group g of int8 codes w8 [N, K] (rows past N zero) as bf16 in the layout the tile products
 * read (see the top), at wb + c * 1024: a code is exactly a bf16 value, so the products are those of the
 * codes. Each weight row's 32 values of a chunk are 16 pairs; a tile is the 16 x 16 transpose of its rows'
 * pairs. The next k block's codes (chunks k1..k2) are read toward L2 as it goes. */
static __attribute__((noinline)) void widen_codes(const int8_t* w8, int N, int K, int g, int k0, int k1,
                                                  int k2, uint16_t* wb) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 16; j++) {
            const int n = 32 * g + 16 * h + j;
            if (n < N)
                for (int c = k1; c < k2; c += 2)
                    _mm_prefetch((const char*)(w8 + (size_t)n * K + 32 * c), _MM_HINT_T1);
        }
    for (int c = k0; c < k1; c++)
        for (int h = 0; h < 2; h++) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const int n = 32 * g + 16 * h + j;
                if (n >= N) {
                    r[j] = _mm512_setzero_si512();
                    continue;
                }
                const int8_t* q = w8 + (size_t)n * K + 32 * c;
                const __m512 lo =
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
                const __m512 hi =
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
                r[j] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            }
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_store_si512(wb + (size_t)c * 1024 + h * 512 + i * 32, r[i]);
        }
}
#else
/* Never called: sidecar_amx_int8_matmul refuses without the path, so no weights hold int8 codes. */
static inline void widen_codes(const int8_t* w8, int N, int K, int g, int k0, int k1, int k2, uint16_t* wb) {
    (void)w8, (void)N, (void)K, (void)g, (void)k0, (void)k1, (void)k2, (void)wb;
}
#endif

#if INT4_PATH
/* The code (0..15) of row n, column k of int4 codes in torch's packed CPU layout (see int4_gemv.c): full
 * blocks of bn rows, bn / 2 bytes a column, split (row j < bn / 2 in the low nibble of byte j, the others in
 * the high nibble of byte j - bn / 2) or interleaved (rows 2 j, 2 j + 1 in byte j); the last N % bn rows an
 * interleaved block. */
static inline int int4_code(const weights* W, int N, int K, int n, int k) {
    const int bn = W->bn, full = N / bn * bn;
    int byte, hi;
    if (n < full) {
        const int j = n % bn;
        const uint8_t* col = W->w4 + (size_t)(n / bn) * (bn / 2) * K + (size_t)k * (bn / 2);
        byte = col[W->split ? j % (bn / 2) : j / 2];
        hi = W->split ? j >= bn / 2 : j & 1;
    } else {
        const int j = n - full;
        byte = W->w4[(size_t)full * K / 2 + (size_t)k * ((N - full) / 2) + j / 2];
        hi = j & 1;
    }
    return hi ? byte >> 4 : byte & 15;
}

/* Chunks k0..k1 of group g of int4 codes as the bf16 values code - 8 (exact) in the tile layout, at wb + c *
 * 1024 (rows past N zero); chunks k1..k2 read toward L2. A group inside a split block of 64 rows (torch's
 * layout with AVX-512) goes by vectors: its 32 rows are the low or the high nibbles of a column's 32 bytes,
 * so the cache line of columns 2 r, 2 r + 1 holds row r of both its tiles (the pairs of those columns for
 * rows 0-15, then 16-31): its nibbles, put in pair order by one byte permutation, are looked up as their bf16
 * values. */
static void widen_int4(const weights* W, int N, int K, int g, int k0, int k1, int k2, uint16_t* wb) {
    const int n0 = 32 * g;
    uint16_t value[32];
    for (int c = 0; c < 32; c++) value[c] = f32_to_bf16((float)((c & 15) - 8));
    if (W->bn == 64 && W->split && n0 + 32 <= N / 64 * 64) {
        const uint8_t* base = W->w4 + (size_t)(n0 / 64) * 32 * K; /* column k: 32 bytes at base + 32 k */
        const __m128i shift = _mm_cvtsi32_si128(n0 % 64 ? 4 : 0);
        const __m512i low = _mm512_set1_epi8(15), table = _mm512_loadu_si512(value);
        uint8_t order[64]; /* byte 2 j + e of the pair order: row j of column 2 r + e */
        for (int i = 0; i < 64; i++) order[i] = (uint8_t)(32 * (i & 1) + i / 2);
        const __m512i pairs = _mm512_loadu_si512(order);
        for (int c = k1; c < k2; c++)
            for (int l = 0; l < 16; l++)
                _mm_prefetch((const char*)(base + (size_t)c * 1024 + 64 * l), _MM_HINT_T1);
        for (int c = k0; c < k1; c++) {
            const uint8_t* line = base + (size_t)c * 1024;
            uint16_t* t = wb + (size_t)c * 1024;
            for (int r = 0; r < 16; r++) {
                const __m512i q =
                        _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(line + 64 * r), shift), low);
                const __m512i p = _mm512_permutexvar_epi8(pairs, q);
                _mm512_store_si512(
                        t + r * 32,
                        _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(p)), table));
                _mm512_store_si512(t + 512 + r * 32,
                                   _mm512_permutexvar_epi16(
                                           _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(p, 1)), table));
            }
        }
        return;
    }
    for (int c = k0; c < k1; c++)
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 16; r++)
                for (int j = 0; j < 16; j++) {
                    const int n = n0 + 16 * h + j;
                    for (int e = 0; e < 2; e++)
                        wb[(size_t)c * 1024 + h * 512 + r * 32 + 2 * j + e] =
                                n < N ? value[int4_code(W, N, K, n, 32 * c + 2 * r + e)] : 0;
                }
}

/* The (scale, zero) pairs of quantization groups q0..q1 for group g's 32 rows as float32: qs[(q - q0) * 64 +
 * i] the scale of row 32 g + i, qs[.. + 32 + i] its zero (rows past N: 0). */
static void group_scales(const uint16_t* sz, int N, int g, int q0, int q1, float* qs) {
    const int valid = N - 32 * g < 32 ? N - 32 * g : 32;
    for (int q = q0; q < q1; q++, qs += 64)
        for (int h = 0; h < 2; h++) {
            const int v = valid - 16 * h;
            const __mmask16 m = v >= 16 ? 0xffff : v <= 0 ? 0 : (__mmask16)((1u << v) - 1);
            const __m512i p = _mm512_maskz_loadu_epi32(m, sz + 2 * ((size_t)q * N + 32 * g + 16 * h));
            _mm512_store_ps(qs + 16 * h, _mm512_castsi512_ps(_mm512_slli_epi32(p, 16)));
            _mm512_store_ps(qs + 32 + 16 * h,
                            _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32((int)0xffff0000u))));
        }
}

/* Rows ra..rb-1 of n (1 or 2) quantization groups' tile sums acc[0], acc[n - 1] ([32][32] each) folded into
 * the panel's sums s in order: s = acc * scale + (xs * zero + s) a group, s taken as 0 before the first group
 * of K (first); qs[0], qs[n - 1]: their scales and zeros (64 floats a group); xs[r * xstride + 0 / 1]: row
 * r's sums of the groups' activations. Two groups in one pass: the sums between them stay in registers (the
 * same operations, the same bits). */
static inline void fold_rows(const float* const* acc, int n, float* s, const float* qs, const float* xs,
                             int xstride, int ra, int rb, int first) {
    const vf s0 = v_load(qs), s1 = v_load(qs + 16), z0 = v_load(qs + 32), z1 = v_load(qs + 48);
    const float* q2 = qs + 64 * (n - 1);
    const vf t0 = v_load(q2), t1 = v_load(q2 + 16), w0 = v_load(q2 + 32), w1 = v_load(q2 + 48);
    for (int r = ra; r < rb; r++) {
        const vf xv = v_set1(xs[(size_t)r * xstride]);
        const vf b0 = first ? v_mul(xv, z0) : v_fma(xv, z0, v_load(s + r * 32));
        const vf b1 = first ? v_mul(xv, z1) : v_fma(xv, z1, v_load(s + r * 32 + 16));
        vf a0 = v_fma(v_load(acc[0] + r * 32), s0, b0), a1 = v_fma(v_load(acc[0] + r * 32 + 16), s1, b1);
        if (n == 2) {
            const vf xw = v_set1(xs[(size_t)r * xstride + 1]);
            a0 = v_fma(v_load(acc[1] + r * 32), t0, v_fma(xw, w0, a0));
            a1 = v_fma(v_load(acc[1] + r * 32 + 16), t1, v_fma(xw, w1, a1));
        }
        v_store(s + r * 32, a0);
        v_store(s + r * 32 + 16, a1);
    }
}

/* fold_rows of rows ra..rb-1 for the fn (1 or 2) groups from fa of a k block (their tile sums in acc's four
 * [32][32] buffers in turn, q0 the block's first group of K); arguments otherwise as multiply_panel_q's. */
static inline void fold_groups(const float* acc, int fa, int fn, float* s, const float* qs, const float* xs,
                               int xstride, int q0, int ra, int rb) {
    const float* const pair[2] = {acc + (fa & 3) * 1024, acc + ((fa + 1) & 3) * 1024};
    fold_rows(pair, fn, s, qs + fa * 64, xs + q0 + fa, xstride, ra, rb, q0 + fa == 0);
}

/* multiply_panel for int4 codes (wg: the k block widened), quantization groups of cq chunks: each group's
 * tile products start from zero and go to one of four [32][32] buffers of acc in turn; groups are folded into
 * s two at a time (fold_rows), between the next two groups' tile products, the last pair (or single group)
 * after them. qs: the k block's scales and zeros (group_scales); xs: the panel's first row's sums of each
 * quantization group's activations (xstride a row), from group 0. */
static inline void multiply_panel_q(const uint16_t* xa, int K, const uint16_t* wg, int k0, int k1, int mr,
                                    int r1, float* s, const float* qs, const float* xs, int xstride, int cq,
                                    float* acc, const outputs* o, pending* p) {
    /* pending rows stored a k step, all of them during the first group's steps: the pending panel may be this
     * one's sums of the previous group of 32 outputs (a batch of one panel), which the folds then write */
    const int rows = (p->mr - p->done + cq - 1) / cq, nq = (k1 - k0) / cq, q0 = k0 / cq;
    int fa = 0, fn = 0, fdone = mr,
        per = mr; /* the groups being folded: fa.., fn of them; rows done, a step */
    for (int i = 0; i < nq; i++) {
        const int c0 = k0 + i * cq;
        _tile_zero(0);
        _tile_zero(1);
        if (r1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int c = c0; c < c0 + cq; c++) {
            const uint16_t* b = wg + (size_t)c * 1024;
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 512, 64);
            _tile_loadd(4, xa + c * 32, K * 2);
            if (r1) _tile_loadd(5, xa + (size_t)16 * K + c * 32, K * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (r1) {
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            if (fdone < mr) {
                const int e = fdone + per < mr ? fdone + per : mr;
                fold_groups(acc, fa, fn, s, qs, xs, xstride, q0, fdone, e);
                fdone = e;
            }
            if (rows && p->done < p->mr) store_rows(o, p, p->done + rows);
        }
        float* a = acc + (i & 3) * 1024;
        _tile_stored(0, a, 128);
        _tile_stored(1, a + 16, 128);
        if (r1) {
            _tile_stored(2, a + 16 * 32, 128);
            _tile_stored(3, a + 16 * 32 + 16, 128);
        }
        if (i % 2 == 1 || i == nq - 1) { /* a pair (or the last group) to fold while the next ones multiply */
            if (fdone < mr) fold_groups(acc, fa, fn, s, qs, xs, xstride, q0, fdone, mr);
            fn = i % 2 == 1 ? 2 : 1;
            fa = i + 1 - fn;
            fdone = 0;
            const int steps = cq * (nq - 1 - i < 2 ? nq - 1 - i : 2); /* the next groups' k steps */
            per = steps ? (mr + steps - 1) / steps : mr;
        }
    }
    if (fdone < mr) fold_groups(acc, fa, fn, s, qs, xs, xstride, q0, fdone, mr);
}
#else
/* Never called: sidecar_amx_int4_matmul refuses without the path, so no weights hold int4 codes. */
static inline void widen_int4(const weights* W, int N, int K, int g, int k0, int k1, int k2, uint16_t* wb) {
    (void)W, (void)N, (void)K, (void)g, (void)k0, (void)k1, (void)k2, (void)wb;
}
static inline void group_scales(const uint16_t* sz, int N, int g, int q0, int q1, float* qs) {
    (void)sz, (void)N, (void)g, (void)q0, (void)q1, (void)qs;
}
static inline void multiply_panel_q(const uint16_t* xa, int K, const uint16_t* wg, int k0, int k1, int mr,
                                    int r1, float* s, const float* qs, const float* xs, int xstride, int cq,
                                    float* acc, const outputs* o, pending* p) {
    (void)xa, (void)K, (void)wg, (void)k0, (void)k1, (void)mr, (void)r1, (void)s, (void)qs, (void)xs,
            (void)xstride, (void)cq, (void)acc, (void)o, (void)p;
}
#endif
#endif /* TILE_LAYOUT */

/* ===== The AMX tile path ===== */
#ifdef AMX_PATH
/* Tiles: accumulators 0 (rows 0-15 x outputs 0-15), 1 (rows 0-15 x outputs 16-31), 2 and 3 (rows 16-31);
 * activation tiles 4 (rows 0-15) and 5 (rows 16-31); weight tiles 6 and 7. r0 / r1: the panel's rows in each
 * half. */
static void configure(int r0, int r1) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64;
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)r0;
    c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)(r1 ? r1 : 1);
    c.rows[6] = c.rows[7] = 16;
    load_tile_config(&c);
}

static inline void tiles_configure(int r0, int r1) {
    configure(r0, r1);
}

static inline void tiles_release(void) {
    _tile_release();
}

/* Which path runs (sidecar_amx_supported): 1, where the kernel granted this process the tile state. */
static int path_id(void) {
    return amx_granted();
}

/* The tile unit multiplies while the weights stream in: the one read-ahead (`ahead`) keeps pace. */
#define PANEL_READS_NEXT_GROUP 0

/* The tile products of one panel (activation rows xa.., 16 + r1 of them, or fewer in tile 0 alone when r1 is
 * 0) with chunks k0..k1 of a group's weights wg, added to the panel's sums s ([32][32] float32; zero before
 * chunk 0). A panel of more than 16 rows reads `lines` cache lines from `ahead` on into L2 as it goes, spread
 * over its k steps. The pending panel's outputs are stored as the k steps go, every row of them by the last.
 */
static inline void multiply_panel(const uint16_t* xa, int K, const uint16_t* wg, int k0, int k1, int mr,
                                  int r1, float* s, const char* ahead, int lines, const char* after,
                                  int after_lines, const outputs* o, pending* p) {
    (void)mr, (void)after, (void)after_lines; /* the tile configuration holds the panel's rows */
    const int rows = (p->mr - p->done + k1 - k0 - 1) / (k1 - k0); /* pending rows stored a k step */
    if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, s, 128);
        _tile_loadd(1, s + 16, 128);
        if (r1) {
            _tile_loadd(2, s + 16 * 32, 128);
            _tile_loadd(3, s + 16 * 32 + 16, 128);
        }
    }
    if (r1) {
        const int per = (lines + k1 - k0 - 1) / (k1 - k0);
        for (int c = k0; c < k1; c++, ahead += 64 * per) {
            const uint16_t* b = wg + (size_t)c * 1024;
            for (int l = 0; l < per; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 512, 64);
            _tile_loadd(4, xa + c * 32, K * 2);
            _tile_loadd(5, xa + (size_t)16 * K + c * 32, K * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            if (rows) store_rows(o, p, p->done + rows);
        }
    } else {
        for (int c = k0; c < k1; c++) {
            const uint16_t* b = wg + (size_t)c * 1024;
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 512, 64);
            _tile_loadd(4, xa + c * 32, K * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (rows) store_rows(o, p, p->done + rows);
        }
    }
    _tile_stored(0, s, 128);
    _tile_stored(1, s + 16, 128);
    if (r1) {
        _tile_stored(2, s + 16 * 32, 128);
        _tile_stored(3, s + 16 * 32 + 16, 128);
    }
}
#endif /* AMX_PATH */

/* ===== The AVX-512 BF16 dot-product path (no AMX) ===== */
#ifdef DOT_PATH
/* Without AMX (AVX-512 BF16: AMD Zen 4 and 5, Intel Cooper Lake) the panel's products go as dot products over
 * the same layout: a tile row of the weights (the pair of values 2 r, 2 r + 1 of a chunk for 16 outputs) is
 * one vector, and vdpbf16ps adds to each output's float32 sum the two products of that pair with the pair of
 * an activation row, broadcast. A register tile holds up to DOT_ROWS rows x the group's 32 outputs (24
 * accumulators, 2 weight vectors, the activations broadcast from memory: vec.h's dot_rows); every output is
 * one float32 sum over the pairs in order, whatever the batch, its panels and k blocks (the sums wait in s
 * between k blocks, exactly). */

/* Register tiles: nothing to configure or release. */
static inline void tiles_configure(int r0, int r1) {
    (void)r0, (void)r1;
}

static inline void tiles_release(void) {}

/* Which path runs (sidecar_amx_supported): 2. */
static int path_id(void) {
    return 2;
}

/* The register tiles after a panel's first read the next group's weights ahead too (multiply_panel below). */
#define PANEL_READS_NEXT_GROUP 1

/* The AMX multiply_panel's contract over dot products: the panel's mr rows in register tiles of nearly equal
 * height (32 rows: 11, 11, 10), the first reading the `lines` ahead -- at every panel height: here the
 * products of a few rows take about as long as their weights' stream, and without the read-ahead the two take
 * turns. The other register tiles, which multiply weights already in L2, read `after_lines` lines from
 * `after` on between them (the next group's, in one pass over the weights), so that the memory works while
 * they do. The pending panel's outputs are stored first (the vector units do both; nothing runs beside
 * them). */
static inline void multiply_panel(const uint16_t* xa, int K, const uint16_t* wg, int k0, int k1, int mr,
                                  int r1, float* s, const char* ahead, int lines, const char* after,
                                  int after_lines, const outputs* o, pending* p) {
    (void)r1;
    store_rows(o, p, p->mr);
    const int parts = (mr + DOT_ROWS - 1) / DOT_ROWS, per = (lines + k1 - k0 - 1) / (k1 - k0);
    const int later = parts > 1 && after ? (after_lines + parts - 2) / (parts - 1) : 0;
    for (int q = 0, i0 = 0; q < parts; q++) {
        const int h = mr / parts + (q < mr % parts);
        const uint16_t* xr = xa + (size_t)i0 * K + (size_t)k0 * 32;
        if (q == 0)
            DOT_ROWS_OF[h](xr, K, wg + (size_t)k0 * 1024, 1024, k1 - k0, s + i0 * 32, 32, k0 != 0, ahead,
                           per);
        else
            DOT_ROWS_OF[h](xr, K, wg + (size_t)k0 * 1024, 1024, k1 - k0, s + i0 * 32, 32, k0 != 0,
                           later ? after + (size_t)64 * later * (q - 1) : NULL,
                           (later + k1 - k0 - 1) / (k1 - k0));
        i0 += h;
    }
}
#endif /* DOT_PATH */

/* ===== The loops both paths run ===== */
#ifdef TILE_LAYOUT
/* How a call's rows, chunks and groups are blocked (see the top), for every thread. */
typedef struct {
    int M, N, K;
    int KB, G;      /* chunks a row, groups of 32 outputs */
    size_t group;   /* bf16 values a group's weights hold */
    int mc, kc, ks; /* rows a block, chunks a k block, chunks a slab */
    int codes;      /* int8 or int4 codes, widened a k block at a time */
    int cq, Gq;     /* int4: chunks a quantization group, quantization groups a row */
} plan;

static plan make_plan(const weights* W, int M, int N, int K) {
    plan P = {M, N, K,      K / 32,         (N + 31) / 32,          (size_t)(K / 32) * 1024,
              0, 0, K / 32, W->w8 || W->w4, W->w4 ? W->gs / 32 : 0, W->w4 ? K / W->gs : 0};
    int mc = BLOCK_BYTES / (2 * K) / 32 * 32;
    mc = mc < 32 ? 32 : mc > 512 ? 512 : mc;
    /* k blocks only where several panels share them: at a few panels the extra passes over the sums slow the
     * weight stream */
    P.kc = M > 64 ? KC : P.KB;
    if (M > 64 && mc < SLAB_ROWS) { /* long rows: blocks of SLAB_ROWS in slabs of chunks, not short blocks */
        mc = SLAB_ROWS;
        P.ks = SLAB_BYTES / (64 * mc) / P.kc * P.kc;
    }
    P.mc = mc > M ? (M + 31) / 32 * 32 : mc;
    return P;
}

/* Whether the outputs go around the caches (stream_row): STREAM_BYTES or more, in whole aligned lines. */
static int streams(int M, int N, int out, int pairs, const void* y) {
    const size_t row_bytes = (size_t)N * (out == OUT_BF16 ? 2 : 4);
    return !pairs && (size_t)M * row_bytes >= STREAM_BYTES && row_bytes % 64 == 0 && !((uintptr_t)y % 64);
}

/* int4: xsum [M][Gq], each row's sum of each quantization group's activations; the rows shared by the threads
 * of the calling parallel region. */
static inline void activation_sums(const uint16_t* x, const weights* W, const plan* P, float* xsum) {
#pragma omp for schedule(static)
    for (int m = 0; m < P->M; m++)
        for (int q = 0; q < P->Gq; q++) {
            vf v = v_zero();
            for (int k = q * W->gs; k < (q + 1) * W->gs; k += VL)
                v = v_add(v, v_load_bf16(x + (size_t)m * P->K + k));
            xsum[(size_t)m * P->Gq + q] = v_sum(v);
        }
}

/* One thread's share of a product: its groups g0..g1, its buffers, the panel whose outputs are pending, and
 * the panel rows the tiles are configured for (r0 -1: none yet). */
typedef struct {
    const uint16_t* x;
    const weights* W;
    const plan* P;
    const outputs* o;
    const float* xsum;
    float* sums; /* [32][32] sums a panel between k blocks; in slabs, every panel of the block in every group
                  */
    uint16_t* wide; /* codes: a group's k block widened */
    float* qs; /* int4: the k block's scales and zeros (64 floats a quantization group), four group sums */
    int g0, g1;
    pending p;
    int r0, r1;
} worker;

/* The k block being multiplied: group g's chunks k0..k1 (of slab s0..s1) over rows mb..me of a row block; wg
 * the group's bf16 tiles, gs its sums, next the weights multiplied after these (read ahead; NULL for codes).
 */
typedef struct {
    int g, mb, me, s0, s1, k0, k1;
    const uint16_t* wg;
    float* gs;
    const uint16_t* next;
} kblock;

/* The thread's buffers; 1 when one cannot be allocated (sums then NULL: the thread multiplies nothing). */
static int thread_buffers(worker* w) {
    const plan* P = w->P;
    const int any = w->g0 < w->g1;
    const size_t nsums = (size_t)32 * P->mc * (P->ks < P->KB ? w->g1 - w->g0 : 1);
    w->sums = any ? (float*)aligned_alloc(64, sizeof(float) * nsums) : NULL;
    w->wide = P->codes && any ? (uint16_t*)aligned_alloc(64, P->group * sizeof(uint16_t)) : NULL;
    w->qs = w->W->w4 && any ? (float*)aligned_alloc(64, sizeof(float) * (64 * (size_t)P->Gq + 4096)) : NULL;
    if (any && (!w->sums || (P->codes && !w->wide) || (w->W->w4 && !w->qs))) {
        free(w->sums);
        w->sums = NULL;
        return 1;
    }
    return 0;
}

/* The k block's codes widened to bf16 tiles in the thread's buffer (chunks k1..k2, the next block's, read
 * toward L2 meanwhile), int4's scales and zeros beside them; nothing for the packed layout. */
static inline void widen_block(worker* w, const kblock* b, int k2) {
    const weights* W = w->W;
    const plan* P = w->P;
    if (W->w8) widen_codes(W->w8, P->N, P->K, b->g, b->k0, b->k1, k2, w->wide);
    if (W->w4) {
        widen_int4(W, P->N, P->K, b->g, b->k0, b->k1, k2, w->wide);
        group_scales(W->sz, P->N, b->g, b->k0 / P->cq, b->k1 / P->cq, w->qs);
    }
}

/* Where panel m0 reads ahead into L2 as it multiplies (*lines cache lines on): codes were read as they were
 * widened; in one pass over the weights, READ_AHEAD bytes ahead a chunk; in k blocks, the block's panels
 * share the next k block's read. */
static inline const char* read_ahead(const plan* P, const kblock* b, int m0, int* lines) {
    *lines = 0;
    if (P->codes) return NULL;
    if (P->kc == P->KB) {
        *lines = 32 * (b->k1 - b->k0);
        return (const char*)(b->wg + (size_t)b->k0 * 1024) + READ_AHEAD;
    }
    const int panels = (b->me - b->mb + 31) / 32, share = (P->kc * 32 + panels - 1) / panels;
    *lines = share;
    return (const char*)b->next + (size_t)64 * share * ((m0 - b->mb) / 32);
}

/* The dot products' second read-ahead (PANEL_READS_NEXT_GROUP): in one pass over the weights, the next
 * group's, shared by the block's panels. */
static inline const char* read_after(const worker* w, const kblock* b, int m0, int* lines) {
    const plan* P = w->P;
    *lines = 0;
    if (!PANEL_READS_NEXT_GROUP || P->codes || P->kc != P->KB || b->g + 1 >= w->g1) return NULL;
    const int panels = (b->me - b->mb + 31) / 32, share = (32 * P->KB + panels - 1) / panels;
    *lines = share;
    return (const char*)(b->wg + P->group) + (size_t)64 * share * ((m0 - b->mb) / 32);
}

/* Panel m0 (up to 32 rows) of the k block: its products added to its sums; after the last k block it is the
 * pending panel, its outputs stored while the next panel multiplies. */
static inline __attribute__((always_inline)) void block_panel(worker* w, const kblock* b, int m0) {
    const plan* P = w->P;
    const int mr = b->me - m0 < 32 ? b->me - m0 : 32, r0 = mr < 16 ? mr : 16, r1 = mr - r0;
    if (r0 != w->r0 || r1 != w->r1) {
        tiles_configure(r0, r1);
        w->r0 = r0;
        w->r1 = r1;
    }
    float* s = b->gs + (size_t)(m0 - b->mb) * 32;
    const uint16_t* xa = w->x + (size_t)m0 * P->K;
    int lines, after_lines;
    const char* ahead = read_ahead(P, b, m0, &lines);
    const char* after = read_after(w, b, m0, &after_lines);
    if (w->W->w4)
        multiply_panel_q(xa, P->K, b->wg, b->k0, b->k1, mr, r1, s, w->qs, w->xsum + (size_t)m0 * P->Gq, P->Gq,
                         P->cq, w->qs + 64 * (size_t)P->Gq, w->o, &w->p);
    else
        multiply_panel(xa, P->K, b->wg, b->k0, b->k1, mr, r1, s, ahead, lines, after, after_lines, w->o,
                       &w->p);
    if (b->k1 < P->KB) return;
    w->p = (pending){s, mr, m0, b->g, 0};
}

/* Group b->g over slab s0..s1 of the rows mb..me: its k blocks in order, each over every panel. */
static inline __attribute__((always_inline)) void block_group(worker* w, kblock* b) {
    const plan* P = w->P;
    const int g = b->g, s1 = b->s1;
    b->wg = P->codes ? w->wide : w->W->wp + (size_t)g * P->group;
    b->gs = w->sums + (P->ks < P->KB ? (size_t)(g - w->g0) * 32 * P->mc : 0);
    for (b->k0 = b->s0; b->k0 < s1; b->k0 += P->kc) {
        b->k1 = b->k0 + P->kc < s1 ? b->k0 + P->kc : s1;
        /* the k block the thread multiplies next: this group's, the next group's in this slab, or the first
         * group's in the next slab (or row block); k2 the next k block's end */
        const int k2 = b->k1 < s1 ? (b->k1 + P->kc < s1 ? b->k1 + P->kc : s1) : b->k1;
        widen_block(w, b, k2);
        b->next = P->codes     ? NULL
                  : b->k1 < s1 ? b->wg + (size_t)b->k1 * 1024
                  : g + 1 < w->g1
                          ? b->wg + P->group + (size_t)b->s0 * 1024
                          : w->W->wp + (size_t)w->g0 * P->group + (size_t)(s1 < P->KB ? s1 : 0) * 1024;
        for (int m0 = b->mb; m0 < b->me; m0 += 32) block_panel(w, b, m0);
    }
}

/* The thread's groups over every row block and slab, then the last pending panel's outputs. */
static inline __attribute__((always_inline)) void thread_products(worker* w) {
    const plan* P = w->P;
    kblock b;
    for (b.mb = 0; b.mb < P->M && w->sums; b.mb += P->mc) {
        b.me = b.mb + P->mc < P->M ? b.mb + P->mc : P->M;
        for (b.s0 = 0; b.s0 < P->KB; b.s0 += P->ks) {
            b.s1 = b.s0 + P->ks < P->KB ? b.s0 + P->ks : P->KB;
            for (b.g = w->g0; b.g < w->g1; b.g++) block_group(w, &b);
        }
    }
    store_rows(w->o, &w->p, 32);
    if (w->r0 >= 0) tiles_release();
}

/* The product (see sidecar_amx_bf16_matmul); pairs: 0, or I for a gate/up layout (N = 2 I) stored as
 * store_pairs stores it (silu: its epilogue). Codes (W's w8 or w4) instead of the packed layout: each thread
 * widens a group's k block to bf16 tiles (widen_codes, widen_int4) for every panel of the block to multiply.
 * Each thread takes a contiguous run of groups. */
static int matmul(const uint16_t* x, const weights* W, const void* bias, void* y, int M, int N, int K,
                  int nthreads, int bias_bf16, int out, int pairs, int silu) {
    if (K % 32 || M < 0 || N < 0 || out < OUT_F32 || out > OUT_F32_OF_BF16 || !path_id()) return 1;
    if (M == 0 || N == 0) return 0;
    const plan P = make_plan(W, M, N, K);
    /* int4: each row's sum of each quantization group's activations (the threads' first work, below) */
    float* xsum = W->w4 ? (float*)malloc(sizeof(float) * (size_t)M * P.Gq) : NULL;
    if (W->w4 && !xsum) return 2;
    const outputs o = {y, bias, W->scales, N, bias_bf16, out, pairs, silu, streams(M, N, out, pairs, y)};
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        if (xsum) activation_sums(x, W, &P, xsum);
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        worker w = {x,
                    W,
                    &P,
                    &o,
                    xsum,
                    NULL,
                    NULL,
                    NULL,
                    (int)((int64_t)P.G * t / nt),
                    (int)((int64_t)P.G * (t + 1) / nt),
                    {NULL, 0, 0, 0, 0},
                    -1,
                    -1};
        if (thread_buffers(&w)) {
#pragma omp atomic write
            failed = 1;
        }
        thread_products(&w);
        if (o.stream) _mm_sfence(); /* the streamed lines reach memory before the caller reads them */
        free(w.sums);
        free(w.wide);
        free(w.qs);
    }
    free(xsum);
    return failed ? 2 : 0;
}

/* ===== Entry points ===== */
/* Which path this build runs: 1 AMX tile products (the kernel granted this process the tile state, asked
 * once), 2 AVX-512 BF16 dot products over the same layout (a CPU without AMX), 0 neither. */
int sidecar_amx_supported(void) {
    return path_id();
}

/* x: [M, K] bf16 rows; wp: the weight in the layout above; bias: NULL, float32 or bf16 (bias_bf16) [N]; y:
 * [M, N] as `out` says: 0 float32, 1 bf16, 2 float32 holding the values rounded to bf16. K a multiple of 32.
 * Returns 0, 1 without either path or for arguments it does not take (nothing written), 2 out of memory for
 * the working sums. */
int sidecar_amx_bf16_matmul(const sidecar_matmul_args* a) {
    const weights W = {a->w, NULL, NULL, NULL, NULL, 0, 0, 0};
    return matmul(a->x, &W, a->bias, a->y, a->M, a->N, a->K, a->nthreads, a->bias_bf16, a->out, 0, 0);
}

/* A fused gate/up projection (gate rows 0..I-1, up rows I..2I-1 of the weight; I a multiple of 16) held with
 * its gate and up rows in pairs: group g holds gate rows 16 g.. and up rows 16 g..
 * (``amx_gemm.pack(pairs=I)``). y: [M, 2 I] in the projection's own column order (silu 0), or [M, I] bf16 =
 * silu(gate) * up as norm_act's silu_mul gives it from the bf16 projection (silu 1: out must be 1, bf16) --
 * one pass, no 2 I-wide output. Returns as above. */
int sidecar_amx_bf16_gate_up(const sidecar_matmul_args* a) {
    const int I = a->N;
    if (I <= 0 || I % 16 || (a->silu && a->out != OUT_BF16)) return 1;
    const weights W = {a->w, NULL, NULL, NULL, NULL, 0, 0, 0};
    return matmul(a->x, &W, a->bias, a->y, a->M, 2 * I, a->K, a->nthreads, a->bias_bf16, a->out, I, a->silu);
}

/* Weight-only int8 on the tile path: y[m, n] = scales[n] * sum_k x[m, k] w8[n, k] (+ bias[n]), x bf16 [M, K],
 * w8 int8 codes [N, K] row-major (int8_gemv's layout, read in place), scales float32 [N]; the sums float32
 * (exact products of bf16 and a code), times the row's scale, then the bias, rounded once as `out` says. For
 * prefill-sized batches: each group's k block is widened once for all of a block's rows. Returns as above. */
int sidecar_amx_int8_matmul(const sidecar_matmul_args* a) {
    if (!INT8_PATH || !a->w || !a->scales) return 1;
    const weights W = {NULL, a->w, a->scales, NULL, NULL, 0, 0, 0};
    return matmul(a->x, &W, a->bias, a->y, a->M, a->N, a->K, a->nthreads, a->bias_bf16, a->out, 0, 0);
}

/* Weight-only int4 on the tile path (AMX only): y[m, n] = sum_q (scale[q, n] * sum_{k in q} x[m, k] (code[n,
 * k] - 8)
 * + zero[q, n] * sum_{k in q} x[m, k]) (+ bias[n]) over the quantization groups q of gs values (a multiple of
 * 32), x bf16 [M, K], w4 the codes of N rows (a multiple of 16) in torch's packed CPU layout (blocks of bn =
 * 32 or 64 rows, split or interleaved nibbles: int4_gemv.c), read in place, sz bf16 [K / gs][N][2] (scale,
 * zero). The products of bf16 and a code are exact, a group's float32 sums as the tile product forms them,
 * the groups folded in order: a row's result does not depend on the other rows of its batch. Returns as
 * above. */
int sidecar_amx_int4_matmul(const sidecar_matmul_args* a) {
    const int gs = a->group_size, bn = a->block_n;
    if (!INT4_PATH || !a->w || !a->scales || gs <= 0 || gs % 32 || gs > 32 * KC || a->K % gs || a->N % 16 ||
        (bn != 32 && bn != 64) || sidecar_amx_supported() != 1)
        return 1;
    const weights W = {NULL, NULL, NULL, a->w, a->scales, gs, bn, a->split != 0};
    return matmul(a->x, &W, a->bias, a->y, a->M, a->N, a->K, a->nthreads, a->bias_bf16, a->out, 0, 0);
}
#else
/* A build without either path: every product refuses (1), and the caller keeps its torch path. */
int sidecar_amx_supported(void) {
    return 0;
}

int sidecar_amx_bf16_matmul(const sidecar_matmul_args* a) {
    (void)a;
    return 1;
}

int sidecar_amx_bf16_gate_up(const sidecar_matmul_args* a) {
    (void)a;
    return 1;
}

int sidecar_amx_int8_matmul(const sidecar_matmul_args* a) {
    (void)a;
    return 1;
}

int sidecar_amx_int4_matmul(const sidecar_matmul_args* a) {
    (void)a;
    return 1;
}
#endif
