/* A step's decoder layers in one call (CPU): Gemma's (norms around each sub-block, q/k
 * norms, GELU) and Llama's (pre-norm blocks, SwiGLU; q/k norms in Qwen3).
 *
 * Each layer is about eleven kernel calls (norms, four projections, RoPE, the KV store,
 * attention, the activation). Made from Python one by one they cost ~10 us of wrappers
 * each, about as much as the kernels themselves at one decode row: 2.4-3 ms of a 9.4 ms
 * step for Gemma 3 270M on a 2-core Zen 5. Here the same calls run back to back with the
 * same arguments, so the outputs are bitwise those of the module-by-module path
 * (models/gemma3.py, models/llama.py): a layer's input norm is the previous layer's last
 * add_norm's second output, which kvs_add_norm computes exactly as kvs_norm_rope would,
 * and a pre-norm block's add is kvs_add_norm without a norm of its input (torch's add).
 */
#include <stdint.h>

/* The projections' kernels share one signature (qmatmul.c, i8matmul.c, bf16gemm.c):
 * y [M, N] = x [M, K] (row stride ldx) @ W.T, 0 on success. */
typedef int (*matmul_fn)(const void *q, const void *d, const void *x, int64_t ldx, int M,
                         int64_t N, int K, void *y, int bf16, int threads);

typedef struct {
    matmul_fn fn;
    const void *q, *d;  /* the packed weight and its scales (NULL where none) */
    int64_t N;
    int K;
} kvs_linear;

/* What one layer reads: its weights, its norms' float32 factors (Gemma's 1 + w), its KV
 * pages. A pre-norm block (Llama) has no w_post_attn, w_post_ff (its adds are plain) and
 * its post-attention norm as w_pre_ff; without q/k norms w_qk is NULL (RoPE alone). */
typedef struct {
    kvs_linear qkv, o, gate_up, down;
    const float *w_in, *w_post_attn, *w_pre_ff, *w_post_ff;
    const float *w_qk;  /* [Hq + Hkv][D]: q_norm's factors per q head, then k_norm's */
    void *cache;        /* the layer's pages [num_pages, 2, T, Hkv, D] */
    int64_t s_page, s_kv, s_tok, s_head;
    int view;           /* which of the step's views (kvs_view) the layer attends through */
    float scale;
    int silu;           /* the MLP's activation: silu (SwiGLU), else tanh-GELU */
} kvs_layer;

/* What a kind of layer (sliding or full) sees this step, as kvs_paged_attention and
 * kvs_store_kv take it, with its RoPE's cos/signed sin [M, D], and its step pages (one
 * layer's, [n, 2, T, Hkv, D]: each layer of the kind writes and reads them in turn). */
typedef struct {
    const int32_t *tables;
    int64_t tables_stride;
    const int32_t *seq, *lo, *n_keys;
    const int64_t *pages, *offs;
    const void *cos, *sin;
    void *steps;
    int64_t ss_page;
} kvs_view;

void kvs_norm_rope(const void *x, int64_t x_ts, int64_t x_hs, int n, int H, int D,
                   const float *scale, float eps, const void *cos, const void *sin,
                   int is_bf16, void *y, int64_t y_ts, int64_t y_hs, int nthreads);
void kvs_add_norm(void *x, const void *h, int n, int D, const float *w_add,
                  const float *w_next, float eps, int is_bf16, void *y, int nthreads);
void kvs_gelu_mul(const void *x, int n, int I, int is_bf16, void *out, int nthreads);
void kvs_silu_mul(const void *x, int n, int I, int is_bf16, void *out, int nthreads);
void kvs_store_kv(const void *k, int64_t k_ts, int64_t k_hs, const void *v, int64_t v_ts,
                  int64_t v_hs, int n, int Hkv, int D, void *cache, void *steps,
                  int64_t s_page, int64_t ss_page, int64_t s_kv, int64_t s_tok, int64_t s_head,
                  const int64_t *pages, const int64_t *offs, int esize);
int kvs_paged_attention(const void *q, int64_t q_sr, int64_t q_sh, const void *cache,
                        const void *steps, int64_t s_page, int64_t ss_page, int64_t s_kv,
                        int64_t s_tok, int64_t s_head, const int32_t *tables,
                        int64_t tables_stride, const int32_t *seq, const int32_t *lo,
                        const int32_t *n_keys, int R, int Hq, int Hkv, int D, int T, float scale,
                        int is_bf16, void *out, float *lse, int nthreads);

/* x [M, hidden] (the residual stream, updated in place) through layers [0, L). buf holds
 * M * (2 hidden + (2 Hq + 2 Hkv) D + 3 I) elements of x's dtype; its first M * hidden are
 * the last layer's output norm'd by w_out (when not NULL, else left unused). Returns 0, 1
 * if a projection refused its arguments, 2 if attention had no scratch memory. */
int kvs_decoder_layers(const kvs_layer *layers, int L, const kvs_view *views, void *x, int M,
                     int hidden, int Hq, int Hkv, int D, int I, int T, float eps,
                     const float *w_out, int is_bf16, void *buf, int threads) {
    const int64_t es = is_bf16 ? 2 : 4, W = (int64_t)(Hq + 2 * Hkv) * D;
    const int64_t row = (int64_t)M * es;  /* bytes of one element of every row */
    char *xn = buf, *qkv = xn + row * hidden, *att = qkv + row * W, *h = att + row * Hq * D;
    char *gu = h + row * hidden, *act = gu + row * 2 * I;
    kvs_norm_rope(x, hidden, hidden, M, 1, hidden, layers[0].w_in, eps, 0, 0, is_bf16, xn,
                  hidden, hidden, threads);
    for (int l = 0; l < L; l++) {
        const kvs_layer *y = layers + l;
        const kvs_view *v = views + y->view;
        const kvs_linear *p[4] = {&y->qkv, &y->o, &y->gate_up, &y->down};
        const void *in[4] = {xn, att, xn, act};
        void *out[4] = {qkv, h, gu, h};
        const int64_t ld[4] = {hidden, (int64_t)Hq * D, hidden, I};
#define PROJ(i) if (p[i]->fn(p[i]->q, p[i]->d, in[i], ld[i], M, p[i]->N, p[i]->K, out[i], \
                             is_bf16, threads)) return 1
        PROJ(0);
        kvs_norm_rope(qkv, W, D, M, Hq + Hkv, D, y->w_qk, eps, v->cos, v->sin, is_bf16, qkv, W,
                      D, threads);
        kvs_store_kv(qkv + (int64_t)Hq * D * es, W, D, qkv + (int64_t)(Hq + Hkv) * D * es, W, D,
                     M, Hkv, D, y->cache, v->steps, y->s_page, v->ss_page, y->s_kv, y->s_tok,
                     y->s_head, v->pages, v->offs, (int)es);
        if (kvs_paged_attention(qkv, W, D, y->cache, v->steps, y->s_page, v->ss_page, y->s_kv,
                                y->s_tok, y->s_head, v->tables, v->tables_stride, v->seq, v->lo,
                                v->n_keys, M, Hq, Hkv, D, T, y->scale, is_bf16, att, 0, threads))
            return 2;
        PROJ(1);
        kvs_add_norm(x, h, M, hidden, y->w_post_attn, y->w_pre_ff, eps, is_bf16, xn, threads);
        PROJ(2);
        (y->silu ? kvs_silu_mul : kvs_gelu_mul)(gu, M, I, is_bf16, act, threads);
        PROJ(3);
#undef PROJ
        kvs_add_norm(x, h, M, hidden, y->w_post_ff, l + 1 < L ? layers[l + 1].w_in : w_out, eps,
                     is_bf16, xn, threads);
    }
    return 0;
}
