/* x @ W.T for a few rows of x, with W in Q8_0 blocks (CPU): the decode-time matmul.
 *
 * At one to four tokens a linear layer is bound by reading its weight, so the fewer bytes
 * per weight the faster: Q8_0 (32 int8 values sharing one float scale, 1.125 bytes a
 * weight) reads half of fp16's bytes and a quarter of float32's. No library kernel here
 * reads int8 weights against float activations fast on AVX2 (fbgemm's int8 also quantizes
 * the activations, which costs quality; torch's weight-only int8 op has no AVX2 kernel).
 *
 * On AVX2 the activations are rounded to int16 blocks of 32 with a float scale each (an
 * error of at most 2^-16 of a block's largest value, against Q8_0's 2^-8 on the weights);
 * each block's products are summed exactly in int32 and the blocks in float32. (llama.cpp
 * rounds the activations to int8 here.) Each row of W is one OpenMP item; the weights of a
 * block are widened once and used for every row of x. The AVX2+FMA path is chosen at
 * compile time (-march=native); other CPUs take the plain float32 loop, which the compiler
 * vectorises as far as it can.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define INT16_PATH 1

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row of W (nb blocks) against M <= 4 rows of x given as int16 blocks: xq[m] holds
 * row m's K values, xd[m][b] the scale of its block b. Widening the weights to int16
 * and multiplying with madd (pairs summed into int32, exact: |w x| < 2^22) takes about
 * half the instructions of widening them to float32, and a step of a few tokens is
 * bound by these instructions, not by memory. */
static void row_dot(const int8_t *q, const float *d, const int16_t *const *xq,
                    const float *const *xd, int M, int nb, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
        for (int m = 0; m < M; m++) {
            const __m256i *xm = (const __m256i *)(xq[m] + 32 * b);
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xm)),
                                               _mm256_madd_epi16(w1, _mm256_loadu_si256(xm + 1)));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[b] * xd[m][b]),
                                     acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum8(acc[m]);
}

/* Row x (K values) to int16 blocks of 32 with one scale each: x = xd[b] * xq[32 b + i],
 * rounded to nearest; the error is at most 2^-16 of the block's largest |x|. */
static void quantize_x16(const float *x, int nb, int16_t *xq, float *xd) {
    for (int b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float scale = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
        xd[b] = scale;
        for (int i = 0; i < 32; i++) xq[32 * b + i] = (int16_t)lrintf(xb[i] * inv);
    }
}
#else
static void row_dot(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                    int nb, float *out) {
    for (int m = 0; m < M; m++) {
        float acc = 0.f;
        for (int b = 0; b < nb; b++) {
            const float *xm = x + m * ldx + 32 * b;
            float s = 0.f;
            for (int i = 0; i < 32; i++) s += (float)q[32 * b + i] * xm[i];
            acc += d[b] * s;
        }
        out[m] = acc;
    }
}
#endif

/* y[m][n] = sum_b d[n][b] * sum_i q[n][32b + i] * x[m][32b + i] for m < M, M <= 4.
 * q: int8 [N][K], d: float [N][K/32], x: float rows of K (row stride ldx), y: [M][N].
 * On AVX2 the rows of x are first rounded to int16 blocks (see quantize_x16).
 * Returns 1 if K is not a multiple of 32 or M is out of range, 2 if scratch memory could
 * not be had, else 0. */
int kvs_q8_matmul(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                  int64_t N, int K, float *y, int threads) {
    if (K % 32 || M < 1 || M > 4) return 1;
    const int nb = K / 32;
#ifdef INT16_PATH
    int16_t *xq[4];
    float *xd[4];
    char *mem = malloc((size_t)M * ((size_t)K * sizeof(int16_t) + (size_t)nb * sizeof(float)));
    if (!mem) return 2;
    for (int m = 0; m < M; m++) {
        xq[m] = (int16_t *)mem + (size_t)m * K;
        xd[m] = (float *)((int16_t *)mem + (size_t)M * K) + (size_t)m * nb;
        quantize_x16(x + m * ldx, nb, xq[m], xd[m]);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float out[4];
        row_dot(q + n * K, d + n * nb, (const int16_t *const *)xq, (const float *const *)xd, M,
                nb, out);
        for (int m = 0; m < M; m++) y[m * N + n] = out[m];
    }
    free(mem);
#else
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float out[4];
        row_dot(q + n * K, d + n * nb, x, ldx, M, nb, out);
        for (int m = 0; m < M; m++) y[m * N + n] = out[m];
    }
#endif
    return 0;
}
