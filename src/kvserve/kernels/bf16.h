/* bfloat16 <-> float32, loads/stores of float32-or-bfloat16 rows, and the exp the kernels
 * share. */
#ifndef KVS_BF16_H
#define KVS_BF16_H

#include <math.h>
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

/* e^x for x <= 0, in three pieces that take a float or any GCC float vector (AVX-512
 * intrinsics' __m512 too): Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2 (n is x
 * EXP_LOG2E rounded to an integer by the caller, EXP_R gives r), e^r a degree-6 Taylor
 * polynomial (EXP_TAYLOR6), then the caller's times 2^n. Within 2 ulp of expf. */
#define EXP_LOG2E 1.44269504f
#define EXP_R(x, n) ((x) - (n) * 0.693145752f - (n) * 1.42860677e-6f)
#define EXP_TAYLOR6(r)                                                                        \
    ((((((((r) * (1.f / 720) + 1.f / 120) * (r) + 1.f / 24) * (r) + 1.f / 6) * (r) + 0.5f) *   \
       (r) + 1.f) * (r)) + 1.f)

/* f as a bfloat16 tensor would hold it */
static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

/* e^x for x <= 0 (the pieces above), 2^n built in the exponent bits; 0 below -87 (where 2^n
 * would leave the normal range). */
static inline float exp_le0(float x) {
    const float xc = x < -87.f ? -87.f : x;
    const float n = rintf(xc * EXP_LOG2E), r = EXP_R(xc, n);
    bits b; b.u = (uint32_t)((int32_t)n + 127) << 23;
    return x < -87.f ? 0.f : EXP_TAYLOR6(r) * b.f;
}

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
