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
 *
 * Q5_0 (llama.cpp's: 5-bit codes q, W = d * (q - 16), one fp16 scale a block of 32) goes
 * through the same tile loop: a GGUF ships most of a small model's layer weights so (Gemma 3
 * 270M Q4_K_M: 63M of them), and decode reads every weight once a step, so its 0.6875 bytes
 * a weight (80 bytes a group of 128 plus 4 fp16 scales) against Q8_0's 1.125 is what a
 * step of a few rows gains. Its codes are expanded to the int16 values Q8_0's widen to, in
 * registers, so the dot products, sums and scaling are Q8_0's (see q5_decode).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

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

/* The weight formats a tile reads: compile-time constants, so each tile instance has one. */
enum { Q8 = 0, Q5 = 1 };
#define Q5_BYTES 80 /* a Q5_0 group: 64 bytes of low nibbles, then 16 bytes of high bits */

/* Bytes of a packed row of Kp weights. */
static inline int64_t row_bytes(int F, int Kp) { return F == Q8 ? Kp : Kp / GROUP * Q5_BYTES; }

/* fp16 <-> float by hand: _Float16 needs GCC 12 or clang 15 on x86, and F16C's
 * instructions are only in the SIMD paths. Rounding to nearest even, as llama.cpp's
 * GGML_FP32_TO_FP16 does; scales never reach infinity or NaN (|d| <= max |w| / 16). */
static inline float half_to_float(uint16_t h) {
    const int exp = h >> 10 & 31, man = h & 1023;
    const float v = exp ? ldexpf((float)(1024 + man), exp - 25) : ldexpf((float)man, -24);
    return h >> 15 ? -v : v;
}
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = x >> 16 & 0x8000;
    const float a = fabsf(f);
    if (!(a < 65520.f)) return sign | 0x7c00; /* rounds past fp16's largest value */
    if (a < 6.103515625e-05f) /* subnormal: whole units of 2^-24, rintf rounding to even */
        return sign | (uint16_t)rintf(a * 16777216.f);
    x &= 0x7fffffff;
    x += 0xfff + (x >> 13 & 1); /* round off 13 mantissa bits to even (may carry on) */
    return sign | (uint16_t)((x >> 13) - (112 << 10));
}

/* A Q5_0 group holds code p (of the 128 in group_pos order) in byte p % 64's low nibble
 * (p < 64) or high nibble (p >= 64), and its fifth bit as bit p of bytes 64-79: one load of
 * bytes b.. gives the codes of positions b.. and 64 + b.. alike (q5_decode). codes: a
 * group's 4 blocks of 32 in their own order, put in group_pos order first (as pairs, as
 * quantize_x16 does) so that the packing loops vectorise. */
static void q5_pack_group(const uint8_t codes[GROUP], uint8_t *group) {
    uint8_t p[GROUP];
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 32; j += 2) memcpy(p + group_pos(k, j), codes + 32 * k + j, 2);
    for (int i = 0; i < 64; i++) group[i] = (uint8_t)((p[i] & 15) | p[64 + i] << 4);
    for (int i = 0; i < 16; i++) {
        uint8_t bits = 0;
        for (int j = 0; j < 8; j++) bits |= (uint8_t)((p[8 * i + j] >> 4) << j);
        group[64 + i] = bits;
    }
}
static inline int q5_get(const uint8_t *group, int p) {
    const int low = group[p % 64] >> (p < 64 ? 0 : 4) & 15;
    return (low | (group[64 + p / 8] >> (p % 8) & 1) << 4) - 16;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))

/* 4 fp16 scales as floats. */
INLINE __m128 half4(const uint16_t *p) {
#if defined(__F16C__)
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
#else
    return _mm_setr_ps(half_to_float(p[0]), half_to_float(p[1]), half_to_float(p[2]),
                       half_to_float(p[3]));
#endif
}

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
#define BCAST4H(p) _mm512_broadcast_f32x4(half4(p))
#define HSUM _mm512_reduce_add_ps
/* Q5_0 codes of positions b..b+31 and 64+b..64+b+31 (b = 0 or 32) as int16 values: bytes
 * widened once, low and high nibbles split, 16 taken off where the fifth bit is clear (a
 * masked subtract: the bits are the mask as stored). */
INLINE void q5_decode(const uint8_t *group, int b, ivec w[2]) {
    const __m512i n = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(group + b)));
    const __m512i lo = _mm512_and_si512(n, _mm512_set1_epi16(15));
    const __m512i hi = _mm512_srli_epi16(n, 4), sixteen = _mm512_set1_epi16(16);
    uint32_t bits[2];
    memcpy(&bits[0], group + 64 + b / 8, 4);
    memcpy(&bits[1], group + 72 + b / 8, 4);
    w[0] = _mm512_mask_sub_epi16(lo, (__mmask32)~bits[0], lo, sixteen);
    w[1] = _mm512_mask_sub_epi16(hi, (__mmask32)~bits[1], hi, sixteen);
}
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
#define BCAST4H(p) _mm256_set_m128(half4(p), half4(p))
/* Q5_0 codes of positions b..b+15 and 64+b..64+b+15 (b a multiple of 16) as int16 values:
 * bytes widened once, nibbles split; a lane whose fifth bit is clear (its bit of the
 * broadcast word ANDed with the lane's own bit is 0: compare gives -1) adds -1 << 4. */
INLINE void q5_decode(const uint8_t *group, int b, ivec w[2]) {
    const __m256i n = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(group + b)));
    const __m256i lane = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                           4096, 8192, 16384, -32768);
    const __m256i lo = _mm256_and_si256(n, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(n, 4);
    for (int h = 0; h < 2; h++) {
        uint16_t bits;
        memcpy(&bits, group + 64 + 8 * h + b / 8, 2);
        const __m256i clear = _mm256_cmpeq_epi16(
            _mm256_and_si256(_mm256_set1_epi16((short)bits), lane), _mm256_setzero_si256());
        w[h] = _mm256_add_epi16(h ? hi : lo, _mm256_slli_epi16(clear, 4));
    }
}
static inline float HSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* y[r][c] for R rows of x (int16, interleaved like the weights; scales xd, row stride
 * Kp / 32) against C columns of q in format F (d: their scales, float for Q8, fp16 for Q5),
 * R <= ROWS, C <= COLS and F compile-time constants so the loops unroll into registers.
 * Within a group every lane sums exactly in int32 (16 products of |w x| < 2^22); the lanes'
 * 4 blocks are scaled in float32 at the end of the group. */
INLINE void tile(const int R, const int C, const int F, const void *q, const void *d,
                 const int16_t *x, const float *xd, int Kp, int64_t N, void *y, int bf16) {
    const int nb = Kp / 32;
    const int64_t stride = row_bytes(F, Kp);
    const uint8_t *qb = q;
    fvec acc[ROWS][COLS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = FZERO();
    for (int g = 0; g < Kp; g += GROUP) {
        const int64_t at = row_bytes(F, g); /* the group's first byte in a row */
        /* Weights streamed from memory (the LM head at decode) wait on their loads
         * otherwise: two columns read side by side defeat the hardware prefetcher. */
        for (int c = 0; c < C; c++) {
            __builtin_prefetch(qb + (AHEAD + c) * stride + at);
            __builtin_prefetch(qb + (AHEAD + c) * stride + at + 64);
        }
        ivec sum[ROWS][COLS];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) sum[r][c] = IZERO();
        if (F == Q8) {
            for (int i = 0; i < GROUP; i += STEP) {
                ivec w[COLS];
                for (int c = 0; c < C; c++) w[c] = LOAD_W(qb + c * stride + g + i);
                for (int r = 0; r < R; r++) {
                    const ivec xv = LOAD_X(x + (int64_t)r * Kp + g + i);
                    for (int c = 0; c < C; c++) sum[r][c] = DOT(sum[r][c], w[c], xv);
                }
            }
        } else {
            /* Each decode gives two steps' values: positions b.. and 64 + b.. */
            for (int b = 0; b < GROUP / 2; b += STEP) {
                ivec w[COLS][2];
                for (int c = 0; c < C; c++) q5_decode(qb + c * stride + at, b, w[c]);
                for (int r = 0; r < R; r++) {
                    const ivec x0 = LOAD_X(x + (int64_t)r * Kp + g + b);
                    const ivec x1 = LOAD_X(x + (int64_t)r * Kp + g + GROUP / 2 + b);
                    for (int c = 0; c < C; c++)
                        sum[r][c] = DOT(DOT(sum[r][c], w[c][0], x0), w[c][1], x1);
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const fvec dc = F == Q8 ? BCAST4((const float *)d + (int64_t)c * nb + g / 32)
                                    : BCAST4H((const uint16_t *)d + (int64_t)c * nb + g / 32);
            for (int r = 0; r < R; r++)
                acc[r][c] = FMA(TO_F(sum[r][c]), FMUL(dc, BCAST4(xd + (int64_t)r * nb + g / 32)),
                                acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const float v = HSUM(acc[r][c]);
            if (bf16)
                ((uint16_t *)y)[r * N + c] = bf16_store(v);
            else
                ((float *)y)[r * N + c] = v;
        }
}

/* One instance per (format, rows, columns): tile()'s loops unroll only for constants. */
#define TILE_CASE(F, R, C)                                                                  \
    case ((F) * ROWS + R - 1) * COLS + C - 1: tile(R, C, F, q, d, x, xd, Kp, N, y, bf16); break;
#define TILE_CASES(F)                                                                       \
    TILE_CASE(F, 1, 1) TILE_CASE(F, 1, 2) TILE_CASE(F, 2, 1) TILE_CASE(F, 2, 2)             \
    TILE_CASE(F, 3, 1) TILE_CASE(F, 3, 2) TILE_CASE(F, 4, 1) TILE_CASE(F, 4, 2)
static void tile_any(int F, int R, int C, const void *q, const void *d, const int16_t *x,
                     const float *xd, int Kp, int64_t N, void *y, int bf16) {
    switch ((F * ROWS + R - 1) * COLS + C - 1) {
        TILE_CASES(Q8) TILE_CASES(Q5)
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

/* Scale d of block b of row n, format F. */
static inline const void *scale_at(int F, const void *d, int64_t n, int nb) {
    return F == Q8 ? (const void *)((const float *)d + n * nb)
                   : (const void *)((const uint16_t *)d + n * nb);
}

static int q_gemm(int F, const void *q, const void *d, const void *x, int64_t ldx, int M,
                  int64_t N, int K, void *y, int bf16, int threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, nb = Kp / 32, esize = bf16 ? 2 : 4;
    const int64_t stride = row_bytes(F, Kp);
    /* 64-byte aligned: a tile loads each row's 32-byte steps, and malloc's 16-byte
     * alignment split a quarter to half of them across cache lines (q8 ran 20-25% slower
     * on such calls, depending on where malloc put the rows). */
    int16_t *xq = aligned_alloc(64, ((size_t)M * Kp * sizeof(int16_t) + 63) / 64 * 64);
    float *xd = malloc((size_t)M * nb * sizeof(float));
    float *rows = malloc((size_t)threads * K * sizeof(float));
    if (!xq || !xd || !rows) {
        free(xq);
        free(xd);
        free(rows);
        return 2;
    }
#pragma omp parallel num_threads(threads)
    {
        float *row = rows + (size_t)omp_get_thread_num() * K;
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            load_row(x, m * ldx, row, K, bf16);
            quantize_x16(row, K, Kp, xq + (size_t)m * Kp, xd + (size_t)m * nb);
        }
        /* A chunk's weights stay in L2 while every row tile (in L1) passes over them. One
         * row (decode) is bound by reading the weights: one column at a time streams them
         * fastest (measured on the 262k-row LM head). */
        const int cols = M == 1 ? 1 : COLS;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += CHUNK) {
            const int64_t n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
            for (int m = 0; m < M; m += ROWS)
                for (int64_t n = n0; n < n1; n += cols)
                    tile_any(F, M - m < ROWS ? M - m : ROWS, n1 - n < cols ? n1 - n : cols,
                             (const uint8_t *)q + n * stride, scale_at(F, d, n, nb),
                             xq + (size_t)m * Kp, xd + (size_t)m * nb, Kp, N,
                             (char *)y + ((size_t)m * N + n) * esize, bf16);
        }
    }
    free(xq);
    free(xd);
    free(rows);
    return 0;
}
#else
/* The plain path: float32 products of the weights' integer values and the float32
 * activations. */
static int q_gemm(int F, const void *q, const void *d, const void *xin, int64_t ldx, int M,
                  int64_t N, int K, void *y, int bf16, int threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, nb = Kp / 32;
    const int64_t stride = row_bytes(F, Kp);
    float *x = malloc((size_t)M * K * sizeof(float) + 1);  /* the rows as float32 */
    if (!x) return 2;
    for (int m = 0; m < M; m++) load_row(xin, m * ldx, x + (size_t)m * K, K, bf16);
    ldx = K;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int m = 0; m < M; m++) {
            float acc = 0.f;
            for (int b = 0; b < K / 32; b++) {
                const uint8_t *group = (const uint8_t *)q + n * stride + row_bytes(F, b / 4 * GROUP);
                const float *xb = x + m * ldx + 32 * b;
                float s = 0.f;
                for (int j = 0; j < 32; j++) {
                    const int p = group_pos(b % 4, j);
                    s += (float)(F == Q8 ? (int8_t)group[p] : q5_get(group, p)) * xb[j];
                }
                acc += (F == Q8 ? ((const float *)d)[n * nb + b]
                                : half_to_float(((const uint16_t *)d)[n * nb + b])) * s;
            }
            if (bf16)
                ((uint16_t *)y)[m * N + n] = bf16_store(acc);
            else
                ((float *)y)[m * N + n] = acc;
        }
    }
    free(x);
    return 0;
}
#endif

/* y[m][n] = sum_b d[n][b] * sum_j W[n][32b + j] * x[m][32b + j] for m < M, with W's int8
 * values q and scales d as kvs_q8_pack lays them out (Kp = K rounded up to 128);
 * x: rows of K (row stride ldx), y: [M][N], both float32 or (bf16) both bfloat16 (y
 * rounded to nearest even, as torch casts). Returns 1 if K is not a multiple of 32 or
 * M < 0, 2 if scratch memory could not be had, else 0. */
int kvs_q8_matmul(const int8_t *q, const float *d, const void *x, int64_t ldx, int M,
                  int64_t N, int K, void *y, int bf16, int threads) {
    if (K % 32 || M < 0) return 1;
    if (M == 0 || N == 0) return 0;
    return q_gemm(Q8, q, d, x, ldx, M, N, K, y, bf16, threads);
}

/* As kvs_q8_matmul, for W in Q5_0 blocks as kvs_q5_pack lays them out: q [N][Kp / 128 * 80]
 * bytes, d fp16 [N][Kp / 32]. */
int kvs_q5_matmul(const uint8_t *q, const uint16_t *d, const void *x, int64_t ldx, int M,
                  int64_t N, int K, void *y, int bf16, int threads) {
    if (K % 32 || M < 0) return 1;
    if (M == 0 || N == 0) return 0;
    return q_gemm(Q5, q, d, x, ldx, M, N, K, y, bf16, threads);
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

/* Q5_0 blocks (codes 0-31 as bytes [N][K], W = d * (code - 16); d fp16 [N][K/32], K a
 * multiple of 32) in the layout kvs_q5_matmul reads: rows padded with zero blocks to Kp = K
 * rounded up to 128, each group of 4 blocks packed by q5_pack_group (qp [N][Kp / 128 * 80],
 * dp [N][Kp/32]). */
void kvs_q5_pack(const uint8_t *codes, const uint16_t *d, int64_t N, int K, uint8_t *qp,
                 uint16_t *dp, int threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, nb = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int g = 0; g < Kp; g += GROUP) {
            uint8_t group[GROUP];
            memset(group, 16, sizeof group); /* padding blocks: zeros */
            memcpy(group, codes + n * K + g, (K - g < GROUP ? K - g : GROUP));
            q5_pack_group(group, qp + n * row_bytes(Q5, Kp) + row_bytes(Q5, g));
        }
        for (int b = 0; b < Kp / 32; b++) dp[n * (Kp / 32) + b] = b < nb ? d[n * nb + b] : 0;
    }
}

/* One block of 32 floats to Q5_0 codes by llama.cpp's quantize_row_q5_0_ref: d = the value
 * of largest magnitude (the first, on ties) / -16, code = (int)(w / d + 16.5) capped at 31,
 * with w / d as w * (1 / d) in float32. Returns d. GCC would otherwise fuse the multiply
 * and add into one rounding, which moves codes exactly at .5 off kernels/q5.py's. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static float q5_round(const float *w, uint8_t *codes) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = fabsf(w[j]) > amax ? fabsf(w[j]) : amax;
    int first = 0; /* the value itself, for its sign: the first of that magnitude */
    while (first < 31 && fabsf(w[first]) != amax) first++;
    const float d = w[first] / -16.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; j++) {
        const float t = w[j] * id;
        const int code = (int)(t + 16.5f);
        codes[j] = (uint8_t)(code < 31 ? code : 31);
    }
    return d;
}

/* How many of a block's 32 weights d * (code - 16) does not give back exactly. */
static int q5_misses(const float *w, const uint8_t *codes, float d) {
    int misses = 0;
    for (int j = 0; j < 32; j++) misses += d * (float)(codes[j] - 16) != w[j];
    return misses;
}

/* Float rows w [N][K] (K a multiple of 32) to Q5_0 blocks straight in kvs_q5_pack's layout,
 * by kernels/q5.py's q5_blocks rule (llama.cpp's), scales rounded to fp16: one pass on every
 * core. Returns how many weights the blocks do not hold exactly: 0 for a GGUF's own Q5_0
 * tensors (and fusions of them), which is how the caller knows it rounded nothing. */
int64_t kvs_q5_quantize(const float *w, int64_t N, int K, uint8_t *qp, uint16_t *dp,
                        int threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, nb = K / 32;
    int64_t inexact = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : inexact)
    for (int64_t n = 0; n < N; n++) {
        for (int g = 0; g < Kp; g += GROUP) {
            uint8_t codes[GROUP];
            memset(codes, 16, sizeof codes); /* padding blocks: zeros */
            for (int b = g / 32; b < g / 32 + 4; b++) {
                const float *wb = w + n * K + 32 * b;
                uint8_t *cb = codes + 32 * (b % 4);
                const uint16_t h = float_to_half(b < nb ? q5_round(wb, cb) : 0.f);
                if (b < nb) inexact += q5_misses(wb, cb, half_to_float(h));
                dp[n * (Kp / 32) + b] = h;
            }
            q5_pack_group(codes, qp + n * row_bytes(Q5, Kp) + row_bytes(Q5, g));
        }
    }
    return inexact;
}
