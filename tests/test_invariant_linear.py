"""The batch-invariant linear kernel (models/invariant_linear.py): the product, bit-identical rows whatever the
row count, the choice rule, speculative output equal to plain output bit for bit, and the unavailable path."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specloom import SpecloomError
from specloom.host import kernel_choice as kernel_probe
from specloom.host.kernel_choice import choose_kernels, kernel_choice
from specloom.models import cpu_packing, invariant_linear

needs_kernel = pytest.mark.skipif(not invariant_linear.available(),
                                  reason=f"invariant kernel unavailable: {invariant_linear.unavailable_reason()}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 64, True), (37, 77, False), (130, 9, True), (4, 1000, False)])
def test_product_and_row_count_invariance(dtype, shape):
    out_f, in_f, bias = shape
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    mod = cpu_packing.build_kernel("invariant", lin)
    assert mod.kernel == "invariant" and mod.weight is lin.weight
    x = torch.randn(17, in_f).to(dtype)
    y = mod(x)
    assert y.dtype == dtype and y.shape == (17, out_f)
    ref = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(y.float(), ref, atol=tol, rtol=tol)
    # every row alone, and every prefix, gives the same bits as inside the 17-row product
    for i in range(17):
        assert torch.equal(mod(x[i:i + 1]), y[i:i + 1]), i
    for m in (2, 3, 8, 9, 16):
        assert torch.equal(mod(x[:m]), y[:m]), m
    assert torch.equal(mod(x.view(1, 17, in_f)), y.view(1, 17, out_f))  # any leading shape


def _probe(ms: dict) -> dict:
    return {"version": 2, "widths": [1, 4, 9, 16], "quiet": True,
            "ms": {k: {"1": a, "4": (a + b) / 2, "9": b, "16": 2 * b} for k, (a, b) in ms.items()},
            "invariant": {k: k == "invariant" for k in ms}}


def test_choice_prefers_the_invariant_kernel_within_the_slack(monkeypatch):
    monkeypatch.setattr(cpu_packing, "kernel_available",
                        lambda k, dt, dev: k in ("invariant", "native", "fp32", "int8"))
    # an AVX2 host: native bf16 costs ~n rows for n (and is not batch-invariant), invariant ~2x for 9 rows
    c = choose_kernels(_probe({"invariant": (17.5, 35.0), "native": (18.6, 129.0), "fp32": (32, 93)}),
                       torch.bfloat16)
    assert (c.single, c.multi) == ("invariant", "invariant") and c.invariant and "batch-invariant" in c.reason
    # 2 % slower for a decode step: still chosen (bit-identical speculation), the reason says by how much
    c = choose_kernels(_probe({"invariant": (19.0, 35.0), "native": (18.6, 129.0)}), torch.bfloat16)
    assert c.single == "invariant" and "behind native" in c.reason
    # far slower for plain decoding: native runs, and the note offers the invariant kernel
    c = choose_kernels(_probe({"invariant": (25.0, 35.0), "native": (18.6, 129.0)}), torch.bfloat16)
    assert (c.single, c.multi) == ("native", "native") and not c.invariant
    assert any("--linear-kernel invariant" in n for n in c.notes)
    # ... unless a drafter will run: then the 9-token pass decides
    d = kernel_probe.Drafting(tau=2.2)
    assert choose_kernels(_probe({"invariant": (25.0, 35.0), "native": (18.6, 129.0)}), torch.bfloat16,
                          drafting=d).single == "invariant"


@needs_kernel
def test_speculative_output_is_plain_output_bit_for_bit_in_bf16(tiny):
    """bf16 with the invariant kernel: the target drafting for itself accepts every draft, and the greedy tokens
    equal plain decoding's -- with native bf16 a multi-row pass may round differently (cpu_packing's caveat)."""
    from specloom.engine import load

    t = tiny("llama")
    plain = load(t.path, dtype="bf16", linear_kernel="invariant", progress=False)
    assert cpu_packing.kernel_of(plain.model.layers[0].mlp.down_proj) == "invariant"
    spec = load(t.path, {"method": "draft_model", "model": t.path, "num_speculative_tokens": 4}, dtype="bf16",
                linear_kernel="invariant", speculation="fixed", progress=False)
    prompt = [5, 9, 13, 2, 7, 11, 3]
    want = plain.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True).token_ids
    got = spec.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True)
    assert got.token_ids == want
    assert got.num_accepted_tokens == got.num_draft_tokens > 0


def test_unavailable_kernel_is_never_chosen_and_a_forced_one_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(invariant_linear, "_state", {})
    monkeypatch.setenv("SPECLOOM_INVARIANT_KERNEL", "0")
    assert not invariant_linear.available()
    assert "SPECLOOM_INVARIANT_KERNEL" in invariant_linear.unavailable_reason()
    assert not cpu_packing.kernel_available("invariant", torch.bfloat16, "cpu")
    m = nn.Sequential(nn.Linear(16, 8)).bfloat16()
    with pytest.raises(SpecloomError, match="invariant.*cannot run"):
        kernel_choice(m, "invariant", "cpu")
    monkeypatch.setattr(invariant_linear, "_state", {})
    monkeypatch.delenv("SPECLOOM_INVARIANT_KERNEL")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(invariant_linear.shutil, "which", lambda name: None)
    assert not invariant_linear.available() and "no C compiler" in invariant_linear.unavailable_reason()
    monkeypatch.setattr(invariant_linear, "_state", {})  # later tests load it again
