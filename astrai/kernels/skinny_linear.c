/* Products of a few rows by a weight matrix: out[m, n] = x[m, :] . w[n, :] + bias[n], for the m rows of a decode
 * step, from a copy of the weight laid out for this loop.
 *
 * Why: oneDNN computes such a product in about the time of this loop, but torch's call into it (ideep's tensors,
 * descriptors, primitive-cache lookup and scratchpad, per call) cost about 12 us more (an 8-row product by a 384 x 256
 * bfloat16 weight: 18.8 us a call, 5-7 of them in oneDNN; one run), and a decode step makes 25 of them on the
 * embedded model and 121 on a SmolLM2-135M-shaped one. ``astrai/skinny_linear.py`` gives the measurements and where
 * the boundary in rows lies.
 *
 * Layouts (n_pad: N rounded up to 16, the padding columns zero):
 *   float32:  w[n_pad / 16][K][16]: for each block of 16 output columns, its weights k after k, 16 side by side;
 *   bfloat16: w[n_pad / 16][K / 2][16][2]: the same, k in pairs (k even, k odd) next to each other, as the
 *             AVX512-BF16 dot product instruction takes them (K even).
 * x[m, k] at x[m * x_row + k]; out[m, n] at out[m * out_row + n], only its N columns written. Work items are pairs of
 * column blocks, split over ``threads`` OpenMP threads (torch's own pool, as in paged_attention.c); each item takes
 * the rows ROWS at a time, its 2 x ROWS accumulators in registers while it walks K. Everything accumulates in
 * float32; bfloat16 results are rounded to nearest even, as torch rounds.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define LANES 16
#define ROWS 8   /* rows of x per pass over an item's weights */
#define BLOCKS 2 /* column blocks per work item */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

/* 1 where the bfloat16 product is built: it needs the CPU's bfloat16 dot product (AVX512-BF16). Without it, the
 * same loop as float32 multiply-adds took up to twice oneDNN's time on the larger weights (one run, AMD EPYC): the
 * caller keeps oneDNN there, and skinny_linear_bfloat16 refuses every call. */
int skinny_bfloat16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* The columns of one item (blocks first .. first + count - 1) for rows r0 .. r0 + rows - 1, out of acc. */
#define STORE_ITEM(T, LOAD, STORE)                                                                                 \
    for (int r = 0; r < rows; r++)                                                                                 \
        for (int b = 0; b < count; b++) {                                                                          \
            const int64_t column = (first + b) * LANES;                                                            \
            const int64_t width = n - column < LANES ? n - column : LANES;                                         \
            T *o = out + (r0 + r) * out_row + column;                                                              \
            for (int64_t i = 0; i < width; i++) {                                                                  \
                o[i] = STORE(acc[r][b][i] + (bias != NULL ? LOAD(bias[column + i]) : 0.0f));                       \
            }                                                                                                      \
        }

#define IDENTITY(x) (x)

int skinny_linear_float32(const float *x, int64_t x_row, const float *w, const float *bias, float *out,
                          int64_t out_row, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t blocks = (n + LANES - 1) / LANES, items = (blocks + BLOCKS - 1) / BLOCKS;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t item = 0; item < items; item++) {
        const int64_t first = item * BLOCKS;
        const int count = blocks - first < BLOCKS ? (int)(blocks - first) : BLOCKS;
        const float *wb[BLOCKS];
        for (int b = 0; b < BLOCKS; b++) wb[b] = w + (first + (b < count ? b : 0)) * k * LANES;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            vec acc[ROWS][BLOCKS] = {{{0}}};
            for (int64_t j = 0; j < k; j++) {
                vec wv[BLOCKS];
                for (int b = 0; b < BLOCKS; b++) memcpy(&wv[b], wb[b] + j * LANES, sizeof(vec));
                for (int r = 0; r < ROWS; r++) {
                    if (r >= rows) break;
                    const float xj = x[(r0 + r) * x_row + j];
                    for (int b = 0; b < BLOCKS; b++) acc[r][b] += xj * wv[b];
                }
            }
            STORE_ITEM(float, IDENTITY, IDENTITY)
        }
    }
    return 0;
}

#ifdef __AVX512BF16__
int skinny_linear_bfloat16(const uint16_t *x, int64_t x_row, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                           int64_t out_row, int64_t m, int64_t n, int64_t k, int threads) {
    if (k % 2) return -1;
    const int64_t blocks = (n + LANES - 1) / LANES, items = (blocks + BLOCKS - 1) / BLOCKS, pairs = k / 2;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t item = 0; item < items; item++) {
        const int64_t first = item * BLOCKS;
        const int count = blocks - first < BLOCKS ? (int)(blocks - first) : BLOCKS;
        const uint32_t *wb[BLOCKS]; /* one uint32 per (column, pair of k) */
        for (int b = 0; b < BLOCKS; b++) wb[b] = (const uint32_t *)w + (first + (b < count ? b : 0)) * pairs * LANES;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            vec acc[ROWS][BLOCKS] = {{{0}}}; /* GCC's __m512 is this same vector type */
            for (int64_t p = 0; p < pairs; p++) {
                __m512bh wv[BLOCKS];
                for (int b = 0; b < BLOCKS; b++) wv[b] = (__m512bh)_mm512_loadu_si512(wb[b] + p * LANES);
                for (int r = 0; r < ROWS; r++) {
                    if (r >= rows) break;
                    uint32_t pair; /* x[r, 2p] and x[r, 2p + 1], in every lane */
                    memcpy(&pair, x + (r0 + r) * x_row + 2 * p, sizeof pair);
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
                    for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
                }
            }
            STORE_ITEM(uint16_t, bf16_to_float, float_to_bf16)
        }
    }
    return 0;
}
#else
int skinny_linear_bfloat16(const uint16_t *x, int64_t x_row, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                           int64_t out_row, int64_t m, int64_t n, int64_t k, int threads) {
    return -1;
}
#endif
