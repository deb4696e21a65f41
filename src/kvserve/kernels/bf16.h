/* bfloat16 <-> float32 and loads/stores of float32-or-bfloat16 rows, shared by the kernels. */
#ifndef KVS_BF16_H
#define KVS_BF16_H

#include <stdint.h>
#include <string.h>

typedef union { uint32_t u; float f; } bits;

/* Values from which the row-wise kernels (norms, activations) split their rows over the
 * threads: an OpenMP fork and join costs a few microseconds, a value ~1 ns. */
#define PARALLEL_MIN 8192

static inline float bf16_load(uint16_t x) { bits b; b.u = (uint32_t)x << 16; return b.f; }

static inline uint16_t bf16_store(float f) {  /* round to nearest even, as torch does */
    bits b; b.f = f;
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

/* f as a bfloat16 tensor would hold it */
static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

/* dst[0:n] = src[i:i + n] as float32, src float32 or bfloat16 */
static inline void load_row(const void *src, int64_t i, float *restrict dst, int n,
                            int is_bf16) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src + i;
        #pragma omp simd
        for (int d = 0; d < n; d++) dst[d] = bf16_load(s[d]);
    } else {
        memcpy(dst, (const float *)src + i, sizeof(float) * (size_t)n);
    }
}

/* dst[i:i + n] = src[0:n], rounded to bfloat16 if dst is */
static inline void store_row(void *dst, int64_t i, const float *restrict src, int n,
                             int is_bf16) {
    if (is_bf16) {
        uint16_t *o = (uint16_t *)dst + i;
        #pragma omp simd
        for (int d = 0; d < n; d++) o[d] = bf16_store(src[d]);
    } else {
        memcpy((float *)dst + i, src, sizeof(float) * (size_t)n);
    }
}

#endif
