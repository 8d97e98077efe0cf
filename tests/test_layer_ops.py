"""The small bf16 C kernels of a decode step (models/layer_ops.py, kernels/layer_ops.c) against PyTorch's own ops:
RoPE, the residual add, the fp32 <-> bf16 conversions and silu(gate) * up bit for bit; RMSNorm to one bf16 step
(its mean sums in its own fixed order); every row computed alone (a row alone = the same row in a batch)."""

import pytest
import torch
import torch.nn.functional as F

from specloom.models import layer_ops
from specloom.models.layers import apply_rope

pytestmark = pytest.mark.skipif(not layer_ops.usable(torch.zeros(2, dtype=torch.bfloat16)),
                                reason="the C kernels do not build here")
G = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("d", [8, 12, 64, 128])
def test_rope_is_apply_rope_bit_for_bit(d):
    x = (torch.randn(2, 5, 7, d, generator=G) * 3).bfloat16()
    cos, sin = torch.randn(2, 5, 1, d, generator=G).bfloat16(), torch.randn(2, 5, 1, d, generator=G).bfloat16()
    want = torch.cat([apply_rope(x[:, :, :5], cos, sin), x[:, :, 5:]], dim=2)  # 5 heads rotated, 2 left alone
    got = x.clone()
    assert layer_ops.rope_(got, 5, cos.reshape(2, 5, d).contiguous(), sin.reshape(2, 5, d).contiguous())
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", [7, 576, 1537])
def test_silu_mul_is_pytorchs_bit_for_bit(n):
    gu = torch.cat([torch.randn(9, n, generator=G) * 8, torch.randn(9, n, generator=G)], dim=-1).bfloat16()
    gu[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 0.0, 88.5, -95.0])
    want = F.silu(gu[:, :n]) * gu[:, n:]
    got = layer_ops.silu_mul(gu)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(layer_ops.silu_mul(gu[4:5]), got[4:5])  # a row alone


def test_rms_norm_and_residual():
    x, r = (torch.randn(9, 576, generator=G) * 4).bfloat16(), torch.randn(9, 576, generator=G).bfloat16()
    w = torch.randn(576, generator=G)
    h, out = layer_ops.rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(h, x + r)  # the residual add: exact sum, one rounding, as PyTorch's
    ref = F.rms_norm(h.float(), (576,), w, 1e-5).bfloat16().float()
    assert ((out.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()  # within one bf16 step
    assert torch.equal(layer_ops.rms_norm(x[3:4], w, 1e-5, residual=r[3:4])[1], out[3:4])


def test_elementwise_steps_are_pytorchs():
    fns = layer_ops.elementwise()
    assert fns is not None
    a, b = (torch.randn(1003, generator=G) * 50).bfloat16(), torch.randn(1003, generator=G).bfloat16()
    x = a.clone()
    fns["add_bf16"](x.data_ptr(), b.data_ptr(), x.numel())
    assert torch.equal(x, a + b)
    f = torch.randn(1003, generator=G) * 1e3
    f[:4] = torch.tensor([float("inf"), -float("inf"), 3.0e38, 1e-40])
    y = torch.empty(1003, dtype=torch.bfloat16)
    fns["f32_to_bf16"](f.data_ptr(), y.data_ptr(), f.numel())
    assert torch.equal(y, f.bfloat16())
    z = torch.empty(1003)
    fns["bf16_to_f32"](a.data_ptr(), z.data_ptr(), a.numel())
    assert torch.equal(z, a.float())
