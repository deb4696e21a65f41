/* Picking each row's token from logits over the vocabulary (CPU): the greedy argmax, and a
 * draw from softmax(x / T) restricted to the row's top-k and top-p nucleus.
 *
 * A row is read in chunks of ROW_CHUNK values and little is written: one sum a chunk, and
 * under top-k/top-p the tokens that may be kept (hundreds on a real row, most of a flat
 * one). torch's way (a float32 copy, a division, softmax, top-k or a sort, a cumulative
 * sum) writes the whole [rows, vocab] several times, ~50 ms a step at batch 32 for Gemma's
 * 262k vocabulary.
 *
 * What top-k and top-p keep is a floor on the logit: every token at or above it. Top-k's
 * floor is the k-th largest value; top-p's is the value of the last token a full sort by
 * decreasing probability keeps (the first token, and each whose mass before it is below
 * p times the total). Tokens tied with that last one are kept too, as in torch's top-k
 * masking and FlashInfer's threshold sampling: a sort's order among equal values is no
 * property of the distribution. */
#include <math.h>
#include <omp.h>

#include "bf16.h"

#define ROW_CHUNK 1024 /* a row of the vocabulary is read in chunks of this many values */

/* Chunk c of the row of V values at element `base` of x, as float32 into buf; its length. */
static inline int load_chunk(const void *x, int64_t base, int64_t V, int64_t c, int is_bf16,
                             float *buf) {
    const int n = V - c * ROW_CHUNK < ROW_CHUNK ? (int)(V - c * ROW_CHUNK) : ROW_CHUNK;
    load_row(x, base + c * ROW_CHUNK, buf, n, is_bf16);
    return n;
}

/* The largest of n values (-inf for none; NaN is never larger). */
static inline float max_of(const float *buf, int n) {
    float top = -INFINITY;
    #pragma omp simd reduction(max : top)
    for (int i = 0; i < n; i++) top = buf[i] > top ? buf[i] : top;
    return top;
}

/* out[b] = the first index of the largest value of row b (rows of V, contiguous), as
 * torch's max(dim) gives it: one vectorised pass, a scalar look only at the chunks that
 * raise the maximum. (Rows holding NaN give an unspecified index.) */
void kvs_argmax(const void *x, int B, int64_t V, int is_bf16, int64_t *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int b = 0; b < B; b++) {
        float best = -INFINITY;
        int64_t at = 0;
        float buf[ROW_CHUNK];
        for (int64_t c = 0; c * ROW_CHUNK < V; c++) {
            const int m = load_chunk(x, b * V, V, c, is_bf16, buf);
            const float top = max_of(buf, m);
            if (top > best)
                for (int i = 0; i < m; i++)
                    if (buf[i] == top) { best = top; at = c * ROW_CHUNK + i; break; }
        }
        out[b] = at;
    }
}

/* A float's bits as an unsigned key in the same order (-0 as +0), and back. */
static inline uint32_t key_of(float f) {
    bits b; b.f = f + 0.f;
    return b.u & 0x80000000u ? ~b.u : b.u | 0x80000000u;
}

static inline float float_of(uint32_t key) {
    bits b; b.u = key & 0x80000000u ? key & 0x7fffffffu : ~key;
    return b.f;
}

typedef struct { uint32_t key; float e; } cand;  /* a logit's key and its e^((x - max) / T) */

/* The largest key K for which the candidates at or above K weigh at least `target` (1 each
 * if by_mass is 0, else e each): a radix select over 11, 11 and 10 bits, each level a
 * histogram of the candidates that match the bits fixed so far. Where float rounding
 * leaves the whole weight short of target, the smallest key: keep every candidate. */
static uint32_t select_key(const cand *c, int64_t n, int by_mass, double target) {
    static const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    uint32_t prefix = 0, fixed = 0;
    for (int level = 0; level < 3; level++) {
        double w[1 << 11] = {0};
        const uint32_t top = (1u << width[level]) - 1;
        for (int64_t i = 0; i < n; i++)
            if ((c[i].key & fixed) == prefix)
                w[(c[i].key >> shift[level]) & top] += by_mass ? (double)c[i].e : 1.;
        int64_t b = top;
        while (b >= 0 && !(w[b] > 0. && w[b] >= target)) target -= w[b--];
        if (b < 0) {  /* short by rounding */
            uint32_t low = UINT32_MAX;
            for (int64_t i = 0; i < n; i++) low = c[i].key < low ? c[i].key : low;
            return low;
        }
        prefix |= (uint32_t)b << shift[level];
        fixed |= top << shift[level];
    }
    return prefix;
}

/* What the passes over a row share: where it lies, its maximum m, 1 / T and each chunk's
 * maximum (a chunk whose maximum is below a bound holds nothing at or above it). */
typedef struct {
    const void *x;
    int64_t base, V, nc;
    int is_bf16;
    float m, it;
    const float *cmax;
} row_t;

static inline float row_exp(const row_t *r, float x) { return exp_le0((x - r->m) * r->it); }

/* The row's tokens at or above lo into cs (room for the row), as (key, e) pairs; how many. */
static int64_t gather(const row_t *r, float lo, cand *cs) {
    int64_t k = 0;
    float buf[ROW_CHUNK];
    for (int64_t c = 0; c < r->nc; c++) {
        if (!(r->cmax[c] >= lo)) continue;
        const int len = load_chunk(r->x, r->base, r->V, c, r->is_bf16, buf);
        for (int i = 0; i < len; i++)
            if (buf[i] >= lo) cs[k++] = (cand){key_of(buf[i]), row_exp(r, buf[i])};
    }
    return k;
}

/* Cuts on d = (x - max) / T at which the row's tokens are counted and weighed, to bound the
 * floor from below before gathering; below the last, every token. A typical row's nucleus
 * lies above -9 (e^-9 ~ 1e-4 of the top token's mass each), so what is gathered is ~1e2-1e3
 * tokens, not the vocabulary. */
#define NCUTS 4
static const float CUTS[NCUTS] = {-3.f, -9.f, -20.f, -INFINITY};

/* A logit at or below the floor that top_k (0: none) or top_p (1: none) leaves. With top_k:
 * the k-th largest chunk maximum, if there are k chunks (k distinct tokens reach it).
 * Otherwise the highest cut whose tokens hold k tokens or p of the mass, from one pass over
 * the row, which also gives the row's whole mass (*mass_out). */
static float floor_bound(const row_t *r, int top_k, double top_p, cand *cs, double *mass_out) {
    if (top_k && top_k <= r->nc) {
        for (int64_t c = 0; c < r->nc; c++) cs[c] = (cand){key_of(r->cmax[c]), 0.f};
        return float_of(select_key(cs, r->nc, 0, top_k));
    }
    double count[NCUTS] = {0}, mass[NCUTS] = {0};
    float buf[ROW_CHUNK];
    for (int64_t c = 0; c < r->nc; c++) {
        const int n = load_chunk(r->x, r->base, r->V, c, r->is_bf16, buf);
        /* one loop, the cuts written out: float counts (exact to 2^24) vectorise with the
         * sums, where an int count beside them did not */
        float c0 = 0.f, c1 = 0.f, c2 = 0.f, s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        #pragma omp simd reduction(+ : c0, c1, c2, s0, s1, s2, s3)
        for (int i = 0; i < n; i++) {
            const float d = (buf[i] - r->m) * r->it, e = exp_le0(d);
            c0 += d >= CUTS[0] ? 1.f : 0.f;
            c1 += d >= CUTS[1] ? 1.f : 0.f;
            c2 += d >= CUTS[2] ? 1.f : 0.f;
            s0 += d >= CUTS[0] ? e : 0.f;
            s1 += d >= CUTS[1] ? e : 0.f;
            s2 += d >= CUTS[2] ? e : 0.f;
            s3 += e;
        }
        count[0] += c0; count[1] += c1; count[2] += c2; count[3] += n;
        mass[0] += s0; mass[1] += s1; mass[2] += s2; mass[3] += s3;
    }
    *mass_out = mass[NCUTS - 1];
    int j = 0;
    while (j < NCUTS - 1 && (top_k ? count[j] < top_k : mass[j] < top_p * mass[NCUTS - 1])) j++;
    if (j == NCUTS - 1) return -INFINITY;
    /* d >= cut means x >= m + cut * T up to rounding: a little below that, to be sure */
    const float lo = r->m + CUTS[j] / r->it;
    return lo - 1e-5f * (fabsf(lo) + fabsf(CUTS[j] / r->it)) - 1e-30f;
}

/* The floor on the row's logits that top_k (0: none) and top_p (1: none) leave: the tokens
 * from floor_bound up gathered into cs (room for the row), then selected by key, top-k
 * first and top-p of its mass. */
static float nucleus_floor(const row_t *r, int top_k, double top_p, cand *cs) {
    double total = 0.;  /* the mass top_p is taken of: the row's, or its top-k set's */
    int64_t n = gather(r, floor_bound(r, top_k, top_p, cs, &total), cs);
    if (top_k) {
        const uint32_t k_key = select_key(cs, n, 0, top_k);
        if (top_p >= 1.) return float_of(k_key);
        int64_t kept = 0;
        total = 0.;
        for (int64_t i = 0; i < n; i++)
            if (cs[i].key >= k_key) { total += cs[i].e; cs[kept++] = cs[i]; }
        n = kept;
    }
    return float_of(select_key(cs, n, 1, top_p * total));
}

/* out[k] = a token of row rows[k] of x drawn with probability softmax(x / T) over the tokens
 * at or above the row's floor (inv_t[k] = 1 / T; top_k[k] in 1..V-1, else 0 for none;
 * top_p[k] in (0, 1], 1 for none): the first index whose cumulative e^((x - max) / T) over
 * kept tokens passes u[k] (in [0, 1)) times their total. Passes over the row: the maximum
 * (and each chunk's), with a limit the floor (nucleus_floor), the chunks' sums of kept mass,
 * then a rescan of the one chunk the draw falls in. scratch: room for nthreads * V (key, e)
 * pairs of 8 bytes, where a thread gathers a row's candidates (nothing is allocated here). */
void kvs_sample(const void *x, const int32_t *rows, int K, int64_t V, int is_bf16,
                const float *inv_t, const int32_t *top_k, const double *top_p,
                const double *u, void *scratch, int64_t *out, int nthreads) {
    #pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int k = 0; k < K; k++) {
        const int64_t base = (int64_t)rows[k] * V, nc = (V + ROW_CHUNK - 1) / ROW_CHUNK;
        const float it = inv_t[k];
        float buf[ROW_CHUNK], cmax[nc], m = -INFINITY;
        double sums[nc], total = 0.;
        for (int64_t c = 0; c < nc; c++) {
            cmax[c] = max_of(buf, load_chunk(x, base, V, c, is_bf16, buf));
            m = cmax[c] > m ? cmax[c] : m;
        }
        const row_t r = {x, base, V, nc, is_bf16, m, it, cmax};
        const int limit_k = top_k[k] > 0 && top_k[k] < V ? top_k[k] : 0;
        cand *cs = (cand *)scratch + omp_get_thread_num() * V;
        const float floor = limit_k || top_p[k] < 1. ? nucleus_floor(&r, limit_k, top_p[k], cs)
                                                      : -INFINITY;
        for (int64_t c = 0; c < nc; c++) {
            float s = 0.f;
            if (cmax[c] >= floor) {  /* else no kept token in the chunk */
                const int n = load_chunk(x, base, V, c, is_bf16, buf);
                #pragma omp simd reduction(+ : s)
                for (int i = 0; i < n; i++) s += buf[i] >= floor ? row_exp(&r, buf[i]) : 0.f;
            }
            sums[c] = s;
            total += s;
        }
        const double target = u[k] * total;
        double run = 0.;
        int64_t c = 0;
        while (c < nc - 1 && run + sums[c] <= target) run += sums[c++];
        const int n = load_chunk(x, base, V, c, is_bf16, buf);
        int64_t pick = -1;
        for (int i = 0; i < n; i++) {
            const float e = buf[i] >= floor ? row_exp(&r, buf[i]) : 0.f;
            if (e > 0.f) pick = c * ROW_CHUNK + i;  /* the last token with mass, if rounding */
            run += e;                          /* carries the sum past the chunk's end */
            if (e > 0.f && run > target) break;
        }
        if (pick < 0)  /* the draw rounded past every token with mass: the most likely one */
            kvs_argmax((const char *)x + base * (is_bf16 ? 2 : 4), 1, V, is_bf16, &pick, 1);
        out[k] = pick;
    }
}
