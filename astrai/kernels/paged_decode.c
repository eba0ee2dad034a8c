/* Decode attention read straight from the paged KV cache: no gathered copy of the context.
 *
 * One query token per request. For request b and KV head kvh, the G query heads of that KV group walk the
 * request's context slot by slot: each K row and V row is read once, from where it lives in the cache, and all G
 * queries use it while it is in cache (GQA without repeating heads). Three passes per (request, KV head): the
 * scores against every K row, their softmax numerators, then the numerator-weighted sum of the V rows, divided by
 * the numerators' sum; all in float32, whatever the cache's dtype. Two passes over scores kept in ``scores``
 * (G x L_max floats per thread) let the compiler vectorize the exponentials, which one online pass could not:
 * on a 2-core AMD EPYC one bfloat16 layer of 8 requests at 301 tokens took 225-230 us against 680-730 (one run).
 *
 * The (request, KV head) pairs are independent and split over ``threads`` OpenMP threads. Built with -fopenmp, the
 * library needs libgomp.so.1, which the loader resolves to the one torch already loaded (torch is imported first,
 * and its bundled runtime carries that name): the kernel's threads are torch's own intra-op pool, not a second
 * pool competing for the cores. Each thread writes only its pairs' rows of ``out``.
 *
 * Layouts (all contiguous): q and out [B, KVH * G, D]; k_cache and v_cache [KVH, S, D]; slots [B, L_max] holding
 * each request's context slots in position order, of which the first lengths[b] are read.
 * Every decode row has at least one context slot (its own token), so lengths[b] >= 1.
 * Built by astrai/paged_kernel.py with -O3 -march=native -ffast-math -fopenmp: the loops over D and over the scores
 * vectorize (-ffast-math lets the sums reassociate and the exponentials use the vector math library); nothing here
 * relies on infinities or NaNs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUPS 16
#define MAX_HEAD_DIM 256

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                                       \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *slots, const int64_t *lengths,       \
             T *out, int64_t batch, int64_t kv_heads, int64_t groups, int64_t head_dim, int64_t cache_slots,     \
             int64_t max_len, float scale, int threads) {                                                        \
        if (groups > MAX_GROUPS || head_dim > MAX_HEAD_DIM) return -1;                                           \
        int failed = 0;                                                                                          \
        _Pragma("omp parallel num_threads(threads) reduction(|: failed)")                                        \
        {                                                                                                        \
        float qf[MAX_GROUPS][MAX_HEAD_DIM], acc[MAX_GROUPS][MAX_HEAD_DIM], row[MAX_HEAD_DIM];                     \
        float *scores = malloc(sizeof(float) * groups * max_len); /* this thread's G x L_max scores */            \
        if (scores == NULL) failed = 1;                                                                          \
        _Pragma("omp for collapse(2) schedule(static)")                                                          \
        for (int64_t b = 0; b < batch; b++) {                                                                    \
            for (int64_t h = 0; h < kv_heads; h++) {                                                             \
                if (scores == NULL) continue;                                                                    \
                const int64_t *ctx = slots + b * max_len;                                                        \
                const int64_t len = lengths[b];                                                                  \
                const T *kh = k_cache + h * cache_slots * head_dim, *vh = v_cache + h * cache_slots * head_dim;  \
                for (int64_t g = 0; g < groups; g++) {                                                           \
                    const T *qg = q + ((b * kv_heads + h) * groups + g) * head_dim;                              \
                    for (int64_t d = 0; d < head_dim; d++) qf[g][d] = LOAD(qg[d]) * scale;                       \
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;                                     \
                }                                                                                                \
                for (int64_t l = 0; l < len; l++) { /* scores: each K row read once, for the whole group */     \
                    const T *kr = kh + ctx[l] * head_dim;                                                        \
                    for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(kr[d]);                                 \
                    for (int64_t g = 0; g < groups; g++) {                                                       \
                        float s = 0.0f;                                                                          \
                        for (int64_t d = 0; d < head_dim; d++) s += qf[g][d] * row[d];                           \
                        scores[g * max_len + l] = s;                                                             \
                    }                                                                                            \
                }                                                                                                \
                float totals[MAX_GROUPS];                                                                        \
                for (int64_t g = 0; g < groups; g++) { /* softmax numerators; their sum divides at the end */   \
                    float *sg = scores + g * max_len, top = sg[0], total = 0.0f;                                 \
                    for (int64_t l = 1; l < len; l++) top = sg[l] > top ? sg[l] : top;                           \
                    for (int64_t l = 0; l < len; l++) {                                                          \
                        sg[l] = expf(sg[l] - top);                                                               \
                        total += sg[l];                                                                          \
                    }                                                                                            \
                    totals[g] = total;                                                                           \
                }                                                                                                \
                for (int64_t l = 0; l < len; l++) { /* values: each V row read once */                          \
                    const T *vr = vh + ctx[l] * head_dim;                                                        \
                    for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(vr[d]);                                 \
                    for (int64_t g = 0; g < groups; g++) {                                                       \
                        const float w = scores[g * max_len + l];                                                 \
                        for (int64_t d = 0; d < head_dim; d++) acc[g][d] += w * row[d];                          \
                    }                                                                                            \
                }                                                                                                \
                for (int64_t g = 0; g < groups; g++) {                                                           \
                    T *og = out + ((b * kv_heads + h) * groups + g) * head_dim;                                  \
                    for (int64_t d = 0; d < head_dim; d++) og[d] = STORE(acc[g][d] / totals[g]);                 \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        free(scores);                                                                                            \
        }                                                                                                        \
        return failed ? -2 : 0;                                                                                  \
    }

#define LOAD_FLOAT(x) (x)
#define STORE_FLOAT(x) (x)
DEFINE_DECODE(paged_decode_float32, float, LOAD_FLOAT, STORE_FLOAT)
DEFINE_DECODE(paged_decode_bfloat16, uint16_t, bf16_to_float, float_to_bf16)
