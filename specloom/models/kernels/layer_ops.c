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
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u | 0x00400000) >> 16);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* x, r, h, out: [M, H] bf16 (r and h may be NULL: no residual); w: [H] fp32. */
int rms_norm_bf16(const uint16_t *x, const uint16_t *r, uint16_t *h, uint16_t *out, const float *w, int64_t M,
                  int64_t H, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * H;
        uint16_t *om = out + m * H;
        float acc[16] = {0};
        float hv[H > 0 ? H : 1];
        for (int64_t i = 0; i < H; i++) {
            float v = bf(xm[i]);
            if (r) {
                uint16_t s = rn(v + bf(r[m * H + i]));
                h[m * H + i] = s;
                v = bf(s);
            }
            hv[i] = v;
            acc[i & 15] += v * v;
        }
        float s = 0.f;
        for (int j = 0; j < 16; j++) s += acc[j];
        float inv = 1.0f / sqrtf(s / (float)H + eps);
        for (int64_t i = 0; i < H; i++) om[i] = rn(hv[i] * inv * w[i]);
    }
    return 0;
}

/* qkv: [rows, heads_total, d] bf16 (rows = B * T, row stride `rs` elements, head stride d); the first `nrot` heads of
   each row are rotated in place by that row's cos / signed sin (bf16, [rows, d], row stride d). */
int rope_bf16(uint16_t *qkv, int64_t rows, int64_t rs, int64_t nrot, int64_t d, const uint16_t *cos,
              const uint16_t *sin) {
    int64_t half = d / 2;
    uint16_t tmp[d > 0 ? d : 1];
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *c = cos + t * d, *s = sin + t * d;
        for (int64_t hd = 0; hd < nrot; hd++) {
            uint16_t *x = qkv + t * rs + hd * d;
            memcpy(tmp, x, d * 2);
            for (int64_t i = 0; i < d; i++) {
                float a = bf(rn(bf(tmp[i]) * bf(c[i])));
                float b = bf(rn(bf(tmp[(i + half) % d]) * bf(s[i])));
                x[i] = rn(a + b);
            }
        }
    }
    return 0;
}
