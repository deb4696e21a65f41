/* y = x @ W.T in bfloat16 on AMX's tiles (float32 sums), for q8+bf16's steps of more than a
 * few rows and for bf16 weights served unquantized, on CPUs with AMX-BF16.
 *
 * Why not oneDNN, which torch ships and which runs AMX too: at decode-sized steps (5-64
 * rows) a step reads every weight once from DRAM, and oneDNN's calls read at about half the
 * measured bandwidth (Gemma 3 270M's head at 32 rows: 35-42 ms against this kernel's 14-23
 * on the same 2-core Xeon, docs/benchmarks.md). Tile loads are not followed by the hardware
 * prefetchers, so this kernel prefetches each weight tile two K-blocks ahead of its load.
 * The products and their float32 order are oneDNN's at Gemma 3 270M's width (K = 640:
 * bitwise equal results up to 32 rows); where oneDNN blocks differently (K = 2048, or 64
 * rows of the head) about one output in ten thousand is a rounding apart.
 *
 * Layout (kvs_amx_pack): 16 output columns make a stripe; a stripe's weights are K / 32
 * tiles of 16 rows of 64 bytes, row r holding the 16 columns' values k = 2r and 2r + 1
 * side by side (AMX's bf16 pair form), so a tile is one contiguous KiB. Two stripes (32
 * columns) and up to 32 activation rows use all eight tiles: four sums (2 x 2), two
 * activation tiles, two weight tiles. OpenMP splits the column blocks; rows go in blocks
 * of 256 so one block's activations stay in L2 while the columns pass.
 *
 * Linux lends the tile registers to a process that asks (arch_prctl); kvs_amx_ready says
 * whether it did. Built without AMX (other CPUs, or KVSERVE_CPU_FLAGS hiding it) every entry
 * point refuses, and the callers take oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
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

/* W [N, K] row-major bfloat16 to the stripe layout above; N a multiple of 16, K of 32. */
void kvs_amx_pack(const uint16_t *w, int64_t N, int K, uint16_t *out, int threads) {
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

/* y [M, N] (row stride N) = x [M, K] (row stride ldx) @ W.T, x and y bfloat16 (`bf16` must
 * be 1; the argument keeps kvs_q8_matmul's signature), W as kvs_amx_pack laid it out.
 * Returns 1 if the shapes or dtype do not fit (K a multiple of 32, N of 16) or the tiles
 * were refused, 2 if scratch memory could not be had, else 0. */
int kvs_amx_matmul(const uint16_t *w, const void *unused, const uint16_t *x, int64_t ldx,
                   int M, int64_t N, int K, uint16_t *y, int bf16, int threads) {
    (void)unused;
    if (K % 32 || N % 16 || M < 0 || !bf16 || !kvs_amx_ready()) return 1;
    if (M == 0 || N == 0) return 0;
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

#else /* no AMX in this build: the callers take oneDNN */

int kvs_amx_ready(void) { return 0; }

void kvs_amx_pack(const uint16_t *w, int64_t N, int K, uint16_t *out, int threads) {
    (void)w, (void)N, (void)K, (void)out, (void)threads;
}

int kvs_amx_matmul(const uint16_t *w, const void *unused, const uint16_t *x, int64_t ldx,
                   int M, int64_t N, int K, uint16_t *y, int bf16, int threads) {
    (void)w, (void)unused, (void)x, (void)ldx, (void)M, (void)N, (void)K, (void)y, (void)bf16,
        (void)threads;
    return 1;
}
#endif
