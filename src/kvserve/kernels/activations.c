/* The gated MLPs' activations, gelu_tanh(gate) * up (Gemma) and silu(gate) * up (Llama's
 * SwiGLU), in one pass (CPU).
 *
 * As torch ops it is two passes over a [tokens, intermediate] buffer (gelu, then the
 * product), and torch's tanh-GELU is slow on bf16 (~1 ns per element here). This is
 * written so the compiler vectorises all of it; each value is rounded where the ops round
 * it (gelu's result, then the product), so results differ only where this exp's last ulp
 * differs from the library's tanh and survives that rounding.
 */
/* Without AVX-512's masks GCC vectorises the selects below (and exp_le0's) only if float
 * compares may not trap: with traps assumed, the AVX2 build ran these loops one value at
 * a time (5.6% of an AVX2 batch-32 run). Results do not change: no value is computed
 * otherwise, only both sides of a select where one was. */
#pragma GCC optimize("no-trapping-math")

#include <math.h>

#include "bf16.h"

/* 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3); sigmoid from
 * e = e^(-2|u|) <= 1, so nothing overflows. */
static inline float gelu_tanh(float x) {
    const float u = 0.7978845608f * (x + 0.044715f * (x * x * x));
    const float e = exp_le0(-2.f * fabsf(u));
    return x * ((u >= 0.f ? 1.f : e) / (1.f + e)); /* one division: no branch to vectorise */
}

/* x sigmoid(x), the sigmoid from e = e^(-|x|) <= 1 as above. */
static inline float silu(float x) {
    const float e = exp_le0(-fabsf(x));
    return x * ((x >= 0.f ? 1.f : e) / (1.f + e));
}

/* out[t][:I] = act(x[t][:I]) * x[t][I:2I]; rows of x are 2I long, out contiguous. `use_silu`
 * is a constant where each entry point inlines this, so each gets its own loops. */
static inline void act_mul(const void *x, int n, int I, int is_bf16, void *out, int nthreads,
                           const int use_silu) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if ((int64_t)n * I > PARALLEL_MIN)
    for (int t = 0; t < n; t++) {
        if (is_bf16) {
            const uint16_t *g = (const uint16_t *)x + (size_t)t * 2 * I, *up = g + I;
            uint16_t *o = (uint16_t *)out + (size_t)t * I;
            #pragma omp simd
            for (int i = 0; i < I; i++) {
                const float v = bf16_load(g[i]);
                const float a = bf16_load(bf16_store(use_silu ? silu(v) : gelu_tanh(v)));
                o[i] = bf16_store(a * bf16_load(up[i]));
            }
        } else {
            const float *g = (const float *)x + (size_t)t * 2 * I, *up = g + I;
            float *o = (float *)out + (size_t)t * I;
            #pragma omp simd
            for (int i = 0; i < I; i++) o[i] = (use_silu ? silu(g[i]) : gelu_tanh(g[i])) * up[i];
        }
    }
}

/* gelu_tanh(gate) * up (Gemma) and silu(gate) * up (Llama's SwiGLU) of [gate | up] rows. */
void kvs_gelu_mul(const void *x, int n, int I, int is_bf16, void *out, int nthreads) {
    act_mul(x, n, I, is_bf16, out, nthreads, 0);
}

void kvs_silu_mul(const void *x, int n, int I, int is_bf16, void *out, int nthreads) {
    act_mul(x, n, I, is_bf16, out, nthreads, 1);
}
