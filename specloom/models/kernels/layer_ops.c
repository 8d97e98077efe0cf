/* The small per-layer ops of a bf16 decode step, one call each instead of PyTorch's 5-9 (issue 37, "a lean
 * step"): RMSNorm (optionally fused with the residual add before it) and RoPE on the q and k heads of a fused
 * q/k/v projection's output, in place.
 *
 * Every row is computed alone, in a fixed order: batch-invariant. bf16 tensors are read and written as raw
 * uint16; widening is exact; rounding is to nearest even, as PyTorch rounds.
 *
 * rms_norm: h = bf16(x + r) when r is given (PyTorch's bf16 add: exact sum in fp32, rounded once), then
 *   out = bf16(h * (1 / sqrt(mean(h^2) + eps)) * w) in fp32, one rounding: F.rms_norm's numerics for bf16; the
 *   mean's summation order is this file's, so now and then a result differs from PyTorch's in the last bit.
 * silu_mul: out = bf16(bf16(silu(g)) * u) for the gate and up halves of a fused gate/up projection's output: PyTorch's
 *   bf16 `F.silu(gate) * up` (silu in fp32, x / (1 + exp(-x)), rounded; the product of the two bf16 values
 *   rounded), with an 8-lane polynomial exp within ~2 ulp of libm's (PyTorch's own vectorised exp may differ in the
 *   last bits of the fp32 silu, so now and then a bf16 result differs from PyTorch's by one unit).
 * rope: for each of the first `nrot` heads of each row, x' = bf16(bf16(x * cos) + bf16(rot(x) * sin)) with bf16
 *   cos and signed sin -- bit for bit what `layers.apply_rope` computes with PyTorch's bf16 ops.
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t rn(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint32_t r = ((u & 0x7fffffff) > 0x7f800000) ? (u | 0x00400000) : u + 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(r >> 16);
}

static inline __m256 load_bf8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* rn() on 8 lanes: the bf16 bits in each 32-bit lane's low half. */
static inline __m256i rn8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    return _mm256_srli_epi32(r, 16);
}

/* 8 bf16 values from the rounded lanes of rn8 (their low halves), stored at p */
static inline void store_bf8(uint16_t *p, __m256i r) {
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

#define MAXH 16384  /* the widest hidden size / head size these per-row buffers take */

/* x, r, h, out: [M, H] bf16 (r and h may be NULL: no residual); w: [H] fp32. The mean of squares: 16 lanes, lane j
   summing i = j, j + 16, ... in order, then lanes 0..15 in order. Returns -1 for H > MAXH. */
int rms_norm_bf16(const uint16_t *x, const uint16_t *r, uint16_t *h, uint16_t *out, const float *w, int64_t M,
                  int64_t H, float eps) {
    if (H > MAXH) return -1;
    float hv[MAXH];
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * H;
        uint16_t *om = out + m * H;
        int64_t i = 0;
        if (r) {
            const uint16_t *rm = r + m * H;
            uint16_t *hm = h + m * H;
            for (; i + 8 <= H; i += 8) {  /* h = bf16(x + r), kept widened */
                __m256i s = rn8(_mm256_add_ps(load_bf8(xm + i), load_bf8(rm + i)));
                store_bf8(hm + i, s);
                _mm256_storeu_ps(hv + i, _mm256_castsi256_ps(_mm256_slli_epi32(s, 16)));
            }
            for (; i < H; i++) { hm[i] = rn(bf(xm[i]) + bf(rm[i])); hv[i] = bf(hm[i]); }
        } else {
            for (; i + 8 <= H; i += 8) _mm256_storeu_ps(hv + i, load_bf8(xm + i));
            for (; i < H; i++) hv[i] = bf(xm[i]);
        }
        /* lanes 0-7 and 8-15 of the 16-lane sum of squares: the same order as a scalar acc[16] */
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        i = 0;
        for (; i + 16 <= H; i += 16) {
            __m256 v0 = _mm256_loadu_ps(hv + i), v1 = _mm256_loadu_ps(hv + i + 8);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
        }
        float acc[16];
        _mm256_storeu_ps(acc, a0);
        _mm256_storeu_ps(acc + 8, a1);
        for (; i < H; i++) acc[i & 15] += hv[i] * hv[i];
        float s = 0.f;
        for (int j = 0; j < 16; j++) s += acc[j];
        float inv = 1.0f / sqrtf(s / (float)H + eps);
        __m256 vinv = _mm256_set1_ps(inv);
        int64_t k = 0;
        for (; k + 8 <= H; k += 8)
            store_bf8(om + k, rn8(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(hv + k), vinv), _mm256_loadu_ps(w + k))));
        for (; k < H; k++) om[k] = rn(hv[k] * inv * w[k]);
    }
    return 0;
}

/* qkv: [rows, heads_total, d] bf16 (rows = B * T, row stride `rs` elements, head stride d); the first `nrot` heads of
   each row are rotated in place by that row's cos / signed sin (bf16, [rows, d], row stride d). */
int rope_bf16(uint16_t *qkv, int64_t rows, int64_t rs, int64_t nrot, int64_t d, const uint16_t *cos,
              const uint16_t *sin) {
    if (d > MAXH || d % 2) return -1;
    int64_t half = d / 2;
    float c[MAXH], sn[MAXH], a[MAXH], b[MAXH];
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t i = 0; i < d; i++) { c[i] = bf(cos[t * d + i]); sn[i] = bf(sin[t * d + i]); }
        for (int64_t hd = 0; hd < nrot; hd++) {
            uint16_t *x = qkv + t * rs + hd * d;
            int64_t i0 = 0;
            if (half % 8 == 0) {  /* 8 lanes at a time: the same operations, the same bits */
                for (; i0 < half; i0 += 8) {
                    __m256 x0 = load_bf8(x + i0), x1 = load_bf8(x + i0 + half);
                    __m256 pa = _mm256_castsi256_ps(_mm256_slli_epi32(rn8(_mm256_mul_ps(x0, _mm256_loadu_ps(c + i0))), 16));
                    __m256 qa = _mm256_castsi256_ps(_mm256_slli_epi32(rn8(_mm256_mul_ps(x1, _mm256_loadu_ps(sn + i0))), 16));
                    __m256 pb = _mm256_castsi256_ps(_mm256_slli_epi32(rn8(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i0 + half))), 16));
                    __m256 qb = _mm256_castsi256_ps(_mm256_slli_epi32(rn8(_mm256_mul_ps(x0, _mm256_loadu_ps(sn + i0 + half))), 16));
                    _mm256_storeu_ps(a + i0, _mm256_add_ps(pa, qa));
                    _mm256_storeu_ps(b + i0, _mm256_add_ps(pb, qb));
                }
                for (int64_t i = 0; i < half; i += 8) {
                    store_bf8(x + i, rn8(_mm256_loadu_ps(a + i)));
                    store_bf8(x + i + half, rn8(_mm256_loadu_ps(b + i)));
                }
                continue;
            }
            for (int64_t i = 0; i < half; i++) {
                float x0 = bf(x[i]), x1 = bf(x[i + half]);
                a[i] = bf(rn(x0 * c[i])) + bf(rn(x1 * sn[i]));               /* rot(x)[i] = x[i + d/2] */
                b[i] = bf(rn(x1 * c[i + half])) + bf(rn(x0 * sn[i + half]));  /* rot(x)[i + d/2] = x[i] */
            }
            for (int64_t i = 0; i < half; i++) { x[i] = rn(a[i]); x[i + half] = rn(b[i]); }
        }
    }
    return 0;
}

/* e^x for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial, 2^n by exponent
   bits); within ~2 ulp of libm's expf; +inf above ~88.72 and 0 below ~-103.97 (the fp32 range), NaN kept. The
   same instructions on every AVX2 host: the same bits. */
static inline __m256 exp8(__m256 x0) {
    __m256 x = _mm256_min_ps(_mm256_max_ps(x0, _mm256_set1_ps(-103.972084f)), _mm256_set1_ps(88.7228391f));
    __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                              _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(x, x)), x), _mm256_set1_ps(1.0f));
    __m256i n = _mm256_cvtps_epi32(fx), n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);  /* 2^n in two
        steps: n up to 128 and down into the subnormals */
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23)));
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23)));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x0, _mm256_set1_ps(88.7228391f), _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x0, _mm256_set1_ps(-103.972084f), _CMP_LT_OQ));
    return _mm256_blendv_ps(y, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
}



/* o[j] = bf16(bf16(silu(g[j])) * u[j]) for n <= 8 elements (fewer: through zero-padded copies, same lanes). */
static inline void silu8(const uint16_t *g, const uint16_t *u, uint16_t *o, int n) {
    uint16_t gp[8] = {0}, up[8] = {0}, op[8];
    if (n < 8) { memcpy(gp, g, n * 2); memcpy(up, u, n * 2); g = gp; u = up; }
    __m256 x = load_bf8(g);
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    __m256 sb = _mm256_castsi256_ps(_mm256_slli_epi32(
        rn8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e))), 16));
    __m256i r = rn8(_mm256_mul_ps(sb, load_bf8(u)));
    store_bf8(n == 8 ? o : op, r);
    if (n < 8) memcpy(o, op, n * 2);
}

/* gu: [M, 2 * I] bf16 (gate columns first, then up); out: [M, I] bf16. */
int silu_mul_bf16(const uint16_t *gu, int64_t M, int64_t I, uint16_t *out) {
    int64_t per = (I + 7) / 8, n = M * per;  /* 8-element pieces; each computed alone: any split, the same bits */
#pragma omp parallel for schedule(static) if (M * I >= 4096)
    for (int64_t k = 0; k < n; k++) {
        int64_t m = k / per, i = (k % per) * 8;
        silu8(gu + m * 2 * I + i, gu + m * 2 * I + I + i, out + m * I + i, I - i < 8 ? (int)(I - i) : 8);
    }
    return 0;
}

/* x = bf16(x + d), n elements (PyTorch's bf16 add: the exact sum in fp32, rounded once). */
int add_bf16(uint16_t *x, const uint16_t *d, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store_bf8(x + i, rn8(_mm256_add_ps(load_bf8(x + i), load_bf8(d + i))));
    for (; i < n; i++) x[i] = rn(bf(x[i]) + bf(d[i]));
    return 0;
}

/* dst = bf16(src), n elements, rounded to nearest even (PyTorch's .to(torch.bfloat16)). */
int f32_to_bf16(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store_bf8(dst + i, rn8(_mm256_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = rn(src[i]);
    return 0;
}

/* dst = float(src), n elements (exact). */
int bf16_to_f32(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf8(src + i));
    for (; i < n; i++) dst[i] = bf(src[i]);
    return 0;
}
