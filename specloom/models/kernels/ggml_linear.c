/* A batch-invariant linear over GGML block-quantized weights, as a GGUF file ships them:
 * y[M, N] = x[M, K] @ W[N, K]^T, W given as N rows of GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
 * Q6_K) and never materialised as a whole.
 *
 * Numerics: each weight is dequantised to fp32 exactly as the `gguf` package does (fp16 scales widened, the same
 * products and sums, one rounding each: this file is compiled with fp contraction off), activations are fp32
 * (bf16 activations are widened, exactly), products accumulate in fp32 by fused multiply-adds. So the kernel
 * computes the published model's weights, not a bf16 rounding of them.
 *
 * Batch-invariant: every product y[m, n] is the same sequence of operations whatever M is and whichever rows
 * share the call -- 16 lanes, lane j sums w[n, k] * x[m, k] for k = j, j + 16, ... in order, then a fixed tree
 * (lane j + lane j+8, then +4, +2, +1). A row alone (plain decoding) and the same row inside a verification pass
 * give the same bits, so speculative output is plain output bit for bit. The AVX-512 and AVX2 paths compute the
 * same sequence (an AVX2 register holds lanes 0-7 or 8-15): the bits are the same on either kind of host.
 *
 * Work: blocks of NB weight rows are dequantised into a per-thread fp32 buffer once per tile of up to MT rows of
 * x and multiplied with every row of the tile (so a 9-row verification pass reads the weights once). Threads:
 * OpenMP over the blocks of weight rows (the split does not change any product). Built on first use by
 * specloom/models/ggml_linear.py.
 */
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("f16c")  /* every AVX2 CPU has F16C (the loader requires AVX2) */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 8   /* weight rows per block */
#define MT 32  /* rows of x per tile */

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* bytes per block and elements per block */
static int block_bytes(int t) {
    switch (t) {
    case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24; case Q8_0: return 34;
    case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
    }
    return 0;
}
static int block_elems(int t) { return (t == Q4_K || t == Q5_K || t == Q6_K) ? 256 : 32; }

int ggml_block_bytes(int t) { return block_bytes(t); }
int ggml_block_elems(int t) { return block_bytes(t) ? block_elems(t) : 0; }

static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else { *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

/* One weight row (K elements in K / block_elems blocks) into fp32, as gguf's numpy dequantisation computes it. */
static inline __attribute__((always_inline)) void deq_row(int t, const uint8_t *b, float *o, int64_t K) {
    int64_t nblk = K / block_elems(t);
    for (int64_t i = 0; i < nblk; i++) {
        switch (t) {
        case Q4_0: {
            float d = h2f(rd16(b));
            const uint8_t *qs = b + 2;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)((int)(qs[j] & 15) - 8);
                o[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
            }
            b += 18; o += 32; break;
        }
        case Q4_1: {
            float d = h2f(rd16(b)), m = h2f(rd16(b + 2));
            const uint8_t *qs = b + 4;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)(qs[j] & 15) + m;
                o[j + 16] = d * (float)(qs[j] >> 4) + m;
            }
            b += 20; o += 32; break;
        }
        case Q5_0: {
            float d = h2f(rd16(b));
            uint32_t qh = rd32(b + 2);
            const uint8_t *qs = b + 6;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)((int)((qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
                o[j + 16] = d * (float)((int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
            }
            b += 22; o += 32; break;
        }
        case Q5_1: {
            float d = h2f(rd16(b)), m = h2f(rd16(b + 2));
            uint32_t qh = rd32(b + 4);
            const uint8_t *qs = b + 8;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)((qs[j] & 15) | (((qh >> j) & 1) << 4)) + m;
                o[j + 16] = d * (float)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
            }
            b += 24; o += 32; break;
        }
        case Q8_0: {
            float d = h2f(rd16(b));
            const int8_t *qs = (const int8_t *)(b + 2);
            for (int j = 0; j < 32; j++) o[j] = (float)qs[j] * d;
            b += 34; o += 32; break;
        }
        case Q4_K:
        case Q5_K: {
            float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (t == Q5_K ? 48 : 16);
            for (int g = 0; g < 4; g++) {  /* 32 bytes of qs: sub-blocks 2g (low nibbles) and 2g + 1 (high) */
                for (int h = 0; h < 2; h++) {
                    int j = 2 * g + h;
                    uint8_t s, mn;
                    scale_min_k4(j, sc, &s, &mn);
                    float dd = d * (float)s, dm = dmin * (float)mn;
                    for (int l = 0; l < 32; l++) {
                        int q = (qs[32 * g + l] >> (4 * h)) & 15;
                        if (t == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
                        o[32 * j + l] = dd * (float)q - dm;
                    }
                }
            }
            b += t == Q5_K ? 176 : 144; o += 256; break;
        }
        case Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = h2f(rd16(b + 208));
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++) {
                    float dd[2] = {d * (float)sc[8 * h + 2 * g], d * (float)sc[8 * h + 2 * g + 1]};
                    for (int l = 0; l < 32; l++) {
                        int lo = (ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15;
                        int hi = (qh[32 * h + l] >> (2 * g)) & 3;
                        o[128 * h + 32 * g + l] = dd[l >> 4] * (float)((lo | (hi << 4)) - 32);
                    }
                }
            b += 210; o += 256; break;
        }
        }
    }
}

/* ---- the products: 16 lanes, fixed order, the same bits on both paths -------------------------------------- */

static inline float hsum8(__m256 t) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void store(void *y, int y_bf16, int64_t i, float v) {
    if (y_bf16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        if ((u & 0x7fffffff) > 0x7f800000) u |= 0x00400000;  /* NaN stays NaN */
        else u += 0x7fff + ((u >> 16) & 1);                  /* round to nearest even */
        ((uint16_t *)y)[i] = (uint16_t)(u >> 16);
    } else ((float *)y)[i] = v;
}

#define AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))

AVX512 static inline float hsum16(__m512 a) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
}

/* NB dequantised weight rows (w, each K) against `mt` rows of x (each K): y[m * ldy + n0 + r] for r < nb. */
AVX512 static void tile512(const float *w, int nb, const float *x, int64_t mt, int64_t K, void *y, int y_bf16,
                           int64_t ldy, int64_t n0) {
    int64_t m = 0;
    for (; m + 4 <= mt; m += 4) {  /* 4 rows of x against 4 weight rows at a time: 16 accumulators */
        for (int r0 = 0; r0 < NB; r0 += 4) {
            if (r0 >= nb) break;
            const float *x0 = x + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
            __m512 C[4][4];
            for (int i = 0; i < 4; i++) for (int r = 0; r < 4; r++) C[i][r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                __m512 v0 = _mm512_loadu_ps(x0 + k), v1 = _mm512_loadu_ps(x1 + k);
                __m512 v2 = _mm512_loadu_ps(x2 + k), v3 = _mm512_loadu_ps(x3 + k);
                for (int r = 0; r < 4; r++) {
                    __m512 q = _mm512_loadu_ps(w + (r0 + r) * K + k);
                    C[0][r] = _mm512_fmadd_ps(q, v0, C[0][r]);
                    C[1][r] = _mm512_fmadd_ps(q, v1, C[1][r]);
                    C[2][r] = _mm512_fmadd_ps(q, v2, C[2][r]);
                    C[3][r] = _mm512_fmadd_ps(q, v3, C[3][r]);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int r = 0; r < 4 && r0 + r < nb; r++) store(y, y_bf16, (m + i) * ldy + n0 + r0 + r, hsum16(C[i][r]));
        }
    }
    for (; m + 2 <= mt; m += 2) {
        const float *xa = x + m * K, *xb = xa + K;
        __m512 A[NB], B[NB];
        for (int r = 0; r < NB; r++) A[r] = B[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __m512 va = _mm512_loadu_ps(xa + k), vb = _mm512_loadu_ps(xb + k);
            for (int r = 0; r < NB; r++) {
                __m512 q = _mm512_loadu_ps(w + r * K + k);
                A[r] = _mm512_fmadd_ps(q, va, A[r]);
                B[r] = _mm512_fmadd_ps(q, vb, B[r]);
            }
        }
        for (int r = 0; r < nb; r++) {
            store(y, y_bf16, m * ldy + n0 + r, hsum16(A[r]));
            store(y, y_bf16, (m + 1) * ldy + n0 + r, hsum16(B[r]));
        }
    }
    for (; m < mt; m++) {
        const float *xa = x + m * K;
        __m512 A[NB];
        for (int r = 0; r < NB; r++) A[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __m512 va = _mm512_loadu_ps(xa + k);
            for (int r = 0; r < NB; r++) A[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * K + k), va, A[r]);
        }
        for (int r = 0; r < nb; r++) store(y, y_bf16, m * ldy + n0 + r, hsum16(A[r]));
    }
}

static void tile256(const float *w, int nb, const float *x, int64_t mt, int64_t K, void *y, int y_bf16,
                    int64_t ldy, int64_t n0) {
    for (int64_t m = 0; m < mt; m++) {
        const float *xa = x + m * K;
        for (int r0 = 0; r0 < nb; r0 += 4) {
            __m256 L[4], H[4];
            for (int r = 0; r < 4; r++) L[r] = H[r] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                __m256 vl = _mm256_loadu_ps(xa + k), vh = _mm256_loadu_ps(xa + k + 8);
                for (int r = 0; r < 4; r++) {
                    const float *wr = w + (r0 + r) * K + k;
                    L[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wr), vl, L[r]);
                    H[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wr + 8), vh, H[r]);
                }
            }
            for (int r = 0; r < 4 && r0 + r < nb; r++)
                store(y, y_bf16, m * ldy + n0 + r0 + r, hsum8(_mm256_add_ps(L[r], H[r])));
        }
    }
}

AVX512 static void deq512(int t, const uint8_t *b, float *o, int64_t K) { deq_row(t, b, o, K); }
static void deq256(int t, const uint8_t *b, float *o, int64_t K) { deq_row(t, b, o, K); }

/* AVX-512: one unit of 32 weights (a Q*_0/Q*_1 block, or one of a K-quant super-block's 32-element sub-blocks)
   dequantised into two registers: elements 0-15 and 16-31 -- lanes 0-15 of the product order either way.
   The same operations per element as deq_row (products and sums rounded once each), so the same bits. */
AVX512 static inline __attribute__((always_inline)) void unit512(int t, const uint8_t *row, int64_t u, __m512 *lo,
                                                                 __m512 *hi) {
    const __m128i m4 = _mm_set1_epi8(15);
    switch (t) {
    case Q4_0: case Q4_1: {
        const uint8_t *b = row + u * (t == Q4_0 ? 18 : 20);
        __m128i qs = _mm_loadu_si128((const __m128i *)(b + (t == Q4_0 ? 2 : 4)));
        __m512i a = _mm512_cvtepu8_epi32(_mm_and_si128(qs, m4));
        __m512i c = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), m4));
        __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b)));
        if (t == Q4_0) {
            __m512i e = _mm512_set1_epi32(8);
            *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(a, e)));
            *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(c, e)));
        } else {
            __m512 m = _mm512_set1_ps(_cvtsh_ss(rd16(b + 2)));
            *lo = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(a)), m);
            *hi = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(c)), m);
        }
        return;
    }
    case Q5_0: {
        const uint8_t *b = row + u * 22;
        uint32_t qh = rd32(b + 2);
        __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6));
        __m512i a = _mm512_cvtepu8_epi32(_mm_and_si128(qs, m4));
        __m512i c = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), m4));
        __m512i s16 = _mm512_set1_epi32(16);
        a = _mm512_sub_epi32(_mm512_mask_or_epi32(a, (__mmask16)(qh & 0xffff), a, s16), s16);
        c = _mm512_sub_epi32(_mm512_mask_or_epi32(c, (__mmask16)(qh >> 16), c, s16), s16);
        __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b)));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(a));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(c));
        return;
    }
    case Q8_0: {
        const uint8_t *b = row + u * 34;
        __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b)));
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
        return;
    }
    case Q4_K: {
        const uint8_t *b = row + (u >> 3) * 144;
        int j = (int)(u & 7), g = j >> 1, h = j & 1;
        uint8_t sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        __m512 dd = _mm512_set1_ps(_cvtsh_ss(rd16(b)) * (float)sc);
        __m512 dm = _mm512_set1_ps(_cvtsh_ss(rd16(b + 2)) * (float)mn);
        const uint8_t *qs = b + 16 + 32 * g;
        __m128i q0 = _mm_loadu_si128((const __m128i *)qs), q1 = _mm_loadu_si128((const __m128i *)(qs + 16));
        if (h) { q0 = _mm_srli_epi16(q0, 4); q1 = _mm_srli_epi16(q1, 4); }
        *lo = _mm512_sub_ps(_mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q0, m4)))), dm);
        *hi = _mm512_sub_ps(_mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q1, m4)))), dm);
        return;
    }
    case Q6_K: {
        const uint8_t *b = row + (u >> 3) * 210;
        int j = (int)(u & 7), h = j >> 2, g = j & 3;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = _cvtsh_ss(rd16(b + 208));
        const uint8_t *ql = b + 64 * h + 32 * (g & 1), *qh = b + 128 + 32 * h;
        __m128i l0 = _mm_loadu_si128((const __m128i *)ql), l1 = _mm_loadu_si128((const __m128i *)(ql + 16));
        __m128i h0 = _mm_loadu_si128((const __m128i *)qh), h1 = _mm_loadu_si128((const __m128i *)(qh + 16));
        if (g >> 1) { l0 = _mm_srli_epi16(l0, 4); l1 = _mm_srli_epi16(l1, 4); }
        __m128i m3 = _mm_set1_epi8(3);
        h0 = _mm_and_si128(_mm_srl_epi16(h0, _mm_cvtsi32_si128(2 * g)), m3);
        h1 = _mm_and_si128(_mm_srl_epi16(h1, _mm_cvtsi32_si128(2 * g)), m3);
        __m128i a = _mm_or_si128(_mm_and_si128(l0, m4), _mm_slli_epi16(h0, 4));
        __m128i c = _mm_or_si128(_mm_and_si128(l1, m4), _mm_slli_epi16(h1, 4));
        __m512i s32 = _mm512_set1_epi32(32);
        __m512 d0 = _mm512_set1_ps(d * (float)sc[8 * h + 2 * g]), d1 = _mm512_set1_ps(d * (float)sc[8 * h + 2 * g + 1]);
        *lo = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(a), s32)));
        *hi = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(c), s32)));
        return;
    }
    }
}

static int vector_type(int t) { return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q8_0 || t == Q4_K || t == Q6_K; }

/* A row of weights into the buffer, unit by unit (the buffered path of the vector types). */
AVX512 static inline __attribute__((always_inline)) void deqv512(int t, const uint8_t *row, float *o, int64_t K) {
    for (int64_t u = 0; u < K / 32; u++) {
        __m512 lo, hi;
        unit512(t, row, u, &lo, &hi);
        _mm512_storeu_ps(o + 32 * u, lo);
        _mm512_storeu_ps(o + 32 * u + 16, hi);
    }
}

/* One or two rows of x against NB weight rows dequantised in registers as they are read (decode steps):
   the same products, in the same order, as deq + tile512. */
AVX512 static inline __attribute__((always_inline)) void fused512(int t, const uint8_t *w, int64_t row_bytes,
                                                                  int nb, const float *x, int64_t mt, int64_t K,
                                                                  void *y, int y_bf16, int64_t ldy, int64_t n0) {
    __m512 A[NB], B[NB];
    for (int r = 0; r < NB; r++) A[r] = B[r] = _mm512_setzero_ps();
    const float *xb = x + K;
    for (int64_t u = 0; u < K / 32; u++) {
        __m512 a0 = _mm512_loadu_ps(x + 32 * u), a1 = _mm512_loadu_ps(x + 32 * u + 16), b0 = a0, b1 = a1;
        if (mt == 2) { b0 = _mm512_loadu_ps(xb + 32 * u); b1 = _mm512_loadu_ps(xb + 32 * u + 16); }
        for (int r = 0; r < NB; r++) {
            if (r >= nb) break;
            __m512 lo, hi;
            unit512(t, w + (n0 + r) * row_bytes, u, &lo, &hi);
            A[r] = _mm512_fmadd_ps(hi, a1, _mm512_fmadd_ps(lo, a0, A[r]));
            if (mt == 2) B[r] = _mm512_fmadd_ps(hi, b1, _mm512_fmadd_ps(lo, b0, B[r]));
        }
    }
    for (int r = 0; r < nb; r++) {
        store(y, y_bf16, n0 + r, hsum16(A[r]));
        if (mt == 2) store(y, y_bf16, ldy + n0 + r, hsum16(B[r]));
    }
}

AVX512 static void fused_any(int t, const uint8_t *w, int64_t row_bytes, int nb, const float *x, int64_t mt,
                             int64_t K, void *y, int y_bf16, int64_t ldy, int64_t n0) {
    switch (t) {
#define CASE(T) case T: fused512(T, w, row_bytes, nb, x, mt, K, y, y_bf16, ldy, n0); return;
    CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q8_0) CASE(Q4_K) CASE(Q6_K)
#undef CASE
    }
}

AVX512 static void deqv_any(int t, const uint8_t *row, float *o, int64_t K) {
    switch (t) {
#define CASE(T) case T: deqv512(T, row, o, K); return;
    CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q8_0) CASE(Q4_K) CASE(Q6_K)
#undef CASE
    }
}

static int use512(void) {
    static int v = -1;
    if (v < 0) v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? 1 : 0;
    return v;
}

/* y (fp32 or bf16, row stride ldy) = x (fp32 or bf16, [M, K]) @ W^T, W: N rows of `row_bytes` bytes of GGML
   blocks of type t. force256: take the AVX2 path even where AVX-512 runs (tests). Returns 0; -1 for a type this
   kernel does not know or a K that is no whole number of blocks; -2 when a buffer could not be allocated. */
int ggml_linear(const void *x, int x_bf16, const uint8_t *w, int t, int64_t row_bytes, void *y, int y_bf16,
                int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads, int force256) {
    int bb = block_bytes(t);
    if (!bb || K % block_elems(t) || row_bytes != K / block_elems(t) * bb) return -1;
    int wide = use512() && !force256, fast = vector_type(t);
    float *xf = (float *)x;
    if (x_bf16) {
        xf = (float *)malloc((size_t)(M * K) * 4 + 64);
        if (!xf) return -2;
        const uint16_t *xb = (const uint16_t *)x;
        for (int64_t i = 0; i < M * K; i++) {
            uint32_t u = (uint32_t)xb[i] << 16;
            memcpy(xf + i, &u, 4);
        }
    }
    int failed = 0;
    int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(nthreads)
    {
        float *wbuf = (float *)aligned_alloc(64, (size_t)NB * K * 4);
        if (!wbuf) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            int64_t mt = M - m0 < MT ? M - m0 : MT;
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < nblocks; blk++) {
                if (!wbuf) continue;
                int64_t n0 = blk * NB;
                int nb = (int)(N - n0 < NB ? N - n0 : NB);
                if (wide && fast && M <= 2) {
                    fused_any(t, w, row_bytes, nb, xf, M, K, y, y_bf16, ldy, n0);
                    continue;
                }
                for (int r = 0; r < nb; r++) {
                    if (wide && fast) deqv_any(t, w + (n0 + r) * row_bytes, wbuf + r * K, K);
                    else if (wide) deq512(t, w + (n0 + r) * row_bytes, wbuf + r * K, K);
                    else deq256(t, w + (n0 + r) * row_bytes, wbuf + r * K, K);
                }
                if (nb < NB) memset(wbuf + nb * K, 0, (size_t)(NB - nb) * K * 4);
                void *ym = (char *)y + m0 * ldy * (y_bf16 ? 2 : 4);
                if (wide) tile512(wbuf, nb, xf + m0 * K, mt, K, ym, y_bf16, ldy, n0);
                else tile256(wbuf, nb, xf + m0 * K, mt, K, ym, y_bf16, ldy, n0);
            }
        }
        free(wbuf);
    }
    if (x_bf16) free(xf);
    return failed ? -2 : 0;
}

/* Rows `ids` of W (an embedding held as GGML blocks) dequantised into out (fp32, [n, K]). */
int ggml_rows(const uint8_t *w, int t, int64_t row_bytes, const int64_t *ids, int64_t n, float *out, int64_t K) {
    int bb = block_bytes(t);
    if (!bb || K % block_elems(t) || row_bytes != K / block_elems(t) * bb) return -1;
    for (int64_t i = 0; i < n; i++) deq256(t, w + ids[i] * row_bytes, out + i * K, K);
    return 0;
}
