"""GGUF weights held as shipped (issue 37): the GGML block kernel (models/kernels/ggml_linear.c) against the
`gguf` package, bit for bit where it should be; batch-invariant (a row alone = the same row in a 9- and a 16-row
pass) on both its AVX-512 and AVX2 paths, which give the same bits; every drafter kind's greedy output equal to
plain decoding on a bf16 target whose linears run the kernel; a tiny GGUF written here loads as shipped; a real
SmolLM2 loads as shipped and speculates exactly; bad input is named."""

import copy

import numpy as np
import pytest
import torch
from torch.nn.functional import linear as F_linear

from specloom import Engine
from specloom.errors import SpecloomError
from specloom.models import ggml_linear
from specloom.speculative import SpeculativeConfig

pytestmark = pytest.mark.skipif(not ggml_linear.available(),
                                reason=f"GGML kernel unavailable: {ggml_linear.unavailable_reason()}")

BLOCKWISE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the gguf package quantizes these
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # it only dequantizes these: random blocks with sane scales


def _blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    import gguf

    t = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    if type_name in BLOCKWISE:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.2, t)
    blk, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n, k // blk, size), dtype=np.uint8)
    small = lambda m: (rng.random((n, k // blk, m)) * 0.01).astype(np.float16).view(np.uint8)  # noqa: E731
    if type_name == "Q6_K":
        raw[:, :, 208:210] = small(1)
    else:
        raw[:, :, 0:4] = small(2)
    return raw.reshape(n, -1)


def _reference(raw: np.ndarray, type_name: str, k: int) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(-1, k))


@pytest.fixture
def both_paths():
    yield
    ggml_linear.FORCE_AVX2 = False
    ggml_linear.REPACK = True


PATHS = ["blocks", pytest.param("repacked", marks=pytest.mark.skipif(
    not ggml_linear.repacked_path(), reason="this CPU lacks AVX512-BF16: no repacked path"))]


@pytest.mark.parametrize("type_name", BLOCKWISE + K_QUANTS)
def test_dequantisation_is_the_gguf_packages_bit_for_bit(type_name):
    k = 512
    raw = _blocks(type_name, 24, k)
    ours = ggml_linear.dequantize(torch.from_numpy(raw.copy()), ggml_linear.KERNEL_TYPES[type_name], k)
    assert torch.equal(ours, _reference(raw, type_name, k).float())


@pytest.mark.parametrize("type_name", BLOCKWISE + K_QUANTS)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_blocks_as_shipped_right_and_batch_invariant_on_both_isas(type_name, act, both_paths):
    """The blocks as shipped (fp32 FMA path): products right, every row's bits independent of the pass, and the
    AVX2 path (any AVX2 host) giving the AVX-512 path's bits."""
    ggml_linear.REPACK = False
    n, k = 45, 512  # 45 rows: a last block of weight rows that is not full
    raw = _blocks(type_name, n, k, seed=1)
    w = ggml_linear.GGMLLinear([(torch.from_numpy(raw.copy()), ggml_linear.KERNEL_TYPES[type_name])], k, act)
    assert not w.repacked
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(2)).to(act)  # 37: more than one 32-row tile
    ref = (x.double() @ _reference(raw, type_name, k).double().T)
    outs = {}
    for force in (False, True):
        ggml_linear.FORCE_AVX2 = force
        y = w(x)
        assert y.dtype == act
        tol = 1e-4 if act == torch.float32 else 1e-2
        assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        _assert_invariant(w, x, y)
        outs[force] = y
    assert torch.equal(outs[False], outs[True]), "the AVX2 path rounds differently from the AVX-512 path"


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_gradient_through_a_frozen_ggml_linear(act):
    """A drafter trained through the target's GGUF head (DFlash, DSpark, EAGLE-1, Medusa) needs the input's
    gradient: grad_out @ W with W dequantised; the forward stays the kernel's own bits, and without autograd
    nothing changes."""
    k, n = 256, 40
    raw = _blocks("Q4_0", n, k, seed=3)
    w = ggml_linear.GGMLLinear([(torch.from_numpy(raw.copy()), ggml_linear.KERNEL_TYPES["Q4_0"])], k, act)
    w.fp32_out = True
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4)).to(act).requires_grad_()
    y = w(x)
    assert torch.equal(y.detach(), w(x.detach()))
    g = torch.randn(5, n, generator=torch.Generator().manual_seed(5))
    y.backward(g)
    ref = (g.to(act) @ _reference(raw, "Q4_0", k).to(act)).to(act)
    assert x.grad.dtype == act and torch.allclose(x.grad.float(), ref.float(), rtol=1e-2, atol=1e-2)


def _assert_invariant(w, x, y):
    for rows in (1, 2, 3, 4, 5, 9, 16):
        assert torch.equal(w(x[:rows]), y[:rows]), f"a {rows}-row pass differs from the same rows in a bigger pass"
    assert all(torch.equal(w(x[i:i + 1])[0], y[i]) for i in (0, 5, 8, 15, 36, len(x) - 1) if i < len(x))


@pytest.mark.skipif(not ggml_linear.repacked_path(), reason="this CPU lacks AVX512-BF16: no repacked path")
@pytest.mark.parametrize("type_name", BLOCKWISE + K_QUANTS)
def test_repacked_right_exact_weights_and_batch_invariant(type_name):
    """bf16 on an AVX512-BF16 host: the weights repacked for bf16 dot products are still exactly the gguf
    package's (d * code + m), the products right, every row's bits independent of the pass."""
    n, k = 45, 512
    raw = _blocks(type_name, n, k, seed=1)
    w = ggml_linear.GGMLLinear([(torch.from_numpy(raw.copy()), ggml_linear.KERNEL_TYPES[type_name])], k,
                               torch.bfloat16)
    assert w.repacked
    assert torch.equal(w.ws[0].dense(), _reference(raw, type_name, k).float())
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2)).bfloat16()  # past the 64 rows of a weight pass
    ref = (x.double() @ _reference(raw, type_name, k).double().T)
    y = w(x)
    assert torch.allclose(y.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    _assert_invariant(w, x, y)


def test_q8_0_quantisation_is_within_half_a_step():
    """A dense weight as Q8_0 blocks: each weight within half its block's step d = fp16(max |w| / 127) (plus the
    fp16 rounding of d), the block's largest weight at code +-127, a zero block all zeros; rows that are not whole
    blocks are refused."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 96, generator=g) * torch.logspace(-3, 1, 7)[:, None]
    w[3, 32:64] = 0
    blocks = ggml_linear.quantize_q8_0(w)
    assert blocks.shape == (7, 3 * 34) and blocks.dtype == torch.uint8
    back = ggml_linear.dequantize(blocks, ggml_linear.KERNEL_TYPES["Q8_0"], 96)
    d = blocks.view(7, 3, 34)[..., :2].contiguous().view(torch.float16).float()  # (7, 3, 1)
    err = (back - w).abs().view(7, 3, 32)
    assert bool((err <= d * 0.5 * (1 + 1e-3) + w.abs().view(7, 3, 32) * 2 ** -10).all())
    codes = blocks.view(7, 3, 34)[..., 2:].contiguous().view(torch.int8)
    assert bool((codes.abs().amax(-1)[d[..., 0] > 0] == 127).all())
    assert torch.equal(back[3, 32:64], torch.zeros(32))
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml_linear.quantize_q8_0(torch.randn(2, 40))


@pytest.mark.skipif(not ggml_linear.repacked_path(), reason="this CPU lacks AVX512-BF16: drafters stay bf16")
def test_drafter_linears_run_q8_0_and_keep_their_weights(monkeypatch):
    """A bf16 drafter's linears draft from Q8_0 copies (products close to the bf16 ones), while state dicts (export,
    warm starts) and gradients still see the original weights; SPECLOOM_DRAFTER_Q8=0 keeps them bf16."""
    from torch import nn

    from specloom.models.cpu_packing import DraftQ8Linear, pack_linears

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 40, bias=False), nn.Linear(40, 8)).bfloat16()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert pack_linears(net) == 3
    assert [type(m).__name__ for m in net] == ["DraftQ8Linear", "DraftQ8Linear", "PackedLinear"]  # 40: not blocks
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        y = net[0](x)
    ref = F_linear(x.float(), before["0.weight"].float(), before["0.bias"].float())
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref, atol=0.02 * ref.abs().max().item())
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    net[0](xg).float().sum().backward()  # a pass that needs gradients runs the original weight
    F_linear(xr, before["0.weight"], before["0.bias"]).float().sum().backward()
    assert torch.equal(xg.grad, xr.grad)
    monkeypatch.setenv("SPECLOOM_DRAFTER_Q8", "0")
    other = nn.Sequential(nn.Linear(64, 96)).bfloat16()
    pack_linears(other)
    assert not isinstance(other[0], DraftQ8Linear)


def test_dense_state_of_a_held_layer_and_mtp_warm_start(kinds):
    """A layer held as GGML blocks has no weights in its state dict; `dense_state` gives them (dequantised), and
    MTP's warm start from the target's last layer works on such a target (it raised before)."""
    from specloom.drafters.mtp.model import MTPModel, init_mtp

    model = as_shipped(kinds[0].model)
    layer = model.layers[-1]
    assert "self_attn.qkv_proj.weight" not in layer.state_dict()
    sd = ggml_linear.dense_state(layer)
    assert set(sd) == set(kinds[0].model.layers[-1].state_dict())
    assert torch.equal(sd["mlp.down_proj.weight"], layer.mlp.down_proj.weight)
    mtp = MTPModel(model.config, 1)
    init_mtp(mtp, model)
    assert torch.equal(mtp.layers[0].block.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.weight.float())


def test_mixed_types_in_one_fused_linear():
    """Gemma's q and k are Q5_0 where v is Q8_0: one linear over both, each segment its own type."""
    k = 256
    parts = [(_blocks("Q5_0", 40, k, 3), "Q5_0"), (_blocks("Q8_0", 8, k, 4), "Q8_0")]
    w = ggml_linear.GGMLLinear([(torch.from_numpy(r.copy()), ggml_linear.KERNEL_TYPES[t]) for r, t in parts], k,
                               torch.float32)
    dense = torch.cat([_reference(r, t, k) for r, t in parts])
    x = torch.randn(3, k)
    assert torch.allclose(w(x), x @ dense.T, atol=1e-4)
    assert torch.equal(w.weight, dense)


def test_a_kernel_refuses_rows_that_do_not_fit():
    raw = torch.from_numpy(_blocks("Q4_1", 4, 64).copy())
    w = ggml_linear.GGMLLinear([(raw[:, :30].contiguous(), ggml_linear.KERNEL_TYPES["Q4_1"])], 64, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        w(torch.randn(1, 64))


# -- every drafter kind on a target whose linears run the kernel ---------------------------------------------------

TYPES = {"qkv_proj": "Q4_1", "o_proj": "Q5_0", "gate_up_proj": "Q8_0", "down_proj": "Q4_0", "lm_head": "Q8_0"}


def as_shipped(model, dtype=torch.bfloat16):
    """A copy of `model` in `dtype` whose linears hold GGML blocks quantized from its weights."""
    import gguf

    m = copy.deepcopy(model).to(dtype)
    for prefix, parent in list(m.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name in TYPES:
                t = TYPES[name]
                raw = gguf.quants.quantize(child.weight.detach().float().numpy(), gguf.GGMLQuantizationType[t])
                setattr(parent, name, ggml_linear.GGMLLinear(
                    [(torch.from_numpy(raw.copy()), ggml_linear.KERNEL_TYPES[t])], child.in_features, dtype))
    return m


KINDS = ["ngram", "suffix", "self_draft", "draft_model_tree", "eagle", "eagle_tree", "eagle3", "medusa", "dflash",
         "dspark", "dflash2_tree", "mtp"]
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [9, 200, 9, 200, 17]]
N = 24


@pytest.fixture(scope="module")
def targets(kinds):
    t, (mtp_model, mtp_tok), specs = kinds
    return as_shipped(t.model), as_shipped(mtp_model), specs


from test_kv_types import kinds  # noqa: E402,F401  (fixture: a spec for every drafter kind on the tiny target)


@pytest.mark.parametrize("kind", KINDS)
def test_every_drafter_exact_with_the_kernel_in_bf16(kinds, targets, kind):
    t, (_, mtp_tok), _ = kinds
    model, mtp_model, specs = targets
    assert any(isinstance(m, ggml_linear.GGMLLinear) for m in model.modules())
    target, tok = (mtp_model, mtp_tok) if kind == "mtp" else (model, t.tokenizer)
    want = [Engine(target, tok).generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids
            for p in PROMPTS]
    with _quiet():
        e = Engine(target, tok, SpeculativeConfig.parse(specs[kind]), speculation="fixed")
    got = [e.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True) for p in PROMPTS]
    assert [r.token_ids for r in got] == want
    if kind != "suffix":
        assert sum(r.num_draft_tokens for r in got) > 0


@pytest.mark.parametrize("kind", ["self_draft", "eagle_tree"])
def test_sampling_distribution_with_the_kernel(kinds, targets, kind, sampling_tv):
    """Temperature-1 samples from a bf16 target whose linears run the kernel: speculative and plain decoding give
    the same distribution (total variation bound with 400 samples each; the drafter must draft)."""
    t = kinds[0]
    model, _, specs = targets
    with _quiet():
        e = Engine(model, t.tokenizer, SpeculativeConfig.parse(specs[kind]), speculation="fixed")
    tv = sampling_tv(e, Engine(model, t.tokenizer), PROMPTS[0])
    assert tv < 0.12, tv


class _quiet:
    """Drafters were saved for the fp32 original: the fingerprint warning (another copy) is expected here."""

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


# -- a tiny GGUF written here, loaded as shipped --------------------------------------------------------------------

GGUF_TYPES = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
              "ffn_up": "Q4_0", "ffn_down": "Q5_1"}


def _write_gguf(hf, path: str, types=GGUF_TYPES, embed_type="Q8_0") -> None:
    """A Llama GGUF of `hf`'s weights in `types`, no output.weight (the head tied to a quantized embedding)."""
    from test_formats import _write_llama_gguf

    _write_llama_gguf(hf, path, types={**types, "token_embd": embed_type}, tied=True)


def _load_gguf(path, dtype, resident):
    from specloom.loading.gguf_file import gguf_config, gguf_raw_tensors
    from specloom.loading.weights import build_model, load_state_dict
    from specloom.config import ModelConfig

    cfg = gguf_config(path)
    config = ModelConfig.from_hf(cfg)
    state, plan = load_state_dict(config, gguf_raw_tensors(path, cfg), dtype, resident=resident)
    return build_model(config, state), plan


def test_tiny_gguf_as_shipped(tiny, tmp_path):
    """Every linear and the tied embedding/head held as blocks (q/k unpermuted row-wise, a fused q/k/v of two
    types); the logits those of the fp32 dequantised load to bf16 precision; speculation exact."""
    t = tiny("llama")
    path = str(tmp_path / "tiny-q.gguf")
    _write_gguf(t.hf, path)
    shipped, _ = _load_gguf(path, torch.bfloat16, "quantized")
    ref, _ = _load_gguf(path, torch.float32, "dequantized")
    assert isinstance(shipped.embed_tokens, ggml_linear.GGMLEmbedding)
    assert isinstance(shipped.lm_head, ggml_linear.GGMLLinear)
    assert shipped.lm_head.storage_ptr() == shipped.embed_tokens.storage_ptr()  # one copy
    qkv = shipped.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ggml_linear.GGMLLinear) and len(qkv.types) == 2  # Q4_1 q/k, Q8_0 v
    assert torch.equal(qkv.weight.float(), ref.layers[0].self_attn.qkv_proj.weight.bfloat16().float())
    ids = torch.arange(4, 40)[None]
    with torch.inference_mode():
        a = shipped(ids, torch.arange(36)[None], shipped.new_kv(40)).logits
        b = ref(ids, torch.arange(36)[None], ref.new_kv(40)).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    plain = Engine(shipped, t.tokenizer).generate(prompt_token_ids=[5, 6, 7, 8, 5, 6, 7, 8, 5], max_tokens=20,
                                                 ignore_eos=True)
    spec = Engine(shipped, t.tokenizer, SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}),
                  speculation="fixed").generate(prompt_token_ids=[5, 6, 7, 8, 5, 6, 7, 8, 5], max_tokens=20,
                                                ignore_eos=True)
    assert spec.token_ids == plain.token_ids and spec.num_draft_tokens > 0


def test_a_gguf_type_without_a_kernel_is_named_and_dequantised(tiny, tmp_path, capfd):
    t = tiny("llama")
    path = str(tmp_path / "tiny-iq4.gguf")
    _write_gguf(t.hf, path, {**GGUF_TYPES, "ffn_down": "IQ4_NL"})
    model, _ = _load_gguf(path, torch.bfloat16, "quantized")
    err = capfd.readouterr().err
    assert "GGUF type IQ4_NL has no GGML block kernel" in err and "dequantised to bfloat16 at load" in err
    assert err.count("IQ4_NL") == 1  # one line, not one per layer
    assert type(model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(model.layers[0].mlp.gate_up_proj, ggml_linear.GGMLLinear)


def test_truncated_quantized_tensor_is_one_clear_error(tmp_path):
    import subprocess
    import sys

    from specloom.loading import resolve

    try:
        src = resolve("smollm2-135m").path
    except SpecloomError as e:
        pytest.skip(str(e))
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(60_000_000))
    r = subprocess.run([sys.executable, "-m", "specloom", "generate", str(cut), "--prompt", "hi", "--max-tokens",
                        "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "runs past the end of the file (truncated?)" in r.stderr


@pytest.mark.real
def test_real_smollm2_as_shipped_speculates_exactly():
    from specloom.loading import load_target, resolve

    try:
        resolve("smollm2-135m")
    except SpecloomError as e:
        pytest.skip(str(e))
    model, tok = load_target("smollm2-135m", "bf16", progress=False, kernel="ggml")
    assert model.kernel_choice.single == "ggml" and model.kernel_choice.invariant
    assert isinstance(model.layers[0].mlp.gate_up_proj, ggml_linear.GGMLLinear)
    plain = Engine(model, tok)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4}, {"method": "eagle3", "suffix_decoding": True}):
        engine = Engine(model, tok, SpeculativeConfig.parse(spec), speculation="fixed")
        for p in ("Write a haiku about the sea.", "List three prime numbers and explain why they are prime."):
            a = plain.generate(p, chat=True, max_tokens=40)
            b = engine.generate(p, chat=True, max_tokens=40)
            assert b.token_ids == a.token_ids, (spec, p)
            assert b.num_target_passes < a.num_target_passes


# -- the decoder layers in one C call (models/fused_stack.py) ---------------------------------------------------------

from specloom.models import fused_stack  # noqa: E402

_RUN = fused_stack.run


def _passes(model, monkeypatch, fused: bool, rows: int = 1):
    """Logits and captures of a prefill, three decode steps and a tree-masked pass, with the fused stack on or
    off; also which passes the fused stack ran."""
    monkeypatch.setenv("SPECLOOM_FUSED_STACK", "1" if fused else "0")
    ran, real = [], _RUN

    def counted(*a):
        out = real(*a)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(fused_stack, "run", counted)
    g = torch.Generator().manual_seed(0)
    V, L = model.config.vocab_size, model.config.num_layers
    kv, outs = model.new_kv(64, batch=rows), []
    with torch.inference_mode():
        o = model(torch.randint(0, V, (rows, 12), generator=g), torch.arange(12).expand(rows, 12), kv,
                  capture=(1, L - 1, -1))
        kv.commit()
        outs += [o.logits, *o.hidden.values()]
        for step in range(3):
            o = model(torch.randint(0, V, (rows, 1), generator=g), torch.full((rows, 1), 12 + step), kv, num_logits=1)
            kv.commit()
            outs.append(o.logits)
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        o = model(torch.randint(0, V, (rows, 4), generator=g), torch.tensor([[15, 16, 16, 17]]).expand(rows, 4), kv,
                  attn_mask=mask, capture=(2,))
        outs += [o.logits, o.hidden[2]]
    return outs, ran


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_stack_is_the_layers_bit_for_bit(kinds, path, rows, both_paths, monkeypatch):
    """The C layer loop computes what the layers compute, bit for bit: prefill with captures, decode steps, a
    tree-masked pass, one row and two; and it does run (and does not where it is switched off)."""
    ggml_linear.REPACK = path == "repacked"
    model = as_shipped(kinds[0].model)
    want, ran_off = _passes(model, monkeypatch, fused=False, rows=rows)
    got, ran_on = _passes(model, monkeypatch, fused=True, rows=rows)
    assert not any(ran_off) and all(ran_on) and len(ran_on) == 5
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_fused_stack_stays_out_where_it_cannot_run(kinds, monkeypatch):
    """A dense target, an fp32 one and a quantized KV store take the layers one by one (same results as before)."""
    calls = []
    monkeypatch.setattr(fused_stack, "run", lambda *a: calls.append(_RUN(*a)) or calls[-1])
    model = kinds[0].model
    with torch.inference_mode():
        for m, kv_type in ((copy.deepcopy(model).bfloat16(), None), (as_shipped(model, torch.float32), None),
                           (as_shipped(model), "int8")):
            m(torch.arange(3, 9)[None], torch.arange(6)[None], m.new_kv(16, kv_type))
    assert calls == [None, None, None]
