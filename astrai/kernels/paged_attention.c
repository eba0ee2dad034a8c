/* Attention read straight from the paged KV cache: no gathered copy of the context, no slot table. Two kernels:
 * decode (one query token per request; this comment) and prefill (multi-token chunks; its comment below).
 *
 * Decode: one query token per request. For request b and KV head kvh, the G query heads of that KV group walk the
 * request's pages (its page table, as vLLM's kernels take a block table): each K row and V row is read once, from
 * where it lives in the cache, and all G queries use it while it is in cache (GQA without repeating heads). Three
 * passes per (request, KV head): the scores against every K row, their softmax numerators, then the
 * numerator-weighted sum of the V rows, divided by the numerators' sum; all in float32, whatever the cache's dtype.
 *
 * When given the step's new K and V rows (one per request, the token at position lengths[b] - 1), the kernel first
 * writes them into their slots, for every pair, and only then attends: a request's context may share pages with
 * another's, so no pair reads before every pair has written (the barrier at the end of the first loop).
 *
 * The arithmetic runs on 16-float vectors (GCC's vector extensions: the compiler lowers them to AVX-512 where the
 * CPU has it, to AVX2 or SSE pairs elsewhere), so head_dim must be a multiple of 16. The sums over a row's 16-lane
 * products, the softmax and the weighted sum of V rows keep their accumulators in registers: the previous kernel,
 * scalar C the compiler vectorized over runtime-sized stack arrays, took 107-118 us for one float32 layer of 8
 * requests at 301 tokens (4 query heads per KV head, head_dim 32) on a 2-core AMD EPYC, this one 34-35 (the best
 * and median of 5 x 2,000 calls, one run each).
 *
 * While it scores a K row, the kernel asks the CPU to fetch the same row of the request's next page, and this row's
 * V (``__builtin_prefetch``). Why: a request's pages lie anywhere in the pool, and the hardware prefetchers cannot
 * guess where its next page begins. On 30 layers of SmolLM2-135M-shaped decode in turn (8 requests at 301 tokens,
 * bfloat16, more K and V than the CPU's caches hold), these hints and the bfloat16 dot products below made a layer
 * 1.60-1.64x faster with each request's pages in random order, 1.30-1.32x with them in order (``python -m
 * benchmarks.kernel_ab --tolerance 0.05``, 3 rounds, 2-core AMD EPYC, no AMX), where the dot products alone gave
 * 1.26x with the pool in the caches. The hints alone (throwaway scripts, 3 rounds each): 1.60-1.61x a layer on
 * pages in random order, 1.01x on whole decode steps of a fresh pool. With the pool in the caches they cost float32
 * 1-2%.
 *
 * The (request, KV head) pairs are independent and split over ``threads`` OpenMP threads, balanced by their
 * context lengths (plan_pairs). Built with -fopenmp, the library needs libgomp.so.1, which the loader resolves to
 * the one torch already loaded (torch is imported first, and its bundled runtime carries that name): the kernel's
 * threads are torch's own intra-op pool, not a second pool competing for the cores. Each thread writes only its
 * pairs' rows of ``out`` and of the caches.
 *
 * Layouts: q element (b, head, d) at q[b * q_row + head * q_head + d], likewise the new K and V (per KV head);
 * k_cache and v_cache [KVH, S, D] contiguous; pages [B, max_pages] holding each request's pages in position order;
 * out [B, KVH * G, D] contiguous. Every decode row has at least one context slot (its own token): lengths[b] >= 1.
 * Built by astrai/paged_kernel.py with -O3 -march=native -ffast-math -fopenmp (-ffast-math lets the exponentials
 * use the vector math library); nothing here relies on infinities or NaNs.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define MAX_GROUPS 16
#define MAX_HEAD_DIM 256
#define LANES 16

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint16_t half_lanes __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t word_lanes __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline vec load_float(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vec load_bfloat16(const uint16_t *p) { /* a bfloat16 is the high half of a float32 */
    half_lanes h;
    memcpy(&h, p, sizeof h);
    word_lanes w = __builtin_convertvector(h, word_lanes) << 16;
    vec v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline float lane_sum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}


/* Each query head's score against one K row. QUERY_<dtype> prepares a query head once per (request, KV head) in
 * MAX_HEAD_DIM / LANES vectors, then SCORE_<dtype> takes each row: in float32, the query scaled, D / LANES
 * multiply-adds summed over the lanes. */
#define DEFINE_SCORE(SUFFIX, T, LOADV)                                                                             \
    static inline void query_##SUFFIX(const T *qg, vec *qv, int64_t head_dim, float scale) {                     \
        for (int64_t c = 0; c < head_dim / LANES; c++) qv[c] = LOADV(qg + c * LANES) * scale;                    \
    }                                                                                                             \
    static inline float score_##SUFFIX(const T *kr, const vec *qv, int64_t head_dim, float scale) {              \
        vec acc = LOADV(kr) * qv[0];                                                                              \
        for (int64_t c = 1; c < head_dim / LANES; c++) acc += LOADV(kr + c * LANES) * qv[c];                      \
        return lane_sum(acc);                                                                                     \
    }

DEFINE_SCORE(float32, float, load_float)
#ifdef __AVX512BF16__
/* bfloat16 where the CPU has AVX512-BF16: the query stays bfloat16 (its bits copied, unscaled), and one dot product
 * instruction takes 32 of the row's values in pairs as they lie in the cache, each product exact in float32; the
 * sum is scaled after. Why: widening each K row to float32 first (two instructions per 16 values) and multiplying
 * it out was most of the score pass; this made a SmolLM2-135M-shaped layer's decode (8 requests at 320 tokens, its
 * pool in the CPU's caches) 1.26x faster, the embedded model's 1.15x (2-core AMD EPYC, no AMX; ``python -m
 * benchmarks.kernel_ab --tolerance 0.05``, 3 rounds, docs/benchmarks.md). */
static inline void query_bfloat16(const uint16_t *qg, vec *qv, int64_t head_dim, float scale) {
    memset(qv, 0, sizeof(vec) * ((head_dim + 2 * LANES - 1) / (2 * LANES))); /* a last half vector's zeros */
    memcpy(qv, qg, sizeof(uint16_t) * head_dim);
}

static inline float score_bfloat16(const uint16_t *kr, const vec *qv, int64_t head_dim, float scale) {
    __m512 acc = _mm512_setzero_ps(); /* GCC's __m512 is the same vector type as vec */
    int64_t d = 0;
    for (; d + 2 * LANES <= head_dim; d += 2 * LANES)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kr + d), (__m512bh)qv[d / (2 * LANES)]);
    if (d < head_dim) /* 16 values left: the query's other 16 are zeros */
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256((const void *)(kr + d))),
                               (__m512bh)qv[d / (2 * LANES)]);
    return lane_sum(acc) * scale;
}
#else
DEFINE_SCORE(bfloat16, uint16_t, load_bfloat16)
#endif

/* Calls BODY with `slot` bound to each context slot of a request in position order and `l` its position. */
#define FOR_EACH_SLOT(table, len, page_size, BODY)                                                                 \
    for (int64_t p = 0, l = 0; l < (len); p++) {                                                                  \
        const int64_t base = (table)[p] * (page_size);                                                            \
        const int64_t end = (len) - l < (page_size) ? (len) : l + (page_size);                                    \
        for (int64_t slot = base; l < end; l++, slot++) BODY                                                      \
    }

/* Which thread attends each (request, KV head) pair: pairs are numbered by request, longest context first (item i
 * is request order[i / kv_heads], KV head i % kv_heads), and each goes to the thread with the least work so far
 * (longest processing time first). Why: a pair's cost grows with its context, and a static split of the pairs in
 * request order gave one thread most of the long ones: on W2's decode (8 requests of 56 to 340 tokens, 2 threads)
 * the other thread waited for it, and a layer took 1.23-1.31x as long as with this plan, where equal contexts
 * (W1's) took 0.995-1.006x (``python -m benchmarks.kernel_ab``, 3 rounds, 2-core AMD EPYC, no AMX). Handing the
 * pairs out one at a time instead (OpenMP's dynamic schedule) balanced them too, but cost 2-8% where the contexts
 * are equal (one run). Returns the order, followed by the owners, in one allocation the caller frees; or NULL. */
static int64_t *plan_pairs(const int64_t *lengths, int64_t batch, int64_t kv_heads, int threads) {
    int64_t *order = malloc(sizeof(int64_t) * (batch + batch * kv_heads + threads));
    if (order == NULL) return NULL;
    int64_t *owner = order + batch, *load = owner + batch * kv_heads;
    for (int64_t b = 0; b < batch; b++) { /* an insertion sort: a batch is a few dozen requests */
        int64_t at = b;
        for (; at > 0 && lengths[order[at - 1]] < lengths[b]; at--) order[at] = order[at - 1];
        order[at] = b;
    }
    for (int t = 0; t < threads; t++) load[t] = 0;
    for (int64_t i = 0; i < batch * kv_heads; i++) {
        int least = 0;
        for (int t = 1; t < threads; t++) least = load[t] < load[least] ? t : least;
        owner[i] = least;
        load[least] += lengths[order[i / kv_heads]] + 16; /* + a pair's fixed cost, in keys */
    }
    return order;
}

#define DEFINE_DECODE(NAME, T, LOADV, STORE, QUERY, SCORE)                                                        \
    int NAME(const T *q, int64_t q_row, int64_t q_head, const T *k_new, int64_t k_row, int64_t k_head,           \
             const T *v_new, int64_t v_row, int64_t v_head, T *k_cache, T *v_cache, const int64_t *pages,        \
             int64_t max_pages, const int64_t *lengths, T *out, int64_t batch, int64_t kv_heads, int64_t groups,  \
             int64_t head_dim, int64_t cache_slots, int64_t page_size, float scale, int threads) {               \
        if (groups > MAX_GROUPS || head_dim > MAX_HEAD_DIM || head_dim % LANES) return -1;                        \
        int64_t max_len = 0;                                                                                      \
        for (int64_t b = 0; b < batch; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;              \
        const int64_t chunks = head_dim / LANES;                                                                  \
        int64_t *order = plan_pairs(lengths, batch, kv_heads, threads);                                           \
        if (order == NULL) return -2;                                                                             \
        const int64_t *owner = order + batch;                                                                     \
        int failed = 0;                                                                                           \
        _Pragma("omp parallel num_threads(threads) reduction(|: failed)")                                         \
        {                                                                                                         \
        /* OpenMP may give fewer threads than asked: then each takes the owners equal to it modulo the team */  \
        const int team = omp_get_num_threads(), me = omp_get_thread_num();                                        \
        if (k_new != NULL) { /* the new rows first, every one of them: the loop ends in a barrier */             \
            _Pragma("omp for collapse(2) schedule(static)")                                                       \
            for (int64_t b = 0; b < batch; b++) {                                                                 \
                for (int64_t h = 0; h < kv_heads; h++) {                                                          \
                    const int64_t pos = lengths[b] - 1;                                                           \
                    const int64_t slot = pages[b * max_pages + pos / page_size] * page_size + pos % page_size;   \
                    const int64_t at = (h * cache_slots + slot) * head_dim;                                       \
                    memcpy(k_cache + at, k_new + b * k_row + h * k_head, sizeof(T) * head_dim);                   \
                    memcpy(v_cache + at, v_new + b * v_row + h * v_head, sizeof(T) * head_dim);                   \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        vec qv[MAX_GROUPS][MAX_HEAD_DIM / LANES];                                                                 \
        float *scores = malloc(sizeof(float) * groups * max_len); /* this thread's G x L scores */                \
        if (scores == NULL) failed = 1;                                                                           \
        for (int64_t item = 0; item < batch * kv_heads; item++) {                                                 \
            if (owner[item] % team != me) continue;                                                               \
            {                                                                                                     \
                const int64_t b = order[item / kv_heads], h = item % kv_heads;                                    \
                if (scores == NULL) continue;                                                                     \
                const int64_t *table = pages + b * max_pages;                                                     \
                const int64_t len = lengths[b];                                                                   \
                const T *kh = k_cache + h * cache_slots * head_dim, *vh = v_cache + h * cache_slots * head_dim;   \
                for (int64_t g = 0; g < groups; g++)                                                              \
                    QUERY(q + b * q_row + (h * groups + g) * q_head, qv[g], head_dim, scale);                     \
                FOR_EACH_SLOT(table, len, page_size, { /* scores: each K row read once, for the whole group */   \
                    const T *kr = kh + slot * head_dim;                                                           \
                    /* the same row of the next page, and this V row (the values' pass reads it): see the top */ \
                    const int64_t ahead = (p + 1) * page_size < len ? table[p + 1] * page_size + slot - base : slot; \
                    for (int64_t o = 0; o < head_dim * (int64_t)sizeof(T); o += 64) {                            \
                        __builtin_prefetch((const char *)(kh + ahead * head_dim) + o);                            \
                        __builtin_prefetch((const char *)(vh + slot * head_dim) + o);                             \
                    }                                                                                             \
                    for (int64_t g = 0; g < groups; g++) scores[g * len + l] = SCORE(kr, qv[g], head_dim, scale); \
                })                                                                                                \
                float totals[MAX_GROUPS];                                                                         \
                for (int64_t g = 0; g < groups; g++) { /* softmax numerators; their sum divides at the end */    \
                    float *sg = scores + g * len, top = sg[0], total = 0.0f;                                      \
                    for (int64_t i = 1; i < len; i++) top = sg[i] > top ? sg[i] : top;                            \
                    for (int64_t i = 0; i < len; i++) {                                                           \
                        sg[i] = expf(sg[i] - top);                                                                \
                        total += sg[i];                                                                           \
                    }                                                                                             \
                    totals[g] = total;                                                                            \
                }                                                                                                 \
                /* values: blocks of up to 4 query heads x 4 vectors of D, accumulated in registers */           \
                for (int64_t c0 = 0; c0 < chunks; c0 += 4) {                                                      \
                    const int nc = chunks - c0 < 4 ? (int)(chunks - c0) : 4;                                      \
                    for (int64_t g0 = 0; g0 < groups; g0 += 4) {                                                  \
                        const int ng = groups - g0 < 4 ? (int)(groups - g0) : 4;                                  \
                        vec acc[4][4] = {{{0}}};                                                                  \
                        FOR_EACH_SLOT(table, len, page_size, {                                                    \
                            const T *vr = vh + slot * head_dim + c0 * LANES;                                      \
                            vec v[4] = {{0}};                                                                      \
                            for (int c = 0; c < 4; c++)                                                           \
                                if (c < nc) v[c] = LOADV(vr + c * LANES);                                         \
                            for (int g = 0; g < 4; g++) {                                                         \
                                if (g >= ng) break;                                                               \
                                const float w = scores[(g0 + g) * len + l];                                       \
                                for (int c = 0; c < 4; c++)                                                       \
                                    if (c < nc) acc[g][c] += w * v[c];                                            \
                            }                                                                                     \
                        })                                                                                        \
                        for (int g = 0; g < ng; g++) {                                                            \
                            T *og = out + ((b * kv_heads + h) * groups + g0 + g) * head_dim + c0 * LANES;         \
                            const float inverse = 1.0f / totals[g0 + g];                                          \
                            for (int c = 0; c < nc; c++)                                                          \
                                for (int i = 0; i < LANES; i++) og[c * LANES + i] = STORE(acc[g][c][i] * inverse); \
                        }                                                                                         \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        free(scores);                                                                                             \
        }                                                                                                         \
        free(order);                                                                                              \
        return failed ? -2 : 0;                                                                                   \
    }

#define STORE_FLOAT(x) (x)
DEFINE_DECODE(paged_decode_float32, float, load_float, STORE_FLOAT, query_float32, score_float32)
DEFINE_DECODE(paged_decode_bfloat16, uint16_t, load_bfloat16, float_to_bf16, query_bfloat16, score_bfloat16)

/* Prefill attention read straight from the paged KV cache: the causal attention of a step's multi-token chunks.
 *
 * A chunk is a request computing `length` tokens (rows start .. start + length - 1 of the step) after `done` tokens
 * already in its pages; its K and V rows, the new ones included, are in the cache before the call. Query row r of
 * the chunk (position done + r) attends to the chunk's positions 0 .. done + r. Work items are (chunk, KV head,
 * block of QUERY_BLOCK rows): an item's G x QUERY_BLOCK query vectors walk the context in blocks of LANES keys,
 * which it first copies out of the pages into float32 (the keys transposed, so that one query's scores against
 * the whole block are D vector multiply-adds and no horizontal sums), then takes each query's scores through an
 * online softmax (running maximum and sum, the accumulator rescaled when the maximum grows) into its weighted sum
 * of the block's V rows. Items run longest first (a chunk's last rows see the most keys), handed out one at a time
 * over the threads, which each write only their items' rows of `out`.
 *
 * Why: PyTorch's scaled_dot_product_attention took each chunk separately, its context gathered into a copy first:
 * on a SmolLM2-135M-shaped model in bfloat16, W1's 512-token step spent about 4.1 ms a layer there, against 1.8
 * in vLLM's CPU attention (2-core AMD EPYC, no AMX; one profiled run each, docs/benchmarks.md). A padded tile of
 * TILE query vectors shares each key and value it loads (load-bound otherwise), the softmax runs on whole vectors
 * (one vector exponential per query and block, the TILE rescales in one more), and the value accumulators stay in
 * registers for head sizes up to 64 (tile_values).
 *
 * Layouts: q element (row, head, d) at q[row * q_row + head * q_head + d]; chunks [n_chunks, 3] of (start, length,
 * done); pages [n_chunks, max_pages]; out element (row, head, d) at out[row * out_row + head * head_dim + d].
 */
#define QUERY_BLOCK 16
#define TILE 4              /* query vectors that share each key and value they load */
#define MASKED (-1e30f)     /* a score no query may keep: its exponential is 0 (no infinities under -ffast-math) */

static inline float load_float_scalar(const float *p) { return *p; }

static inline float load_bfloat16_scalar(const uint16_t *p) { return bf16_to_float(*p); }

typedef int32_t lane_mask __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec select_lanes(lane_mask keep, vec a, vec b) { /* a where keep, else b */
    lane_mask x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    x = (x & keep) | (y & ~keep);
    vec v;
    memcpy(&v, &x, sizeof v);
    return v;
}

static inline float lane_max(vec v) { /* a tree of shuffles: log2(LANES) steps, not LANES - 1 */
    const lane_mask halves[] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                                {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                                {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                                {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
    for (int step = 0; step < 4; step++) {
        const vec other = __builtin_shuffle(v, halves[step]);
        v = select_lanes(v > other, v, other);
    }
    return v[0];
}

static inline vec lane_exp(vec v) { /* one call of the vector math library's exponential (-ffast-math) */
    float x[LANES];
    memcpy(x, &v, sizeof x);
    for (int j = 0; j < LANES; j++) x[j] = expf(x[j]);
    memcpy(&v, x, sizeof v);
    return v;
}

static inline void *vectors_of(int64_t n) { /* vec-aligned: the compiler may load a vec with aligned moves */
    return aligned_alloc(sizeof(vec), sizeof(vec) * n);
}

static inline int64_t query_blocks(int64_t length) { return (length + QUERY_BLOCK - 1) / QUERY_BLOCK; }

/* The scores of TILE query vectors (float32, scaled, D apart) against the block's LANES keys (transposed). */
static inline __attribute__((always_inline)) void tile_scores(const float *queries, const vec *keys_t,
                                                             int64_t head_dim, vec scores[TILE]) {
    vec even[TILE] = {{0}}, odd[TILE] = {{0}}; /* two chains per query: eight multiply-adds in flight */
    for (int64_t d = 0; d < head_dim; d += 2) {
        const vec k0 = keys_t[d], k1 = keys_t[d + 1];
        for (int t = 0; t < TILE; t++) {
            even[t] += queries[t * head_dim + d] * k0;
            odd[t] += queries[t * head_dim + d + 1] * k1;
        }
    }
    for (int t = 0; t < TILE; t++) scores[t] = even[t] + odd[t];
}

/* acc[t] = acc[t] * rescale[t] + sum over the block's first `used` keys j of weights[t][j] * V_j; `chunks` is
 * D / LANES, a constant where the caller switches on it, so that the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile_values(vec *acc, const float weights[TILE][LANES],
                                                             const float rescale[TILE], const vec *values,
                                                             int64_t used, const int64_t chunks) {
    vec a[TILE][MAX_HEAD_DIM / LANES];
    for (int t = 0; t < TILE; t++)
        for (int64_t k = 0; k < chunks; k++) a[t][k] = acc[t * chunks + k] * rescale[t];
    for (int64_t j = 0; j < used; j++) {
        for (int64_t k = 0; k < chunks; k++) {
            const vec v = values[j * chunks + k];
            for (int t = 0; t < TILE; t++) a[t][k] += weights[t][j] * v;
        }
    }
    for (int t = 0; t < TILE; t++)
        for (int64_t k = 0; k < chunks; k++) acc[t * chunks + k] = a[t][k];
}

#define DEFINE_PREFILL(NAME, T, LOADV, LOADS, STORE)                                                               \
    int NAME(const T *q, int64_t q_row, int64_t q_head, const T *k_cache, const T *v_cache, const int64_t *pages, \
             int64_t max_pages, const int64_t *chunks, int64_t n_chunks, T *out, int64_t out_row,                \
             int64_t kv_heads, int64_t groups, int64_t head_dim, int64_t cache_slots, int64_t page_size,          \
             float scale, int threads) {                                                                          \
        if (groups > MAX_GROUPS || head_dim > MAX_HEAD_DIM || head_dim % LANES) return -1;                        \
        int64_t items = 0;                                                                                        \
        for (int64_t c = 0; c < n_chunks; c++) items += query_blocks(chunks[3 * c + 1]) * kv_heads;              \
        const int64_t dims = head_dim / LANES;                                                                    \
        const int64_t capacity = (QUERY_BLOCK * groups + TILE - 1) / TILE * TILE; /* query vectors, padded */    \
        int failed = 0;                                                                                           \
        _Pragma("omp parallel num_threads(threads) reduction(|: failed)")                                         \
        {                                                                                                         \
        /* each thread's own buffers, on cache lines of their own */                                              \
        float *queries = vectors_of(capacity * dims), *top = vectors_of(capacity), *total = vectors_of(capacity); \
        int64_t *last = vectors_of(capacity);                                                                     \
        vec *acc = vectors_of(capacity * dims), *keys_t = vectors_of(head_dim), *values = vectors_of(LANES * dims); \
        if (!queries || !top || !total || !last || !acc || !keys_t || !values) failed = 1;                        \
        _Pragma("omp for schedule(dynamic, 1)")                                                                   \
        for (int64_t item = 0; item < items; item++) {                                                            \
            if (failed) continue;                                                                                 \
            int64_t rest = item, c = 0; /* the item's chunk; within it, the last query blocks first */            \
            while (rest >= query_blocks(chunks[3 * c + 1]) * kv_heads) rest -= query_blocks(chunks[3 * c++ + 1]) * kv_heads; \
            const int64_t start = chunks[3 * c], length = chunks[3 * c + 1], done = chunks[3 * c + 2];           \
            const int64_t h = rest % kv_heads, r0 = (query_blocks(length) - 1 - rest / kv_heads) * QUERY_BLOCK;  \
            const int64_t rows = length - r0 < QUERY_BLOCK ? length - r0 : QUERY_BLOCK;                          \
            const int64_t used_vectors = rows * groups, tiles = (used_vectors + TILE - 1) / TILE;                 \
            const int64_t *table = pages + c * max_pages;                                                         \
            const T *kh = k_cache + h * cache_slots * head_dim, *vh = v_cache + h * cache_slots * head_dim;       \
            for (int64_t i = 0; i < tiles * TILE; i++) { /* query vector i: row i / G, head h * G + i % G */      \
                const int64_t r = i / groups;                                                                     \
                float *qi = queries + i * head_dim;                                                               \
                if (i < used_vectors) {                                                                           \
                    const T *source = q + (start + r0 + r) * q_row + (h * groups + i % groups) * q_head;         \
                    for (int64_t d = 0; d < head_dim; d++) qi[d] = LOADS(source + d) * scale;                    \
                } else {                                                                                          \
                    memset(qi, 0, sizeof(float) * head_dim);                                                      \
                }                                                                                                 \
                last[i] = i < used_vectors ? done + r0 + r : -1; /* the last position it attends; -1: padding */ \
                for (int64_t k = 0; k < dims; k++) acc[i * dims + k] = (vec){0};                                  \
                top[i] = MASKED;                                                                                  \
                total[i] = 0.0f;                                                                                  \
            }                                                                                                     \
            const int64_t context = done + r0 + rows; /* the keys of the item's last row */                      \
            for (int64_t j0 = 0; j0 < context; j0 += LANES) {                                                     \
                const int64_t n = context - j0 < LANES ? context - j0 : LANES;                                    \
                for (int64_t j = 0; j < LANES; j++) {                                                             \
                    if (j < n) {                                                                                  \
                        const int64_t pos = j0 + j;                                                               \
                        const int64_t slot = table[pos / page_size] * page_size + pos % page_size;               \
                        const T *kr = kh + slot * head_dim, *vr = vh + slot * head_dim;                           \
                        for (int64_t d = 0; d < head_dim; d++) keys_t[d][j] = LOADS(kr + d);                     \
                        for (int64_t k = 0; k < dims; k++) values[j * dims + k] = LOADV(vr + k * LANES);         \
                    } else {                                                                                      \
                        for (int64_t d = 0; d < head_dim; d++) keys_t[d][j] = 0.0f;                               \
                    }                                                                                             \
                }                                                                                                 \
                for (int64_t i0 = 0; i0 < tiles * TILE; i0 += TILE) {                                             \
                    vec scores[TILE];                                                                             \
                    tile_scores(queries + i0 * head_dim, keys_t, head_dim, scores);                               \
                    float weights[TILE][LANES], rescale[TILE], sums[TILE] = {0};                                  \
                    vec shift = {0};   /* each query's old maximum minus its new one: its rescale's exponent */  \
                    int64_t used = 0; /* keys of the block the tile's longest row attends */                     \
                    for (int t = 0; t < TILE; t++) {                                                              \
                        const int64_t i = i0 + t, allowed = last[i] - j0 + 1; /* lanes this query may attend */  \
                        if (allowed <= 0) { /* a padding vector, or a row that ends before this block */         \
                            memset(weights[t], 0, sizeof weights[t]);                                             \
                            continue;                                                                             \
                        }                                                                                         \
                        const vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                  \
                        const vec x = select_lanes(lane < (float)allowed, scores[t], (vec){0} + MASKED);          \
                        const float block_high = lane_max(x), high = block_high > top[i] ? block_high : top[i];  \
                        const vec w = lane_exp(x - high);                                                         \
                        memcpy(weights[t], &w, sizeof w);                                                         \
                        shift[t] = top[i] - high;                                                                 \
                        top[i] = high;                                                                            \
                        sums[t] = lane_sum(w);                                                                    \
                        used = allowed > used ? (allowed < n ? allowed : n) : used;                               \
                    }                                                                                             \
                    const vec factor = lane_exp(shift);                                                           \
                    for (int t = 0; t < TILE; t++) { /* 1 where nothing was added */                              \
                        rescale[t] = factor[t];                                                                   \
                        total[i0 + t] = total[i0 + t] * rescale[t] + sums[t];                                     \
                    }                                                                                             \
                    vec *tile_acc = acc + i0 * dims;                                                              \
                    switch (dims) { /* a constant width: the accumulators stay in registers */                   \
                    case 1: tile_values(tile_acc, weights, rescale, values, used, 1); break;                      \
                    case 2: tile_values(tile_acc, weights, rescale, values, used, 2); break;                      \
                    case 4: tile_values(tile_acc, weights, rescale, values, used, 4); break;                      \
                    default: tile_values(tile_acc, weights, rescale, values, used, dims);                         \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
            for (int64_t i = 0; i < used_vectors; i++) {                                                          \
                T *o = out + (start + r0 + i / groups) * out_row + (h * groups + i % groups) * head_dim;          \
                const float inverse = 1.0f / total[i];                                                            \
                for (int64_t k = 0; k < dims; k++)                                                                \
                    for (int j = 0; j < LANES; j++) o[k * LANES + j] = STORE(acc[i * dims + k][j] * inverse);     \
            }                                                                                                     \
        }                                                                                                         \
        free(queries);                                                                                            \
        free(top);                                                                                                \
        free(total);                                                                                              \
        free(last);                                                                                               \
        free(acc);                                                                                                \
        free(keys_t);                                                                                             \
        free(values);                                                                                             \
        }                                                                                                         \
        return failed ? -2 : 0;                                                                                   \
    }

DEFINE_PREFILL(paged_prefill_float32, float, load_float, load_float_scalar, STORE_FLOAT)
DEFINE_PREFILL(paged_prefill_bfloat16, uint16_t, load_bfloat16, load_bfloat16_scalar, float_to_bf16)
