/* bfloat16 <-> float32 for the kernels: a bfloat16 is the high half of a float32. Included by paged_attention.c and
 * skinny_linear.c; astrai/native.py hashes it into both libraries' cache keys. */
#ifndef ASTRAI_BFLOAT16_H
#define ASTRAI_BFLOAT16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#endif
