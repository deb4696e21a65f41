/* Gemma's RMSNorm fused with what surrounds it in a decoder layer (CPU).
 *
 * A norm written as torch ops is ~8 small ops, each a pass over memory and a
 * dispatch; at decode batch sizes the dispatch dominates. Each function here
 * is one pass per row and keeps torch's rounding points, so results differ
 * from the op-by-op version only by float32 summation order in the mean:
 *   norm(x) = dtype((x * rsqrt(mean(x^2) + eps)) * scale),  in float32;
 *   x + norm(h) rounds the norm to dtype first, then the sum;
 *   rope(y) = dtype(dtype(y * cos) + dtype(roll(y, D/2) * signed_sin)).
 */
#include <math.h>

#include "bf16.h"

#define MAX_ROW 8192  /* longest row, in elements (rows live on the stack); cpu.py too */

/* y[d] = dtype((x[d] * r) * scale[d]) with r = 1 / sqrt(mean(x^2) + eps), in place */
static inline void norm_row(float *restrict x, const float *restrict scale, int D, float eps,
                            int is_bf16) {
    float ss = 0.f;
    #pragma omp simd reduction(+ : ss)
    for (int d = 0; d < D; d++) ss += x[d] * x[d];
    const float r = 1.f / sqrtf(ss / (float)D + eps);
    if (is_bf16) {
        #pragma omp simd
        for (int d = 0; d < D; d++) x[d] = bf16_round(x[d] * r * scale[d]);
    } else {
        #pragma omp simd
        for (int d = 0; d < D; d++) x[d] = x[d] * r * scale[d];
    }
}

/* Rows x[t][h][:D] (strides in elements) -> norm with scale[h][:D] (none where scale is
 * NULL), then, when cos is given, rotary embedding with cos/signed_sin [t][:D] (contiguous
 * rows, x's dtype). y may be x (in place). D <= MAX_ROW. */
void kvs_norm_rope(const void *x, int64_t x_ts, int64_t x_hs, int n, int H, int D,
                   const float *scale, float eps, const void *cos, const void *sin,
                   int is_bf16, void *y, int64_t y_ts, int64_t y_hs, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n * H * D > PARALLEL_MIN)
    for (int t = 0; t < n; t++) {
        float row[MAX_ROW], c[MAX_ROW], s[MAX_ROW];
        if (cos) {
            load_row(cos, (int64_t)t * D, c, D, is_bf16);
            load_row(sin, (int64_t)t * D, s, D, is_bf16);
        }
        for (int h = 0; h < H; h++) {
            load_row(x, t * x_ts + h * x_hs, row, D, is_bf16);
            if (scale) norm_row(row, scale + (size_t)h * D, D, eps, is_bf16);
            if (cos) {
                float out[MAX_ROW];
                const int half = D / 2;
                for (int d = 0; d < D; d++) {
                    const float rolled = row[d < half ? d + half : d - half];
                    out[d] = (is_bf16 ? bf16_round(row[d] * c[d]) + bf16_round(rolled * s[d])
                                     : row[d] * c[d] + rolled * s[d]);
                }
                store_row(y, t * y_ts + h * y_hs, out, D, is_bf16);
            } else {
                store_row(y, t * y_ts + h * y_hs, row, D, is_bf16);
            }
        }
    }
}

/* Residual step, rows of D: x += norm(h, w_add) in place (x += h where w_add is NULL: a
 * pre-norm block's add); then, when w_next is given, y = norm(x, w_next) (the next
 * sub-block's input). All rows contiguous. D <= MAX_ROW. */
void kvs_add_norm(void *x, const void *h, int n, int D, const float *w_add,
                  const float *w_next, float eps, int is_bf16, void *y, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n * D > PARALLEL_MIN)
    for (int t = 0; t < n; t++) {
        float a[MAX_ROW], b[MAX_ROW];
        load_row(h, (int64_t)t * D, b, D, is_bf16);
        if (w_add) norm_row(b, w_add, D, eps, is_bf16);
        load_row(x, (int64_t)t * D, a, D, is_bf16);
        #pragma omp simd
        for (int d = 0; d < D; d++) a[d] += b[d];
        store_row(x, (int64_t)t * D, a, D, is_bf16);
        if (w_next) {
            load_row(x, (int64_t)t * D, a, D, is_bf16);  /* the sum as x now holds it */
            norm_row(a, w_next, D, eps, is_bf16);
            store_row(y, (int64_t)t * D, a, D, is_bf16);
        }
    }
}
