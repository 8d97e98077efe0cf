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
 * rope: for each of the first `nrot` heads of each row, x' = bf16(bf16(x * cos) + bf16(rot(x) * sin)) with bf16
 *   cos and signed sin -- bit for bit what `layers.apply_rope` computes with PyTorch's bf16 ops.
 */
#pragma GCC optimize("fp-contract=off")
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
        if (r) {
            const uint16_t *rm = r + m * H;
            uint16_t *hm = h + m * H;
            for (int64_t i = 0; i < H; i++) hm[i] = rn(bf(xm[i]) + bf(rm[i]));
            for (int64_t i = 0; i < H; i++) hv[i] = bf(hm[i]);
        } else {
            for (int64_t i = 0; i < H; i++) hv[i] = bf(xm[i]);
        }
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= H; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += hv[i + j] * hv[i + j];
        for (; i < H; i++) acc[i & 15] += hv[i] * hv[i];
        float s = 0.f;
        for (int j = 0; j < 16; j++) s += acc[j];
        float inv = 1.0f / sqrtf(s / (float)H + eps);
        for (int64_t k = 0; k < H; k++) om[k] = rn(hv[k] * inv * w[k]);
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
