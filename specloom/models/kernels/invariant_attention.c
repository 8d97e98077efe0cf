/* Batch-invariant attention for AVX2 + FMA CPUs: out[b, h, t] = softmax_j(scale * q[b, h, t] . k[b, g, j]) @ v[b, g, j]
 * over the keys j that query t may see (g = h / (H / Hkv): grouped-query attention).
 *
 * Why: PyTorch's CPU attention picks its blocking from the shapes of the pass (how many queries, how many key
 * slots), so one position decoded alone and the same position inside a verification pass get different bits,
 * and in bf16 a near-tie then parts speculative output from plain decoding. Here every query is computed from
 * *the list of keys it sees, in slot order*, and from nothing else:
 *
 *   1. every score (q . k_j) * scale is its own sequence: lane l of an 8-lane accumulator sums q[d] * k_j[d] for
 *      d = l, l + 8, ... in order, then one fixed tree adds the lanes (reduce8);
 *   2. m = max over the seen keys (exact whatever the order);
 *   3. p_j = exp(score_j - m), an elementwise vector exp, 0 for an unseen slot; sum = the p_j added in slot order
 *      (an unseen slot adds an exact zero);
 *   4. acc[d] = the p_j * v_j[d] added in slot order (one FMA chain per d), out[d] = acc[d] / sum.
 *
 * Which other queries share the pass, how many key slots the row holds past the visible ones, and where the
 * visible keys lie (a tree node sees its ancestors' slots, plain decoding the same keys in consecutive slots)
 * change nothing. Keys/values fp32 or bf16 (raw uint16 bits, widened exactly); q and out fp32.
 * Threads: OpenMP over (row, head, query) tasks; a task's result does not depend on the split.
 * Built on first use by specloom/models/invariant_attention.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* 8 consecutive elements of a key/value row as fp32. */
static inline __m256 load8(const void *base, int64_t off, int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + off);
}

/* e^x for x <= 0, elementwise (each lane's result depends on its own input only): a Cephes-style range reduction
   x = n ln2 + r and a degree-6 polynomial, about 1 ulp; below -87 it flushes to 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, p);
}

/* reduce8(a0..a7) = [sum a0, ..., sum a7]: each accumulator's 8 lanes added by one fixed tree,
   ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), whatever the other seven hold. */
static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
    __m256 h45 = _mm256_hadd_ps(a4, a5), h67 = _mm256_hadd_ps(a6, a7);
    __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    /* h0123 = [a0 lo, a1 lo, a2 lo, a3 lo, a0 hi, a1 hi, a2 hi, a3 hi] */
    __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

#define RB 8 /* query rows per task (the lanes of the transposed score buffer) */

/* Up to RB query rows (q[r], D floats each) of one kv head against its keys. lim[r]: row r considers slots
   [0, lim[r]); mrow[r] (or NULL): which of them it sees. sc: scratch of (S + 8) * RB floats; zero: D zeros of
   the key type. out[r]: D floats.
   Every (row, key) score is its own sequence (lane d mod 8, then reduce8's tree); the exponentials are
   elementwise; a row's sum and its weighted values run over the slots in order, an unseen slot adding an exact
   zero. So each row's bits depend on the keys it sees and their order only. */
static void rows_task(const float *const *q, int R, const void *k, const void *v, int bf16, int64_t kss,
                      int64_t vss, const int64_t *lim, const uint8_t *const *mrow, float *sc, const void *zero,
                      float *const *out, int64_t D, float scale) {
    int64_t jmax = 0;
    for (int r = 0; r < R; r++) jmax = lim[r] > jmax ? lim[r] : jmax;
    static const float qzero[512] = {0};
    const float *qr[RB];
    for (int r = 0; r < RB; r++) qr[r] = r < R ? q[r] : qzero;
    __m256 sv = _mm256_set1_ps(scale);
    /* 1. scores, transposed: sc[j * RB + r]; two rows x four keys per register block */
    for (int64_t j0 = 0; j0 < jmax; j0 += 4) {
        const void *kp[4];
        for (int c = 0; c < 4; c++)
            kp[c] = j0 + c < jmax ? (const void *)((const char *)k + (j0 + c) * kss * (bf16 ? 2 : 4)) : zero;
        for (int r = 0; r < R; r += 2) {
            const float *qa = qr[r], *qb = qr[r + 1];
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                __m256 k0 = load8(kp[0], d, bf16), k1 = load8(kp[1], d, bf16);
                __m256 k2 = load8(kp[2], d, bf16), k3 = load8(kp[3], d, bf16);
                __m256 x = _mm256_loadu_ps(qa + d), y = _mm256_loadu_ps(qb + d);
                a0 = _mm256_fmadd_ps(x, k0, a0); a1 = _mm256_fmadd_ps(x, k1, a1);
                a2 = _mm256_fmadd_ps(x, k2, a2); a3 = _mm256_fmadd_ps(x, k3, a3);
                b0 = _mm256_fmadd_ps(y, k0, b0); b1 = _mm256_fmadd_ps(y, k1, b1);
                b2 = _mm256_fmadd_ps(y, k2, b2); b3 = _mm256_fmadd_ps(y, k3, b3);
            }
            float s[8];
            _mm256_storeu_ps(s, _mm256_mul_ps(reduce8(a0, b0, a1, b1, a2, b2, a3, b3), sv));
            for (int c = 0; c < 4; c++) {
                sc[(j0 + c) * RB + r] = s[2 * c];
                sc[(j0 + c) * RB + r + 1] = s[2 * c + 1];
            }
        }
    }
    /* 2. unseen slots -> -inf; rows past R stay finite and are never written out */
    for (int r = 0; r < R; r++)
        for (int64_t j = 0; j < jmax; j++)
            if (j >= lim[r] || (mrow[r] && !mrow[r][j])) sc[j * RB + r] = -INFINITY;
    for (int64_t j = 0; j < jmax; j++)
        for (int r = R; r < RB; r++) sc[j * RB + r] = 0.0f;
    /* 3. per-row maximum, exponentials, sums in slot order (lanes are rows) */
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < jmax; j++) m = _mm256_max_ps(m, _mm256_loadu_ps(sc + j * RB));
    m = _mm256_blendv_ps(m, _mm256_setzero_ps(), _mm256_cmp_ps(m, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < jmax; j++) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j * RB), m));
        _mm256_storeu_ps(sc + j * RB, p);
        sum = _mm256_add_ps(sum, p);
    }
    float sums[8];
    _mm256_storeu_ps(sums, sum);
    /* 4. weighted values: four rows x two vectors of the head dimension per register block */
    for (int r0 = 0; r0 < R; r0 += 4) {
        for (int64_t d = 0; d < D; d += 16) {
            int two = d + 8 < D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t j = 0; j < jmax; j++) {
                const void *vp = (const char *)v + j * vss * (bf16 ? 2 : 4);
                __m256 x = load8(vp, d, bf16), y = two ? load8(vp, d + 8, bf16) : _mm256_setzero_ps();
                const float *pj = sc + j * RB + r0;
                __m256 p0 = _mm256_broadcast_ss(pj), p1 = _mm256_broadcast_ss(pj + 1);
                __m256 p2 = _mm256_broadcast_ss(pj + 2), p3 = _mm256_broadcast_ss(pj + 3);
                a0 = _mm256_fmadd_ps(p0, x, a0); b0 = _mm256_fmadd_ps(p0, y, b0);
                a1 = _mm256_fmadd_ps(p1, x, a1); b1 = _mm256_fmadd_ps(p1, y, b1);
                a2 = _mm256_fmadd_ps(p2, x, a2); b2 = _mm256_fmadd_ps(p2, y, b2);
                a3 = _mm256_fmadd_ps(p3, x, a3); b3 = _mm256_fmadd_ps(p3, y, b3);
            }
            __m256 A[4] = {a0, a1, a2, a3}, Bv[4] = {b0, b1, b2, b3};
            for (int c = 0; c < 4 && r0 + c < R; c++) {
                __m256 s = _mm256_set1_ps(sums[r0 + c]);
                _mm256_storeu_ps(out[r0 + c] + d, _mm256_div_ps(A[c], s));
                if (two) _mm256_storeu_ps(out[r0 + c] + d + 8, _mm256_div_ps(Bv[c], s));
            }
        }
    }
}

/* q (B, H, T, D) fp32 contiguous, D a multiple of 8 (at most 512); k, v: element strides per row (b), kv head (g)
   and slot (s), the head dimension contiguous; mask (B, T, S) bytes with strides msb, mst (the slot stride 1), or
   NULL: query t sees slots [0, S - T + t] (a causal pass whose T new entries are the row's last). out (B, H, T, D)
   fp32. Tasks: (row b, kv head g, a chunk of the group's G * T query rows); `chunk` rows each (1..8).
   Returns 0, or -1 when a thread could not allocate its scratch (its queries are then not written). */
int invariant_attention(const float *q, const void *k, const void *v, int kv_bf16,
                        int64_t ksb, int64_t ksg, int64_t kss, int64_t vsb, int64_t vsg, int64_t vss,
                        const uint8_t *mask, int64_t msb, int64_t mst, float *out,
                        int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D, float scale,
                        int chunk, int nthreads) {
    int failed = 0;
    int64_t G = H / Hkv, rows = G * T, per = (rows + chunk - 1) / chunk, tasks = B * Hkv * per;
    int es = kv_bf16 ? 2 : 4;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = (float *)aligned_alloc(32, (size_t)(((S + 8) * RB * 4 + 31) / 32) * 32);
        void *zero = calloc(D, 4);
        if (!sc || !zero) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!sc || !zero) continue;
            int64_t c = task % per, g = (task / per) % Hkv, b = task / (per * Hkv);
            const float *qp[RB];
            float *op[RB];
            int64_t lim[RB];
            const uint8_t *mr[RB];
            int R = 0;
            for (int64_t i = c * chunk; i < rows && i < (c + 1) * chunk; i++, R++) {
                int64_t h = g * G + i / T, t = i % T;
                qp[R] = q + ((b * H + h) * T + t) * D;
                op[R] = out + ((b * H + h) * T + t) * D;
                if (mask) {
                    mr[R] = mask + b * msb + t * mst;
                    int64_t last = S;
                    while (last > 0 && !mr[R][last - 1]) last--;
                    lim[R] = last;
                } else {
                    mr[R] = NULL;
                    lim[R] = S - T + t + 1;
                }
            }
            rows_task(qp, R, (const char *)k + (b * ksb + g * ksg) * es, (const char *)v + (b * vsb + g * vsg) * es,
                      kv_bf16, kss, vss, lim, mr, sc, zero, op, D, scale);
        }
        free(sc);
        free(zero);
    }
    return failed ? -1 : 0;
}
