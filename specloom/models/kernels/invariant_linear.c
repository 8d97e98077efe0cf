/* A batch-invariant linear for AVX2 + FMA CPUs: y[M, N] = x[M, K] @ w[N, K]^T (+ bias).
 *
 * Every product y[m, n] is computed by the same sequence of operations whatever M is and whichever other rows
 * share the call: lane j of one 8-lane fp32 accumulator sums w[n, k] * x[m, k] for k = j, j + 8, ... in order,
 * then a fixed horizontal sum, then the tail k >= K8 in order, then the bias. So a row multiplied alone (plain
 * decoding) and the same row inside a verification pass over 9 rows give the same bits, and speculative output
 * is plain output bit for bit. The weight is read from memory once per call for all M rows (blocks of 4 weight
 * rows converted to fp32 in a per-thread buffer, reused by every row of x), so a pass over a few rows costs about
 * one single-row pass where the weight read dominates.
 *
 * Weights bf16 (raw uint16 bits) or fp32; activations and output fp32 (the caller converts bf16 activations, an
 * exact widening, and rounds the output as the model's dtype wants). fp32 accumulation. Threads: OpenMP over blocks of weight rows (the result does not depend on
 * the split). Built on first use by specloom/models/invariant_linear.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 4

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The end of every product, one copy for every path: the fixed horizontal sum, the tail k >= K8 in order (tw: this
   weight row's tail), the bias. */
static inline float finish(__m256 acc, const float *tw, const float *xm, int64_t K8, int64_t K, const float *bias,
                           int64_t n) {
    float s = hsum8(acc);
    for (int64_t k = K8; k < K; k++) s += tw[k - K8] * xm[k];
    if (bias) s += bias[n];
    return s;
}

/* One block of up to NB weight rows (fp32, in wbuf, each of K8 = K rounded down to 8) against every row of x.
   Per (m, n): lane j sums k = j, j+8, ... in order, then a fixed horizontal sum, then the scalar tail in order.
   Nothing depends on M or on the block: every product is the same whatever rows it is computed with. */
static void block(const float *x, const float *wbuf, int nb, const float *tailw, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int64_t n0) {
    int64_t K8 = K & ~7LL;
    int64_t m0 = 0;
    if (nb == NB) {
        const float *w0 = wbuf, *w1 = wbuf + K8, *w2 = wbuf + 2 * K8, *w3 = wbuf + 3 * K8;
        for (; m0 + 2 <= M; m0 += 2) {
            const float *xa = x + m0 * K, *xb = xa + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t k = 0; k < K8; k += 8) {
                __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
                __m256 q0 = _mm256_loadu_ps(w0 + k), q1 = _mm256_loadu_ps(w1 + k);
                __m256 q2 = _mm256_loadu_ps(w2 + k), q3 = _mm256_loadu_ps(w3 + k);
                a0 = _mm256_fmadd_ps(q0, va, a0); b0 = _mm256_fmadd_ps(q0, vb, b0);
                a1 = _mm256_fmadd_ps(q1, va, a1); b1 = _mm256_fmadd_ps(q1, vb, b1);
                a2 = _mm256_fmadd_ps(q2, va, a2); b2 = _mm256_fmadd_ps(q2, vb, b2);
                a3 = _mm256_fmadd_ps(q3, va, a3); b3 = _mm256_fmadd_ps(q3, vb, b3);
            }
            __m256 A[4] = {a0, a1, a2, a3}, B[4] = {b0, b1, b2, b3};
            for (int r = 0; r < NB; r++) {
                y[m0 * N + n0 + r] = finish(A[r], tailw + r * 8, xa, K8, K, bias, n0 + r);
                y[(m0 + 1) * N + n0 + r] = finish(B[r], tailw + r * 8, xb, K8, K, bias, n0 + r);
            }
        }
    }
    for (int64_t m = m0; m < M; m++) {
        const float *xm = x + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        if (nb == NB) {
            const float *w0 = wbuf, *w1 = wbuf + K8, *w2 = wbuf + 2 * K8, *w3 = wbuf + 3 * K8;
            for (int64_t k = 0; k < K8; k += 8) {
                __m256 xv = _mm256_loadu_ps(xm + k);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
            }
        } else {
            __m256 *acc[4] = {&a0, &a1, &a2, &a3};
            for (int r = 0; r < nb; r++) {
                const float *wr = wbuf + r * K8;
                __m256 a = _mm256_setzero_ps();
                for (int64_t k = 0; k < K8; k += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(xm + k), a);
                *acc[r] = a;
            }
        }
        __m256 accs[4] = {a0, a1, a2, a3};
        for (int r = 0; r < nb; r++) y[m * N + n0 + r] = finish(accs[r], tailw + r * 8, xm, K8, K, bias, n0 + r);
    }
}

static inline void cvt_row_bf16(const uint16_t *src, float *dst, int64_t K8) {
    for (int64_t k = 0; k < K8; k += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + k));
        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(w));
    }
}

static inline float bf16f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* One row of x against NB bf16 weight rows read in place (plain decoding: no buffer round trip). The same
   operations per product as block() -- the widening is exact -- so the bits equal block()'s. */
static void row_bf16(const float *xm, const uint16_t *wb, const float *tailw, const float *bias, float *y,
                     int64_t K, int64_t n0) {
    int64_t K8 = K & ~7LL;
    const uint16_t *w0 = wb + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 xv = _mm256_loadu_ps(xm + k);
#define WIDEN(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((p) + k))), 16))
        a0 = _mm256_fmadd_ps(WIDEN(w0), xv, a0);
        a1 = _mm256_fmadd_ps(WIDEN(w1), xv, a1);
        a2 = _mm256_fmadd_ps(WIDEN(w2), xv, a2);
        a3 = _mm256_fmadd_ps(WIDEN(w3), xv, a3);
#undef WIDEN
    }
    __m256 accs[4] = {a0, a1, a2, a3};
    for (int r = 0; r < NB; r++) y[n0 + r] = finish(accs[r], tailw + r * 8, xm, K8, K, bias, n0 + r);
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias), w bf16 (as uint16) or fp32; fp32 accumulation, fp32 out.
   Returns 0, or -1 when a thread could not allocate its buffer (its rows of y are then not written). */
int invariant_linear(const float *x, const void *w, int w_bf16, const float *bias, float *y,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    int failed = 0;
    int64_t K8 = K & ~7LL;
    int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(nthreads)
    {
        float *wbuf = w_bf16 ? (float *)aligned_alloc(32, ((NB * K8 * 4 + 31) / 32) * 32 + 32) : NULL;
        float tailw[NB * 8];
        if (w_bf16 && !wbuf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            if (w_bf16 && !wbuf) continue;
            int64_t n0 = b * NB;
            int nb = (int)((N - n0) < NB ? (N - n0) : NB);
            const float *blk;
            if (w_bf16) {
                const uint16_t *wb = (const uint16_t *)w;
                for (int r = 0; r < nb; r++)
                    for (int64_t k = K8; k < K; k++) tailw[r * 8 + (k - K8)] = bf16f(wb[(n0 + r) * K + k]);
                if (M == 1 && nb == NB) {
                    row_bf16(x, wb, tailw, bias, y, K, n0);
                    continue;
                }
                for (int r = 0; r < nb; r++) cvt_row_bf16(wb + (n0 + r) * K, wbuf + r * K8, K8);
                blk = wbuf;
            } else {
                const float *wf = (const float *)w;
                if (K8 == K) blk = wf + n0 * K;  /* rows are contiguous with stride K == K8 */
                else {
                    /* fp32 with a tail: pack the block (rare: K not a multiple of 8) */
                    static __thread float *pbuf = NULL; static __thread int64_t pcap = 0;
                    if (pcap < NB * K8) {
                        free(pbuf);
                        pbuf = (float *)malloc(NB * K8 * 4 + 32);
                        pcap = pbuf ? NB * K8 : 0;
                    }
                    if (!pbuf) {
#pragma omp atomic write
                        failed = 1;
                        continue;
                    }
                    for (int r = 0; r < nb; r++) memcpy(pbuf + r * K8, wf + (n0 + r) * K, K8 * 4);
                    blk = pbuf;
                }
                for (int r = 0; r < nb; r++)
                    for (int64_t k = K8; k < K; k++) tailw[r * 8 + (k - K8)] = wf[(n0 + r) * K + k];
            }
            block(x, blk, nb, tailw, bias, y, M, N, K, n0);
        }
        free(wbuf);
    }
    return failed ? -1 : 0;
}
