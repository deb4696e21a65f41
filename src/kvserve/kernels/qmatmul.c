/* x @ W.T with W in Q8_0 blocks (CPU): every step size, decode to 2048-token prefill.
 *
 * Q8_0 (32 int8 values sharing one float scale, 1.125 bytes a weight) reads half of fp16's
 * bytes and a quarter of float32's, which is what a decode step of a few tokens is bound
 * by. No library kernel here reads int8 weights against float activations fast on AVX2
 * (fbgemm's int8 also quantizes the activations per tensor, which costs quality; torch's
 * weight-only int8 op has no AVX2 kernel).
 *
 * The activations are rounded to int16 blocks of 32 with a float scale each, once a call
 * (an error of at most 2^-16 of a block's largest value, against Q8_0's 2^-8 on the
 * weights; llama.cpp rounds them to int8). A block's 32 products are summed exactly in
 * int32 by vpmaddwd (16 int16 multiply-adds an AVX2 instruction, 32 with AVX-512; float32
 * FMA does 8 or 16) and the blocks in float32. The micro-kernel takes one output column
 * against a tile of 4 activation rows: the column's weight block is widened to int16 once
 * for the 4 rows, and the 4 rows' block sums are folded into one vector by a shuffle-add
 * tree, so converting and scaling them costs one instruction each for the 4 rows instead
 * of one per row. OpenMP splits the output columns into chunks; within a chunk every row
 * tile runs over the chunk's columns, so a chunk's weights stay in L2 and a row tile's
 * activations in L1.
 *
 * Paths, chosen by the compiler's feature macros (cpu.py builds with -march=native per CPU
 * feature set): AVX-512BW, AVX2+FMA, and a plain float32 loop for every other CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 4      /* activation rows per micro-kernel call */
#define CHUNK 64    /* output columns per OpenMP work item */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INT16_PATH 1
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512BW__)
/* The 4 rows' sums of 16 int32 lanes, folded into [r0 r1 r2 r3] per 128-bit quarter:
 * two rounds of interleave-and-add. */
INLINE __m512i fold4(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1),
                                       _mm512_unpackhi_epi32(p0, p1));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3),
                                       _mm512_unpackhi_epi32(p2, p3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

/* out[r] = sum_b d[b] * xs[4 b + r] * (q block b . x row r block b) for rows r < R (R a
 * compile-time constant; absent rows skip their multiply). A block of 32 int16 is one
 * register: one widening and one vpmaddwd per row. */
INLINE void tile_col(const int R, const int8_t *q, const float *d, const int16_t *x,
                     int64_t K, const float *xs, int nb, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * b)));
        __m512i p[TILE];
        for (int r = 0; r < TILE; r++)
            p[r] = r < R ? _mm512_madd_epi16(w, _mm512_loadu_si512(x + r * K + 32 * b))
                         : _mm512_setzero_si512();
        const __m512 scale = _mm512_mul_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(xs + 4 * b)),
                                           _mm512_set1_ps(d[b]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fold4(p[0], p[1], p[2], p[3])), scale, acc);
    }
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    float all[4];
    _mm_storeu_ps(all, s);
    for (int r = 0; r < R; r++) out[r] = all[r];
}
#else
/* Row r's block product: 8 int32 lanes (pairs summed by vpmaddwd, exact: |w x| < 2^22). */
INLINE __m256i block_dot(__m256i w0, __m256i w1, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* out[r] = sum_b d[b] * xs[4 b + r] * (q block b . x row r block b) for rows r < R (R a
 * compile-time constant; absent rows skip their multiplies). Two rounds of horizontal adds
 * leave [r0 r1 r2 r3] sums of each 128-bit half, converted and scaled together. */
INLINE void tile_col(const int R, const int8_t *q, const float *d, const int16_t *x,
                     int64_t K, const float *xs, int nb, float *out) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 * b)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 * b + 16)));
        __m256i p[TILE];
        for (int r = 0; r < TILE; r++)
            p[r] = r < R ? block_dot(w0, w1, x + r * K + 32 * b) : _mm256_setzero_si256();
        const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                               _mm256_hadd_epi32(p[2], p[3]));
        const __m256 scale = _mm256_mul_ps(_mm256_broadcast_ps((const __m128 *)(xs + 4 * b)),
                                           _mm256_set1_ps(d[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
    }
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    float all[4];
    _mm_storeu_ps(all, s);
    for (int r = 0; r < R; r++) out[r] = all[r];
}
#endif

/* Row x (K values) to int16 blocks of 32 with one scale each: x = xd[b] * xq[32 b + i],
 * rounded to nearest; the error is at most 2^-16 of the block's largest |x|. The scales go
 * to xd[4 b] (the row's place in its tile's interleaved scales). */
static void quantize_x16(const float *x, int nb, int16_t *xq, float *xd) {
    for (int b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        xd[4 * b] = amax / 32767.f;
        for (int i = 0; i < 32; i++) xq[32 * b + i] = (int16_t)lrintf(xb[i] * inv);
    }
}

/* One tile of R rows (x: its int16 rows, xs: its scales) against columns [n0, n1). */
static void tile_cols(int R, const int8_t *q, const float *d, const int16_t *x, int K,
                      const float *xs, int64_t n0, int64_t n1, int64_t N, float *y) {
    const int nb = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        float out[TILE];
        const int8_t *qn = q + n * K;
        const float *dn = d + n * nb;
        switch (R) {  /* one instance per row count: the row loops unroll */
        case 1: tile_col(1, qn, dn, x, K, xs, nb, out); break;
        case 2: tile_col(2, qn, dn, x, K, xs, nb, out); break;
        case 3: tile_col(3, qn, dn, x, K, xs, nb, out); break;
        default: tile_col(4, qn, dn, x, K, xs, nb, out); break;
        }
        for (int r = 0; r < R; r++) y[r * N + n] = out[r];
    }
}

static int q8_gemm(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                   int64_t N, int K, float *y, int threads) {
    const int nb = K / 32, tiles = (M + TILE - 1) / TILE;
    /* xq: M rows of int16; xs: per tile and block, its rows' scales side by side */
    int16_t *xq = malloc((size_t)M * K * sizeof(int16_t));
    float *xs = calloc((size_t)tiles * nb * TILE, sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return 2;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            quantize_x16(x + m * ldx, nb, xq + (size_t)m * K,
                         xs + (size_t)(m / TILE) * nb * TILE + m % TILE);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < (N + CHUNK - 1) / CHUNK; c++) {
            const int64_t n0 = c * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
            for (int t = 0; t < tiles; t++) {
                const int R = M - t * TILE < TILE ? M - t * TILE : TILE;
                tile_cols(R, q, d, xq + (size_t)t * TILE * K, K, xs + (size_t)t * nb * TILE,
                          n0, n1, N, y + (size_t)t * TILE * N);
            }
        }
    }
    free(xq);
    free(xs);
    return 0;
}
#else
/* The plain path: float32 products of the int8 weights and the float32 activations. */
static int q8_gemm(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                   int64_t N, int K, float *y, int threads) {
    const int nb = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int m = 0; m < M; m++) {
            float acc = 0.f;
            for (int b = 0; b < nb; b++) {
                const int8_t *qb = q + n * K + 32 * b;
                const float *xb = x + m * ldx + 32 * b;
                float s = 0.f;
                for (int i = 0; i < 32; i++) s += (float)qb[i] * xb[i];
                acc += d[n * nb + b] * s;
            }
            y[m * N + n] = acc;
        }
    }
    return 0;
}
#endif

/* y[m][n] = sum_b d[n][b] * sum_i q[n][32b + i] * x[m][32b + i] for m < M.
 * q: int8 [N][K], d: float [N][K/32], x: float rows of K (row stride ldx), y: [M][N].
 * Returns 1 if K is not a multiple of 32 or M < 0, 2 if scratch memory could not be had,
 * else 0. */
int kvs_q8_matmul(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                  int64_t N, int K, float *y, int threads) {
    if (K % 32 || M < 0) return 1;
    if (M == 0 || N == 0) return 0;
    return q8_gemm(q, d, x, ldx, M, N, K, y, threads);
}
