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
static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
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

/* ==== The repacked path: bf16 dot products on hosts with AVX512-BF16 ============================================
 *
 * The weights are repacked once at load: 16 weight rows side by side (one lane each), codes kept as small as the
 * type allows (4-bit types: a nibble per weight; the others: a byte, the code minus its offset), and per 16 rows
 * and block of BK = 32 weights (16 for Q6_K) two fp32 vectors: d (the block's scale, for K-quants the super-block
 * scale times the 6-bit sub-scale, as the gguf package computes it) and m (the block's added minimum; 0 where the
 * type has none; minus dmin times the sub-minimum for K-quants). Then for bf16 activations x
 *
 *     y[n] = sum over blocks b, in order, of  fma(m[n, b], X[b], fma(d[n, b], S[n, b], acc))
 *     S[n, b] = the codes' dot product with x over the block, by VDPBF16PS (each code an exact bf16, each pair
 *               product exact, the pair sums in fp32 in the instruction's fixed order), from zero
 *     X[b]   = the block's sum of x (fp32, in order; a function of the activation row alone)
 *
 * -- the same exact weights (d * code + m), summed in another fixed order. Each (row, output) is computed by the
 * same instructions whatever the other rows of the pass: batch-invariant. A block's code vectors are converted
 * once per pass (up to VROWS rows) and used by every row, so a verification pass reads and converts the weights as
 * often as a decode step does; each further row costs only its dot products.
 */
#ifndef PF
#define PF 1024  /* bytes of codes prefetched ahead of the dot products */
#endif
#define AVXBF __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

static int nibble_type(int t) { return t == Q4_0 || t == Q4_1 || t == Q4_K; }
static int vblock(int t) { return t == Q6_K ? 16 : 32; }
static int has_min(int t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }
/* the block types' scales (and minimums) are fp16 as shipped: kept so; K-quants' products d * sub-scale: fp32 */
static int half_scales(int t) { return !(t == Q4_K || t == Q5_K || t == Q6_K); }
/* bytes of one (16-row tile, block)'s scales: 16 d, then 16 m where the type has a minimum */
static int64_t sblock(int t) { return (int64_t)16 * (has_min(t) ? 2 : 1) * (half_scales(t) ? 2 : 4); }

int ggml_vsizes(int t, int64_t N, int64_t K, int64_t *code_bytes, int64_t *scale_bytes) {
    if (!block_bytes(t) || K % block_elems(t) || K % 32) return -1;
    int64_t tiles = (N + 15) / 16;
    *code_bytes = tiles * 16 * K / (nibble_type(t) ? 2 : 1);
    *scale_bytes = tiles * (K / vblock(t)) * sblock(t);
    return 0;
}

static inline float sget(int t, const uint8_t *sb, int i) {  /* element i (0-15: d, 16-31: m) */
    if (half_scales(t)) return h2f(rd16(sb + 2 * i));
    float f; memcpy(&f, sb + 4 * i, 4); return f;
}
static inline void sput(int t, uint8_t *sb, int i, float v) {
    if (half_scales(t)) { uint16_t h = _cvtss_sh(v, 0); memcpy(sb + 2 * i, &h, 2); }  /* exact: fp16 as shipped */
    else memcpy(sb + 4 * i, &v, 4);
}

int ggml_vsupported(void) { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }

/* One row's codes (code value as an int: its weight is d * code + m) and per-BK-block d and m. */
static void row_codes(int t, const uint8_t *b, int64_t K, int *code, float *d, float *m) {
    int64_t nblk = K / block_elems(t);
    for (int64_t i = 0; i < nblk; i++) {
        switch (t) {
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: {
            int sz = block_bytes(t);
            float dd = h2f(rd16(b)), mm = (t == Q4_1 || t == Q5_1) ? h2f(rd16(b + 2)) : 0.f;
            const uint8_t *qs = b + (t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : t == Q5_1 ? 8 : 2);
            uint32_t qh = t == Q5_0 ? rd32(b + 2) : t == Q5_1 ? rd32(b + 4) : 0;
            for (int j = 0; j < 32; j++) {
                int q;
                if (t == Q8_0) q = ((const int8_t *)qs)[j];
                else {
                    q = j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4);
                    if (t == Q5_0 || t == Q5_1) q |= ((qh >> j) & 1) << 4;
                    if (t == Q4_0) q -= 8;
                    if (t == Q5_0) q -= 16;
                }
                code[32 * i + j] = q;
            }
            d[i] = dd; m[i] = mm;
            b += sz; break;
        }
        case Q4_K: case Q5_K: {
            float dd = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (t == Q5_K ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                int g = j >> 1, h = j & 1;
                uint8_t s, mn;
                scale_min_k4(j, sc, &s, &mn);
                d[8 * i + j] = dd * (float)s;
                m[8 * i + j] = -(dmin * (float)mn);
                for (int l = 0; l < 32; l++) {
                    int q = (qs[32 * g + l] >> (4 * h)) & 15;
                    if (t == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
                    code[256 * i + 32 * j + l] = q;
                }
            }
            b += t == Q5_K ? 176 : 144; break;
        }
        case Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            float dd = h2f(rd16(b + 208));
            for (int j = 0; j < 16; j++) { d[16 * i + j] = dd * (float)sc[j]; m[16 * i + j] = 0.f; }
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++)
                    for (int l = 0; l < 32; l++) {
                        int lo = (ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15;
                        int hi = (qh[32 * h + l] >> (2 * g)) & 3;
                        code[256 * i + 128 * h + 32 * g + l] = (lo | (hi << 4)) - 32;
                    }
            b += 210; break;
        }
        }
    }
}

/* Repack N rows of blocks as rows row0 .. row0 + N - 1 of a weight of `total` rows, whose codes/scales (sized by
   ggml_vsizes for `total`) arrive zeroed (rows past `total` keep zero weights). */
int ggml_vrepack(int t, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, int64_t row0, int64_t total,
                 uint8_t *codes, uint8_t *scales) {
    int64_t cb, sf;
    if (ggml_vsizes(t, total, K, &cb, &sf) || row_bytes != K / block_elems(t) * block_bytes(t) || row0 < 0
        || row0 + N > total) return -1;
    int BK = vblock(t), nib = nibble_type(t);
    int64_t tiles = (N + 15) / 16, nbk = K / BK;
    int *code = (int *)malloc(K * sizeof(int));
    float *d = (float *)malloc(nbk * 4), *m = (float *)malloc(nbk * 4);
    if (!code || !d || !m) { free(code); free(d); free(m); return -2; }
    for (int64_t i = 0; i < N; i++) {
        row_codes(t, w + i * row_bytes, K, code, d, m);
        int64_t n = row0 + i, tile = n / 16, r = n % 16;
        for (int64_t b = 0; b < nbk; b++) {
            uint8_t *sb = scales + (tile * nbk + b) * sblock(t);
            sput(t, sb, (int)r, d[b]);
            if (has_min(t)) sput(t, sb, 16 + (int)r, m[b]);
        }
        for (int64_t k = 0; k < K; k++) {
            int64_t pair = k / 2, j = k % 2;
            if (nib) {
                /* per 4 weights (two pairs A, B) of a tile: 32 bytes, byte r*2+j = codeA | codeB << 4 */
                int64_t quad = k / 4, inpair = (k % 4) / 2;
                uint8_t *p = codes + (tile * (K / 4) + quad) * 32 + r * 2 + j;
                *p |= (uint8_t)(((code[k] + (t == Q4_0 ? 8 : 0)) & 15) << (4 * inpair));
            } else {
                codes[(tile * (K / 2) + pair) * 32 + r * 2 + j] = (uint8_t)(int8_t)code[k];
            }
        }
    }
    free(code); free(d); free(m);
    return 0;
}

/* Rows `ids` dequantised from the repacked form (fp32 [n, K]): d * code + m, bit for bit the gguf package's. */
int ggml_vrows(int t, const uint8_t *codes, const uint8_t *scales, int64_t K, const int64_t *ids, int64_t n,
               float *out) {
    int BK = vblock(t), nib = nibble_type(t);
    int64_t nbk = K / BK;
    for (int64_t i = 0; i < n; i++) {
        int64_t tile = ids[i] / 16, r = ids[i] % 16;
        for (int64_t k = 0; k < K; k++) {
            int q;
            if (nib) {
                uint8_t byte = codes[(tile * (K / 4) + k / 4) * 32 + r * 2 + k % 2];
                q = (byte >> (4 * ((k % 4) / 2))) & 15;
                if (t == Q4_0) q -= 8;
            } else q = (int8_t)codes[(tile * (K / 2) + k / 2) * 32 + r * 2 + k % 2];
            int64_t b = k / BK;
            const uint8_t *sb = scales + (tile * nbk + b) * sblock(t);
            float dd = sget(t, sb, (int)r), mm = has_min(t) ? sget(t, sb, 16 + (int)r) : 0.f;
            float v = (t == Q8_0) ? (float)q * dd : dd * (float)q;
            out[i * K + k] = (t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K) ? v + mm : v;
        }
    }
    return 0;
}

/* 32 codes of one pair-group as bf16: nibble types from a 32-byte group (lo or hi nibbles), byte types from 32
   bytes (signed). */
AVXBF static inline __m512bh nib_bf16(__m512i words, __m512i lut) { return (__m512bh)_mm512_permutexvar_epi16(words, lut); }
AVXBF static inline __m512bh byte_bf16(const uint8_t *p) {
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(b, a);  /* words 0-15: a (pairs of rows 0-7), 16-31: b */
}

/* The 16 d (which 0) or 16 m (which 1) of one (tile, block) as fp32. */
AVXBF static inline __m512 sload(int t, const uint8_t *sb, int which) {
    if (half_scales(t)) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32 * which)));
    return _mm512_loadu_ps((const float *)(sb + 64 * which));
}

/* The bf16 bits of a nibble type's code values (0..15, minus 8 for Q4_0): small integers, exact in bf16. */
AVXBF static inline __m512i nib_lut(int t) {
    uint16_t tab[32];
    for (int i = 0; i < 32; i++) {
        float f = (float)((i & 15) - (t == Q4_0 ? 8 : 0));
        uint32_t u; memcpy(&u, &f, 4); tab[i] = (uint16_t)(u >> 16);
    }
    return _mm512_loadu_si512(tab);
}

/* The end of block b for mt rows, one copy for both repacked paths: acc += d * S (+ m * the block's sum of x). */
AVXBF static inline __attribute__((always_inline)) void block_end(int t, const uint8_t *sb, const __m512 *S,
                                                                  const float *xs, int64_t nbk, int64_t b,
                                                                  int64_t mt, __m512 *acc) {
    int hasm = has_min(t);
    __m512 d = sload(t, sb, 0), m = hasm ? sload(t, sb, 1) : d;
    for (int i = 0; i < mt; i++) {
        acc[i] = _mm512_fmadd_ps(d, S[i], acc[i]);
        if (hasm) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i * nbk + b]), acc[i]);
    }
}

/* 16 outputs per row (fewer on the last tile) from the accumulators. */
AVXBF static inline void store_tile(const __m512 *acc, int64_t mt, void *y, int y_bf16, int64_t ldy, int64_t n0,
                              int64_t N) {
    int64_t nn = N - n0 < 16 ? N - n0 : 16;
    for (int i = 0; i < mt; i++) {
        float o[16];
        memcpy(o, &acc[i], 64);
        for (int r = 0; r < nn; r++) store(y, y_bf16, i * ldy + n0 + r, o[r]);
    }
}

/* acc + the dot products of q with a pair of bf16 activations broadcast to every lane: VDPBF16PS with an embedded
   broadcast ({1to16}) of the pair from memory (the intrinsic's broadcast compiles to a separate instruction, which
   doubled a verification row's cost on AVX512-BF16 hosts without AMX, measured on an AMD EPYC). */
AVXBF static inline __m512 dpb_pair(__m512 acc, __m512bh q, const uint16_t *p) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*(const float *)p));
    return acc;
}

/* One block's dot products for R (1 or 2) activation rows (x: the first row at the block's start, stride K):
   per row four partial sums from zero, vector j into sum j & 3, added as (S0 + S1) + (S2 + S3). */
AVXBF static inline __attribute__((always_inline)) void block_dots(const __m512bh *q, int nq, const uint16_t *x,
                                                                   int64_t K, int R, __m512 *sum) {
    __m512 S[2][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) S[r][c] = _mm512_setzero_ps();
    for (int j = 0; j < nq; j++)
        for (int r = 0; r < R; r++) S[r][j & 3] = dpb_pair(S[r][j & 3], q[j], x + r * K + 2 * j);
    for (int r = 0; r < R; r++)
        sum[r] = _mm512_add_ps(_mm512_add_ps(S[r][0], S[r][1]), _mm512_add_ps(S[r][2], S[r][3]));
}

/* One tile of 16 weight rows against mt <= VROWS activation rows: per block, its code vectors are converted once
   into registers and every row takes its dot products from them, two rows at a time. Vector j of a block
   (j < BK/2) holds the codes of the pair group at k0 + 2j and feeds partial sum j & 3; the four partial sums start
   from zero in each block and are added as (S0 + S1) + (S2 + S3) at its end (the dot products do not wait on each
   other). Every row is computed by the same operations in the same order whatever mt is: batch-invariant.
   acc: mt accumulators of this thread. */
AVXBF static inline __attribute__((always_inline)) void vtile(int t, const uint8_t *codes, const uint8_t *scales,
                                                              int64_t tile, const uint16_t *x, const float *xs,
                                                              int64_t mt, int64_t K, void *y, int y_bf16,
                                                              int64_t ldy, int64_t n0, int64_t N, __m512 *acc) {
    int BK = vblock(t), nq = BK / 2;
    int64_t nbk = K / BK;
    for (int64_t i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i lut = nib_lut(t), m4 = _mm512_set1_epi16(15);
    for (int64_t b = 0; b < nbk; b++) {
        __m512bh q[16];
        int64_t k0 = b * BK;
        if (nibble_type(t)) {
            for (int j = 0; j < nq; j += 2) {
                const uint8_t *cp = codes + (tile * (K / 4) + (k0 + 2 * j) / 4) * 32;
                if (!(j & 2)) _mm_prefetch((const char *)cp + PF, _MM_HINT_T0);
                __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)cp));
                q[j] = nib_bf16(_mm512_and_si512(v, m4), lut);
                q[j + 1] = nib_bf16(_mm512_srli_epi16(v, 4), lut);
            }
        } else {
            for (int j = 0; j < nq; j++) {
                const uint8_t *cp = codes + (tile * (K / 2) + (k0 + 2 * j) / 2) * 32;
                if (!(j & 1)) _mm_prefetch((const char *)cp + PF, _MM_HINT_T0);
                q[j] = byte_bf16(cp);
            }
        }
        const uint8_t *sb = scales + (tile * nbk + b) * sblock(t);
        __m512 sum[2];
        int64_t i = 0;
        for (; i + 2 <= mt; i += 2) {
            block_dots(q, nq, x + i * K + k0, K, 2, sum);
            block_end(t, sb, sum, xs + i * nbk, nbk, b, 2, acc + i);
        }
        if (i < mt) {
            block_dots(q, nq, x + i * K + k0, K, 1, sum);
            block_end(t, sb, sum, xs + i * nbk, nbk, b, 1, acc + i);
        }
    }
    store_tile(acc, mt, y, y_bf16, ldy, n0, N);
}

#define VROWS 64  /* rows per weight pass of vtile (its accumulators live on the thread's stack) */
#define VTYPE(T) AVXBF static void vtile_##T(const uint8_t *codes, const uint8_t *scales, int64_t tile, \
                                              const uint16_t *x, const float *xs, int64_t mt, int64_t K, void *y, \
                                              int y_bf16, int64_t ldy, int64_t n0, int64_t N, __m512 *acc) { \
    vtile(T, codes, scales, tile, x, xs, mt, K, y, y_bf16, ldy, n0, N, acc); }
VTYPE(Q4_0) VTYPE(Q4_1) VTYPE(Q5_0) VTYPE(Q5_1) VTYPE(Q8_0) VTYPE(Q4_K) VTYPE(Q5_K) VTYPE(Q6_K)
#undef VTYPE

AVXBF static void vtile_any(int t, const uint8_t *codes, const uint8_t *scales, int64_t tile, const uint16_t *x,
                            const float *xs, int64_t mt, int64_t K, void *y, int y_bf16, int64_t ldy, int64_t n0,
                            int64_t N, __m512 *acc) {
    switch (t) {
#define CASE(T) case T: vtile_##T(codes, scales, tile, x, xs, mt, K, y, y_bf16, ldy, n0, N, acc); return;
    CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q5_1) CASE(Q8_0) CASE(Q4_K) CASE(Q5_K) CASE(Q6_K)
#undef CASE
    }
}

/* ---- AMX (Sapphire Rapids and later): the same repacked codes, the block products by tile instructions --------
 * Per 16 weight rows and block: the codes converted to bf16 form the B tile (pair rows, 16 columns), up to 16
 * activation rows the A tile (read in place), TDPBF16PS the block's dot products for every row at once; then the
 * same scale/minimum FMAs as the vector path. One tile product costs about what 16 vector dot products cost, so a
 * 9- or 16-row verification pass costs about one decode step. Every row's result depends on that row alone (the
 * tile product computes each element from its own A row and B column): batch-invariant. Used on every pass of a
 * host where it runs (`ggml_vpath`), so plain decoding and verification round alike. */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")))

static int amx_state = -1;
static int amx_ok(void) {
    if (amx_state < 0) {
        amx_state = 0;
        if (__builtin_cpu_supports("avx512bf16")) {
            unsigned a, b, c, d;
            __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
            int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
            /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): Linux grants tile state per process */
            if (amx_bf16 && amx_tile && syscall(SYS_arch_prctl, 0x1023, 18) == 0) amx_state = 1;
        }
        if (getenv("SPECLOOM_GGML_AMX") && getenv("SPECLOOM_GGML_AMX")[0] == '0') amx_state = 0;
    }
    return amx_state;
}

/* 2: AMX tiles, 1: AVX512-BF16 vector dot products, 0: no repacked path here. */
int ggml_vpath(void) { return !ggml_vsupported() ? 0 : amx_ok() ? 2 : 1; }

typedef struct {
    uint8_t palette, start;
    uint8_t pad[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tilecfg;

AMX static void amx_config(int mt, int BK) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = (uint8_t)mt; c.colsb[0] = 64;          /* C: mt x 16 fp32 */
    c.rows[1] = (uint8_t)mt; c.colsb[1] = (uint16_t)(2 * BK);  /* A: mt x BK bf16 */
    c.rows[2] = (uint8_t)(BK / 2); c.colsb[2] = 64;    /* B: BK/2 pair rows x 16 columns x 2 bf16 */
    _tile_loadconfig(&c);
}

/* The B tile of block b (BK/2 pair rows x 16 columns of bf16 codes) into dst. */
AMX static inline __attribute__((always_inline)) void conv_block(int t, const uint8_t *codes, int64_t tile,
                                                                 int64_t b, int64_t K, uint16_t *dst) {
    int BK = vblock(t);
    int64_t k0 = b * BK;
    if (nibble_type(t)) {
        const __m512i lut = nib_lut(t), m4 = _mm512_set1_epi16(15);
        for (int64_t k = k0, p = 0; k < k0 + BK; k += 4, p += 2) {
            const uint8_t *cp = codes + (tile * (K / 4) + k / 4) * 32;
            if (!(k & 4)) _mm_prefetch((const char *)cp + PF, _MM_HINT_T0);
            __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)cp));
            _mm512_store_si512(dst + p * 32, _mm512_permutexvar_epi16(_mm512_and_si512(v, m4), lut));
            _mm512_store_si512(dst + (p + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut));
        }
    } else {
        for (int64_t k = k0, p = 0; k < k0 + BK; k += 2, p++) {
            const uint8_t *cp = codes + (tile * (K / 2) + k / 2) * 32;
            if (!(k & 2)) _mm_prefetch((const char *)cp + PF, _MM_HINT_T0);
            _mm512_store_si512(dst + p * 32, (__m512i)byte_bf16(cp));
        }
    }
}

/* One tile of 16 weight rows against mt <= 16 activation rows. bfull NULL: each block's B tile is converted into
   bbuf as it is needed; else bfull holds every block's (converted once for all of a long pass's row tiles). */
AMX static inline __attribute__((always_inline)) void atile(int t, const uint8_t *codes, const uint8_t *scales,
                                                            int64_t tile, const uint16_t *x, const float *xs,
                                                            int64_t mt, int64_t K, void *y, int y_bf16,
                                                            int64_t ldy, int64_t n0, int64_t N, uint16_t *bbuf,
                                                            const uint16_t *bfull, float *cbuf, __m512 *acc) {
    int BK = vblock(t);
    int64_t nbk = K / BK;
    __m512 sum[16];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        const uint16_t *bt = bfull ? bfull + b * (BK / 2) * 32 : bbuf;
        if (!bfull) conv_block(t, codes, tile, b, K, bbuf);
        _tile_zero(0);
        _tile_loadd(1, x + b * BK, K * 2);
        _tile_loadd(2, bt, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, cbuf, 64);
        for (int i = 0; i < mt; i++) sum[i] = _mm512_load_ps(cbuf + 16 * i);
        block_end(t, scales + (tile * nbk + b) * sblock(t), sum, xs, nbk, b, mt, acc);
    }
    store_tile(acc, mt, y, y_bf16, ldy, n0, N);
}

/* Every row tile of the pass against one weight tile (the weights' B tiles converted once when there are
   several row tiles). */
AMX static inline __attribute__((always_inline)) void atile_rows(int t, const uint8_t *codes, const uint8_t *scales,
                                                                 int64_t tile, const uint16_t *x, const float *xs,
                                                                 int64_t M, int64_t K, void *y, int y_bf16,
                                                                 int64_t ldy, int64_t N, uint16_t *bbuf,
                                                                 uint16_t *bfull, float *cbuf, __m512 *acc,
                                                                 int *cfg_rows) {
    int BK = vblock(t);
    int64_t nbk = K / BK;
    if (M > 16 && bfull)
        for (int64_t b = 0; b < nbk; b++) conv_block(t, codes, tile, b, K, bfull + b * (BK / 2) * 32);
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        int64_t mt = M - m0 < 16 ? M - m0 : 16;
        if (*cfg_rows != mt) {
            amx_config((int)mt, BK);
            *cfg_rows = (int)mt;
        }
        atile(t, codes, scales, tile, x + m0 * K, xs + m0 * nbk, mt, K, (char *)y + m0 * ldy * (y_bf16 ? 2 : 4),
              y_bf16, ldy, tile * 16, N, bbuf, M > 16 ? bfull : NULL, cbuf, acc);
    }
}

AMX static void atile_any(int t, const uint8_t *codes, const uint8_t *scales, int64_t tile, const uint16_t *x,
                          const float *xs, int64_t M, int64_t K, void *y, int y_bf16, int64_t ldy, int64_t N,
                          uint16_t *bbuf, uint16_t *bfull, float *cbuf, __m512 *acc, int *cfg_rows) {
    switch (t) {
#define CASE(T) case T: atile_rows(T, codes, scales, tile, x, xs, M, K, y, y_bf16, ldy, N, bbuf, bfull, cbuf, acc, \
                                   cfg_rows); return;
    CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q5_1) CASE(Q8_0) CASE(Q4_K) CASE(Q5_K) CASE(Q6_K)
#undef CASE
    }
}

AMX static int amx_linear(const uint16_t *x, int t, const uint8_t *codes, const uint8_t *scales, const float *xs,
                          int64_t M, int64_t N, int64_t K, void *y, int y_bf16, int64_t ldy, int nthreads) {
    int64_t tiles = (N + 15) / 16;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t bbuf[16 * 32] __attribute__((aligned(64)));
        float cbuf[16 * 16] __attribute__((aligned(64)));
        __m512 acc[16];
        int cfg_rows = -1;
        uint16_t *bfull = M > 16 ? (uint16_t *)aligned_alloc(64, (size_t)K * 16 * 2) : NULL;
        if (M > 16 && !bfull) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++)
            if (M <= 16 || bfull)
                atile_any(t, codes, scales, tile, x, xs, M, K, y, y_bf16, ldy, N, bbuf, bfull, cbuf, acc, &cfg_rows);
        _tile_release();
        free(bfull);
    }
    return failed ? -2 : 0;
}

/* y (fp32 or bf16, row stride ldy) = x (bf16 [M, K]) @ W^T from the repacked form. 0; -1 bad sizes; -2 no memory;
   -3 this CPU lacks AVX512-BF16. */
int ggml_vlinear(const uint16_t *x, int t, const uint8_t *codes, const uint8_t *scales, int64_t M, int64_t N,
                 int64_t K, void *y, int y_bf16, int64_t ldy, int nthreads) {
    if (!ggml_vsupported()) return -3;
    int64_t cb, sf;
    if (ggml_vsizes(t, N, K, &cb, &sf)) return -1;
    int BK = vblock(t);
    int64_t nbk = K / BK, tiles = (N + 15) / 16;
    float *xs = (float *)malloc((size_t)(M * nbk) * 4 + 4);
    if (!xs) return -2;
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nbk; b++) {
            float s = 0.f;
            for (int64_t k = b * BK; k < (b + 1) * BK; k++) s += bf(x[i * K + k]);
            xs[i * nbk + b] = s;
        }
    if (amx_ok()) {
        int rc = amx_linear(x, t, codes, scales, xs, M, N, K, y, y_bf16, ldy, nthreads);
        free(xs);
        return rc;
    }
#pragma omp parallel num_threads(nthreads)
    {
        __m512 acc[VROWS];
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++)
            for (int64_t m0 = 0; m0 < M; m0 += VROWS) {
                int64_t mt = M - m0 < VROWS ? M - m0 : VROWS;
                vtile_any(t, codes, scales, tile, x + m0 * K, xs + m0 * nbk, mt, K,
                          (char *)y + m0 * ldy * (y_bf16 ? 2 : 4), y_bf16, ldy, tile * 16, N, acc);
            }
    }
    free(xs);
    return 0;
}
