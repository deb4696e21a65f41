/* Decode attention that reads the KV pool's pages in place (CPU).
 *
 * One new query token per sequence attends to keys [lo, lo + n) of its own
 * pages: no gather of the pages into a contiguous copy, no padding to the
 * longest sequence of the batch. Work items are (sequence, KV head) pairs; the
 * query heads that share a KV head are done together so each key and value row
 * is read from memory once.
 *
 * Numerics follow the matmul path it replaces: products accumulate in float32;
 * for bfloat16 inputs the raw scores, the probabilities and the output are
 * rounded to bfloat16 where that path rounds them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef union { uint32_t u; float f; } bits;

static inline float bf16_load(uint16_t x) { bits b; b.u = (uint32_t)x << 16; return b.f; }

static inline uint16_t bf16_store(float f) {  /* round to nearest even, as torch does */
    bits b; b.f = f;
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

/* src[0:n] of either dtype -> float32 dst */
static inline void load_row(const void *src, float *restrict dst, int n, int is_bf16) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src;
        #pragma omp simd
        for (int d = 0; d < n; d++) dst[d] = bf16_load(s[d]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.f;
    #pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#define AHEAD 8  /* keys prefetched ahead */

/* sc[g * n + i] = q_g . k_i for G heads, two keys at a time so that 2G independent
 * accumulators hide the dot instruction's latency. q is [G][D] bf16, D % 32 == 0.
 * Rows sit on scattered pages, which defeats the hardware prefetcher: the key and value
 * rows a few keys ahead are prefetched here (the values are read next, from cache). */
static void scores_bf16(const uint16_t *q, const uint16_t *const *rows,
                        const uint16_t *const *vals, int n, int G, int D, float *sc) {
    __m512 acc[16];
    for (int i = 0; i < n; i += 2) {
        const int two = i + 1 < n;
        for (int j = i + AHEAD; j < i + AHEAD + 2 && j < n; j++)
            for (int d = 0; d < D; d += 32) {
                __builtin_prefetch(rows[j] + d);
                __builtin_prefetch(vals[j] + d);
            }
        for (int a = 0; a < 2 * G; a++) acc[a] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(rows[i] + d);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(rows[i + two] + d);
            for (int g = 0; g < G; g++) {
                const __m512bh qg = (__m512bh)_mm512_loadu_si512(q + (size_t)g * D + d);
                acc[2 * g] = _mm512_dpbf16_ps(acc[2 * g], qg, k0);
                acc[2 * g + 1] = _mm512_dpbf16_ps(acc[2 * g + 1], qg, k1);
            }
        }
        for (int g = 0; g < G; g++) {
            sc[(size_t)g * n + i] = _mm512_reduce_add_ps(acc[2 * g]);
            if (two) sc[(size_t)g * n + i + 1] = _mm512_reduce_add_ps(acc[2 * g + 1]);
        }
    }
}

/* acc[g][:] = sum_i p[g * n + i] v_i, with p already bf16-exact. Keys go in pairs: their
 * value rows are interleaved so one dot instruction does two keys. The interleave works
 * within 128-bit lanes, so each 32-wide block of acc comes out in a fixed permuted order
 * that `unpermute` undoes. Blocks of 64 dims keep 4G accumulators in registers. */
static void values_bf16(const float *p, const uint16_t *const *rows, const uint16_t *zero,
                        int n, int G, int D, float *acc) {
    for (int d = 0; d < D; d += 64) {
        __m512 a[32];
        for (int j = 0; j < 4 * G; j++) a[j] = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 2) {
            const uint16_t *r0 = rows[i] + d, *r1 = i + 1 < n ? rows[i + 1] + d : zero;
            __m512i v[4];
            for (int h = 0; h < 2; h++) {
                const __m512i x = _mm512_loadu_si512(r0 + 32 * h);
                const __m512i y = _mm512_loadu_si512(r1 + 32 * h);
                v[2 * h] = _mm512_unpacklo_epi16(x, y);
                v[2 * h + 1] = _mm512_unpackhi_epi16(x, y);
            }
            for (int g = 0; g < G; g++) {
                const float p1 = i + 1 < n ? p[(size_t)g * n + i + 1] : 0.f;
                const uint32_t pair = (uint32_t)bf16_store(p[(size_t)g * n + i])
                                      | (uint32_t)bf16_store(p1) << 16;
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int j = 0; j < 4; j++)
                    a[4 * g + j] = _mm512_dpbf16_ps(a[4 * g + j], pp, (__m512bh)v[j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int h = 0; h < 2; h++) {
                /* lane l of unpacklo holds dim 8*(l/4) + l%4 of the block, unpackhi the +4 */
                float lo[16], hi[16], *o = acc + (size_t)g * D + d + 32 * h;
                _mm512_storeu_ps(lo, a[4 * g + 2 * h]);
                _mm512_storeu_ps(hi, a[4 * g + 2 * h + 1]);
                for (int l = 0; l < 16; l++) {
                    o[8 * (l / 4) + l % 4] = lo[l];
                    o[8 * (l / 4) + l % 4 + 4] = hi[l];
                }
            }
    }
}
#endif

/* Generic float32 paths (any dtype the loads support). */
static void scores_f32(const float *qf, const char *const *rows, int n, int G, int D,
                       int is_bf16, float *row, float *sc) {
    for (int i = 0; i < n; i++) {
        load_row(rows[i], row, D, is_bf16);
        for (int g = 0; g < G; g++) sc[(size_t)g * n + i] = dot(qf + (size_t)g * D, row, D);
    }
}

static void values_f32(const float *p, const char *const *rows, int n, int G, int D,
                       int is_bf16, float *row, float *acc) {
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int i = 0; i < n; i++) {
        load_row(rows[i], row, D, is_bf16);
        for (int g = 0; g < G; g++) {
            const float pg = p[(size_t)g * n + i];
            float *restrict a = acc + (size_t)g * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) a[d] += pg * row[d];
        }
    }
}

/* scale the raw scores, softmax each head's row in float32 */
static void softmax(float *sc, int n, int G, float scale, int is_bf16) {
    for (int g = 0; g < G; g++) {
        float *s = sc + (size_t)g * n, m = -INFINITY, sum = 0.f;
        for (int i = 0; i < n; i++) {
            s[i] = (is_bf16 ? bf16_round(s[i]) : s[i]) * scale;
            m = s[i] > m ? s[i] : m;
        }
        for (int i = 0; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
        const float inv = 1.f / sum;
        for (int i = 0; i < n; i++) s[i] = is_bf16 ? bf16_round(s[i] * inv) : s[i] * inv;
    }
}

/* One (sequence, KV head) item. scratch holds (3G + 1) D + G n floats and n pointers. */
static void attend(const char *qb, int64_t q_sh, const char *const *keys, const char **vals,
                   int64_t kv_bytes, int n, int G, int D, float scale, int is_bf16,
                   float *scratch, char *out) {
    const size_t esize = is_bf16 ? 2 : 4;
    float *qf = scratch, *acc = qf + (size_t)G * D, *row = acc + (size_t)G * D, *sc = row + D;
    for (int i = 0; i < n; i++) vals[i] = keys[i] + kv_bytes;
#ifdef HAVE_BF16_DOT
    const int fast = is_bf16 && D % 64 == 0 && G <= 8;
#else
    const int fast = 0;
#endif
    if (fast) {
#ifdef HAVE_BF16_DOT
        uint16_t *q16 = (uint16_t *)qf;  /* the query heads as one [G][D] bf16 block */
        for (int g = 0; g < G; g++)
            memcpy(q16 + (size_t)g * D, qb + (size_t)g * q_sh * esize, (size_t)D * 2);
        scores_bf16(q16, (const uint16_t *const *)keys, (const uint16_t *const *)vals, n, G, D,
                    sc);
        softmax(sc, n, G, scale, is_bf16);
        memset(row, 0, sizeof(float) * D);
        values_bf16(sc, (const uint16_t *const *)vals, (const uint16_t *)row, n, G, D, acc);
#endif
    } else {
        for (int g = 0; g < G; g++) load_row(qb + (size_t)g * q_sh * esize, qf + (size_t)g * D,
                                             D, is_bf16);
        scores_f32(qf, keys, n, G, D, is_bf16, row, sc);
        softmax(sc, n, G, scale, is_bf16);
        values_f32(sc, (const char *const *)vals, n, G, D, is_bf16, row, acc);
    }
    for (int g = 0; g < G; g++) {
        const float *a = acc + (size_t)g * D;
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)out + (size_t)g * D;
            for (int d = 0; d < D; d++) dst[d] = bf16_store(a[d]);
        } else {
            memcpy((float *)out + (size_t)g * D, a, sizeof(float) * (size_t)D);
        }
    }
}

/* Strides are in elements. pages[b * pages_stride + j] is the page holding keys
 * [(lo[b] / T + j) * T, ...). out is contiguous [B, Hq, D]. Returns 0, or -1 if
 * scratch memory could not be had. */
int kvs_paged_decode(
    const void *q, int64_t q_sb, int64_t q_sh,
    const void *cache, int64_t s_page, int64_t s_kv, int64_t s_tok, int64_t s_head,
    const int32_t *pages, int64_t pages_stride, const int32_t *lo, const int32_t *n_keys,
    int B, int Hq, int Hkv, int D, int T, float scale, int is_bf16, void *out, int nthreads)
{
    const int G = Hq / Hkv;
    const size_t esize = is_bf16 ? 2 : 4;
    int failed = 0;

    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
    for (int item = 0; item < B * Hkv; item++) {
        const int b = item / Hkv, h = item % Hkv, n = n_keys[b], first = lo[b];
        const size_t floats = (size_t)(3 * G + 1) * D + (size_t)G * n;
        char *mem = malloc(floats * sizeof(float) + 2 * (size_t)n * sizeof(char *));
        if (!mem) { failed = 1; continue; }
        const char **keys = (const char **)(mem + floats * sizeof(float)), **vals = keys + n;
        const int32_t *tbl = pages + (size_t)b * pages_stride;
        for (int i = 0; i < n; i++) {
            const int k = first + i;
            keys[i] = (const char *)cache
                      + (tbl[k / T - first / T] * s_page + (k % T) * s_tok + h * s_head) * esize;
        }
        attend((const char *)q + ((size_t)b * q_sb + (size_t)h * G * q_sh) * esize, q_sh,
               keys, vals, s_kv * (int64_t)esize, n, G, D, scale, is_bf16, (float *)mem,
               (char *)out + ((size_t)b * Hq + (size_t)h * G) * D * esize);
        free(mem);
    }
    return failed ? -1 : 0;
}
