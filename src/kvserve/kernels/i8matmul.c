/* x @ W.T with both sides in int8 blocks of 32 (llama.cpp's Q8_0 x Q8_0), for steps of many
 * rows.
 *
 * From ~16 rows a step computes rather than reads, and the rate of its dot products decides:
 * bf16 (vdpbf16ps) multiplies 32 pairs an AVX-512 instruction, int16 (vpdpwssd, qmatmul.c)
 * 32 as well, int8 (vpdpbusd) 64. So both sides go to int8: each weight block of 32 has
 * one float scale (as Q8_0), and so has each activation block of 32, rounded once a call
 * (llama.cpp rounds its activations the same way). A block's 32 products are summed exactly
 * in int32; the blocks in float32 (convert, multiply the two scales, FMA: 3 instructions a
 * block for every 8 vpdpbusd).
 *
 * Layout: the output columns go across the 16 int32 lanes of a vector, and vpdpbusd sums 4
 * consecutive products into each lane, so the weights of 16 columns are stored as
 * [K / 4][16 columns][4 values], and one activation word (4 int8 values) is broadcast to
 * every lane. A tile's 3 vectors are interleaved word by word ([K / 4][3][16][4]), so its
 * weights are one sequential stream (the LM head at 32 rows: 5% faster than 3 streams). vpdpbusd multiplies unsigned bytes by signed ones: the weights are stored
 * plus 128 (unsigned), the activations as they are, and each block's sum starts at
 * -128 * (the sum of its activation values), which takes the 128 back off exactly.
 *
 * A tile is 4 rows by 3 vectors (48 columns): 12 int32 sums, 12 float sums and 3 weight
 * vectors fit AVX-512's 32 registers. OpenMP splits the column tiles; each tile's weights
 * (48 x K bytes) stay in L1 while every row tile passes over them.
 *
 * Paths, by the compiler's feature macros (cpu.py builds with -march=native per CPU feature
 * set): AVX-512 VNNI, AVX-VNNI (256-bit: each 16-column vector as two halves), AVX2 (no
 * int8 dot product instruction: vpmaddubsw and vpmaddwd, same sums; 1.0-1.25x our int16
 * Q8_0 kernel from 17 rows on a Zen 5 held to AVX2, the LM head 1.18x at 32), and a plain
 * loop for CPUs without AVX2 (correct and slow; quant.py serves no q8 mode there).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define LANES 16   /* output columns per stored vector */
#define TR 4       /* rows per tile */
#define TC 3       /* vectors per tile */
#define MBLOCK 256 /* rows whose activations one pass over the columns reuses */
#ifndef CHUNK
#define CHUNK 16
#endif

/* Weights of column n (of N), value k, in the packed form: the tile's vectors interleaved
 * word by word, so that a tile reads its weights as one sequential stream. */
static inline int64_t w_at(int64_t n, int64_t N, int K, int k) {
    const int64_t t = n / (TC * LANES), left = N / LANES - t * TC;
    const int nvt = left < TC ? (int)left : TC;
    return t * TC * LANES * (int64_t)K + ((int64_t)(k / 4) * nvt + n % (TC * LANES) / LANES) * LANES * 4 +
           (n % LANES) * 4 + k % 4;
}

/* One row of 32-value blocks to int8 with a float scale each (d = max |x| / 127, q = x / d
 * rounded to nearest even: as quant.py's q8_blocks), and (corr, if not NULL) each block's
 * correction -128 * sum(q). Weights (kvs_i8_pack) and activations are rounded alike. */
static void quantize_row(const float *x, int K, int8_t *q, float *d, int32_t *corr) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        d[b] = amax / 127.f;
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            q[32 * b + j] = amax > 0.f ? (int8_t)rintf(xb[j] / d[b]) : 0;
            sum += q[32 * b + j];
        }
        if (corr) corr[b] = -128 * sum;
    }
}

/* Whether y, much larger than the caches (the LM head's logits: 32 rows are 33 MB in
 * float32), is written past them: each 64-byte piece would otherwise be read in before it
 * is written. With the next tile's prefetch (gemm) the head took 11-17% less time at 17-64
 * rows, float32 and bf16, on a Zen 5 with AVX-512 VNNI (docs/benchmarks.md). */
static int streams(int M, int64_t N, int bf16, const void *y) {
    return (int64_t)M * N * (bf16 ? 2 : 4) > (8 << 20) && (uintptr_t)y % 64 == 0;
}

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512VNNI__)
typedef __m512i ivec;
typedef __m512 fvec;
#define HALVES 1 /* vectors of the machine per stored 16-column vector */
#define LOAD_W(p) _mm512_loadu_si512(p)
#define DOT(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define ISET1 _mm512_set1_epi32
#define FSET1 _mm512_set1_ps
#define FZERO _mm512_setzero_ps
#define LOAD_F _mm512_loadu_ps
#define TO_F _mm512_cvtepi32_ps
#define FMUL _mm512_mul_ps
#define FMA _mm512_fmadd_ps
#define STORE_F _mm512_storeu_ps
#define STREAM_F _mm512_stream_ps
/* 16 floats to bf16, rounded to nearest even (as bf16.h's bf16_store, NaN aside). */
INLINE __m256i bf16_bits(fvec v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#define STORE_H(y, v) _mm256_storeu_si256((__m256i *)(y), bf16_bits(v))
#define STREAM_H(y, v) _mm256_stream_si256((__m256i *)(y), bf16_bits(v))
#else
typedef __m256i ivec;
typedef __m256 fvec;
#define HALVES 2
#define LOAD_W(p) _mm256_loadu_si256((const __m256i *)(p))
#define DOT(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define ISET1 _mm256_set1_epi32
#define FSET1 _mm256_set1_ps
#define FZERO _mm256_setzero_ps
#define LOAD_F _mm256_loadu_ps
#define TO_F _mm256_cvtepi32_ps
#define FMUL _mm256_mul_ps
#define FMA _mm256_fmadd_ps
#define STORE_F _mm256_storeu_ps
#define STREAM_F _mm256_stream_ps
INLINE __m128i bf16_bits(fvec v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#define STORE_H(y, v) _mm_storeu_si128((__m128i *)(y), bf16_bits(v))
#define STREAM_H(y, v) _mm_stream_si128((__m128i *)(y), bf16_bits(v))
#endif
#define VW (LANES / HALVES) /* columns per machine vector */
#define VC (TC * HALVES)    /* machine vectors per tile */

/* y[r][.] for R rows and V machine vectors of columns at w (packed weights of the tile's
 * first stored vector, scales sw); x: the rows' int8 values, xd their block scales, xc
 * their corrections; y float32 or (bf16) bfloat16 with row stride ldy. R, V compile-time
 * constants, so the loops unroll into registers. */
INLINE void tile(const int R, const int V, const uint8_t *w, const float *sw, const int8_t *x,
                 const float *xd, const int32_t *xc, int K, int64_t ldy, void *y, int bf16,
                 int stream) {
    const int nb = K / 32;
    fvec acc[TR][VC];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = FZERO();
    for (int b = 0; b < nb; b++) {
        ivec s[TR][VC];
        for (int r = 0; r < R; r++) {
            const ivec c0 = ISET1(xc[r * nb + b]);
            for (int v = 0; v < V; v++) s[r][v] = c0;
        }
        for (int k = 0; k < 8; k++) {
            ivec wv[VC];
            for (int v = 0; v < V; v++)
                wv[v] = LOAD_W(w + ((int64_t)(b * 8 + k) * (V / HALVES) + v / HALVES) * LANES * 4 +
                               (v % HALVES) * VW * 4);
            for (int r = 0; r < R; r++) {
                int32_t word;
                memcpy(&word, x + (int64_t)r * K + b * 32 + 4 * k, 4);
                const ivec xv = ISET1(word);
                for (int v = 0; v < V; v++) s[r][v] = DOT(s[r][v], wv[v], xv);
            }
        }
        for (int v = 0; v < V; v++) {
            const fvec d = LOAD_F(sw + (int64_t)(v / HALVES) * nb * LANES + b * LANES +
                                  (v % HALVES) * VW);
            for (int r = 0; r < R; r++)
                acc[r][v] = FMA(TO_F(s[r][v]), FMUL(d, FSET1(xd[r * nb + b])), acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) {
            if (bf16 && stream)
                STREAM_H((uint16_t *)y + r * ldy + v * VW, acc[r][v]);
            else if (bf16)
                STORE_H((uint16_t *)y + r * ldy + v * VW, acc[r][v]);
            else if (stream)
                STREAM_F((float *)y + r * ldy + v * VW, acc[r][v]);
            else
                STORE_F((float *)y + r * ldy + v * VW, acc[r][v]);
        }
}

#define TILE_CASE(R, V)                                                                     \
    case (R - 1) * VC + V - 1: tile(R, V, w, sw, x, xd, xc, K, ldy, y, bf16, stream); break;
#define TILE_ROWS(R) TILE_CASE(R, 1 * HALVES) TILE_CASE(R, 2 * HALVES) TILE_CASE(R, 3 * HALVES)
static void tile_any(int R, int V, const uint8_t *w, const float *sw, const int8_t *x,
                     const float *xd, const int32_t *xc, int K, int64_t ldy, void *y, int bf16,
                     int stream) {
    switch ((R - 1) * VC + V - 1) { TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) }
}

/* R rows against a column tile of nv stored vectors (xa: unused, see ABS_ROWS). */
static void tile_cols(int R, int nv, const uint8_t *w, const float *sw, const int8_t *x,
                      const int8_t *xa, const float *xd, const int32_t *xc, int K, int64_t ldy,
                      void *y, int bf16, int stream) {
    (void)xa;
    tile_any(R, nv * HALVES, w, sw, x, xd, xc, K, ldy, y, bf16, stream);
}
#elif defined(__AVX2__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))
#define ABS_ROWS 1 /* gemm reads each row's absolute values after the row (see below) */

/* AVX2 has no vpdpbusd, and its vpmaddubsw (unsigned by signed bytes, pairs summed into
 * int16 with saturation) would saturate on the stored weights (w + 128 up to 255, times
 * activations up to 127). So llama.cpp's sign trick: the weights back to signed (w + 128
 * xor 128), the activation's sign moved onto them (vpsignb), and |x| as the unsigned side:
 * a pair of products is at most 2 * 127 * 128 < 2^15, so the int16 pairs are exact, and
 * vpmaddwd by ones sums 4 products into each int32 lane as vpdpbusd does. The block sums
 * are sum(w x) itself (no -128 * sum(x) correction), the same integers as the VNNI paths',
 * so the results are bit for bit theirs.
 *
 * Tile: 4 rows by one stored vector (16 columns, two machine vectors): 8 int32 sums stay
 * in registers through a block; the float sums live in memory (16 registers hold no more),
 * one load and store each a block against its 32 multiply-adds. */
INLINE __m256i dot2(__m256i acc, __m256i w, __m256i x, __m256i ax) {
    const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* y[r][0..15] for R rows against stored vector v of a tile of nvt vectors at w. */
INLINE void tile2(const int R, const uint8_t *w, int nvt, int v, const float *sw,
                  const int8_t *x, const int8_t *xa, const float *xd, int K, int64_t ldy,
                  void *y, int bf16, int stream) {
    const int nb = K / 32;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    float acc[TR][LANES] __attribute__((aligned(32))) = {{0}};
    for (int b = 0; b < nb; b++) {
        __m256i s[TR][2];
        for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
            const uint8_t *wk = w + ((int64_t)(b * 8 + k) * nvt + v) * LANES * 4;
            const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wk), flip);
            const __m256i w1 =
                _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wk + 32)), flip);
            for (int r = 0; r < R; r++) {
                int32_t word, aword;
                memcpy(&word, x + (int64_t)r * K + b * 32 + 4 * k, 4);
                memcpy(&aword, xa + (int64_t)r * K + b * 32 + 4 * k, 4);
                const __m256i xv = _mm256_set1_epi32(word), ax = _mm256_set1_epi32(aword);
                s[r][0] = dot2(s[r][0], w0, xv, ax);
                s[r][1] = dot2(s[r][1], w1, xv, ax);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_loadu_ps(sw + (int64_t)v * nb * LANES + b * LANES + 8 * h);
            for (int r = 0; r < R; r++) {
                const __m256 sc = _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nb + b]));
                _mm256_store_ps(acc[r] + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), sc,
                                                                _mm256_load_ps(acc[r] + 8 * h)));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        if (stream && !bf16) { /* past the caches (see streams); bf16 rows as below */
            float *yr = (float *)y + r * ldy;
            _mm256_stream_ps(yr, _mm256_load_ps(acc[r]));
            _mm256_stream_ps(yr + 8, _mm256_load_ps(acc[r] + 8));
            continue;
        }
        for (int c = 0; c < LANES; c++) {
            if (bf16)
                ((uint16_t *)y)[r * ldy + c] = bf16_store(acc[r][c]);
            else
                ((float *)y)[r * ldy + c] = acc[r][c];
        }
    }
}

static void tile2_any(int R, const uint8_t *w, int nvt, int v, const float *sw,
                      const int8_t *x, const int8_t *xa, const float *xd, int K, int64_t ldy,
                      void *y, int bf16, int stream) {
    switch (R) {
    case 1: tile2(1, w, nvt, v, sw, x, xa, xd, K, ldy, y, bf16, stream); break;
    case 2: tile2(2, w, nvt, v, sw, x, xa, xd, K, ldy, y, bf16, stream); break;
    case 3: tile2(3, w, nvt, v, sw, x, xa, xd, K, ldy, y, bf16, stream); break;
    default: tile2(4, w, nvt, v, sw, x, xa, xd, K, ldy, y, bf16, stream);
    }
}

/* R rows against a column tile of nv stored vectors, one stored vector at a time (xc:
 * unused, the sums need no correction). */
static void tile_cols(int R, int nv, const uint8_t *w, const float *sw, const int8_t *x,
                      const int8_t *xa, const float *xd, const int32_t *xc, int K, int64_t ldy,
                      void *y, int bf16, int stream) {
    (void)xc;
    for (int v = 0; v < nv; v++)
        tile2_any(R, w, nv, v, sw, x, xa, xd, K, ldy, (char *)y + v * LANES * (bf16 ? 2 : 4),
                  bf16, stream);
}
#endif

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__) || defined(__AVX2__)
/* Every thread of the caller's parallel region takes its share of the column tiles. */
static void gemm(const uint8_t *w, const float *sw, const int8_t *xq, const float *xd,
                 const int32_t *xc, int M, int64_t N, int K, void *y, int bf16) {
    const int nb = K / 32, stream = streams(M, N, bf16, y);
    const int64_t vectors = N / LANES, tiles = (vectors + TC - 1) / TC, esize = bf16 ? 2 : 4;
    const int64_t bytes = (int64_t)TC * LANES * K; /* a full tile's weights */
    const int64_t total = vectors * LANES * K;      /* all of them */
    for (int m0 = 0; m0 < M; m0 += MBLOCK) {
        const int m1 = m0 + MBLOCK < M ? m0 + MBLOCK : M;
        const int64_t slice = bytes / ((m1 - m0 + TR - 1) / TR) + 64;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t v0 = t * TC;
            const int nv = vectors - v0 < TC ? (int)(vectors - v0) : TC;
            /* The next tile's weights (from memory where N is large, as the LM head's) are
             * fetched a slice a row tile while this one computes. */
            const int64_t at = (v0 + TC) * K * LANES, ahead = total - at < bytes ? total - at : bytes;
            for (int m = m0; m < m1; m += TR) {
                const int64_t o0 = (m - m0) / TR * slice;
                for (int64_t o = o0; o < o0 + slice && o < ahead; o += 64)
                    __builtin_prefetch(w + at + o);
                tile_cols(m1 - m < TR ? m1 - m : TR, nv, w + v0 * K * LANES,
                          sw + v0 * nb * LANES, xq + (int64_t)m * K, xq + (int64_t)(M + m) * K,
                          xd + (int64_t)m * nb, xc + (int64_t)m * nb, K, N,
                          (char *)y + (m * N + v0 * LANES) * esize, bf16, stream);
            }
        }
    }
    if (stream) _mm_sfence(); /* the streamed stores are seen before the region ends */
}
#else
/* The plain path: the same integer sums, one column at a time. */
static void gemm(const uint8_t *w, const float *sw, const int8_t *xq, const float *xd,
                 const int32_t *xc, int M, int64_t N, int K, void *y, int bf16) {
    const int nb = K / 32;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int m = 0; m < M; m++) {
            float acc = 0.f;
            for (int b = 0; b < nb; b++) {
                int32_t s = xc[m * nb + b];
                for (int k = 32 * b; k < 32 * b + 32; k++)
                    s += (int32_t)w[w_at(n, N, K, k)] * xq[(int64_t)m * K + k];
                acc += (float)s * sw[(n / LANES) * nb * LANES + b * LANES + n % LANES] *
                       xd[m * nb + b];
            }
            if (bf16)
                ((uint16_t *)y)[m * N + n] = bf16_store(acc);
            else
                ((float *)y)[m * N + n] = acc;
        }
}
#endif

/* W [N, K] float (N a multiple of 16, K of 32) to blocks of 32: d = max |w| / 127 per
 * block of a row (a GGUF's Q8_0 tensors come back exactly), stored plus 128 in the layout
 * above. */
void kvs_i8_pack(const float *wt, int64_t N, int K, uint8_t *w, float *sw, int threads) {
    const int nb = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int8_t q[K];
        float d[nb];
        quantize_row(wt + n * K, K, q, d, NULL);
        for (int k = 0; k < K; k++) w[w_at(n, N, K, k)] = (uint8_t)(q[k] + 128);
        for (int b = 0; b < nb; b++) sw[(n / LANES) * nb * LANES + b * LANES + n % LANES] = d[b];
    }
}

/* y [M, N] = x [M, K] (row stride ldx) @ W.T, W as kvs_i8_pack made it; x and y both
 * float32 or (bf16) both bfloat16. Returns 1 if K is not a multiple of 32, N of 16 or
 * M < 0, 2 if scratch memory could not be had, else 0. */
int kvs_i8_matmul(const uint8_t *w, const float *sw, const void *x, int64_t ldx, int M,
                  int64_t N, int K, void *y, int bf16, int threads) {
    if (K % 32 || N % LANES || M < 0) return 1;
    if (M == 0 || N == 0) return 0;
    const int nb = K / 32;
    int8_t *xq = malloc((size_t)2 * M * K); /* the rows, then (ABS_ROWS) their absolute values */
    float *xd = malloc((size_t)M * nb * sizeof(float));
    int32_t *xc = malloc((size_t)M * nb * sizeof(int32_t));
    float *rows = malloc((size_t)threads * K * sizeof(float));
    int rc = 2;
    if (xq && xd && xc && rows) {
#pragma omp parallel num_threads(threads)
        {
            float *row = rows + (size_t)omp_get_thread_num() * K;
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) {
                load_row(x, m * ldx, row, K, bf16);
#ifdef ABS_ROWS /* the sums need no correction; gemm reads |x| after the rows instead */
                quantize_row(row, K, xq + (int64_t)m * K, xd + (int64_t)m * nb, NULL);
                for (int k = 0; k < K; k++)
                    xq[(int64_t)(M + m) * K + k] = (int8_t)abs(xq[(int64_t)m * K + k]);
#else
                quantize_row(row, K, xq + (int64_t)m * K, xd + (int64_t)m * nb,
                             xc + (int64_t)m * nb);
#endif
            }
            gemm(w, sw, xq, xd, xc, M, N, K, y, bf16);
        }
        rc = 0;
    }
    free(xq);
    free(xd);
    free(xc);
    free(rows);
    return rc;
}
