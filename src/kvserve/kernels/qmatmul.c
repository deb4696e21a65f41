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
 * FMA does 8 or 16) and the blocks in float32. The micro-kernel takes 2 output columns
 * against a tile of 4 activation rows: each column's weights are widened to int16 once for
 * the 4 rows, and each row's activations loaded once for the 2 columns; every group of 4
 * blocks, each (row, column) sum is converted and scaled in float32 (cvt, mul, fma: as
 * many instructions as its 4 vpdpwssd, which is why bf16 oneDNN stays ahead from ~16 rows
 * on CPUs with AVX-512 BF16). OpenMP splits the output columns into chunks; within a chunk every row
 * tile runs over the chunk's columns, so a chunk's weights stay in L2 and a row tile's
 * activations in L1.
 *
 * Paths, chosen by the compiler's feature macros (cpu.py builds with -march=native per CPU
 * feature set): AVX-512BW (with VNNI's vpdpwssd where the CPU has it: 10-20% faster from
 * 8 rows on a Zen 4 EPYC), AVX2+FMA, and a plain float32 loop for every other CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 4      /* activation rows per micro-kernel call */
#define COLS 2      /* output columns per micro-kernel call */
#define GROUP 128   /* weights per interleaved group: 4 blocks */
#define CHUNK 64    /* output columns per OpenMP work item */
#define AHEAD 4     /* columns ahead whose weights are prefetched */

/* Position of element j of block k (k < 4) within its group (see kvs_q8_pack): 16-value
 * steps i, each holding pair i of every (half, block) lane side by side. */
static inline int group_pos(int k, int j) {
    const int half = j / 16, i = (j % 16) / 2;
    return 16 * i + 2 * (4 * half + k) + j % 2;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512BW__)
/* 16 int32 lanes: two 16-value steps at once (lanes 8-15 repeat 0-7's (half, block)). */
typedef __m512i ivec;
typedef __m512 fvec;
#define STEP 32
#define LOAD_W(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD_X(p) _mm512_loadu_si512(p)
#if defined(__AVX512VNNI__)
#define DOT(acc, w, x) _mm512_dpwssd_epi32(acc, w, x) /* vpmaddwd and the add in one */
#else
#define DOT(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif
#define IZERO _mm512_setzero_si512
#define FZERO _mm512_setzero_ps
#define TO_F _mm512_cvtepi32_ps
#define FMUL _mm512_mul_ps
#define FMA _mm512_fmadd_ps
#define BCAST4(p) _mm512_broadcast_f32x4(_mm_loadu_ps(p))
#define HSUM _mm512_reduce_add_ps
#else
/* 8 int32 lanes: one 16-value step. */
typedef __m256i ivec;
typedef __m256 fvec;
#define STEP 16
#define LOAD_W(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_X(p) _mm256_loadu_si256((const __m256i *)(p))
#define DOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#define IZERO _mm256_setzero_si256
#define FZERO _mm256_setzero_ps
#define TO_F _mm256_cvtepi32_ps
#define FMUL _mm256_mul_ps
#define FMA _mm256_fmadd_ps
#define BCAST4(p) _mm256_broadcast_ps((const __m128 *)(p))
static inline float HSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* y[r][c] for R rows of x (int16, interleaved like the weights; scales xd, row stride
 * Kp / 32) against C columns of q (d: their scales), R <= ROWS, C <= COLS compile-time
 * constants so the loops unroll into registers. Within a group every lane sums exactly in
 * int32 (16 products of |w x| < 2^22); the lanes' 4 blocks are scaled in float32 at the
 * end of the group. */
INLINE void tile(const int R, const int C, const int8_t *q, const float *d, const int16_t *x,
                 const float *xd, int Kp, int64_t N, float *y) {
    const int nb = Kp / 32;
    fvec acc[ROWS][COLS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = FZERO();
    for (int g = 0; g < Kp; g += GROUP) {
        /* Weights streamed from memory (the LM head at decode) wait on their loads
         * otherwise: two columns read side by side defeat the hardware prefetcher. */
        for (int c = 0; c < C; c++) {
            __builtin_prefetch(q + (int64_t)(AHEAD + c) * Kp + g);
            __builtin_prefetch(q + (int64_t)(AHEAD + c) * Kp + g + 64);
        }
        ivec sum[ROWS][COLS];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) sum[r][c] = IZERO();
        for (int i = 0; i < GROUP; i += STEP) {
            ivec w[COLS];
            for (int c = 0; c < C; c++) w[c] = LOAD_W(q + (int64_t)c * Kp + g + i);
            for (int r = 0; r < R; r++) {
                const ivec xv = LOAD_X(x + (int64_t)r * Kp + g + i);
                for (int c = 0; c < C; c++) sum[r][c] = DOT(sum[r][c], w[c], xv);
            }
        }
        for (int c = 0; c < C; c++) {
            const fvec dc = BCAST4(d + (int64_t)c * nb + g / 32);
            for (int r = 0; r < R; r++)
                acc[r][c] = FMA(TO_F(sum[r][c]), FMUL(dc, BCAST4(xd + (int64_t)r * nb + g / 32)),
                                acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * N + c] = HSUM(acc[r][c]);
}

/* One instance per (rows, columns) shape: tile()'s loops unroll only for constants. */
#define TILE_CASE(R, C) case (R - 1) * COLS + C - 1: tile(R, C, q, d, x, xd, Kp, N, y); break;
static void tile_any(int R, int C, const int8_t *q, const float *d, const int16_t *x,
                     const float *xd, int Kp, int64_t N, float *y) {
    switch ((R - 1) * COLS + C - 1) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(2, 1) TILE_CASE(2, 2)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(4, 1) TILE_CASE(4, 2)
    }
}

/* Row x (K values) to int16 blocks of 32 with one scale each, x = xd[b] * xq[...], rounded
 * to nearest (the error is at most 2^-16 of the block's largest |x|), stored interleaved as
 * the weights are; blocks past K (up to Kp) are zero. The rounding loops vectorise (rintf
 * is one instruction; lrintf and fmaxf stay library calls under -fmath-errno); the
 * interleave then moves pairs of values as 32-bit words. */
static void quantize_x16(const float *x, int K, int Kp, int16_t *xq, float *xd) {
    for (int g = 0; g < Kp; g += GROUP) {
        int16_t plain[GROUP];
        for (int k = 0; k < 4; k++) {
            const int b = g / 32 + k;
            const float *xb = x + 32 * b;
            int16_t *v = plain + 32 * k;
            float amax = 0.f;
            for (int j = 0; b * 32 < K && j < 32; j++)
                amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            const float inv = amax > 0.f ? 32767.f / amax : 0.f;
            xd[b] = amax / 32767.f;
            if (amax > 0.f)
                for (int j = 0; j < 32; j++) v[j] = (int16_t)rintf(xb[j] * inv);
            else
                for (int j = 0; j < 32; j++) v[j] = 0;
        }
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 32; j += 2) memcpy(xq + g + group_pos(k, j), plain + 32 * k + j, 4);
    }
}

static int q8_gemm(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                   int64_t N, int K, float *y, int threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, nb = Kp / 32;
    int16_t *xq = malloc((size_t)M * Kp * sizeof(int16_t));
    float *xd = malloc((size_t)M * nb * sizeof(float));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return 2;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            quantize_x16(x + m * ldx, K, Kp, xq + (size_t)m * Kp, xd + (size_t)m * nb);
        /* A chunk's weights stay in L2 while every row tile (in L1) passes over them. One
         * row (decode) is bound by reading the weights: one column at a time streams them
         * fastest (measured on the 262k-row LM head). */
        const int cols = M == 1 ? 1 : COLS;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += CHUNK) {
            const int64_t n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
            for (int m = 0; m < M; m += ROWS)
                for (int64_t n = n0; n < n1; n += cols)
                    tile_any(M - m < ROWS ? M - m : ROWS, n1 - n < cols ? n1 - n : cols,
                             q + n * Kp, d + n * nb, xq + (size_t)m * Kp, xd + (size_t)m * nb,
                             Kp, N, y + (size_t)m * N + n);
        }
    }
    free(xq);
    free(xd);
    return 0;
}
#else
/* The plain path: float32 products of the int8 weights and the float32 activations. */
static int q8_gemm(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                   int64_t N, int K, float *y, int threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, nb = Kp / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int m = 0; m < M; m++) {
            float acc = 0.f;
            for (int b = 0; b < K / 32; b++) {
                const int8_t *group = q + n * Kp + (b / 4) * GROUP;
                const float *xb = x + m * ldx + 32 * b;
                float s = 0.f;
                for (int j = 0; j < 32; j++) s += (float)group[group_pos(b % 4, j)] * xb[j];
                acc += d[n * nb + b] * s;
            }
            y[m * N + n] = acc;
        }
    }
    return 0;
}
#endif

/* y[m][n] = sum_b d[n][b] * sum_j W[n][32b + j] * x[m][32b + j] for m < M, with W's int8
 * values q and scales d as kvs_q8_pack lays them out (Kp = K rounded up to 128);
 * x: float rows of K (row stride ldx), y: [M][N]. Returns 1 if K is not a multiple of 32
 * or M < 0, 2 if scratch memory could not be had, else 0. */
int kvs_q8_matmul(const int8_t *q, const float *d, const float *x, int64_t ldx, int M,
                  int64_t N, int K, float *y, int threads) {
    if (K % 32 || M < 0) return 1;
    if (M == 0 || N == 0) return 0;
    return q8_gemm(q, d, x, ldx, M, N, K, y, threads);
}

/* Q8_0 blocks (q int8 [N][K], d float [N][K/32], K a multiple of 32) in the layout
 * kvs_q8_matmul reads: rows padded with zero blocks to Kp = K rounded up to 128 (qp
 * [N][Kp], dp [N][Kp/32]), each group of 4 blocks interleaved by group_pos. */
void kvs_q8_pack(const int8_t *q, const float *d, int64_t N, int K, int8_t *qp, float *dp,
                 int threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, nb = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int b = 0; b < Kp / 32; b++) {
            int8_t *group = qp + n * Kp + (b / 4) * GROUP;
            for (int j = 0; j < 32; j++)
                group[group_pos(b % 4, j)] = b < nb ? q[n * K + 32 * b + j] : 0;
            dp[n * (Kp / 32) + b] = b < nb ? d[n * nb + b] : 0.f;
        }
    }
}

/* Float rows w [N][K] (K a multiple of 32) to Q8_0 blocks straight in kvs_q8_pack's layout,
 * by llama.cpp's rule as models/quant.py's q8_blocks states it: d = max |w| / 127 per block
 * of 32, q = w / d rounded to nearest even (0 where d is 0). One pass over the weights on
 * every core: rounding the 262k-row head in torch took ~0.9 s of a warm start. */
void kvs_q8_quantize(const float *w, int64_t N, int K, int8_t *qp, float *dp, int threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, nb = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int b = 0; b < Kp / 32; b++) {
            int8_t *group = qp + n * Kp + (b / 4) * GROUP;
            const float *wb = w + n * K + 32 * b;
            float amax = 0.f;
            for (int j = 0; b < nb && j < 32; j++)
                amax = fabsf(wb[j]) > amax ? fabsf(wb[j]) : amax;
            const float d = amax / 127.f;
            for (int j = 0; j < 32; j++)
                group[group_pos(b % 4, j)] = d > 0.f ? (int8_t)rintf(wb[j] / d) : 0;
            dp[n * (Kp / 32) + b] = d;
        }
    }
}
