/* y = x @ W.T in bfloat16 (float32 sums) for q8+bf16's steps of more than a few rows and
 * for bf16 weights served unquantized, on every CPU with native bf16 dot products: AMX's
 * tiles where Linux grants them, AVX-512 BF16's vdpbf16ps elsewhere (Zen 4 and 5, or a
 * Xeon build without AMX). One layout serves both.
 *
 * Why not oneDNN, which torch ships and which runs both: at decode-sized steps (5-64 rows)
 * a step reads every weight once from DRAM, and oneDNN's calls do not overlap that read with
 * their products. On AMX it read at about half the measured bandwidth (Gemma 3 270M's head
 * at 32 rows: 35-42 ms against this kernel's 14-23 on a 2-core Xeon); with vectors, a
 * 2-core Zen 5 ran Gemma's projections at 32 rows in 0.70-0.75x oneDNN's time, and level
 * from 128 rows up to prefill's 2048 (docs/benchmarks.md). The products are oneDNN's in the
 * same float32 order at Gemma 3 270M's width (K = 640) up to 32 rows on the tiles and at 5
 * rows with vectors (bitwise equal results); elsewhere about one output in ten thousand is
 * a rounding apart.
 *
 * Layout (kvs_bf16_pack): 16 output columns make a stripe; a stripe's weights are K / 32
 * tiles of 16 rows of 64 bytes, row r holding the 16 columns' values k = 2r and 2r + 1
 * side by side (AMX's bf16 pair form), so a tile is one contiguous KiB, and a stripe one
 * stream of K / 2 vectors of 16 column pairs, which vdpbf16ps takes as they are.
 *
 * Tiles: two stripes (32 columns) and up to 32 activation rows use all eight tiles: four
 * sums (2 x 2), two activation tiles, two weight tiles. OpenMP splits the column blocks;
 * rows go in blocks of 256 so one block's activations stay in L2 while the columns pass.
 *
 * Vectors: 8 rows by 3 stripes of float32 sums in 24 registers; each pair of k is 3 weight
 * loads, 8 broadcast activations and 24 vdpbf16ps. For a decode-sized step (up to 64 rows)
 * K goes in blocks of 32 and every row tile passes over a block before the next, the sums
 * parked in L1 between blocks: so the weights' read from DRAM (each weight once a call) is
 * spread over all the products instead of stalling the first row tile's. Larger steps take
 * all of K at once, rows in blocks of 128 (their activations stay in L2).
 *
 * Linux lends the tile registers to a process that asks (arch_prctl); kvs_amx_ready says
 * whether it did. Built without AVX-512 BF16 (other CPUs, or KVSERVE_CPU_FLAGS hiding it)
 * every entry point refuses, and the callers take oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

/* W [N, K] row-major bfloat16 to the stripe layout above; N a multiple of 16, K of 32. */
void kvs_bf16_pack(const uint16_t *w, int64_t N, int K, uint16_t *out, int threads) {
    const int kb_n = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t s = 0; s < N / 16; s++)
        for (int kb = 0; kb < kb_n; kb++) {
            uint16_t *tile = out + (s * kb_n + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    const uint16_t *src = w + (s * 16 + c) * (int64_t)K + kb * 32 + 2 * r;
                    tile[r * 32 + 2 * c] = src[0];
                    tile[r * 32 + 2 * c + 1] = src[1];
                }
        }
}

/* ---- vectors: vdpbf16ps over the same layout ---- */

#define RT 8             /* rows of a vector tile */
#define ST 3             /* stripes of a vector tile: 8 x 3 sums, 24 of 32 registers */
#define DECODE_ROWS 64   /* up to this many rows, K goes in blocks of DECODE_PAIRS pairs */
#define DECODE_PAIRS 16
#define VEC_ROWS 128     /* above: rows in blocks of this many, K whole */
#define AHEAD 32         /* pairs ahead of each weight load that the first row tile prefetches */

/* Rows [0, R) of x times stripes [0, S) of b over pairs [p0, p1), the sums carried in
 * `park` (16 floats a row and stripe) between calls: from zero if `first`, into y as
 * bfloat16 if `last`. always_inline so that R and S fold where the caller's are constant
 * and the 24 sums stay in registers. */
static inline __attribute__((always_inline)) void vec_tile(
        const uint16_t *x, int64_t ldx, int R, const uint16_t *b, int64_t stripe, int S,
        int p0, int p1, float *park, int first, int last, uint16_t *y, int64_t ldy,
        int prefetch) {
    __m512 acc[RT][ST];
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 3
        for (int s = 0; s < ST; s++)
            acc[r][s] = first ? _mm512_setzero_ps() : _mm512_load_ps(park + (r * ST + s) * 16);
    for (int p = p0; p < p1; p++) {
        __m512bh wv[ST];
#pragma GCC unroll 3
        for (int s = 0; s < ST; s++) {
            wv[s] = (__m512bh)_mm512_setzero_si512();  /* unread where s >= S (for gcc) */
            if (s < S) {
                const uint16_t *bp = b + s * stripe + p * 32;
                if (prefetch) _mm_prefetch((const char *)(bp + AHEAD * 32), _MM_HINT_T0);
                wv[s] = (__m512bh)_mm512_loadu_si512(bp);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < RT; r++)
            if (r < R) {
                int32_t pair; /* x[r, 2p] and x[r, 2p + 1]: memcpy, as ldx may be odd */
                memcpy(&pair, x + r * ldx + 2 * p, 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 3
                for (int s = 0; s < ST; s++)
                    if (s < S) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], xv, wv[s]);
            }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 3
        for (int s = 0; s < ST; s++)
            if (r < R && s < S) {
                if (last)
                    _mm256_storeu_si256((__m256i *)(y + r * ldy + 16 * s),
                                        (__m256i)_mm512_cvtneps_pbh(acc[r][s]));
                else
                    _mm512_store_ps(park + (r * ST + s) * 16, acc[r][s]);
            }
}

/* The vector GEMM with K in blocks of `kb` pairs (constant where inlined) and rows in blocks
 * of `rows`. Returns 2 if the parked sums could not be had. */
static inline __attribute__((always_inline)) int vec_run(
        const uint16_t *w, const uint16_t *x, int64_t ldx, int M, int64_t N, int K,
        uint16_t *y, int threads, const int kb, const int rows) {
    const int64_t stripe = (int64_t)K * 16, ns = N / 16, groups = (ns + ST - 1) / ST;
    const int P = K / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *park = aligned_alloc(64, (size_t)(rows / RT) * RT * ST * 64);
        failed = !park;
        for (int m0 = 0; m0 < M && !failed; m0 += rows) {
            const int tiles = ((M - m0 < rows ? M - m0 : rows) + RT - 1) / RT;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const int S = ns - g * ST < ST ? ns - g * ST : ST;
                const uint16_t *b = w + g * ST * stripe;
                for (int p0 = 0; p0 < P; p0 += kb) {
                    const int p1 = P - p0 < kb ? P : p0 + kb;
                    for (int t = 0; t < tiles; t++) {
                        const int m = m0 + t * RT, R = M - m < RT ? M - m : RT;
                        vec_tile(x + m * ldx, ldx, R, b, stripe, S, p0, p1,
                                 park + t * RT * ST * 16, p0 == 0, p1 == P,
                                 y + (int64_t)m * N + g * ST * 16, N, t == 0);
                    }
                }
            }
        }
        free(park);
    }
    return failed ? 2 : 0;
}

static int vec_matmul(const uint16_t *w, const uint16_t *x, int64_t ldx, int M, int64_t N,
                      int K, uint16_t *y, int threads) {
    if (M <= RT) return vec_run(w, x, ldx, M, N, K, y, threads, 1 << 30, RT); /* one tile */
    if (M <= DECODE_ROWS) return vec_run(w, x, ldx, M, N, K, y, threads, DECODE_PAIRS, 64);
    return vec_run(w, x, ldx, M, N, K, y, threads, 1 << 30, VEC_ROWS);
}

/* ---- tiles: AMX where Linux grants them ---- */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROW_BLOCK 256       /* activation rows one pass over the columns serves */
#define PREFETCH 2          /* K-blocks ahead that a weight tile is prefetched */
#define STREAM_BYTES (8 << 20) /* outputs larger than this bypass the caches */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

int kvs_amx_ready(void) {
    static int ready = -1; /* asked once a process (a race asks twice, harmlessly) */
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* Every tile 16 rows of 64 bytes: what this kernel and paged_attention.c's blocks use. The
 * configuration is constant data: GCC 12 drops stores to a local one as dead when this is
 * an out-of-line function (it does not see ldtilecfg read all 64 bytes), and the tiles
 * then fault. */
static const tile_config CONFIG = {.palette = 1,
                                   .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                   .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

void kvs_amx_configure(void) { _tile_loadconfig(&CONFIG); }

/* rows x 16 float32 sums (in `sums`, 16 floats a row) -> bfloat16 rows of y, from two
 * stripes at once when `hi` is not NULL (32 columns, one 64-byte store a row). */
static void store(const float *lo, const float *hi, int rows, uint16_t *y, int64_t ldy,
                  int stream) {
    for (int r = 0; r < rows; r++) {
        uint16_t *o = y + r * ldy;
        if (hi) {
            __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(hi + 16 * r),
                                                     _mm512_load_ps(lo + 16 * r));
            if (stream) _mm512_stream_si512((void *)o, v);
            else _mm512_storeu_si512(o, v);
        } else {
            _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(lo + 16 * r)));
        }
    }
}

/* Rows [m, m + 32) (the second 16 only if `two`) times one or two stripes (b1 NULL: one). */
static void block(const uint16_t *a, int64_t lda, int two, const uint16_t *b0,
                  const uint16_t *b1, int kb_n, float sums[4][256]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < kb_n; kb++) {
        const char *p0 = (const char *)(b0 + (kb + PREFETCH) * 512);
        const char *p1 = b1 ? (const char *)(b1 + (kb + PREFETCH) * 512) : p0;
        for (int l = 0; l < 1024; l += 64) {  /* past the end is harmless: no fault */
            _mm_prefetch(p0 + l, _MM_HINT_T0);
            _mm_prefetch(p1 + l, _MM_HINT_T0);
        }
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(4, a + kb * 32, lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (b1) {
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
            _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (b1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0], 64);
    if (b1) _tile_stored(1, sums[1], 64);
    if (two) {
        _tile_stored(2, sums[2], 64);
        if (b1) _tile_stored(3, sums[3], 64);
    }
}

static int tiles_matmul(const uint16_t *w, const uint16_t *x, int64_t ldx, int M, int64_t N,
                        int K, uint16_t *y, int threads) {
    const int kb_n = K / 32, Mp = (M + 15) & ~15;
    const int64_t stripe = (int64_t)K * 16, blocks = (N / 16 + 1) / 2;
    /* streamed stores take whole aligned lines: 32 columns a row, rows 64-byte aligned */
    const int stream = (int64_t)M * N * 2 > STREAM_BYTES && N % 32 == 0 && !((uintptr_t)y & 63);
    uint16_t *pad = NULL;
    if (Mp != M) { /* a tile reads 16 rows: the last ones come from a zero-padded copy */
        pad = aligned_alloc(64, (size_t)Mp * K * 2);
        if (!pad) return 2;
        for (int m = 0; m < M; m++) memcpy(pad + (size_t)m * K, x + m * ldx, (size_t)K * 2);
        memset(pad + (size_t)M * K, 0, (size_t)(Mp - M) * K * 2);
        x = pad;
        ldx = K;
    }
#pragma omp parallel num_threads(threads)
    {
        kvs_amx_configure();
        float sums[4][256] __attribute__((aligned(64)));
        for (int m0 = 0; m0 < Mp; m0 += ROW_BLOCK) {
            const int m1 = Mp - m0 < ROW_BLOCK ? Mp : m0 + ROW_BLOCK;
#pragma omp for schedule(static) nowait
            for (int64_t j = 0; j < blocks; j++) {
                const uint16_t *b0 = w + 2 * j * stripe;
                const uint16_t *b1 = 2 * j + 1 < N / 16 ? b0 + stripe : NULL;
                for (int m = m0; m < m1; m += 32) {
                    const int two = Mp - m > 16, lo = M - m < 16 ? M - m : 16;
                    uint16_t *o = y + (int64_t)m * N + 32 * j;
                    block(x + m * ldx, ldx, two, b0, b1, kb_n, sums);
                    store(sums[0], b1 ? sums[1] : NULL, lo, o, N, stream);
                    if (two)
                        store(sums[2], b1 ? sums[3] : NULL, M - m - 16 < 16 ? M - m - 16 : 16,
                              o + 16 * N, N, stream);
                }
            }
        }
        _tile_release();
    }
    if (stream) _mm_sfence();
    free(pad);
    return 0;
}

#else /* no tiles in this build: the vectors serve */

int kvs_amx_ready(void) { return 0; }
#endif

int kvs_bf16_ready(void) { return 1; }

/* y [M, N] (row stride N) = x [M, K] (row stride ldx) @ W.T, x and y bfloat16 (`bf16` must
 * be 1; the argument keeps kvs_q8_matmul's signature), W as kvs_bf16_pack laid it out: on
 * the tiles where they were granted, else with vectors. Returns 1 if the shapes or dtype do
 * not fit (K a multiple of 32, N of 16), 2 if scratch memory could not be had, else 0. */
int kvs_bf16_matmul(const uint16_t *w, const void *unused, const uint16_t *x, int64_t ldx,
                    int M, int64_t N, int K, uint16_t *y, int bf16, int threads) {
    (void)unused;
    if (K % 32 || N % 16 || M < 0 || !bf16) return 1;
    if (M == 0 || N == 0) return 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (kvs_amx_ready()) return tiles_matmul(w, x, ldx, M, N, K, y, threads);
#endif
    return vec_matmul(w, x, ldx, M, N, K, y, threads);
}

#else /* no native bf16 in this build: the callers take oneDNN (or float32) */

int kvs_amx_ready(void) { return 0; }

int kvs_bf16_ready(void) { return 0; }

void kvs_bf16_pack(const uint16_t *w, int64_t N, int K, uint16_t *out, int threads) {
    (void)w, (void)N, (void)K, (void)out, (void)threads;
}

int kvs_bf16_matmul(const uint16_t *w, const void *unused, const uint16_t *x, int64_t ldx,
                    int M, int64_t N, int K, uint16_t *y, int bf16, int threads) {
    (void)w, (void)unused, (void)x, (void)ldx, (void)M, (void)N, (void)K, (void)y, (void)bf16,
        (void)threads;
    return 1;
}
#endif
