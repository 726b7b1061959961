/* A sparse block's router on the CPU: from the gate's logits [T, E] (float32 or bf16) to each row's k experts
 * and their weights, the bits torch's router gives (moe.py, ``SparseMoE.route_logits``):
 *
 *   probs = softmax(logits.float(), -1); weights, ids = topk(probs, k); [weights /= weights.sum(-1)];
 *   [weights = weights.to(bf16)]; ids, perm = ids.sort(-1); weights = weights.gather(-1, perm)
 *
 * so the grouped expert kernel (moe_args.h) reads ids ascending in each row, their weights beside them.
 *
 * Softmax: torch's last-dimension float32 kernel on a CPU of `lanes`-wide vectors (8: AVX2, 16: AVX-512). The
 * maximum is exact in any order; exp is SLEEF's 1-ulp single-precision exp (a Cody-Waite reduction by ln 2,
 * a degree-6 polynomial in fused multiply-adds, the power of two applied in two halves); the exps are summed
 * in `lanes` lane-wise partial sums (a tail shorter than a vector added into the first lanes), the partials
 * then halved pairwise (lane i + lane i + lanes/2, ...), fewer values than a vector summed in order; each
 * probability is the exp times the reciprocal of that sum.
 *
 * Top-k: the set torch.topk picks, ties included. torch selects with libstdc++'s std::nth_element
 * (introselect: median-of-three partitions, insertion sort under four elements, a heap select past the depth
 * limit) on (value, index) pairs ordered by value, larger first, a NaN above any number; with
 * std::partial_sort (a heap select) where 64 k <= E. Which of equal values make the set follows from those
 * algorithms' exact steps, which `select_k` repeats; the set's order does not matter here (the ids are sorted
 * after), and its sum does not either beyond the values: torch sums the k weights in its descending order,
 * and `topk_sum` sums them in descending value order too (equal values give the same sum in any order between
 * them), in the order torch's contiguous sum takes for so few values: under a vector, four running sums
 * (values j, j + 4, ... into sum j, a tail into the first), then added in turn; from a vector on,
 * `lanes`-wide running sums over four vectors at a time (a tail of vectors into the first), added lane-wise
 * in turn, and the scalar tail added first, then each lane in order.
 *
 * sidecar_moe_route_picked: the routers that take the top-k of the logits first and weigh the k picked after
 * (gpt-oss's softmax over them, Llama 4's sigmoid of each), the same steps.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float v;
    int64_t i;
} pair;

/* x before y in descending order: a NaN first, then larger values */
static inline int before(const pair* x, const pair* y) {
    return (isnan(x->v) && !isnan(y->v)) || x->v > y->v;
}

static inline void swap_pairs(pair* a, pair* b) {
    pair t = *a;
    *a = *b;
    *b = t;
}

/* ---- libstdc++'s heap and selection steps over pair arrays, with `before` as the ordering ---- */

static void push_heap(pair* first, int64_t hole, int64_t top, pair value) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && before(&first[parent], &value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

static void adjust_heap(pair* first, int64_t hole, int64_t len, pair value) {
    const int64_t top = hole;
    int64_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(&first[child], &first[child - 1])) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    push_heap(first, hole, top, value);
}

static void make_heap(pair* first, int64_t len) {
    if (len < 2) return;
    for (int64_t parent = (len - 2) / 2;; parent--) {
        adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

/* the `middle` elements a heap select keeps at [0, middle) */
static void heap_select(pair* first, int64_t middle, int64_t last) {
    make_heap(first, middle);
    for (int64_t i = middle; i < last; i++)
        if (before(&first[i], &first[0])) {
            pair value = first[i];
            first[i] = first[0];
            adjust_heap(first, 0, middle, value);
        }
}

static void insertion_sort(pair* first, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        pair value = first[i];
        if (before(&value, &first[0])) {
            memmove(first + 1, first, (size_t)i * sizeof(pair));
            first[0] = value;
        } else {
            int64_t j = i;
            while (before(&value, &first[j - 1])) {
                first[j] = first[j - 1];
                j--;
            }
            first[j] = value;
        }
    }
}

static void median_to_first(pair* result, pair* a, pair* b, pair* c) {
    if (before(a, b)) {
        if (before(b, c))
            swap_pairs(result, b);
        else if (before(a, c))
            swap_pairs(result, c);
        else
            swap_pairs(result, a);
    } else if (before(a, c))
        swap_pairs(result, a);
    else if (before(b, c))
        swap_pairs(result, c);
    else
        swap_pairs(result, b);
}

/* pairs [first, last) around the pivot at *pivot (outside the range); returns the cut */
static pair* partition(pair* first, pair* last, const pair* pivot) {
    for (;;) {
        while (before(first, pivot)) first++;
        last--;
        while (before(pivot, last)) last--;
        if (!(first < last)) return first;
        swap_pairs(first, last);
        first++;
    }
}

static int floor_log2(int64_t n) {
    int k = 0;
    while (n > 1) {
        n >>= 1;
        k++;
    }
    return k;
}

/* std::nth_element(q, q + nth, q + n) */
static void nth_element(pair* q, int64_t nth, int64_t n) {
    pair *first = q, *last = q + n, *at = q + nth;
    if (nth == n) return;
    int depth = 2 * floor_log2(n);
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(first, at - first + 1, last - first);
            swap_pairs(first, at);
            return;
        }
        depth--;
        pair* mid = first + (last - first) / 2;
        median_to_first(first, first + 1, mid, last - 1);
        pair* cut = partition(first + 1, last, first);
        if (cut <= at)
            first = cut;
        else
            last = cut;
    }
    insertion_sort(first, last - first);
}

/* torch.topk's set of k of the n pairs in q, left at q[0, k) */
static void select_k(pair* q, int64_t n, int64_t k) {
    if (k * 64 <= n)
        heap_select(q, k, n);
    else
        nth_element(q, k - 1, n);
}

/* ---- softmax ---- */

/* SLEEF's expf (1 ulp) for d <= 0, as torch's AVX2 / AVX-512 vectors compute it */
static float exp_nonpositive(float d) {
    if (isnan(d)) return d;
    if (d < -104.0f) return 0.0f;
    const int32_t q = (int32_t)rintf(d * 1.442695040888963407359924681001892137f);
    const float qf = (float)q;
    float s = fmaf(qf, -0.693145751953125f, d);
    s = fmaf(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    const int32_t h = q >> 1;
    union {
        int32_t i;
        float f;
    } a = {.i = (h + 0x7f) << 23}, b = {.i = (q - h + 0x7f) << 23};
    return u * a.f * b.f;
}

/* SLEEF's expf (1 ulp) over the whole range, as torch's vectors compute it (exp_nonpositive's steps; past 100
 * an infinity, as SLEEF gives) */
static float exp_sleef(float d) {
    if (isnan(d)) return d;
    if (d > 100.0f) return INFINITY;
    return exp_nonpositive(d);
}

static inline float bf16_to_f32(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* round to nearest even, a NaN to torch's quiet NaN */
static inline uint16_t f32_to_bf16(float f) {
    union {
        float f;
        uint32_t u;
    } v = {.f = f};
    if (isnan(f)) return 0x7fc0;
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

#define MAX_LANES 16
#define MAX_K     256 /* topk_sum's bound at 8 lanes */

/* p[0, E) = softmax of x[0, E), torch's float32 order of operations for vectors of `lanes` */
static void softmax_row(const float* x, float* p, int64_t E, int lanes) {
    float mx = x[0];
    int nan = 0;
    for (int64_t e = 0; e < E; e++) {
        nan |= isnan(x[e]);
        mx = x[e] > mx ? x[e] : mx;
    }
    if (nan) mx = NAN;
    for (int64_t e = 0; e < E; e++) p[e] = exp_nonpositive(x[e] - mx);
    float sum;
    if (E < lanes) {
        sum = p[0];
        for (int64_t e = 1; e < E; e++) sum += p[e];
    } else {
        float acc[MAX_LANES];
        memcpy(acc, p, (size_t)lanes * sizeof(float));
        int64_t d = lanes;
        for (; d + lanes <= E; d += lanes)
            for (int l = 0; l < lanes; l++) acc[l] += p[d + l];
        for (int64_t l = 0; d + l < E; l++) acc[l] += p[d + l];
        for (int half = lanes / 2; half >= 1; half /= 2)
            for (int l = 0; l < half; l++) acc[l] = acc[l] + acc[l + half];
        sum = acc[0];
    }
    const float r = 1.0f / sum;
    for (int64_t e = 0; e < E; e++) p[e] = p[e] * r;
}

/* torch's float32 sum of x[0, k), k < 16 * 4 * lanes (no cascade level reached) */
static float topk_sum(const float* x, int64_t k, int lanes) {
    if (k < lanes) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int64_t n4 = k / 4;
        for (int64_t i = 0; i < n4; i++)
            for (int j = 0; j < 4; j++) acc[j] += x[4 * i + j];
        for (int64_t e = 4 * n4; e < k; e++) acc[0] += x[e];
        return ((acc[0] + acc[1]) + acc[2]) + acc[3];
    }
    float pv[4][MAX_LANES];
    memset(pv, 0, sizeof(pv));
    const int64_t nv = k / lanes, n4 = nv / 4;
    for (int64_t i = 0; i < n4; i++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < lanes; l++) pv[j][l] += x[(4 * i + j) * lanes + l];
    for (int64_t i = 4 * n4; i < nv; i++)
        for (int l = 0; l < lanes; l++) pv[0][l] += x[i * lanes + l];
    for (int j = 1; j < 4; j++)
        for (int l = 0; l < lanes; l++) pv[0][l] += pv[j][l];
    float sum = 0.0f;
    for (int64_t e = nv * lanes; e < k; e++) sum += x[e];
    for (int l = 0; l < lanes; l++) sum += pv[0][l];
    return sum;
}

/* q[0, k) by ascending id, each value beside its id */
static void sort_by_id(pair* q, int64_t k) {
    for (int64_t j = 1; j < k; j++) {
        pair value = q[j];
        int64_t i = j;
        while (i > 0 && q[i - 1].i > value.i) {
            q[i] = q[i - 1];
            i--;
        }
        q[i] = value;
    }
}

/* Each of the T rows of logits [T, E] (bf16 when logits_bf16) routed to k experts: ids [T, k] int64
 * ascending, weights [T, k] beside them (bf16 when weights_bf16), renormalised to sum 1 where `norm`; k <=
 * MAX_K. `lanes`: the vector width whose softmax to repeat (8 or 16). Returns 0, or 1 for arguments it does
 * not take (nothing written), 2 when out of memory. */
int sidecar_moe_route(const void* logits, int64_t T, int64_t E, int64_t k, int logits_bf16, int norm,
                      int weights_bf16, int lanes, int64_t* ids, void* weights) {
    if (T < 0 || E < 1 || k < 1 || k > E || k > MAX_K || (lanes != 8 && lanes != 16)) return 1;
    float* p = malloc((size_t)E * sizeof(float) * 2);
    pair* q = malloc((size_t)E * sizeof(pair));
    if (p == NULL || q == NULL) {
        free(p);
        free(q);
        return 2;
    }
    float* x = p + E;
    for (int64_t t = 0; t < T; t++) {
        if (logits_bf16) {
            const uint16_t* row = (const uint16_t*)logits + t * E;
            for (int64_t e = 0; e < E; e++) x[e] = bf16_to_f32(row[e]);
        } else
            memcpy(x, (const float*)logits + t * E, (size_t)E * sizeof(float));
        softmax_row(x, p, E, lanes);
        for (int64_t e = 0; e < E; e++) {
            q[e].v = p[e];
            q[e].i = e;
        }
        select_k(q, E, k);
        /* the set in torch's order (descending values) for the sum, then ascending ids for the experts */
        insertion_sort(q, k);
        for (int64_t j = 0; j < k; j++) p[j] = q[j].v;
        const float sum = norm ? topk_sum(p, k, lanes) : 1.0f;
        sort_by_id(q, k);
        for (int64_t j = 0; j < k; j++) {
            const float w = norm ? q[j].v / sum : q[j].v;
            ids[t * k + j] = q[j].i;
            if (weights_bf16)
                ((uint16_t*)weights)[t * k + j] = f32_to_bf16(w);
            else
                ((float*)weights)[t * k + j] = w;
        }
    }
    free(p);
    free(q);
    return 0;
}

/* The routers that pick before they weigh, over the same logits [T, E] (bf16 when logits_bf16): each row's
 * top-k of the logits themselves (torch.topk's set, as above), ids ascending, weighed by
 *   form 1 (gpt-oss): the softmax of the k picked logits in the logits' dtype: softmax_row's float32 steps
 * over the k values in torch's descending order (bf16 logits: the results rounded once to bf16); form 2
 * (Llama 4): the sigmoid of each picked logit in float32, 1 / (1 + exp(-x)), as torch's elementwise loop
 * takes the T * k values: SLEEF's exp for the values its whole pairs of vectors cover (from the first), the C
 * library's expf for the tail it leaves to scalar code; the weights stored as bf16 when weights_bf16. Returns
 * as sidecar_moe_route (1 also for another form). */
int sidecar_moe_route_picked(const void* logits, int64_t T, int64_t E, int64_t k, int logits_bf16, int form,
                             int weights_bf16, int lanes, int64_t* ids, void* weights) {
    if (T < 0 || E < 1 || k < 1 || k > E || k > MAX_K || (lanes != 8 && lanes != 16)) return 1;
    if (form != 1 && form != 2) return 1;
    float* x =
            malloc((size_t)(E + 2 * k) * sizeof(float)); /* a row, then the k picked logits, their weights */
    pair* q = malloc((size_t)E * sizeof(pair));
    if (x == NULL || q == NULL) {
        free(x);
        free(q);
        return 2;
    }
    float *v = x + E, *w = v + k;
    const int64_t vector_end = T * k / (2 * lanes) * (2 * lanes); /* flat positions torch's vectors take */
    for (int64_t t = 0; t < T; t++) {
        for (int64_t e = 0; e < E; e++) {
            q[e].v = logits_bf16 ? bf16_to_f32(((const uint16_t*)logits)[t * E + e])
                                 : ((const float*)logits)[t * E + e];
            q[e].i = e;
        }
        select_k(q, E, k);
        insertion_sort(q, k); /* torch.topk's order: descending values */
        for (int64_t j = 0; j < k; j++) v[j] = q[j].v;
        if (form == 1) {
            softmax_row(v, w, k, lanes);
            if (logits_bf16)
                for (int64_t j = 0; j < k; j++) w[j] = bf16_to_f32(f32_to_bf16(w[j]));
        } else {
            for (int64_t j = 0; j < k; j++) {
                const float e = t * k + j < vector_end ? exp_sleef(-v[j]) : expf(-v[j]);
                w[j] = 1.0f / (1.0f + e);
            }
        }
        for (int64_t j = 0; j < k; j++) q[j].v = w[j];
        sort_by_id(q, k);
        for (int64_t j = 0; j < k; j++) {
            ids[t * k + j] = q[j].i;
            if (weights_bf16)
                ((uint16_t*)weights)[t * k + j] = f32_to_bf16(q[j].v);
            else
                ((float*)weights)[t * k + j] = q[j].v;
        }
    }
    free(x);
    free(q);
    return 0;
}
