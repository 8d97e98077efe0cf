"""KV cache types (kv_quant.py, `--kv-cache-dtype`, `kv_cache_dtype` in `--speculative-config`).

* quantize / dequantize of token-head vectors against an independent reference: int8 by numpy's fp32
  arithmetic, fp8 E4M3 / E5M2 by a code table decoded from the bit layout (sign, exponent, mantissa, subnormals)
  and a nearest-value search with ties to the even code; table entries checked against hand-computed values;
* bytes per token per type (scales included), a store's `nbytes`, and the serving memory plan counting the
  target's and the drafter's KV at their own types;
* every drafter kind at every KV type: greedy output identical to plain decoding at that same KV type (target
  and drafter KV of that type), alone and through the batch scheduler (ragged passes, rows coming and going);
* fp32 / bf16 named through the new option give the very logits of today's torch-dtype path;
* bad values: one clear message (CLI, API, --speculative-config).
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from specloom import Engine, SpecloomError
from specloom.drafters.checkpoint import specloom_meta
from specloom.drafters.mtp.format import save_into_target
from specloom.kv import KVCache, kv_bytes_per_token
from specloom.kv_quant import KV_TYPES, kv_dtype_arg, parse_kv_cache_dtype
from specloom.loading import load_target
from specloom.speculative import SpeculativeConfig
from test_block_drafters import make_block, save as save_block
from test_hidden_drafters import make_eagle, make_medusa
from test_mtp import random_mtp

QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8")
ALL_TYPES = ("fp32", "bf16", "fp16", *QUANTIZED)


# -- the reference: fp8 codes decoded from their bit layout -------------------------------------------------------

FP8_LAYOUT = {"fp8_e4m3": (4, 3, 7, True), "fp8_e5m2": (5, 2, 15, False)}  # exponent, mantissa bits, bias, "fn"


def fp8_table(name: str) -> np.ndarray:
    """Value of each of the 256 codes (NaN for NaN codes, +-inf for E5M2's infinities)."""
    e_bits, m_bits, bias, fn = FP8_LAYOUT[name]
    e_max, m_max = (1 << e_bits) - 1, (1 << m_bits) - 1
    out = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> m_bits) & e_max, code & m_max
        if fn and e == e_max and m == m_max:  # E4M3FN: S.1111.111 is the only NaN, no infinities
            out.append(math.nan)
        elif not fn and e == e_max:  # IEEE-like E5M2
            out.append(sign * math.inf if m == 0 else math.nan)
        elif e == 0:  # subnormal
            out.append(sign * m / (1 << m_bits) * 2.0 ** (1 - bias))
        else:
            out.append(sign * (1 + m / (1 << m_bits)) * 2.0 ** (e - bias))
    return np.array(out, dtype=np.float64)


@pytest.mark.parametrize("name,code,value", [
    ("fp8_e4m3", 0x7E, 448.0), ("fp8_e4m3", 0x08, 2.0 ** -6), ("fp8_e4m3", 0x01, 2.0 ** -9),
    ("fp8_e4m3", 0x38, 1.0), ("fp8_e4m3", 0xC4, -3.0), ("fp8_e4m3", 0x3B, 1.375),
    ("fp8_e5m2", 0x7B, 57344.0), ("fp8_e5m2", 0x04, 2.0 ** -14), ("fp8_e5m2", 0x01, 2.0 ** -16),
    ("fp8_e5m2", 0x3C, 1.0), ("fp8_e5m2", 0xC2, -3.0), ("fp8_e5m2", 0x3D, 1.25),
])
def test_fp8_table_against_hand_computed_values(name, code, value):
    assert fp8_table(name)[code] == value
    # and PyTorch's float8 types (which the store decodes through) agree with the table at that code
    t = KV_TYPES[name]
    assert torch.tensor([code], dtype=torch.uint8).view(t.dtype).float().item() == value


def ref_quantize(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """x (N, d) fp32 -> (codes (N, d) uint8/int8, scales (N,) fp32), one vector at a time."""
    qmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}[name]
    codes, scales = [], []
    table = fp8_table(name) if name != "int8" else None
    for vec in x.astype(np.float32):
        amax = np.float32(np.max(np.abs(vec)))
        scale = np.float32(amax / np.float32(qmax))
        y = vec / (scale if scale > 0 else np.float32(1.0))
        y = np.clip(y, -qmax, qmax).astype(np.float32)
        if table is None:
            codes.append(np.rint(y).astype(np.int8))  # round half to even
        else:
            row = []
            for v in y:
                cands = [c for c in range(256) if np.isfinite(table[c]) and bool(c & 0x80) == bool(np.signbit(v))]
                dist = [abs(table[c] - float(v)) for c in cands]
                best = min(dist)
                ties = [c for c, dd in zip(cands, dist) if dd == best]
                row.append(next((c for c in ties if c % 2 == 0), ties[0]))  # ties to the even code
            codes.append(np.array(row, dtype=np.uint8))
        scales.append(scale)
    return np.stack(codes), np.array(scales, dtype=np.float32)


def _vectors(d: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, d, generator=g) * torch.logspace(-3, 3, 40)[:, None]  # scales from 1e-3 to 1e3
    x[3] = 0.0  # a zero vector: scale 0, codes 0
    x[4] = torch.tensor([2.0 ** -k for k in range(d)])  # exact powers of two
    x[5, :] = 1e-30  # (nearly) underflowing values
    x[5, 0] = 1.0
    x[6] = torch.linspace(-1, 1, d)
    return x


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantize_matches_reference(name):
    t = KV_TYPES[name]
    x = _vectors()
    codes, scale = t.quantize(x)
    ref_codes, ref_scale = ref_quantize(x.numpy(), name)
    assert codes.dtype == t.storage and scale.dtype == torch.float32
    assert np.array_equal(scale.numpy(), ref_scale)
    assert np.array_equal(codes.numpy(), ref_codes)
    # dequantise: code value x scale, in fp32
    back = t.dequantize(codes, scale)
    values = ref_codes.astype(np.float64) if name == "int8" else fp8_table(name)[ref_codes]
    assert np.array_equal(back.numpy(), (values.astype(np.float32) * ref_scale[:, None]).astype(np.float32))
    assert torch.equal(back[3], torch.zeros(16))  # the zero vector stays zero
    # the largest element of each vector comes back as itself (up to the scale's rounding)
    amax = x.abs().amax(-1)
    assert torch.allclose(back.abs().amax(-1), amax, rtol=1e-6)


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_store_holds_codes_and_scales(name):
    t = KV_TYPES[name]
    kv = KVCache(2, 2, 16, 8, name)
    assert kv.kv_type is t and kv.k.dtype == t.storage and kv.k_scale.shape == (2, 1, 2, 8)
    assert kv.dtype == t.dtype and kv.read_dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g)
    p = kv.open(3)
    p.set_positions(torch.arange(3)[None])
    keys, values = p.write(1, k, v)
    for got, x in ((keys, k), (values, v)):
        c, s = t.quantize(x)
        assert torch.equal(got, t.dequantize(c, s))
    kv.commit(path=[0, 2])  # a non-contiguous path: codes and scales move together
    keys, _ = kv.read(1, 0, 1, 2)
    c, s = t.quantize(k[:, :, [0, 2]])
    assert torch.equal(keys, t.dequantize(c, s))


# -- bytes ---------------------------------------------------------------------------------------------------------

BYTES = {"fp32": 4 * 16, "bf16": 2 * 16, "fp16": 2 * 16, "fp8_e4m3": 16 + 4, "fp8_e5m2": 16 + 4, "int8": 16 + 4}


@pytest.mark.parametrize("name", ALL_TYPES)
def test_bytes_per_token(name):
    L, H, d = 3, 2, 16
    assert kv_bytes_per_token(L, H, d, name) == 2 * L * H * BYTES[name]  # keys + values, per layer and head
    assert kv_bytes_per_token(L, H, d, KV_TYPES[name]) == 2 * L * H * BYTES[name]
    kv = KVCache(L, H, d, 10, name, batch=3)
    assert kv.nbytes == kv_bytes_per_token(L, H, d, name) * 10 * 3
    if name in ("fp32", "bf16"):  # the torch dtypes count as before
        assert kv_bytes_per_token(L, H, d, KV_TYPES[name].dtype) == 2 * L * H * BYTES[name]


def test_memory_plan_counts_target_and_drafter_kv_at_their_types(kinds):
    from specloom.scheduler import plan_memory
    from specloom.kv import TREE_SLACK

    t, _, specs = kinds
    c = t.model.config
    spec = {**specs["eagle3"], "kv_cache_dtype": "fp16"}
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(spec), max_model_len=256, kv_dtype="fp8_e4m3")
    row = 256 + TREE_SLACK
    plan = plan_memory(e, 8, None, e.kv_dtype)
    assert plan["target_kv_per_row"] == 2 * c.num_layers * c.num_kv_heads * (c.head_dim + 4) * row
    assert plan["drafter_kv_per_row"] == 2 * 1 * c.num_kv_heads * c.head_dim * 2 * row  # one EAGLE layer, fp16
    assert (plan["target_kv_dtype"], plan["drafter_kv_dtype"]) == ("fp8_e4m3", "float16")
    default = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(specs["eagle3"]), max_model_len=256)
    dplan = plan_memory(default, 8, None)
    assert dplan["target_kv_per_row"] == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * row  # fp32 on CPU
    assert dplan["drafter_kv_per_row"] == 2 * c.num_kv_heads * c.head_dim * 4 * row
    # a budget fits more rows at the smaller types
    budget = plan["target_weights"] + plan["drafter_weights"] + 3 * (
        dplan["target_kv_per_row"] + dplan["drafter_kv_per_row"] + dplan["activations_per_row"])
    assert plan_memory(default, 64, budget)["rows"] == 3
    assert plan_memory(e, 64, budget, e.kv_dtype)["rows"] > 3
    # the drafter's companion store really is of its type
    e.generate(prompt_token_ids=[5, 6, 7, 8, 9], max_tokens=4, ignore_eos=True)
    assert e._kv.kv_type.name == "fp8_e4m3"
    assert [s.kv_type.name for s in e._kv._companions.values()] == ["fp16"]


# -- every drafter kind, every KV type -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kinds(tiny, tmp_path_factory):
    t = tiny("llama")
    root = tmp_path_factory.mktemp("kv_type_drafters")
    mtp_dir = str(root / "target_with_mtp")
    shutil.copytree(t.path, mtp_dir)
    save_into_target(random_mtp(t, 2), mtp_dir, specloom_meta("mtp", t.model, t.tokenizer, (3,)),
                     dtype=torch.float32)
    mtp_target = load_target(mtp_dir, "fp32", progress=False)
    return t, mtp_target, {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix"},
        "self_draft": {"method": "draft_model", "model": t.path, "num_speculative_tokens": 3},
        "draft_model_tree": {"method": "draft_model", "model": tiny("qwen3").path, "num_speculative_tokens": 3,
                             "tree_width": 2},
        "eagle": {"method": "eagle", "model": make_eagle(t, str(root / "eagle"), False), "num_speculative_tokens": 3},
        "eagle_tree": {"method": "eagle", "model": make_eagle(t, str(root / "eagle_t"), False, seed=1),
                       "num_speculative_tokens": 4, "tree_width": 3, "num_draft_tokens": 9},
        "eagle3": {"method": "eagle3", "model": make_eagle(t, str(root / "eagle3"), True, draft_vocab=200),
                   "num_speculative_tokens": 3},
        "medusa": {"method": "medusa", "model": make_medusa(t, str(root / "medusa"))},
        "dflash": {"method": "dflash", "model": save_block(t, make_block(t, False, 5), "dflash", str(root / "df"))},
        "dspark": {"method": "dspark", "model": save_block(t, make_block(t, True, 4, "vanilla", confidence=True),
                                                          "dspark", str(root / "ds"))},
        "dflash2_tree": {"method": "dflash2", "model": save_block(t, make_block(t, False, 5, seed=3, dflash2=True),
                                                                 "dflash2", str(root / "df2")),
                         "tree_width": 3, "num_draft_tokens": 8},
        "mtp": {"method": "mtp", "num_speculative_tokens": 2},
        "mtp_tree": {"method": "mtp", "num_speculative_tokens": 3, "tree_width": 2, "num_draft_tokens": 6},
    }


KINDS = ("ngram", "suffix", "self_draft", "draft_model_tree", "eagle", "eagle_tree", "eagle3", "medusa", "dflash",
         "dspark", "mtp", "mtp_tree")
OWN_KV = {"self_draft", "draft_model_tree", "eagle", "eagle_tree", "eagle3", "dflash", "dspark", "mtp", "mtp_tree"}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [9, 200, 9, 200, 17]]
N = 25


def _engine(kinds, kind: str, kv: str, drafter_kv: str | None = None, **kw) -> tuple[Engine, object]:
    t, (mtp_model, mtp_tok), specs = kinds
    spec = dict(specs[kind])
    if kind in OWN_KV:
        spec["kv_cache_dtype"] = drafter_kv or kv
    model, tok = (mtp_model, mtp_tok) if kind.startswith("mtp") else (t.model, t.tokenizer)
    return Engine(model, tok, SpeculativeConfig.parse(spec), kv_dtype=kv, **kw), (model, tok)


_PLAIN: dict = {}


def _plain(model, tok, kv: str, prompts=PROMPTS, n=N) -> list[list[int]]:
    """Plain greedy decoding at KV type `kv` (computed once per model, type, prompts and length: the 72-case
    matrix below compares every drafter kind against the same 6 x 2 references)."""
    key = (id(model), kv, tuple(map(tuple, prompts)), n)
    if key not in _PLAIN:
        e = Engine(model, tok, kv_dtype=kv)
        # the model is kept with its outputs, so that its id is never reused by another model
        _PLAIN[key] = model, [e.generate(prompt_token_ids=p, max_tokens=n, ignore_eos=True).token_ids
                              for p in prompts]
    return _PLAIN[key][1]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv", ALL_TYPES)
def test_every_drafter_exact_at_every_kv_type(kinds, kv, kind):
    e, (model, tok) = _engine(kinds, kind, kv)
    want = _plain(model, tok, kv)
    got = [e.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True) for p in PROMPTS]
    assert [r.token_ids for r in got] == want
    assert e._kv.kv_type.name == kv
    if kind in OWN_KV:
        assert {s.kv_type.name for s in e._kv._companions.values()} == {kv}
    if kind != "suffix":  # (suffix drafts only from earlier repetitions)
        assert sum(r.num_draft_tokens for r in got) > 0
    if kind == "self_draft" and kv == "fp32":  # the target drafting for itself: everything accepted
        assert all(r.num_accepted_tokens == r.num_draft_tokens for r in got)


@pytest.mark.parametrize("kind,kv,drafter_kv", [("eagle3", "int8", "fp8_e5m2"), ("dspark", "fp8_e4m3", "bf16"),
                                                ("mtp_tree", "fp32", "int8"), ("self_draft", "bf16", "fp8_e4m3")])
def test_drafter_kv_type_separate_from_target(kinds, kind, kv, drafter_kv):
    e, (model, tok) = _engine(kinds, kind, kv, drafter_kv)
    got = [e.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids for p in PROMPTS]
    assert got == _plain(model, tok, kv)
    assert e._kv.kv_type.name == kv
    assert {s.kv_type.name for s in e._kv._companions.values()} == {drafter_kv}


@pytest.mark.parametrize("kind", ["self_draft", "eagle_tree", "dspark", "mtp"])
@pytest.mark.parametrize("kv", QUANTIZED)
def test_batched_quantized_identical_to_alone(kinds, kv, kind):
    """Through the batch scheduler: ragged passes (index_copy_ of codes and scales), rows moving into holes."""
    from test_batching import _prompts, run_batched

    e, (model, tok) = _engine(kinds, kind, kv, max_model_len=256)
    prompts = _prompts()
    got = run_batched(e, prompts, kv_dtype=e.kv_dtype)
    assert [r.token_ids for r in got] == _plain(model, tok, kv, prompts, n=23)


# -- fp32 / bf16 unchanged; quantized types close to fp32 ----------------------------------------------------------

def _logits(t, kv, ids) -> torch.Tensor:
    """Teacher-forced logits through decode steps of the KV store (prefill of 4, then one token per pass)."""
    store = t.model.new_kv(len(ids) + 1, kv)
    with torch.inference_mode():
        out = [t.model(torch.tensor([ids[:4]]), torch.arange(4)[None], store).logits[0]]
        store.commit()
        for i in range(4, len(ids)):
            out.append(t.model(torch.tensor([[ids[i]]]), torch.tensor([[i]]), store).logits[0])
            store.commit()
    return torch.cat(out)


def test_fp32_bf16_unchanged_and_quantized_close(tiny):
    t = tiny("llama")
    ids = list(range(5, 60, 2))
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ref = _logits(t, dt, ids)
        assert torch.equal(_logits(t, name, ids), ref) and torch.equal(_logits(t, KV_TYPES[name], ids), ref)
        assert torch.equal(_logits(t, kv_dtype_arg(name), ids), ref) and kv_dtype_arg(name) is dt
    ref = _logits(t, torch.float32, ids)
    err = {n: float((_logits(t, n, ids) - ref).abs().max()) for n in ("fp16", "int8", "fp8_e4m3", "fp8_e5m2")}
    assert 0 < err["fp16"] < err["int8"] < err["fp8_e4m3"] < err["fp8_e5m2"], err
    assert err["fp8_e5m2"] < 0.25 * float(ref.abs().max()), err


def test_gemma_sliding_window_quantized_exact(tiny):
    """Sliding-window layers read only their window of a quantized store; speculation stays exact there."""
    t = tiny("gemma3")
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    for kv in ("int8", "fp8_e4m3"):
        e = Engine(t.model, t.tokenizer, spec, kv_dtype=kv)
        got = [e.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids for p in PROMPTS]
        assert got == _plain(t.model, t.tokenizer, kv)


# -- bad values ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["fp4", "int4", "", 3, "float8"])
def test_bad_kv_cache_dtype_one_message(value):
    with pytest.raises(SpecloomError, match=r"--kv-cache-dtype must be one of auto, fp32, bf16, fp16, fp8_e4m3, "
                                            r"fp8_e5m2, int8, got"):
        parse_kv_cache_dtype(value)
    with pytest.raises(SpecloomError, match="kv_cache_dtype must be one of auto"):
        SpeculativeConfig.parse({"method": "eagle3", "kv_cache_dtype": value})


def test_kv_cache_dtype_names_and_aliases():
    assert parse_kv_cache_dtype("auto") is None and parse_kv_cache_dtype(None) is None
    assert parse_kv_cache_dtype("fp8").name == "fp8_e4m3" and parse_kv_cache_dtype("FP8_E5M2").name == "fp8_e5m2"
    assert parse_kv_cache_dtype("bfloat16").name == "bf16" and parse_kv_cache_dtype(torch.float16).name == "fp16"
    assert SpeculativeConfig.parse({"method": "eagle3", "kv_cache_dtype": "fp8"}).kv_cache_dtype == "fp8_e4m3"
    assert SpeculativeConfig.parse({"method": "eagle3", "kv_cache_dtype": "auto"}).kv_cache_dtype is None


@pytest.mark.parametrize("method", ["ngram", "medusa", "suffix"])
def test_kv_cache_dtype_refused_for_drafters_without_kv(method):
    with pytest.raises(SpecloomError, match=f"method '{method}' keeps no KV cache of its own.*dspark, eagle"):
        SpeculativeConfig.parse({"method": method, "kv_cache_dtype": "int8"})


def test_cli_kv_cache_dtype_option(capsys):
    from specloom.cli import build_parser, main

    p = build_parser()
    for cmd in (["generate", "m", "--prompt", "x"], ["bench", "m", "--prompts", "f"], ["serve", "m"],
                ["bench-serve", "m", "--prompts", "f"]):
        assert p.parse_args([*cmd, "--kv-cache-dtype", "int8"]).kv_dtype == "int8"
        assert p.parse_args([*cmd, "--kv-dtype", "fp8_e5m2"]).kv_dtype == "fp8_e5m2"  # the old name: an alias
        assert p.parse_args(cmd).kv_dtype == "auto"
    assert main(["generate", "no-such-model", "--prompt", "x", "--kv-cache-dtype", "fp4", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specloom: error: --kv-cache-dtype must be one of auto, fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, "
                   "int8, got 'fp4'"]
