/* Paged attention that reads the KV pool's pages in place (CPU).
 *
 * Every query row (a decode token or a token of a prefill chunk) attends to the
 * keys [lo, lo + n) of its sequence's pages: no gather of the pages into a
 * contiguous copy, no padding to the longest sequence, no mask. Work items are
 * (row, KV head) pairs; the query heads that share a KV head are done together
 * so each key and value row is read once per item. A prefill chunk's rows read
 * the same pages one after another, so those stay in cache; one row at a time
 * measured faster than torch's flash SDPA here from 64 to 2048-token chunks. Runs of 16
 * rows of one sequence go as blocks instead: bf16 with AVX-512 BF16 (prefill_blocks), and
 * float32 on every build (prefill_blocks_f32).
 *
 * Numerics follow the matmul path it replaces: products accumulate in float32;
 * for bfloat16 inputs the raw scores, the probabilities and the output are
 * rounded to bfloat16 where that path rounds them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bf16.h"

/* Where one layer's keys and values lie. Page id p >= 0 is the pool's page p; p <= -2 is
 * page -2 - p of the step pages, laid out as the pool's within a page: a windowed layer's
 * keys that no later step reads get no page in the pool (window_only), and the prefill chunk
 * that computes them writes them there and its own queries read them there. (-1, a page
 * released before the window, is never read.) Strides in elements of esize bytes. */
typedef struct {
    const char *pool, *steps;
    int64_t s_page, ss_page, s_kv, s_tok, s_head;
    int T, esize;
} kv_pages;

/* Slot `slot` of page p, KV head h: its key (the value is s_kv elements on). */
static inline const char *kv_at(const kv_pages *kv, int64_t p, int64_t slot, int h) {
    const char *page = p >= 0 ? kv->pool + p * kv->s_page * kv->esize
                              : kv->steps + (-2 - p) * kv->ss_page * kv->esize;
    return page + (slot * kv->s_tok + h * kv->s_head) * kv->esize;
}

/* Key k of the sequence whose pages are tbl, KV head h. */
static inline const char *key_at(const kv_pages *kv, const int32_t *tbl, int k, int h) {
    return kv_at(kv, tbl[k / kv->T], k % kv->T, h);
}

/* Key and value rows are prefetched this many rows ahead: a sequence's rows lie on pages
 * anywhere in the pool, and the hardware prefetcher, which follows addresses within a 4 KB
 * page, loses them at every page (decode attention of 32 rows x 200 keys, Gemma 3 270M, 18
 * layers: 6.5 -> 4.1 ms a step; 8 and 16 rows ahead measured alike, 4 less). */
#define AHEAD 16

/* An item's value rows are prefetched with its keys while they fit this core's L2 (else
 * the values pass would find them evicted: float32, 2048 keys, 2 MB of values with a 1 MB
 * L2, 88 -> 91 ms with and 78 ms without). */
static size_t value_span(void) {
    static long l2 = 0;  /* a benign race: every thread finds the same value */
    if (!l2) {
        const long got = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = got > 0 ? got : 512 << 10;
    }
    return (size_t)l2;
}

static inline void prefetch_row(const void *row, size_t bytes) {
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b);
}

/* A key row and, vskip bytes on unless vskip is 0, its value row. Both helpers are forced
 * inline: as calls in scores_g's loop (GCC declined to inline them there) the accumulators
 * spilled around each one, and decode attention took 1.55x as long. */
__attribute__((always_inline)) static inline void prefetch_key(const void *row, size_t bytes,
                                                                int64_t vskip) {
    prefetch_row(row, bytes);
    if (vskip) prefetch_row((const char *)row + vskip, bytes);
}

/* The decode loops walk keys i and h + i together (two streams of pages, scores_g): the
 * rows AHEAD on in each stream. */
__attribute__((always_inline)) static inline void prefetch_streams(
    const void *const *rows, int i, int h, int n, size_t bytes, int64_t vskip) {
    if (i + AHEAD < h) prefetch_key(rows[i + AHEAD], bytes, vskip);
    if (h + i + AHEAD < n) prefetch_key(rows[h + i + AHEAD], bytes, vskip);
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.f;
    #pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* scale the raw scores, softmax each head's row in float32; lse[g] (if not NULL) gets the
 * row's log-sum-exp, what DistAttention merges partial results by */
static void softmax(float *sc, int n, int G, float scale, int is_bf16, float *lse) {
    for (int g = 0; g < G; g++) {
        float *s = sc + (size_t)g * n, m = -INFINITY, sum = 0.f;
        for (int i = 0; i < n; i++) {
            s[i] = (is_bf16 ? bf16_round(s[i]) : s[i]) * scale;
            m = s[i] > m ? s[i] : m;
        }
        for (int i = 0; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
        if (lse) lse[g] = m + logf(sum);
        const float inv = 1.f / sum;
        for (int i = 0; i < n; i++) s[i] = is_bf16 ? bf16_round(s[i] * inv) : s[i] * inv;
    }
}

/* Where the run of rows of one sequence that starts at row r ends (the prefill blocks take
 * such runs; seq holds each row's sequence). */
static int run_end(const int32_t *seq, int R, int r) {
    int end = r;
    while (end < R && seq[end] == seq[r]) end++;
    return end;
}

/* The keys rows [r0, r0 + count) read between them: [*first, *end). */
static void key_range(const int32_t *lo, const int32_t *n_keys, int r0, int count, int *first,
                      int *end) {
    int a = lo[r0], b = lo[r0] + n_keys[r0];
    for (int i = r0 + 1; i < r0 + count; i++) {
        a = lo[i] < a ? lo[i] : a;
        b = lo[i] + n_keys[i] > b ? lo[i] + n_keys[i] : b;
    }
    *first = a;
    *end = b;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#define INLINE static inline __attribute__((always_inline))

/* The bf16 paths are written for a compile-time G (query heads per KV head), instantiated
 * below for 1, 2, 4 and 8: with G known the accumulators live in registers; indexed by a
 * runtime G they spill to memory and each dot instruction waits on a store. */

/* sc[g * n + i] = q_g . k_i, keys i and h + i (h = n/2 rounded up) together: two
 * independent streams of pages, whose 2G accumulators also hide the dot instruction's
 * latency. A core reads a page run at ~28 GB/s and computes these products at ~39 GB/s;
 * one stream at a time measured 1/(1/28 + 1/39), the two not overlapping. Two streams, and
 * the value rows prefetched with their keys (vskip bytes on, 0: none; attend) so the values
 * pass finds them in cache: 32 decode rows x 256 keys of Gemma 3 270M's 18 layers, cold
 * pages in random order, 5.74 -> 4.58 ms; 2048 keys 47.9 -> 39.3 ms (Zen 5, 2 threads).
 * q is [G][D] bf16, D % 32 == 0. */
INLINE void scores_g(const int G, const uint16_t *q, const uint16_t *const *rows, int n,
                     int D, float *sc, int64_t vskip) {
    const int h = (n + 1) / 2;  /* keys i and h + i together: two streams of pages */
    const size_t bytes = (size_t)D * 2;
    for (int i = 0; i < h; i++) {
        const int j = h + i < n ? h + i : i;
        const uint16_t *r0 = rows[i], *r1 = rows[j];
        prefetch_streams((const void *const *)rows, i, h, n, bytes, vskip);
        __m512 acc[16];
        for (int a = 0; a < 2 * G; a++) acc[a] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(r0 + d);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(r1 + d);
            for (int g = 0; g < G; g++) {
                const __m512bh qg = (__m512bh)_mm512_loadu_si512(q + (size_t)g * D + d);
                acc[2 * g] = _mm512_dpbf16_ps(acc[2 * g], qg, k0);
                acc[2 * g + 1] = _mm512_dpbf16_ps(acc[2 * g + 1], qg, k1);
            }
        }
        for (int g = 0; g < G; g++) {
            sc[(size_t)g * n + i] = _mm512_reduce_add_ps(acc[2 * g]);
            if (h + i < n) sc[(size_t)g * n + h + i] = _mm512_reduce_add_ps(acc[2 * g + 1]);
        }
    }
}

/* acc[g][:] = sum_i p[g * n + i] v_i, with p already bf16-exact. Keys go in pairs (i and
 * h + i, as in scores_g): their value rows are interleaved so one dot instruction does
 * two keys. The interleave works within 128-bit lanes, so each 32-wide block of acc comes out
 * in a fixed permuted order that the store undoes. Blocks of 64 dims (32 for G = 8) keep the
 * accumulators in registers. */
INLINE void values_g(const int G, const float *p, const uint16_t *const *rows,
                     const uint16_t *zero, int n, int D, float *acc, int32_t *pairs) {
    const int W = G == 8 ? 1 : 2;  /* 32-dim halves per block */
    const int h = (n + 1) / 2;
    for (int g = 0; g < G; g++)
        for (int i = 0; i < h; i++) {
            const float p1 = h + i < n ? p[(size_t)g * n + h + i] : 0.f;
            pairs[(size_t)g * h + i] = (int32_t)((uint32_t)bf16_store(p[(size_t)g * n + i])
                                                 | (uint32_t)bf16_store(p1) << 16);
        }
    for (int d = 0; d < D; d += 32 * W) {
        __m512 a[32];
        for (int j = 0; j < 2 * W * G; j++) a[j] = _mm512_setzero_ps();
        for (int i = 0; i < h; i++) {
            const uint16_t *r0 = rows[i] + d, *r1 = h + i < n ? rows[h + i] + d : zero;
            if (d == 0)  /* whole rows: the later blocks read them too */
                prefetch_streams((const void *const *)rows, i, h, n, (size_t)D * 2, 0);
            __m512i v[4];
            for (int hh = 0; hh < W; hh++) {
                const __m512i x = _mm512_loadu_si512(r0 + 32 * hh);
                const __m512i y = _mm512_loadu_si512(r1 + 32 * hh);
                v[2 * hh] = _mm512_unpacklo_epi16(x, y);
                v[2 * hh + 1] = _mm512_unpackhi_epi16(x, y);
            }
            for (int g = 0; g < G; g++) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32(pairs[(size_t)g * h + i]);
                for (int j = 0; j < 2 * W; j++)
                    a[2 * W * g + j] = _mm512_dpbf16_ps(a[2 * W * g + j], pp, (__m512bh)v[j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int hh = 0; hh < W; hh++) {
                float lo[16], hi[16], *o = acc + (size_t)g * D + d + 32 * hh;
                _mm512_storeu_ps(lo, a[2 * W * g + 2 * hh]);
                _mm512_storeu_ps(hi, a[2 * W * g + 2 * hh + 1]);
                for (int l = 0; l < 16; l++) {
                    o[8 * (l / 4) + l % 4] = lo[l];
                    o[8 * (l / 4) + l % 4 + 4] = hi[l];
                }
            }
    }
}

/* e^x for x <= 0 (scores minus their max): bf16.h's pieces, 2^n by scalef. Within 2 ulp of
 * expf, far below the bf16 rounding that the probabilities get next. */
INLINE __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));  /* e^-103 is 0 in float32 */
    const __m512 n = _mm512_roundscale_ps(x * EXP_LOG2E,
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = EXP_R(x, n);
    return _mm512_scalef_ps(EXP_TAYLOR6(r), n);
}

INLINE __m512 bf16_round512(__m512 x) {  /* round to nearest even, keep as float32 */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* softmax() of one row of n bf16 scores in place, 16 at a time (scores are finite: no NaN
 * handling needed): the probabilities, rounded to bf16, as floats. */
static void softmax_span(float *s, int n, float scale, float *lse) {
    __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(k, s + i);
        x = _mm512_mul_ps(bf16_round512(x), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(s + i, k, x);
        m = _mm512_mask_max_ps(m, k, m, x);
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mx));
        _mm512_mask_storeu_ps(s + i, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    const float total = _mm512_reduce_add_ps(sum);
    if (lse) *lse = _mm512_reduce_max_ps(m) + logf(total);
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv);
        _mm512_mask_storeu_ps(s + i, k, bf16_round512(x));
    }
}

static void softmax_bf16(float *sc, int n, int G, float scale, float *lse) {
    for (int g = 0; g < G; g++) softmax_span(sc + (size_t)g * n, n, scale, lse ? lse + g : NULL);
}

#define HAVE_BLOCKED_PREFILL 1
/* Prefill in blocks of 16 query rows of one sequence.
 *
 * One row at a time, a long prompt's attention is most of its prefill (an 8000-token
 * prompt of Gemma 3 270M: 7.7 of 10.8 s on a Xeon), and each key is read and reduced once
 * per row. A block of 16 rows of one sequence shares its keys, so the scores are a
 * [16 x D] by [D x keys] product and the output a [16 x keys] by [keys x D] one. The keys
 * a sequence's blocks read are laid out once a call (pack_kv) in AMX's pair form: K
 * transposed, 16 keys by 32 dims a tile; V two keys interleaved, 32 keys by 16 dims a tile
 * (zeros past the range). With AMX's tiles granted (kvs_amx_ready) the products are tile
 * products (8192 multiply-adds an instruction); elsewhere vdpbf16ps reads the same layout
 * with the 16 rows' values broadcast, 16 keys or dims to a vector, so no sum is reduced
 * across a vector. Each row still attends to its own range [lo, lo + n): the softmax masks
 * the rest of the block's span, so causal and sliding windows need no mask tensor.
 *
 * The rounding points are the row path's (scores to bf16, then scaled; softmax in float32;
 * probabilities to bf16; output summed in float32, rounded once): only the order of the
 * float32 sums differs. */
#define QB 16 /* query rows a block */

/* Keys [k0, k0 + nk) of one (sequence, KV head) from its pages into kt (per 16 keys, D / 32
 * tiles: row r holds dims 2r, 2r + 1 of each key) and vt (per 32 keys, D / 16 tiles: row r
 * holds keys 2r, 2r + 1 of each dim). kt, vt hold npad = nk rounded up to 32 keys; past nk
 * they are zero. */
static void pack_kv(const kv_pages *kv, const int32_t *tbl, int h, int k0, int nk, int npad,
                    int D, uint32_t *kt, uint16_t *vt) {
#pragma omp for schedule(static)
    for (int i = 0; i < npad; i++) {
        uint32_t *kt_tile = kt + (size_t)(i / 16) * (D / 32) * 256 + i % 16;
        uint16_t *vt_tile = vt + (size_t)(i / 32) * (D / 16) * 512 + (i % 32 / 2) * 32 + i % 2;
        if (i >= nk) {
            for (int j = 0; j < D / 2; j++) kt_tile[(j / 16) * 256 + (j % 16) * 16] = 0;
            for (int d = 0; d < D; d++) vt_tile[(d / 16) * 512 + (d % 16) * 2] = 0;
            continue;
        }
        const int k = k0 + i;
        const uint16_t *key = (const uint16_t *)key_at(kv, tbl, k, h), *val = key + kv->s_kv;
        uint32_t pair;
        for (int j = 0; j < D / 2; j++) {
            memcpy(&pair, key + 2 * j, 4);
            kt_tile[(j / 16) * 256 + (j % 16) * 16] = pair;
        }
        for (int d = 0; d < D; d++) vt_tile[(d / 16) * 512 + (d % 16) * 2] = val[d];
    }
}

/* Value pair i of row r of a bf16 matrix (row stride ld elements), on every lane. */
INLINE __m512bh pair_of(const uint16_t *x, int64_t ld, int r, int i) {
    uint32_t v;
    memcpy(&v, x + r * ld + 2 * i, 4);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

/* Scores of 16 rows (q: the block's first row, one head; row stride ldq elements) against
 * key tiles [t0, t1) into s [16][span] float32, with vdpbf16ps: a key tile's dim pair j is
 * one vector (its 16 keys), times row r's pair j broadcast. (8 rows by 2 key tiles a pass,
 * a broadcast serving two products, measured no faster on a Xeon: vdpbf16ps bound.) */
static void vec_scores(const uint16_t *q, int64_t ldq, const uint32_t *kt, int t0, int t1,
                       int D, float *s, int span) {
    for (int t = t0; t < t1; t++) {
        const uint32_t *k = kt + (size_t)t * (D / 32) * 256;
        __m512 acc[QB];
        for (int r = 0; r < QB; r++) acc[r] = _mm512_setzero_ps();
        for (int j = 0; j < D / 2; j++) {
            const __m512bh kv = (__m512bh)_mm512_load_si512(k + 16 * j);
            for (int r = 0; r < QB; r++) acc[r] = _mm512_dpbf16_ps(acc[r], pair_of(q, ldq, r, j), kv);
        }
        for (int r = 0; r < QB; r++) _mm512_storeu_ps(s + (size_t)r * span + (t - t0) * 16, acc[r]);
    }
}

/* out [16][D] float32 = p [16][span] (bf16, key blocks [b0, b1)) @ V, with vdpbf16ps: a
 * value tile's key pair i is one vector (its 16 dims), times row r's probability pair. */
static void vec_values(const uint16_t *p, int span, const uint16_t *vt, int b0, int b1, int D,
                       float *out) {
    for (int dt = 0; dt < D / 16; dt++) {
        __m512 acc[QB];
        for (int r = 0; r < QB; r++) acc[r] = _mm512_setzero_ps();
        for (int b = b0; b < b1; b++) {
            const uint16_t *v = vt + ((size_t)b * (D / 16) + dt) * 512;
            for (int i = 0; i < 16; i++) {
                const __m512bh vv = (__m512bh)_mm512_load_si512(v + 32 * i);
                for (int r = 0; r < QB; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], pair_of(p + (b - b0) * 32, span, r, i), vv);
            }
        }
        for (int r = 0; r < QB; r++) _mm512_storeu_ps(out + (size_t)r * D + dt * 16, acc[r]);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
int kvs_amx_ready(void);      /* bf16gemm.c */
void kvs_amx_configure(void); /* bf16gemm.c: every tile 16 rows of 64 bytes */

static inline void amx_zero_sums(void) { /* sums 0-3 */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Sum g (0-3, one a head) += operand tiles 4 x 5, and 6 x 7 if `two`: tile numbers must be
 * constants, hence the switch. */
static inline void amx_head_products(int g, int two) {
    switch (g) {
    case 0: _tile_dpbf16ps(0, 4, 5); if (two) _tile_dpbf16ps(0, 6, 7); break;
    case 1: _tile_dpbf16ps(1, 4, 5); if (two) _tile_dpbf16ps(1, 6, 7); break;
    case 2: _tile_dpbf16ps(2, 4, 5); if (two) _tile_dpbf16ps(2, 6, 7); break;
    default: _tile_dpbf16ps(3, 4, 5); if (two) _tile_dpbf16ps(3, 6, 7);
    }
}

/* Scores of 16 rows of ng <= 4 heads (q: the block's first row of the first head; row
 * stride ldq, head stride ldh elements) against key tiles [t0, t1) into s [ng][16][span]
 * float32. The heads share each key tile (sums 0-3: one a head), so a long span's keys are
 * read once a block rather than once a head. */
static void amx_scores(const uint16_t *q, int64_t ldq, int64_t ldh, int ng, const uint32_t *kt,
                       int t0, int t1, int D, float *s, int span) {
    for (int t = t0; t < t1; t++) {
        amx_zero_sums();
        for (int db = 0; db < D / 32; db += 2) { /* two sets of tiles: 4-5, then 6-7 */
            const int two = db + 1 < D / 32;
            const uint32_t *k = kt + ((size_t)t * (D / 32) + db) * 256;
            const uint16_t *x = q + db * 32;
            _tile_loadd(5, k, 64);
            if (two) _tile_loadd(7, k + 256, 64);
            for (int g = 0; g < ng; g++) {
                _tile_loadd(4, x + g * ldh, ldq * 2);
                if (two) _tile_loadd(6, x + g * ldh + 32, ldq * 2);
                amx_head_products(g, two);
            }
        }
        float *o = s + (t - t0) * 16;
        const size_t head = (size_t)QB * span;
        _tile_stored(0, o, span * 4);
        if (ng > 1) _tile_stored(1, o + head, span * 4);
        if (ng > 2) _tile_stored(2, o + 2 * head, span * 4);
        if (ng > 3) _tile_stored(3, o + 3 * head, span * 4);
    }
}

/* out [ng][16][D] float32 = p [ng][16][span] (bf16, key blocks [b0, b1)) @ V: the heads
 * share each value tile, as in amx_scores. */
static void amx_values(const uint16_t *p, int span, int ng, const uint16_t *vt, int b0, int b1,
                       int D, float *out) {
    const size_t head = (size_t)QB * span;
    for (int dt = 0; dt < D / 16; dt++) {
        amx_zero_sums();
        for (int b = b0; b < b1; b += 2) { /* two sets of tiles: 4-5, then 6-7 */
            const int two = b + 1 < b1;
            const uint16_t *v = vt + ((size_t)b * (D / 16) + dt) * 512, *x = p + (b - b0) * 32;
            _tile_loadd(5, v, 64);
            if (two) _tile_loadd(7, v + (size_t)(D / 16) * 512, 64);
            for (int g = 0; g < ng; g++) {
                _tile_loadd(4, x + g * head, span * 2);
                if (two) _tile_loadd(6, x + g * head + 32, span * 2);
                amx_head_products(g, two);
            }
        }
        float *o = out + dt * 16;
        _tile_stored(0, o, D * 4);
        if (ng > 1) _tile_stored(1, o + QB * D, D * 4);
        if (ng > 2) _tile_stored(2, o + 2 * QB * D, D * 4);
        if (ng > 3) _tile_stored(3, o + 3 * QB * D, D * 4);
    }
}
#endif

/* softmax_span for one row whose keys are s[a, b) of its span (overwritten): probabilities
 * as bf16 in p[0, span), zero outside [a, b); lse as there (-inf for an empty range). */
static void softmax_row(float *s, int a, int b, int span, float scale, uint16_t *p,
                        float *lse) {
    memset(p, 0, (size_t)span * 2);
    if (a >= b) {
        if (lse) *lse = -INFINITY;
        return;
    }
    softmax_span(s + a, b - a, scale, lse);
    for (int i = a; i < b; i += 16) { /* bf16-exact already: the top halves */
        const __mmask16 k = b - i >= 16 ? 0xffff : (__mmask16)((1u << (b - i)) - 1);
        const __m512i x = _mm512_castps_si512(_mm512_maskz_loadu_ps(k, s + i));
        _mm256_mask_storeu_epi16(p + i, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
    }
}

/* Scores of a block's 16 rows of ng heads against key tiles [t0, t1), and their outputs
 * from their probabilities, on the tiles or with vdpbf16ps (a head at a time). */
static void scores(int tiles, const uint16_t *q, int64_t ldq, int64_t ldh, int ng,
                   const uint32_t *kt, int t0, int t1, int D, float *s, int span) {
#ifdef HAVE_AMX
    if (tiles) {
        amx_scores(q, ldq, ldh, ng, kt, t0, t1, D, s, span);
        return;
    }
#endif
    (void)tiles;
    for (int g = 0; g < ng; g++)
        vec_scores(q + g * ldh, ldq, kt, t0, t1, D, s + (size_t)g * QB * span, span);
}

static void values(int tiles, const uint16_t *p, int span, int ng, const uint16_t *vt, int b0,
                   int b1, int D, float *out) {
#ifdef HAVE_AMX
    if (tiles) {
        amx_values(p, span, ng, vt, b0, b1, D, out);
        return;
    }
#endif
    (void)tiles;
    for (int g = 0; g < ng; g++)
        vec_values(p + (size_t)g * QB * span, span, vt, b0, b1, D, out + (size_t)g * QB * D);
}

/* One block (rows r0 .. r0 + 15 of one sequence) and KV head h, its keys packed from k0. */
static int prefill_block(int tiles, const uint16_t *q, int64_t q_sr, int64_t q_sh,
                         const uint32_t *kt, const uint16_t *vt, int k0, const int32_t *lo,
                         const int32_t *n_keys, int r0, int h, int G, int Hq, int D,
                         float scale, uint16_t *out, float *lse) {
    int kmin, kmax;
    key_range(lo, n_keys, r0, QB, &kmin, &kmax);
    const int b0 = (kmin - k0) / 32, b1 = kmax > kmin ? (kmax - k0 + 31) / 32 : b0;
    const int span = (b1 - b0) * 32 > 32 ? (b1 - b0) * 32 : 32, base = k0 + b0 * 32;
    const int ng = G % 4 == 0 ? 4 : G % 3 == 0 ? 3 : G % 2 == 0 ? 2 : 1; /* heads a pass */
    float *s = aligned_alloc(64, (size_t)ng * QB * (span + D) * 4);
    uint16_t *p = aligned_alloc(64, (size_t)ng * QB * span * 2);
    if (!s || !p) {
        free(s);
        free(p);
        return -1;
    }
    float *o = s + (size_t)ng * QB * span;
    for (int g0 = 0; g0 < G; g0 += ng) {
        const int head0 = h * G + g0;
        if (b1 > b0)
            scores(tiles, q + (size_t)r0 * q_sr + (size_t)head0 * q_sh, q_sr, q_sh, ng, kt,
                   2 * b0, 2 * b1, D, s, span);
        for (int g = 0; g < ng; g++)
            for (int i = 0; i < QB; i++) {
                const int r = r0 + i;
                const size_t row = (size_t)g * QB + i;
                softmax_row(s + row * span, lo[r] - base, lo[r] + n_keys[r] - base, span, scale,
                            p + row * span, lse ? lse + (size_t)r * Hq + head0 + g : NULL);
            }
        if (b1 > b0) values(tiles, p, span, ng, vt, b0, b1, D, o);
        else memset(o, 0, (size_t)ng * QB * D * 4);
        for (int g = 0; g < ng; g++)
            for (int i = 0; i < QB; i++)
                store_row(out + ((size_t)(r0 + i) * Hq + head0 + g) * D, 0,
                          o + ((size_t)g * QB + i) * D, D, 1);
    }
    free(s);
    free(p);
    return 0;
}

/* The rows of runs of QB rows of one sequence (bf16, D a multiple of 32), on the tiles where
 * Linux granted them; done[r] set for each row computed. Returns -1 if memory could not be
 * had. */
static int prefill_blocks(const uint16_t *q, int64_t q_sr, int64_t q_sh, const kv_pages *kv,
                          const int32_t *tables, int64_t tables_stride, const int32_t *seq,
                          const int32_t *lo, const int32_t *n_keys, int R, int Hq, int Hkv,
                          int D, float scale, uint16_t *out, float *lse, int nthreads,
                          uint8_t *done) {
    const int G = Hq / Hkv;
#ifdef HAVE_AMX
    const int tiles = kvs_amx_ready();
#else
    const int tiles = 0;
#endif
    int failed = 0;
    for (int r = 0, end; r < R; r = end) {
        end = run_end(seq, R, r);
        const int blocks = (end - r) / QB;
        if (blocks == 0) continue;
        int k0, k1;
        key_range(lo, n_keys, r, blocks * QB, &k0, &k1);
        const int nk = k1 - k0, npad = (nk + 31) / 32 * 32;
        uint32_t *kt = aligned_alloc(64, (size_t)Hkv * npad * D * 2 + 64);
        uint16_t *vt = aligned_alloc(64, (size_t)Hkv * npad * D * 2 + 64);
        if (!kt || !vt) {
            free(kt);
            free(vt);
            return -1;
        }
        const int32_t *tbl = tables + (size_t)seq[r] * tables_stride;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
        {
            for (int h = 0; h < Hkv; h++)
                pack_kv(kv, tbl, h, k0, nk, npad, D, kt + (size_t)h * npad * D / 2,
                        vt + (size_t)h * npad * D);
#ifdef HAVE_AMX
            if (tiles) kvs_amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < blocks * Hkv; item++) {
                const int b = item / Hkv, h = item % Hkv;
                failed |= prefill_block(tiles, q, q_sr, q_sh, kt + (size_t)h * npad * D / 2,
                                        vt + (size_t)h * npad * D, k0, lo, n_keys, r + b * QB, h,
                                        G, Hq, D, scale, out, lse);
            }
#ifdef HAVE_AMX
            if (tiles) _tile_release();
#endif
        }
        free(kt);
        free(vt);
        if (failed) return -1;
        memset(done + r, 1, (size_t)blocks * QB);
    }
    return 0;
}

/* Returns 0 where G has no instance (the caller takes the float32 path). */
static int attend_bf16(int G, const uint16_t *q, const uint16_t *const *keys,
                       const uint16_t *const *vals, int64_t vskip, const uint16_t *zero, int n,
                       int D, float scale, float *sc, float *acc, int32_t *pairs, float *lse) {
    switch (G) {
#define CASE(g) case g: scores_g(g, q, keys, n, D, sc, vskip);                            \
                        softmax_bf16(sc, n, g, scale, lse);                               \
                        values_g(g, sc, vals, zero, n, D, acc, pairs); return 1;
    CASE(1) CASE(2) CASE(4) CASE(8)
#undef CASE
    default: return 0;
    }
}
#endif

/* Generic float32 paths (any dtype the loads support). */

/* Row r (D values) as float32: in place where the pool holds float32, else converted into
 * buf. */
static inline const float *row_f32(const char *r, float *buf, int D, int is_bf16) {
    if (!is_bf16) return (const float *)r;
    load_row(r, 0, buf, D, is_bf16);
    return buf;
}

/* sc[g * n + i] = q_g . k_i, keys i and h + i together, value rows prefetched with their
 * keys (vskip bytes on), as scores_g: float32, 256 keys 13.2 -> 10.2 ms (the AVX2 build
 * 14.5 -> 12.5), 2048 keys 88.2 -> 71.0. buf: 2D floats. */
static void scores_f32(const float *qf, const char *const *rows, int n, int G, int D,
                       int is_bf16, int64_t vskip, float *buf, float *sc) {
    const size_t bytes = (size_t)D * (is_bf16 ? 2 : 4);
    const int h = (n + 1) / 2;
    for (int i = 0; i < h; i++) {
        prefetch_streams((const void *const *)rows, i, h, n, bytes, vskip);
        const float *a = row_f32(rows[i], buf, D, is_bf16);
        const float *b = h + i < n ? row_f32(rows[h + i], buf + D, D, is_bf16) : NULL;
        for (int g = 0; g < G; g++) {
            sc[(size_t)g * n + i] = dot(qf + (size_t)g * D, a, D);
            if (b) sc[(size_t)g * n + h + i] = dot(qf + (size_t)g * D, b, D);
        }
    }
}

/* acc[g][:] = sum_i p[g * n + i] v_i, values i and h + i together, as scores_f32. */
static void values_f32(const float *p, const char *const *rows, int n, int G, int D,
                       int is_bf16, float *buf, float *acc) {
    const size_t bytes = (size_t)D * (is_bf16 ? 2 : 4);
    const int h = (n + 1) / 2;
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int i = 0; i < h; i++) {
        prefetch_streams((const void *const *)rows, i, h, n, bytes, 0);
        const float *a = row_f32(rows[i], buf, D, is_bf16);
        const float *b = h + i < n ? row_f32(rows[h + i], buf + D, D, is_bf16) : NULL;
        for (int g = 0; g < G; g++) {
            const float pa = p[(size_t)g * n + i];
            float *restrict o = acc + (size_t)g * D;
            if (b) {
                const float pb = p[(size_t)g * n + h + i];
                #pragma omp simd
                for (int d = 0; d < D; d++) o[d] += pa * a[d] + pb * b[d];
            } else {
                #pragma omp simd
                for (int d = 0; d < D; d++) o[d] += pa * a[d];
            }
        }
    }
}

/* One (query row, KV head) item. scratch holds (3G + 1) D + G (2n + 1) floats: the query
 * heads, their sums, two rows (G >= 1 leaves room), the scores and (bf16) their pairs. */
static void attend(const char *qb, int64_t q_sh, const char *const *keys, const char **vals,
                   int64_t kv_bytes, int n, int G, int D, float scale, int is_bf16,
                   float *scratch, char *out, float *lse) {
    const size_t esize = is_bf16 ? 2 : 4;
    float *qf = scratch, *acc = qf + (size_t)G * D, *row = acc + (size_t)G * D;
    float *sc = row + 2 * (size_t)D;
    if (n == 0) {  /* an empty shard (DistAttention): output 0, weight exp(-inf) = 0 */
        memset(acc, 0, sizeof(float) * (size_t)G * D);
        store_row(out, 0, acc, G * D, is_bf16);
        if (lse) for (int g = 0; g < G; g++) lse[g] = -INFINITY;
        return;
    }
    for (int i = 0; i < n; i++) vals[i] = keys[i] + kv_bytes;
    /* the scores pass prefetches the value rows too while they fit L2 (value_span) */
    const int64_t vskip = (size_t)n * D * esize <= value_span() ? kv_bytes : 0;
    int done = 0;
#ifdef HAVE_BF16_DOT
    if (is_bf16 && D % 64 == 0) {
        uint16_t *q16 = (uint16_t *)qf;  /* the query heads as one [G][D] bf16 block */
        for (int g = 0; g < G; g++)
            memcpy(q16 + (size_t)g * D, qb + (size_t)g * q_sh * esize, (size_t)D * 2);
        memset(row, 0, sizeof(float) * D);
        done = attend_bf16(G, q16, (const uint16_t *const *)keys, (const uint16_t *const *)vals,
                           vskip, (const uint16_t *)row, n, D, scale, sc, acc,
                           (int32_t *)(sc + (size_t)G * n), lse);
    }
#endif
    if (!done) {
        for (int g = 0; g < G; g++)
            load_row(qb + (size_t)g * q_sh * esize, 0, qf + (size_t)g * D, D, is_bf16);
        scores_f32(qf, keys, n, G, D, is_bf16, vskip, row, sc);
        softmax(sc, n, G, scale, is_bf16, lse);
        values_f32(sc, (const char *const *)vals, n, G, D, is_bf16, row, acc);
    }
    store_row(out, 0, acc, G * D, is_bf16);  /* the item's G heads sit side by side */
}

/* ---- float32 prefill in blocks of 16 rows, the rows in vector lanes ----
 *
 * The float32 analogue of prefill_blocks, for every build (AVX2 machines serve float32):
 * 16 rows of one sequence go together, row i in lane i of the block's vectors (GCC's
 * vector extension at the build's width: one zmm with AVX-512, two ymm with AVX2, four xmm
 * without). Then a key's scores for the 16 rows are a sum over d of the rows' q[d] (the
 * block's vectors) times the key's value at d (broadcast), read from its page in place: no
 * layout pass, and no sum reduced across a vector. Keys go KW at a time so that CHAINS chains
 * of sums hide the FMA's latency. The softmax goes down the keys lane-wise (each lane
 * masked to its row's range [lo, lo + n)) over chunks of VC keys, flash attention's way,
 * and the output KW dims a pass likewise, the values broadcast. Numerics: float32 products
 * and sums as the row path (only their order differs), and a polynomial exp within a few
 * ulp of expf. */
#if defined(__AVX512F__)
#define VB 64
#define CHAINS 8
#elif defined(__AVX2__)
#define VB 32
#define CHAINS 12 /* 8 left the FMAs idle a third of the time (attention of an 8000-token
                   * prompt 4.2 -> 3.2 s, AVX2-held Zen 5); AVX-512 with 12: 2.2 -> 3.9 s */
#else
#define VB 16
#define CHAINS 8
#endif
typedef float fvec __attribute__((vector_size(VB)));
typedef int32_t ivec __attribute__((vector_size(VB)));
#define FB 16            /* rows a float32 block */
#define NV (FB * 4 / VB) /* vectors a block's rows fill */
#define KW (CHAINS / NV) /* keys (and output dims) a pass: CHAINS chains of sums */
#define VC (KW * ((64 + KW - 1) / KW)) /* keys a chunk, about 64 in whole passes: their rows
                                        * stay in L1/L2 while every head passes */
#define FG 8             /* query heads a KV head, at most, in the float32 blocks */

static inline fvec fsplat(float x) { return (fvec){0} + x; }
static inline fvec fselect(ivec m, fvec a, fvec b) { return (fvec)(((ivec)a & m) | ((ivec)b & ~m)); }

/* e^x lane-wise for x <= 0 (scores less their row's maximum): bf16.h's pieces, 2^n built in
 * the exponent bits; 0 below -87 (and for -inf, the masked lanes). */
static inline fvec vexp(fvec x) {
    const ivec under = x < -87.f;
    x = fselect(under, fsplat(-87.f), x);
    const fvec n = (x * EXP_LOG2E + 12582912.f) - 12582912.f; /* round to nearest */
    const fvec r = EXP_R(x, n);
    const ivec scale = (__builtin_convertvector(n, ivec) + 127) << 23;
    return (fvec)((ivec)(EXP_TAYLOR6(r) * (fvec)scale) & ~under);
}

/* Scores of the block's rows (qt: D x NV vectors, one query head) against keys krow[0 .. n)
 * into st (n x NV), scaled, and masked to -inf outside each lane's range [first, last) of
 * key indices (k0 is krow[0]'s). */
static void f32_scores(const fvec *qt, const float *const *krow, int n, int k0, int D,
                       float scale, const ivec *first, const ivec *last, fvec *st) {
    for (int k = 0; k < n; k += KW) { /* KW keys a pass */
        const int nk = n - k < KW ? n - k : KW;
        fvec a[KW][NV] = {{{0}}};
        if (nk == KW) {
            for (int d = 0; d < D; d++)
#pragma GCC unroll 8
                for (int j = 0; j < KW; j++) {
                    const float x = krow[k + j][d];
#pragma GCC unroll 4
                    for (int v = 0; v < NV; v++) a[j][v] += qt[d * NV + v] * x;
                }
        } else {
            for (int j = 0; j < nk; j++)
                for (int d = 0; d < D; d++)
                    for (int v = 0; v < NV; v++) a[j][v] += qt[d * NV + v] * krow[k + j][d];
        }
        for (int j = 0; j < nk; j++)
            for (int v = 0; v < NV; v++) {
                const ivec kk = (ivec){0} + (k0 + k + j);
                st[(k + j) * NV + v] = fselect((kk >= first[v]) & (kk < last[v]), a[j][v] * scale,
                                               fsplat(-INFINITY));
            }
    }
}

/* ot (D x NV) += st's probabilities (n x NV) times the keys' value rows, KW dims a pass. */
static void f32_values(const fvec *st, const float *const *krow, int n, int64_t s_kv, int D,
                       fvec *ot) {
    for (int d0 = 0; d0 < D; d0 += KW) {
        const int nd = D - d0 < KW ? D - d0 : KW;
        fvec o[KW][NV];
        for (int j = 0; j < nd; j++)
            for (int v = 0; v < NV; v++) o[j][v] = ot[(d0 + j) * NV + v];
        if (nd == KW) {
            for (int k = 0; k < n; k++) {
                const float *val = krow[k] + s_kv + d0;
#pragma GCC unroll 8
                for (int j = 0; j < KW; j++)
#pragma GCC unroll 4
                    for (int v = 0; v < NV; v++) o[j][v] += st[k * NV + v] * val[j];
            }
        } else {
            for (int k = 0; k < n; k++)
                for (int j = 0; j < nd; j++)
                    for (int v = 0; v < NV; v++) o[j][v] += st[k * NV + v] * krow[k][s_kv + d0 + j];
        }
        for (int j = 0; j < nd; j++)
            for (int v = 0; v < NV; v++) ot[(d0 + j) * NV + v] = o[j][v];
    }
}

/* One block (rows r0 .. r0 + 15 of one sequence) and the G query heads of KV head h: keys
 * [base, base + span) at krow[0 .. span) (pointers to each key's row; its value row is s_kv
 * floats on). The keys go VC at a time (flash attention's running maximum and sum per
 * lane), every head over one chunk before the next: a chunk's key and value rows stay in
 * L1/L2 for all G heads, however long the span. scratch: (2 G D + VC) NV vectors. */
static void f32_block(const float *q, int64_t q_sr, int64_t q_sh, const float *const *krow,
                      int64_t s_kv, int base, int span, const int32_t *lo, const int32_t *n_keys,
                      int r0, int h, int G, int Hq, int D, float scale, fvec *scratch,
                      float *out, float *lse) {
    fvec *qt = scratch, *ot = qt + (size_t)G * D * NV, *st = ot + (size_t)G * D * NV;
    fvec m[FG][NV], sum[FG][NV]; /* per head: each lane's running maximum and sum */
    ivec first[NV], last[NV];  /* each lane's key range */
    for (int v = 0; v < NV; v++)
        for (int i = 0; i < FB / NV; i++) {
            const int r = r0 + v * (FB / NV) + i;
            first[v][i] = lo[r] - base;
            last[v][i] = lo[r] + n_keys[r] - base;
        }
    for (int g = 0; g < G; g++) {
        for (int d = 0; d < D; d++)
            for (int i = 0; i < FB; i++)
                qt[((size_t)g * D + d) * NV + i / (FB / NV)][i % (FB / NV)] =
                    q[(size_t)(r0 + i) * q_sr + (size_t)(h * G + g) * q_sh + d];
        for (int v = 0; v < NV; v++) m[g][v] = fsplat(-INFINITY), sum[g][v] = (fvec){0};
    }
    memset(ot, 0, (size_t)G * D * NV * sizeof(fvec));
    for (int k0 = 0; k0 < span; k0 += VC) {
        const int n = span - k0 < VC ? span - k0 : VC;
        for (int g = 0; g < G; g++) {
            fvec *o = ot + (size_t)g * D * NV;
            f32_scores(qt + (size_t)g * D * NV, krow + k0, n, k0, D, scale, first, last, st);
            for (int v = 0; v < NV; v++) {
                fvec cm = m[g][v];
                for (int k = 0; k < n; k++) cm = fselect(st[k * NV + v] > cm, st[k * NV + v], cm);
                /* lanes with no key yet keep -inf; their exps below are 0 against 0 */
                const fvec safe = (fvec)((ivec)cm & ~(cm == -INFINITY));
                const fvec factor = vexp(m[g][v] - safe);
                m[g][v] = cm;
                fvec add = {0};
                for (int k = 0; k < n; k++) {
                    st[k * NV + v] = vexp(st[k * NV + v] - safe);
                    add += st[k * NV + v];
                }
                sum[g][v] = sum[g][v] * factor + add;
                for (int d = 0; d < D; d++) o[d * NV + v] *= factor;
            }
            f32_values(st, krow + k0, n, s_kv, D, o);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < FB; i++) {
            const int v = i / (FB / NV), l = i % (FB / NV), head = h * G + g;
            const int empty = m[g][v][l] == -INFINITY; /* a row without keys: 0, lse -inf */
            const float inv = empty ? 0.f : 1.f / sum[g][v][l];
            float *row = out + ((size_t)(r0 + i) * Hq + head) * D;
            for (int d = 0; d < D; d++) row[d] = ot[((size_t)g * D + d) * NV + v][l] * inv;
            if (lse)
                lse[(size_t)(r0 + i) * Hq + head] =
                    empty ? -INFINITY : m[g][v][l] + logf(sum[g][v][l]);
        }
}

/* The rows of runs of FB rows of one sequence (float32), done[r] set for each row computed.
 * Returns -1 if memory could not be had. */
static int prefill_blocks_f32(const float *q, int64_t q_sr, int64_t q_sh, const kv_pages *kv,
                              const int32_t *tables, int64_t tables_stride, const int32_t *seq,
                              const int32_t *lo, const int32_t *n_keys, int R, int Hq, int Hkv,
                              int D, float scale, float *out, float *lse, int nthreads,
                              uint8_t *done) {
    const int G = Hq / Hkv;
    int failed = 0;
    for (int r = 0, end; r < R; r = end) {
        end = run_end(seq, R, r);
        const int blocks = (end - r) / FB;
        if (blocks == 0) continue; /* decode rows: no parallel region for nothing */
        const int32_t *tbl = tables + (size_t)seq[r] * tables_stride;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
        for (int item = 0; item < blocks * Hkv; item++) {
            const int r0 = r + item / Hkv * FB, h = item % Hkv;
            int kmin, kmax;
            key_range(lo, n_keys, r0, FB, &kmin, &kmax);
            const int span = kmax > kmin ? kmax - kmin : 0;
            fvec *v = aligned_alloc(64, ((size_t)2 * G * D + VC) * NV * sizeof(fvec));
            const float **krow = malloc(((size_t)span + 1) * sizeof(float *));
            if (!v || !krow) {
                failed = 1;
            } else {
                for (int i = 0; i < span; i++)
                    krow[i] = (const float *)key_at(kv, tbl, kmin + i, h);
                f32_block(q, q_sr, q_sh, krow, kv->s_kv, kmin, span, lo, n_keys, r0, h, G, Hq, D,
                          scale, v, out, lse);
            }
            free(v);
            free(krow);
        }
        if (failed) return -1;
        memset(done + r, 1, (size_t)blocks * FB);
    }
    return 0;
}

/* Strides are in elements. Row r of q belongs to sequence seq[r], whose page j (keys
 * [j T, (j + 1) T)) is tables[seq[r] * tables_stride + j] (a step page where <= -2:
 * kv_pages). out is contiguous [R, Hq, D]; lse, if not NULL, contiguous float32 [R, Hq]
 * (each row's log-sum-exp of scaled scores). Returns 0, or -1 if scratch memory could not
 * be had. */
int kvs_paged_attention(
    const void *q, int64_t q_sr, int64_t q_sh,
    const void *cache, const void *steps, int64_t s_page, int64_t ss_page, int64_t s_kv,
    int64_t s_tok, int64_t s_head, const int32_t *tables, int64_t tables_stride,
    const int32_t *seq, const int32_t *lo, const int32_t *n_keys, int R, int Hq, int Hkv,
    int D, int T, float scale, int is_bf16, void *out, float *lse, int nthreads)
{
    const int G = Hq / Hkv;
    const size_t esize = is_bf16 ? 2 : 4;
    const kv_pages kv = {cache, steps, s_page, ss_page, s_kv, s_tok, s_head, T, (int)esize};
    int failed = 0;
    uint8_t *done = NULL; /* rows the blocks computed */
#ifdef HAVE_BLOCKED_PREFILL
    if (is_bf16 && D % 32 == 0 && R >= QB) {
        done = calloc((size_t)R, 1);
        if (!done || prefill_blocks((const uint16_t *)q, q_sr, q_sh, &kv, tables, tables_stride,
                                    seq, lo, n_keys, R, Hq, Hkv, D, scale, (uint16_t *)out, lse,
                                    nthreads, done)) {
            free(done);
            return -1;
        }
    }
#endif
    if (!is_bf16 && R >= FB && G <= FG) {
        done = calloc((size_t)R, 1);
        if (!done || prefill_blocks_f32((const float *)q, q_sr, q_sh, &kv, tables,
                                        tables_stride, seq, lo, n_keys, R, Hq, Hkv, D, scale,
                                        (float *)out, lse, nthreads, done)) {
            free(done);
            return -1;
        }
    }

    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
    for (int item = 0; item < R * Hkv; item++) {
        const int r = item / Hkv, h = item % Hkv, n = n_keys[r], first = lo[r];
        if (done && done[r]) continue;
        const size_t floats = (size_t)(3 * G + 1) * D + (size_t)G * (2 * n + 1);
        char *mem = malloc(floats * sizeof(float) + 2 * (size_t)n * sizeof(char *));
        if (!mem) { failed = 1; continue; }
        const char **keys = (const char **)(mem + floats * sizeof(float)), **vals = keys + n;
        const int32_t *tbl = tables + (size_t)seq[r] * tables_stride;
        for (int i = 0; i < n; i++) keys[i] = key_at(&kv, tbl, first + i, h);
        attend((const char *)q + ((size_t)r * q_sr + (size_t)h * G * q_sh) * esize, q_sh,
               keys, vals, s_kv * (int64_t)esize, n, G, D, scale, is_bf16, (float *)mem,
               (char *)out + ((size_t)r * Hq + (size_t)h * G) * D * esize,
               lse ? lse + (size_t)r * Hq + (size_t)h * G : NULL);
        free(mem);
    }
    free(done);
    return failed ? -1 : 0;
}

/* The step's new keys and values into their slots: token t of k and v [n, Hkv, D] (token
 * and head strides in elements, unit stride in D) goes to page pages[t] (a step page where
 * <= -2: kv_pages), slot offs[t]. */
void kvs_store_kv(const void *k, int64_t k_ts, int64_t k_hs, const void *v, int64_t v_ts,
                  int64_t v_hs, int n, int Hkv, int D, void *cache, void *steps,
                  int64_t s_page, int64_t ss_page, int64_t s_kv, int64_t s_tok, int64_t s_head,
                  const int64_t *pages, const int64_t *offs, int esize) {
    const kv_pages kv = {cache, steps, s_page, ss_page, s_kv, s_tok, s_head, 1, esize};
    for (int t = 0; t < n; t++)
        for (int h = 0; h < Hkv; h++) {
            char *dst = (char *)kv_at(&kv, pages[t], offs[t], h);
            memcpy(dst, (const char *)k + (t * k_ts + h * k_hs) * esize, (size_t)D * esize);
            memcpy(dst + s_kv * esize, (const char *)v + (t * v_ts + h * v_hs) * esize,
                   (size_t)D * esize);
        }
}
