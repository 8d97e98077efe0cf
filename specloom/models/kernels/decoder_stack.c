/* A run of Llama-family decoder layers in one call (issue 37, "a lean step"): bf16 activations, GGML weights held
 * as shipped, the batch-invariant attention. A decode step of SmolLM2-135M is ~300 small ops; run from Python
 * each costs microseconds of dispatch, ~35 % of the step. Here the layer loop is C and every op is the very C
 * function the Python layers call (their addresses are passed in: one copy of each kernel), in the same order
 * on the same buffers, so this path computes the same bits as models/llama.py's layers (tested) and stays
 * batch-invariant: decode steps, verification passes and prefill chunks may take either path.
 *
 * Per layer, x [M, Hd] bf16 (M = B * T rows, in place):
 *   h = norm1(x) (the first layer: the pass's `ain` where given); qkv = h @ Wqkv^T (+ bias); RoPE on q, k;
 *   k, v -> the KV store at slots [start, start + T);
 *   a = bf16(attention(fp32 q, keys, values, mask)); o = a @ Wo^T (+ bias); x = bf16(x + o); h = norm2(x);
 *   gu = h @ Wgu^T; s = silu_mul(gate, up); x = bf16(x + s @ Wdown^T).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*vlinear_fn)(const uint16_t *x, int t, const uint8_t *codes, const uint8_t *scales, int64_t M,
                          int64_t N, int64_t K, void *y, int y_bf16, int64_t ldy, int nthreads);
typedef int (*blinear_fn)(const void *x, int x_bf16, const uint8_t *w, int t, int64_t row_bytes, void *y,
                          int y_bf16, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads, int force_avx2);
typedef int (*norm_fn)(const uint16_t *x, const uint16_t *r, uint16_t *h, uint16_t *out, const float *w,
                       int64_t M, int64_t H, float eps);
typedef int (*rope_fn)(uint16_t *qkv, int64_t rows, int64_t rs, int64_t nrot, int64_t d, const uint16_t *cos,
                       const uint16_t *sin);
typedef int (*silu_fn)(const uint16_t *gu, int64_t M, int64_t I, uint16_t *out);
typedef int (*add_fn)(uint16_t *x, const uint16_t *d, int64_t n);
typedef int (*narrow_fn)(const float *src, uint16_t *dst, int64_t n);
typedef int (*widen_fn)(const uint16_t *src, float *dst, int64_t n);
typedef int (*attn_fn)(const float *q, const void *k, const void *v, int kv_bf16, int64_t ksb, int64_t ksg,
                       int64_t kss, int64_t vsb, int64_t vsg, int64_t vss, const uint8_t *mask, int64_t msb,
                       int64_t mst, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                       float scale, int chunk, int nthreads);

typedef struct {
    vlinear_fn vlinear;
    blinear_fn blinear;
    norm_fn norm;
    rope_fn rope;
    silu_fn silu_mul;
    attn_fn attend;
    add_fn add;        /* x = bf16(x + d) */
    narrow_fn narrow;  /* fp32 -> bf16, nearest even */
    widen_fn widen;    /* bf16 -> fp32 */
} ops_t;

#define RUNS 4
typedef struct {  /* one linear: up to RUNS weights of one GGML type each, stacked along the outputs */
    int n;
    int type[RUNS];
    const uint8_t *w[RUNS];      /* repacked codes, or the blocks as shipped */
    const uint8_t *scales[RUNS]; /* repacked scales; NULL: `w` holds blocks as shipped */
    int64_t rows[RUNS], row_bytes[RUNS];
    const uint16_t *bias;        /* bf16 [out] or NULL */
    int64_t out;
} lin_t;

typedef struct {
    const float *norm1, *norm2;  /* fp32 weights */
    lin_t qkv, o, gu, down;
} layer_t;

typedef struct {  /* the pass: shapes, the KV store, RoPE tables, mask */
    int64_t B, T, Hd, H, Hkv, D, I;
    float eps, scale;
    void *k, *v;       /* the store's layer 0, row r0, slot 0 */
    int kv_bf16;
    int64_t lstride;   /* elements from one layer to the next */
    int64_t rstride;   /* from one row to the next */
    int64_t smax;      /* slots per (row, head) */
    int64_t start, S;  /* first new slot; slots the pass reads */
    const uint16_t *cos, *sin;  /* bf16 [M, D] */
    const uint8_t *mask; int64_t msb, mst;  /* (B, T, S) or NULL (causal over the pass's last T slots) */
    int chunk, threads, force_avx2;
    double *prof;  /* NULL, or [3]: seconds added up in the linears, in attention, in the whole call */
    const uint16_t *ain;  /* NULL, or the first layer's attention input [M, ain_k] bf16 in place of norm1(x): an
                             EAGLE drafter layer reads cat[norm(embedding), norm(u)] with u (= x) the residual */
    int64_t ain_k;
} pass_t;

/* y [M, out] bf16 = x [M, K] @ W^T (+ bias): each run into its columns, as GGMLLinear.forward does. */
static inline double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int linear(const ops_t *op, const lin_t *l, const uint16_t *x, int64_t M, int64_t K, uint16_t *y,
                  const pass_t *p) {
    int threads = p->threads;
    double t0 = p->prof ? now() : 0;
    int64_t col = 0;
    for (int r = 0; r < l->n; r++) {
        int rc = l->scales[r]
            ? op->vlinear(x, l->type[r], l->w[r], l->scales[r], M, l->rows[r], K, y + col, 1, l->out, threads)
            : op->blinear(x, 1, l->w[r], l->type[r], l->row_bytes[r], y + col, 1, l->out, M, l->rows[r], K, threads,
                          p->force_avx2);
        if (rc) return rc;
        col += l->rows[r];
    }
    if (l->bias)
        for (int64_t m = 0; m < M; m++) op->add(y + m * l->out, l->bias, l->out);
    if (p->prof) p->prof[0] += now() - t0;
    return 0;
}

/* Layers [l0, l1) over x [B * T, Hd] bf16, in place. 0, or the first failing kernel's code (-2: no memory). */
int llama_stack(const ops_t *op, const layer_t *layers, int l0, int l1, const pass_t *p, uint16_t *x) {
    int64_t M = p->B * p->T, Hd = p->Hd, H = p->H, Hkv = p->Hkv, D = p->D, T = p->T;
    int64_t nqkv = (H + 2 * Hkv) * D, hD = H * D;
    size_t bytes = (size_t)M * (2 * Hd + nqkv + hD + 2 * Hd + 2 * p->I + p->I + Hd) * 2 + (size_t)M * hD * 8 + 64;
    char *buf = (char *)malloc(bytes);
    if (!buf) return -2;
    uint16_t *h = (uint16_t *)buf, *qkv = h + M * Hd, *a = qkv + M * nqkv, *o = a + M * hD, *gu = o + M * Hd,
             *s = gu + M * 2 * p->I, *dn = s + M * p->I;
    float *qf = (float *)(((uintptr_t)(dn + M * Hd) + 31) & ~(uintptr_t)31), *att = qf + M * hD;
    int es = p->kv_bf16 ? 2 : 4, rc = 0;
    double t0 = p->prof ? now() : 0, ta = 0;
    for (int l = l0; l < l1 && !rc; l++) {
        const layer_t *L = layers + l;
        const uint16_t *qin = h;
        int64_t kq = Hd;
        if (p->ain && l == l0) {
            qin = p->ain;
            kq = p->ain_k;
        } else if ((rc = op->norm(x, NULL, NULL, h, L->norm1, M, Hd, p->eps))) break;
        if ((rc = linear(op, &L->qkv, qin, M, kq, qkv, p))) break;
        if ((rc = op->rope(qkv, M, nqkv, H + Hkv, D, p->cos, p->sin))) break;
        char *kl = (char *)p->k + (size_t)l * p->lstride * es, *vl = (char *)p->v + (size_t)l * p->lstride * es;
        for (int64_t b = 0; b < p->B; b++)
            for (int64_t t = 0; t < T; t++) {
                const uint16_t *row = qkv + (b * T + t) * nqkv;
                for (int64_t g = 0; g < Hkv; g++) {
                    int64_t off = b * p->rstride + (g * p->smax + p->start + t) * D;
                    const uint16_t *ks = row + (H + g) * D, *vs = row + (H + Hkv + g) * D;
                    if (p->kv_bf16) {
                        memcpy((uint16_t *)kl + off, ks, D * 2);
                        memcpy((uint16_t *)vl + off, vs, D * 2);
                    } else {
                        op->widen(ks, (float *)kl + off, D);
                        op->widen(vs, (float *)vl + off, D);
                    }
                }
                for (int64_t hh = 0; hh < H; hh++)  /* q as (B, H, T, D) fp32 */
                    op->widen(row + hh * D, qf + ((b * H + hh) * T + t) * D, D);
            }
        if (p->prof) ta = now();
        if ((rc = op->attend(qf, kl, vl, p->kv_bf16, p->rstride, p->smax * D, D, p->rstride, p->smax * D, D, p->mask,
                             p->msb, p->mst, att, p->B, H, Hkv, T, p->S, D, p->scale, p->chunk, p->threads))) break;
        if (p->prof) p->prof[1] += now() - ta;
        for (int64_t b = 0; b < p->B; b++)  /* (B, H, T, D) -> (B * T, H * D), rounded to bf16 */
            for (int64_t hh = 0; hh < H; hh++)
                for (int64_t t = 0; t < T; t++)
                    op->narrow(att + ((b * H + hh) * T + t) * D, a + (b * T + t) * hD + hh * D, D);
        if ((rc = linear(op, &L->o, a, M, hD, o, p))) break;
        if ((rc = op->norm(o, x, x, h, L->norm2, M, Hd, p->eps))) break;  /* x = bf16(x + o), h = norm2(x) */
        if ((rc = linear(op, &L->gu, h, M, Hd, gu, p))) break;
        if ((rc = op->silu_mul(gu, M, p->I, s))) break;
        if ((rc = linear(op, &L->down, s, M, p->I, dn, p))) break;
        op->add(x, dn, M * Hd);
    }
    free(buf);
    if (p->prof) p->prof[2] += now() - t0;
    return rc;
}

/* ---- an EAGLE-3 drafting pass of one row in one call ---------------------------------------------------------
 * The drafter's forward from the target's features to its draft, as drafters/eagle/model.py computes it layer by
 * layer (the same C kernels in the same order, so the same bits; tested):
 *   u = fc(feats) [M, Hd]; e = bf16(embedding rows of ids: GGML rows dequantised, or a bf16 table's); ain = cat[norm_e(e), norm_u(u)] [M, 2 Hd];
 *   x = the drafter layer (llama_stack with `ain`) over u, its K/V written to the pass's slots;
 *   for the last row: logits [V] bf16 = head(norm_o(x)), best = the first maximum.
 * x [M, Hd] bf16 is the caller's: it holds the layer's outputs afterwards (the next depth's input). */
typedef int (*vrows_fn)(int t, const uint8_t *codes, const uint8_t *scales, int64_t K, const int64_t *ids, int64_t n,
                        float *out);

typedef struct {
    lin_t fc, head;
    const float *norm_e, *norm_u, *norm_o;  /* fp32 weights */
    vrows_fn vrows;                         /* the repacked embedding's row lookup (ggml_vrows) ... */
    int emb_type;
    const uint8_t *emb_codes, *emb_scales;
    const uint16_t *emb_dense;              /* ... or NULL, and a bf16 embedding table [vocab, Hd] instead */
    int64_t F;                              /* fc's input: the concatenated target features */
} eagle_t;

int eagle3_pass(const ops_t *op, const layer_t *layer, const eagle_t *e, const pass_t *p, const uint16_t *feats,
                const int64_t *ids, uint16_t *x, uint16_t *logits, int64_t *best) {
    int64_t M = p->B * p->T, Hd = p->Hd, V = e->head.out;
    size_t bytes = (size_t)M * Hd * 4 + (size_t)M * Hd * 2 * 4 + (size_t)Hd * 2 + 64;
    char *buf = (char *)malloc(bytes);
    if (!buf) return -2;
    float *ef = (float *)buf;
    uint16_t *eb = (uint16_t *)(ef + M * Hd), *tmp = eb + M * Hd, *ain = tmp + M * Hd, *hn = ain + M * 2 * Hd;
    int rc = linear(op, &e->fc, feats, M, e->F, x, p);
    if (e->emb_dense)
        for (int64_t m = 0; m < M; m++) memcpy(eb + m * Hd, e->emb_dense + ids[m] * Hd, Hd * 2);
    else {
        if (!rc) rc = e->vrows(e->emb_type, e->emb_codes, e->emb_scales, Hd, ids, M, ef);
        if (!rc) rc = op->narrow(ef, eb, M * Hd);
    }
    if (!rc) rc = op->norm(eb, NULL, NULL, tmp, e->norm_e, M, Hd, p->eps);
    for (int64_t m = 0; !rc && m < M; m++) memcpy(ain + m * 2 * Hd, tmp + m * Hd, Hd * 2);
    if (!rc) rc = op->norm(x, NULL, NULL, tmp, e->norm_u, M, Hd, p->eps);
    for (int64_t m = 0; !rc && m < M; m++) memcpy(ain + m * 2 * Hd + Hd, tmp + m * Hd, Hd * 2);
    if (!rc) {
        pass_t q = *p;
        q.ain = ain;
        q.ain_k = 2 * Hd;
        rc = llama_stack(op, layer, 0, 1, &q, x);
    }
    for (int64_t b = 0; !rc && b < p->B; b++) {
        const uint16_t *last = x + (b * p->T + p->T - 1) * Hd;
        uint16_t *lb = logits + b * V;
        if ((rc = op->norm(last, NULL, NULL, hn, e->norm_o, 1, Hd, p->eps))) break;
        if ((rc = linear(op, &e->head, hn, 1, Hd, lb, p))) break;
        int64_t arg = 0;
        float top = 0;
        for (int64_t v = 0; v < V; v++) {
            union { uint32_t u; float f; } c;
            c.u = (uint32_t)lb[v] << 16;
            if (v == 0 || c.f > top) { top = c.f; arg = v; }
        }
        best[b] = arg;
    }
    free(buf);
    return rc;
}
