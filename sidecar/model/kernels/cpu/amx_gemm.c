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
 * for. */
#include <omp.h>
#include <stdlib.h>

#include "vec.h"
#include "matmul_args.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define AMX_PATH 1
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
/* no AMX: the same layout and loops, each panel's products as AVX-512 BF16 dot products */
#define DOT_PATH 1
#endif

#if defined(AMX_PATH) || defined(DOT_PATH)
#define TILE_LAYOUT 1
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
#endif

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
#endif

#ifdef TILE_LAYOUT
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

/* Where a product's outputs go (see store_panel, store_pairs). */
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

#if defined(__AVX512BF16__)
#define INT8_PATH 1
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
static void widen_codes(const int8_t* w8, int N, int K, int g, int k0, int k1, int k2, uint16_t* wb) {
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
#endif

#if defined(AMX_PATH) && defined(__AVX512VBMI__)
#define INT4_PATH 1
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
#endif

#ifdef AMX_PATH
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
#endif

#ifdef DOT_PATH
/* Without AMX (AVX-512 BF16: AMD Zen 4 and 5, Intel Cooper Lake) the panel's products go as dot products over
 * the same layout: a tile row of the weights (the pair of values 2 r, 2 r + 1 of a chunk for 16 outputs) is
 * one vector, and vdpbf16ps adds to each output's float32 sum the two products of that pair with the pair of
 * an activation row, broadcast. A register tile holds up to DOT_ROWS rows x the group's 32 outputs (24
 * accumulators, 2 weight vectors, the activations broadcast from memory: vec.h's dot_rows); every output is
 * one float32 sum over the pairs in order, whatever the batch, its panels and k blocks (the sums wait in s
 * between k blocks, exactly). */

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
#endif
#endif /* TILE_LAYOUT */

/* Which path this build runs: 1 AMX tile products (the kernel granted this process the tile state, asked
 * once), 2 AVX-512 BF16 dot products over the same layout (a CPU without AMX), 0 neither. */
int sidecar_amx_supported(void) {
#if defined(AMX_PATH)
    return amx_granted();
#elif defined(DOT_PATH)
    return 2;
#else
    return 0;
#endif
}

#ifdef TILE_LAYOUT
/* The product (see sidecar_amx_bf16_matmul); pairs: 0, or I for a gate/up layout (N = 2 I) stored as
 * store_pairs stores it (silu: its epilogue). Codes (W's w8 or w4) instead of the packed layout: each thread
 * widens a group's k block to bf16 tiles (widen_codes, widen_int4) for every panel of the block to multiply.
 */
static int matmul(const uint16_t* x, const weights* W, const void* bias, void* y, int M, int N, int K,
                  int nthreads, int bias_bf16, int out, int pairs, int silu) {
    if (K % 32 || M < 0 || N < 0 || out < OUT_F32 || out > OUT_F32_OF_BF16 || !sidecar_amx_supported())
        return 1;
    if (M == 0 || N == 0) return 0;
    const int KB = K / 32, G = (N + 31) / 32;
    const uint16_t* wp = W->wp;
    const int codes = W->w8 || W->w4;
    const int cq = W->w4 ? W->gs / 32 : 0,
              Gq = W->w4 ? K / W->gs : 0; /* chunks a quantization group, groups a row */
    (void)cq;
    /* int4: [M][Gq] each row's sum of each quantization group's activations (the threads' first work, below)
     */
    float* xsum = W->w4 ? (float*)malloc(sizeof(float) * (size_t)M * Gq) : NULL;
    if (W->w4 && !xsum) return 2;
    const size_t group = (size_t)KB * 1024; /* bf16 values per group */
    int mc = BLOCK_BYTES / (2 * K) / 32 * 32;
    mc = mc < 32 ? 32 : mc > 512 ? 512 : mc;
    const int kc = M > 64 ? KC : KB; /* k blocks only where several panels share them: at a few panels the
                                      * extra passes over the sums slow the weight stream */
    int ks = KB;                     /* chunks a slab holds */
    if (M > 64 && mc < SLAB_ROWS) {  /* long rows: blocks of SLAB_ROWS in slabs of chunks, not short blocks */
        mc = SLAB_ROWS;
        ks = SLAB_BYTES / (64 * mc) / kc * kc;
    }
    if (mc > M) mc = (M + 31) / 32 * 32;
    const size_t row_bytes = (size_t)N * (out == OUT_BF16 ? 2 : 4);
    const int stream =
            !pairs && (size_t)M * row_bytes >= STREAM_BYTES && row_bytes % 64 == 0 && !((uintptr_t)y % 64);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        if (xsum) {
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++)
                for (int q = 0; q < Gq; q++) {
                    vf v = v_zero();
                    for (int k = q * W->gs; k < (q + 1) * W->gs; k += VL)
                        v = v_add(v, v_load_bf16(x + (size_t)m * K + k));
                    xsum[(size_t)m * Gq + q] = v_sum(v);
                }
        }
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int g0 = (int)((int64_t)G * t / nt), g1 = (int)((int64_t)G * (t + 1) / nt);
        /* [32][32] sums a panel between k blocks; in slabs, for every panel of the block in every group */
        const size_t nsums = (size_t)32 * mc * (ks < KB ? g1 - g0 : 1);
        float* sums = g0 < g1 ? (float*)aligned_alloc(64, sizeof(float) * nsums) : NULL;
        uint16_t* wide = codes && g0 < g1 ? (uint16_t*)aligned_alloc(64, group * sizeof(uint16_t)) : NULL;
        /* int4: the k block's scales and zeros (64 floats a quantization group), then four [32][32] group
         * sums */
        float* qs =
                W->w4 && g0 < g1 ? (float*)aligned_alloc(64, sizeof(float) * (64 * (size_t)Gq + 4096)) : NULL;
        if (g0 < g1 && (!sums || (codes && !wide) || (W->w4 && !qs))) {
#pragma omp atomic write
            failed = 1;
            free(sums);
            sums = NULL;
        }
        const outputs o = {y, bias, W->scales, N, bias_bf16, out, pairs, silu, stream};
        pending p = {NULL, 0, 0, 0, 0};
        int c0 = -1, c1 = -1;
        for (int mb = 0; mb < M && sums; mb += mc) {
            const int me = mb + mc < M ? mb + mc : M;
            for (int s0 = 0; s0 < KB; s0 += ks) {
                const int s1 = s0 + ks < KB ? s0 + ks : KB;
                for (int g = g0; g < g1; g++) {
                    const uint16_t* wg = codes ? wide : wp + (size_t)g * group;
                    float* gs = sums + (ks < KB ? (size_t)(g - g0) * 32 * mc : 0);
                    for (int k0 = s0; k0 < s1; k0 += kc) {
                        const int k1 = k0 + kc < s1 ? k0 + kc : s1;
                        /* the k block the thread multiplies next: this group's, the next group's in this
                         * slab, or the first group's in the next slab (or row block) */
                        const int k2 =
                                k1 < s1 ? (k1 + kc < s1 ? k1 + kc : s1) : k1; /* the next k block's end */
#ifdef INT8_PATH
                        if (W->w8) widen_codes(W->w8, N, K, g, k0, k1, k2, wide);
#endif
#ifdef INT4_PATH
                        if (W->w4) {
                            widen_int4(W, N, K, g, k0, k1, k2, wide);
                            group_scales(W->sz, N, g, k0 / cq, k1 / cq, qs);
                        }
#endif
                        const uint16_t* next =
                                codes        ? NULL
                                : k1 < s1    ? wg + (size_t)k1 * 1024
                                : g + 1 < g1 ? wg + group + (size_t)s0 * 1024
                                             : wp + (size_t)g0 * group + (size_t)(s1 < KB ? s1 : 0) * 1024;
                        for (int m0 = mb; m0 < me; m0 += 32) {
                            const int mr = me - m0 < 32 ? me - m0 : 32, r0 = mr < 16 ? mr : 16, r1 = mr - r0;
                            if (r0 != c0 || r1 != c1) {
#ifdef AMX_PATH
                                configure(r0, r1);
#endif
                                c0 = r0;
                                c1 = r1;
                            }
                            float* s = gs + (size_t)(m0 - mb) * 32;
                            const char* ahead;
                            int lines;
                            if (codes) { /* the codes were read ahead as they were widened */
                                ahead = NULL;
                                lines = 0;
                            } else if (kc ==
                                       KB) { /* one pass over the weights: READ_AHEAD bytes ahead a chunk */
                                ahead = (const char*)(wg + (size_t)k0 * 1024) + READ_AHEAD;
                                lines = 32 * (k1 - k0);
                            } else { /* the block's panels share the next k block's read */
                                const int panels = (me - mb + 31) / 32,
                                          share = (kc * 32 + panels - 1) / panels;
                                ahead = (const char*)next + (size_t)64 * share * ((m0 - mb) / 32);
                                lines = share;
                            }
                            const char* after = NULL; /* the dot products' second read-ahead (DOT_PATH) */
                            int after_lines = 0;
#ifdef DOT_PATH
                            if (!codes && kc == KB &&
                                g + 1 < g1) { /* the next group, shared by the block's panels */
                                const int panels = (me - mb + 31) / 32,
                                          share = (32 * KB + panels - 1) / panels;
                                after = (const char*)(wg + group) + (size_t)64 * share * ((m0 - mb) / 32);
                                after_lines = share;
                            }
#endif
#ifdef INT4_PATH
                            if (W->w4)
                                multiply_panel_q(x + (size_t)m0 * K, K, wg, k0, k1, mr, r1, s, qs,
                                                 xsum + (size_t)m0 * Gq, Gq, cq, qs + 64 * (size_t)Gq, &o,
                                                 &p);
                            else
#endif
                                multiply_panel(x + (size_t)m0 * K, K, wg, k0, k1, mr, r1, s, ahead, lines,
                                               after, after_lines, &o, &p);
                            if (k1 < KB) continue;
                            p = (pending){s, mr, m0, g, 0}; /* stored while the next panel multiplies */
                        }
                    }
                }
            }
        }
        store_rows(&o, &p, 32); /* the last panel's */
#ifdef AMX_PATH
        if (c0 >= 0) _tile_release();
#endif
        if (stream) _mm_sfence(); /* the streamed lines reach memory before the caller reads them */
        free(sums);
        free(wide);
        free(qs);
    }
    free(xsum);
    return failed ? 2 : 0;
}
#endif

/* x: [M, K] bf16 rows; wp: the weight in the layout above; bias: NULL, float32 or bf16 (bias_bf16) [N]; y:
 * [M, N] as `out` says: 0 float32, 1 bf16, 2 float32 holding the values rounded to bf16. K a multiple of 32.
 * Returns 0, 1 without either path or for arguments it does not take (nothing written), 2 out of memory for
 * the working sums. */
int sidecar_amx_bf16_matmul(const sidecar_matmul_args* a) {
    const uint16_t* x = a->x;
    const uint16_t* wp = a->w;
    const void* bias = a->bias;
    void* y = a->y;
    int M = a->M;
    int N = a->N;
    int K = a->K;
    int nthreads = a->nthreads;
    int bias_bf16 = a->bias_bf16;
    int out = a->out;
#ifdef TILE_LAYOUT
    const weights W = {wp, NULL, NULL, NULL, NULL, 0, 0, 0};
    return matmul(x, &W, bias, y, M, N, K, nthreads, bias_bf16, out, 0, 0);
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads, (void)bias_bf16,
            (void)out;
    return 1;
#endif
}

/* A fused gate/up projection (gate rows 0..I-1, up rows I..2I-1 of the weight; I a multiple of 16) held with
 * its gate and up rows in pairs: group g holds gate rows 16 g.. and up rows 16 g..
 * (``amx_gemm.pack(pairs=I)``). y: [M, 2 I] in the projection's own column order (silu 0), or [M, I] bf16 =
 * silu(gate) * up as norm_act's silu_mul gives it from the bf16 projection (silu 1: out must be 1, bf16) --
 * one pass, no 2 I-wide output. Returns as above. */
int sidecar_amx_bf16_gate_up(const sidecar_matmul_args* a) {
    const uint16_t* x = a->x;
    const uint16_t* wp = a->w;
    const void* bias = a->bias;
    void* y = a->y;
    int M = a->M;
    int I = a->N;
    int K = a->K;
    int nthreads = a->nthreads;
    int bias_bf16 = a->bias_bf16;
    int out = a->out;
    int silu = a->silu;
#ifdef TILE_LAYOUT
    if (I <= 0 || I % 16 || (silu && out != OUT_BF16)) return 1;
    const weights W = {wp, NULL, NULL, NULL, NULL, 0, 0, 0};
    return matmul(x, &W, bias, y, M, 2 * I, K, nthreads, bias_bf16, out, I, silu);
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)I, (void)K, (void)nthreads, (void)bias_bf16,
            (void)out, (void)silu;
    return 1;
#endif
}

/* Weight-only int8 on the tile path: y[m, n] = scales[n] * sum_k x[m, k] w8[n, k] (+ bias[n]), x bf16 [M, K],
 * w8 int8 codes [N, K] row-major (int8_gemv's layout, read in place), scales float32 [N]; the sums float32
 * (exact products of bf16 and a code), times the row's scale, then the bias, rounded once as `out` says. For
 * prefill-sized batches: each group's k block is widened once for all of a block's rows. Returns as above. */
int sidecar_amx_int8_matmul(const sidecar_matmul_args* a) {
    const uint16_t* x = a->x;
    const int8_t* w8 = a->w;
    const float* scales = a->scales;
    const void* bias = a->bias;
    void* y = a->y;
    int M = a->M;
    int N = a->N;
    int K = a->K;
    int nthreads = a->nthreads;
    int bias_bf16 = a->bias_bf16;
    int out = a->out;
#if defined(TILE_LAYOUT) && defined(INT8_PATH)
    if (!w8 || !scales) return 1;
    const weights W = {NULL, w8, scales, NULL, NULL, 0, 0, 0};
    return matmul(x, &W, bias, y, M, N, K, nthreads, bias_bf16, out, 0, 0);
#else
    (void)x, (void)w8, (void)scales, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads,
            (void)bias_bf16, (void)out;
    return 1;
#endif
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
    const uint16_t* x = a->x;
    const uint8_t* w4 = a->w;
    const uint16_t* sz = a->scales;
    const void* bias = a->bias;
    void* y = a->y;
    int M = a->M;
    int N = a->N;
    int K = a->K;
    int gs = a->group_size;
    int bn = a->block_n;
    int split = a->split;
    int nthreads = a->nthreads;
    int bias_bf16 = a->bias_bf16;
    int out = a->out;
#if defined(TILE_LAYOUT) && defined(INT4_PATH)
    if (!w4 || !sz || gs <= 0 || gs % 32 || gs > 32 * KC || K % gs || N % 16 || (bn != 32 && bn != 64) ||
        sidecar_amx_supported() != 1)
        return 1;
    const weights W = {NULL, NULL, NULL, w4, sz, gs, bn, split != 0};
    return matmul(x, &W, bias, y, M, N, K, nthreads, bias_bf16, out, 0, 0);
#else
    (void)x, (void)w4, (void)sz, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)gs, (void)bn,
            (void)split, (void)nthreads, (void)bias_bf16, (void)out;
    return 1;
#endif
}
