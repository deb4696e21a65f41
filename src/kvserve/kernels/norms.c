/* Gemma's RMSNorm fused with what surrounds it in a decoder layer, and the sampling
 * passes over the vocabulary (CPU).
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

#define ROW_CHUNK 1024 /* a row of the vocabulary is read in chunks of this many values */

/* The length of chunk c of a row of V values. */
static inline int chunk_len(int64_t V, int64_t c) {
    return V - c * ROW_CHUNK < ROW_CHUNK ? (int)(V - c * ROW_CHUNK) : ROW_CHUNK;
}

/* out[b] = the first index of the largest value of row b (rows of V, contiguous), as
 * torch's max(dim) gives it: one vectorised pass, a scalar look only at the chunks that
 * raise the maximum. (Rows holding NaN give an unspecified index.) */
void kvs_argmax(const void *x, int B, int64_t V, int is_bf16, int64_t *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int b = 0; b < B; b++) {
        float best = -INFINITY;
        int64_t at = 0;
        float buf[ROW_CHUNK];
        for (int64_t i0 = 0; i0 < V; i0 += ROW_CHUNK) {
            const int m = chunk_len(V, i0 / ROW_CHUNK);
            load_row(x, b * V + i0, buf, m, is_bf16);
            float top = -INFINITY;
            #pragma omp simd reduction(max : top)
            for (int i = 0; i < m; i++) top = buf[i] > top ? buf[i] : top;
            if (top > best)
                for (int i = 0; i < m; i++)
                    if (buf[i] == top) { best = top; at = i0 + i; break; }
        }
        out[b] = at;
    }
}

/* out[k] = a token of row rows[k] of x drawn with probability softmax(x / T): the first
 * index whose cumulative e^((x - max) / T) passes u[k] times their total (u in [0, 1);
 * inv_t[k] = 1 / T). Three passes over the row and nothing stored but one sum per ROW_CHUNK:
 * the maximum, the chunks' sums, then a rescan of the one chunk the draw falls in
 * (as torch ops: a float32 copy of the logits, their division, softmax and a cumulative
 * sum, each a pass that writes the whole [rows, vocab] again). */
void kvs_sample(const void *x, const int32_t *rows, int K, int64_t V, int is_bf16,
                const float *inv_t, const double *u, int64_t *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int k = 0; k < K; k++) {
        const int64_t base = (int64_t)rows[k] * V, nc = (V + ROW_CHUNK - 1) / ROW_CHUNK;
        const float it = inv_t[k];
        float buf[ROW_CHUNK], m = -INFINITY;
        double sums[nc], total = 0.;
        for (int64_t c = 0; c < nc; c++) {
            const int n = chunk_len(V, c);
            load_row(x, base + c * ROW_CHUNK, buf, n, is_bf16);
            #pragma omp simd reduction(max : m)
            for (int i = 0; i < n; i++) m = buf[i] > m ? buf[i] : m;
        }
        for (int64_t c = 0; c < nc; c++) {
            const int n = chunk_len(V, c);
            load_row(x, base + c * ROW_CHUNK, buf, n, is_bf16);
            float s = 0.f;
            #pragma omp simd reduction(+ : s)
            for (int i = 0; i < n; i++) s += exp_le0((buf[i] - m) * it);
            sums[c] = s;
            total += s;
        }
        const double target = u[k] * total;
        double run = 0.;
        int64_t c = 0;
        while (c < nc - 1 && run + sums[c] <= target) run += sums[c++];
        const int n = chunk_len(V, c);
        load_row(x, base + c * ROW_CHUNK, buf, n, is_bf16);
        int64_t pick = -1;
        for (int i = 0; i < n; i++) {
            const float e = exp_le0((buf[i] - m) * it);
            if (e > 0.f) pick = c * ROW_CHUNK + i;  /* the last token with mass, if rounding */
            run += e;                          /* carries the sum past the chunk's end */
            if (e > 0.f && run > target) break;
        }
        if (pick < 0)  /* the draw rounded past every token with mass: the most likely one */
            kvs_argmax((const char *)x + base * (is_bf16 ? 2 : 4), 1, V, is_bf16, &pick, 1);
        out[k] = pick;
    }
}
