/* x @ W.T for a few rows of x, with W in Q8_0 blocks (CPU): the decode-time matmul.
 *
 * At one to four tokens a linear layer is bound by reading its weight, so the fewer bytes
 * per weight the faster: Q8_0 (32 int8 values sharing one float scale, 1.125 bytes a
 * weight) reads half of fp16's bytes and a quarter of float32's. No library kernel here
 * reads int8 weights against float activations fast on AVX2 (fbgemm's int8 also quantizes
 * the activations, which costs quality; torch's weight-only int8 op has no AVX2 kernel).
 *
 * Activations and sums stay float32: the only rounding is the weights' to Q8_0. Each row
 * of W is one OpenMP item; the weights of a block are widened once and used for every row
 * of x. The AVX2+FMA path is chosen at compile time (-march=native); other CPUs take the
 * plain loop, which the compiler vectorises as far as it can.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 widen8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* One row of W (nb blocks) against M <= 4 rows of x. */
static void row_dot(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                    int nb, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
        const __m256 w0 = widen8(lo), w1 = widen8(_mm_srli_si128(lo, 8));
        const __m256 w2 = widen8(hi), w3 = widen8(_mm_srli_si128(hi, 8));
        const __m256 scale = _mm256_broadcast_ss(d + b);
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * ldx + 32 * b;
            __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xm));
            s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), s);
            s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), s);
            s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), s);
            acc[m] = _mm256_fmadd_ps(scale, s, acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum8(acc[m]);
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
 * Returns 1 if K is not a multiple of 32 or M is out of range, else 0. */
int kvs_q8_matmul(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                  int64_t N, int K, float *y, int threads) {
    if (K % 32 || M < 1 || M > 4) return 1;
    const int nb = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float out[4];
        row_dot(q + n * K, d + n * nb, x, ldx, M, nb, out);
        for (int m = 0; m < M; m++) y[m * N + n] = out[m];
    }
    return 0;
}
