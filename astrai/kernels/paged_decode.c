/* Decode attention read straight from the paged KV cache: no gathered copy of the context, no slot table.
 *
 * One query token per request. For request b and KV head kvh, the G query heads of that KV group walk the
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
 * The (request, KV head) pairs are independent and split over ``threads`` OpenMP threads. Built with -fopenmp, the
 * library needs libgomp.so.1, which the loader resolves to the one torch already loaded (torch is imported first,
 * and its bundled runtime carries that name): the kernel's threads are torch's own intra-op pool, not a second
 * pool competing for the cores. Each thread writes only its pairs' rows of ``out`` and of the caches.
 *
 * Layouts: q element (b, head, d) at q[b * q_row + head * q_head + d], likewise the new K and V (per KV head);
 * k_cache and v_cache [KVH, S, D] contiguous; pages [B, max_pages] holding each request's pages in position order;
 * out [B, KVH * G, D] contiguous. Every decode row has at least one context slot (its own token): lengths[b] >= 1.
 * Built by astrai/paged_kernel.py with -O3 -march=native -ffast-math -fopenmp (-ffast-math lets the exponentials
 * use the vector math library); nothing here relies on infinities or NaNs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* Calls BODY with `slot` bound to each context slot of a request in position order and `l` its position. */
#define FOR_EACH_SLOT(table, len, page_size, BODY)                                                                 \
    for (int64_t p = 0, l = 0; l < (len); p++) {                                                                  \
        const int64_t base = (table)[p] * (page_size);                                                            \
        const int64_t end = (len) - l < (page_size) ? (len) : l + (page_size);                                    \
        for (int64_t slot = base; l < end; l++, slot++) BODY                                                      \
    }

#define DEFINE_DECODE(NAME, T, LOADV, STORE)                                                                       \
    int NAME(const T *q, int64_t q_row, int64_t q_head, const T *k_new, int64_t k_row, int64_t k_head,           \
             const T *v_new, int64_t v_row, int64_t v_head, T *k_cache, T *v_cache, const int64_t *pages,        \
             int64_t max_pages, const int64_t *lengths, T *out, int64_t batch, int64_t kv_heads, int64_t groups,  \
             int64_t head_dim, int64_t cache_slots, int64_t page_size, float scale, int threads) {               \
        if (groups > MAX_GROUPS || head_dim > MAX_HEAD_DIM || head_dim % LANES) return -1;                        \
        int64_t max_len = 0;                                                                                      \
        for (int64_t b = 0; b < batch; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;              \
        const int64_t chunks = head_dim / LANES;                                                                  \
        int failed = 0;                                                                                           \
        _Pragma("omp parallel num_threads(threads) reduction(|: failed)")                                         \
        {                                                                                                         \
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
        _Pragma("omp for collapse(2) schedule(static)")                                                           \
        for (int64_t b = 0; b < batch; b++) {                                                                     \
            for (int64_t h = 0; h < kv_heads; h++) {                                                              \
                if (scores == NULL) continue;                                                                     \
                const int64_t *table = pages + b * max_pages;                                                     \
                const int64_t len = lengths[b];                                                                   \
                const T *kh = k_cache + h * cache_slots * head_dim, *vh = v_cache + h * cache_slots * head_dim;   \
                for (int64_t g = 0; g < groups; g++) {                                                            \
                    const T *qg = q + b * q_row + (h * groups + g) * q_head;                                      \
                    for (int64_t c = 0; c < chunks; c++) qv[g][c] = LOADV(qg + c * LANES) * scale;                \
                }                                                                                                 \
                FOR_EACH_SLOT(table, len, page_size, { /* scores: each K row read once, for the whole group */   \
                    const T *kr = kh + slot * head_dim;                                                           \
                    for (int64_t g = 0; g < groups; g++) {                                                        \
                        vec acc = LOADV(kr) * qv[g][0];                                                           \
                        for (int64_t c = 1; c < chunks; c++) acc += LOADV(kr + c * LANES) * qv[g][c];             \
                        scores[g * len + l] = lane_sum(acc);                                                      \
                    }                                                                                             \
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
        return failed ? -2 : 0;                                                                                   \
    }

#define STORE_FLOAT(x) (x)
DEFINE_DECODE(paged_decode_float32, float, load_float, STORE_FLOAT)
DEFINE_DECODE(paged_decode_bfloat16, uint16_t, load_bfloat16, float_to_bf16)
