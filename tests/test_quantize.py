"""`specloom quantize` (issue 15, items 3 and 4): round-to-nearest into FP8 / MXFP4 / NVFP4 checked on hand-computed
values; write -> load round trips where the loaded weights equal the writer's own reference dequantisation bit
for bit (target, built-in MTP / DSpark layers, a drafter directory); the files in their producers' layouts; the
seed's case on a tiny random model (NVFP4 target + MXFP4 built-in DSpark and MTP; FP8 target + bf16 EAGLE-3;
dense target + NVFP4 DFlash), each decoding exactly like plain decoding of the same quantized directory; bad input;
and the real SmolLM2-135M written as NVFP4 with an MXFP4 DSpark + MTP (marked `real`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

import specloom
from specloom import Engine, SpecloomError
from specloom.drafters.block.format import add_to_target_dir
from specloom.drafters.block.model import BlockDraftConfig, BlockDraftModel
from specloom.drafters.checkpoint import read_prefixed, save_drafter, specloom_meta
from specloom.drafters.eagle.model import EagleDraftModel, eagle_config_for, init_weights
from specloom.drafters.mtp.format import save_into_target
from specloom.drafters.mtp.model import MTPModel, init_mtp
from specloom.loading import load_target
from specloom.loading.formats import format_for
from specloom.quantize import WRITERS, quantize
from specloom.quantize.rtn import e2m1_round
from specloom.speculative import SpeculativeConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
N = 24
QC = {"fp8": {"quant_method": "fp8", "weight_block_size": [128, 128]}, "mxfp4": {"quant_method": "mxfp4"},
      "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}


# -- round to nearest, by hand ------------------------------------------------------------------------------------

def test_e2m1_round_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -0.3, 0.26, -6.0, 2.9])
    codes, vals = e2m1_round(x)
    assert vals.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -0.5, 0.5, -6.0, 3.0]
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 0, 9, 1, 15, 5]


def test_mxfp4_hand_block():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([1.0, -3.0, 0.3, 6.5])  # absmax 6.5: floor(log2) = 2, scale 2^(2-2) = 1 (byte 127)
    q, ref = WRITERS["mxfp4"].quantize(w)
    assert q["weight_scales"].tolist() == [[127]] and q["weight_blocks"].shape == (1, 1, 16)
    # codes 1.0 -> 2, -3 -> 8 + 5, 0.3 -> 0.5 (1), 6.5 -> 6 (7): bytes low nibble first
    assert q["weight_blocks"][0, 0, :2].tolist() == [2 | 13 << 4, 1 | 7 << 4]
    assert ref[0, :4].tolist() == [1.0, -3.0, 0.5, 6.0] and ref[0, 4:].abs().sum() == 0
    w2 = w * 2 ** -10  # the same block 2^-10 smaller: the scale byte alone moves
    q2, ref2 = WRITERS["mxfp4"].quantize(w2)
    assert q2["weight_scales"].tolist() == [[117]] and torch.equal(q2["weight_blocks"], q["weight_blocks"])
    assert torch.equal(ref2, ref * 2 ** -10)


def test_nvfp4_hand_block():
    w = torch.zeros(2, 16)
    w[0, :4] = torch.tensor([3.0, -0.25, 0.625, 1.0])  # block absmax 3: scale 3 / 6 / 2^-9 = 256 (E4M3 exact)
    w[1, :2] = torch.tensor([5.25, -1.75])  # global absmax 5.25: weight_scale_2 = 5.25 / (6 * 448) = 2^-9; scale 448
    q, ref = WRITERS["nvfp4"].quantize(w)
    assert q["weight_scale_2"].item() == 2.0 ** -9 and q["weight_scale_2"].dim() == 0
    assert q["weight_scale"].float().tolist() == [[256.0], [448.0]] and q["weight_scale"].dtype == torch.float8_e4m3fn
    assert q["weight"].dtype == torch.uint8 and q["weight"].shape == (2, 8)
    # row 0 / (256 * 2^-9) = 6, -0.5, 1.25 (a tie: to the even code, 1.0), 2; row 1 / 0.875 = 6, -2
    assert q["weight"][0, :2].tolist() == [7 | 9 << 4, 2 | 4 << 4] and q["weight"][1, 0].item() == 7 | 12 << 4
    assert q["input_scale"].item() == 1.0
    assert ref[0, :4].tolist() == [3.0, -0.25, 0.5, 1.0] and ref[1, :2].tolist() == [5.25, -1.75]


def test_fp8_hand_blocks():
    w = torch.zeros(130, 129)
    w[0, 0], w[129, 128], w[5, 1] = 448.0 * 3, -2.0, 3.0  # three blocks with absmax 1344, 2 (corner), 0 (others)
    q, ref = WRITERS["fp8"].quantize(w)
    s = q["weight_scale_inv"]
    assert s.shape == (2, 2) and s.dtype == torch.float32
    assert s[0].tolist() == [3.0, 1.0] and s[1, 0] == 1.0  # absmax / 448; an all-zero block gets 1
    assert s[1, 1] == torch.tensor(2.0) / 448
    assert q["weight"].dtype == torch.float8_e4m3fn and q["weight"][0, 0].float().item() == 448.0
    assert q["weight"][129, 128].float().item() == -448.0
    assert ref[0, 0] == 1344.0 and ref[5, 1] == 3.0 and ref[129, 128] == -448.0 * s[1, 1]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_writer_reference_is_what_the_loader_reads_and_is_nearest(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 320, generator=g) * torch.logspace(-3, 1, 320)  # columns of very different sizes
    q, ref = WRITERS[fmt].quantize(w)
    loaded = format_for("m", q, QC[fmt]).load("m", q, torch.float32, quant_config=QC[fmt])["weight"]
    assert torch.equal(loaded, ref)
    if fmt == "fp8":
        return
    # round to nearest: no other E2M1 value (times the same scale) lies closer to the weight
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    grid = torch.cat([grid, -grid])
    if fmt == "mxfp4":
        scale = torch.ldexp(torch.ones(q["weight_scales"].shape), q["weight_scales"].long() - 127).repeat_interleave(32, 1)
    else:
        scale = q["weight_scale"].float().repeat_interleave(16, 1) * q["weight_scale_2"]
    x, got = w / scale, ref / scale
    best = (x[..., None] - grid).abs().min(-1).values
    assert torch.all((x - got).abs() <= best + 1e-5 * x.abs().clamp(min=1))


# -- a tiny target: write, load, compare ---------------------------------------------------------------------------

def _hf_names(config) -> dict[str, list[str]]:
    """specloom linear -> the HF modules it is made of."""
    out = {}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        out[p + "self_attn.qkv_proj"] = [f"model.{p}self_attn.{x}_proj" for x in "qkv"]
        out[p + "self_attn.o_proj"] = [f"model.{p}self_attn.o_proj"]
        out[p + "mlp.gate_up_proj"] = [f"model.{p}mlp.gate_proj", f"model.{p}mlp.up_proj"]
        out[p + "mlp.down_proj"] = [f"model.{p}mlp.down_proj"]
    return out


def _tensors(path: str, file: str = "model.safetensors") -> dict:
    with safe_open(os.path.join(path, file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_tiny_round_trip(tiny, tmp_path, fmt, capfd):
    t = tiny("llama")
    out = str(tmp_path / fmt)
    capfd.readouterr()
    rep = quantize(t.path, fmt, out, exclude=["model.layers.1.mlp.*", "model.nothing.*"], keep_refs=True,
                   progress=False)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "'model.nothing.*'" in err and "left out of its config" in err, err
    model, _ = load_target(out, "fp32", progress=False)
    sd = model.state_dict()
    for name, parts in _hf_names(model.config).items():
        if name.startswith("layers.1.mlp."):
            assert not any(p in rep.quantized.formats for p in parts)
            continue
        want = torch.cat([rep.quantized.refs[p] for p in parts])
        assert torch.equal(sd[name + ".weight"], want), name
    src = _tensors(t.path)
    assert torch.equal(sd["embed_tokens.weight"], src["model.embed_tokens.weight"].to(torch.bfloat16).float())
    assert torch.equal(sd["layers.1.mlp.down_proj.weight"],
                       src["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16).float())
    # the producers' layouts
    ts, raw = _tensors(out), json.load(open(os.path.join(out, "config.json")))
    m = "model.layers.0.mlp.down_proj"
    qc = raw["quantization_config"]
    if fmt == "nvfp4":
        assert ts[m + ".weight"].dtype == torch.uint8 and ts[m + ".weight"].shape == (64, 64)
        assert ts[m + ".weight_scale"].dtype == torch.float8_e4m3fn and ts[m + ".weight_scale"].shape == (64, 8)
        assert ts[m + ".weight_scale_2"].shape == () and ts[m + ".input_scale"].dtype == torch.float32
        hq = json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]
        assert hq["quant_algo"] == "NVFP4" and hq["group_size"] == 16
        assert qc["quant_method"] == "modelopt" and hq["exclude_modules"] == ["model.layers.1.mlp.*", "lm_head"]
    elif fmt == "mxfp4":
        assert set(k for k in ts if k.startswith(m)) == {m + ".weight_blocks", m + ".weight_scales"}
        assert ts[m + ".weight_blocks"].shape == (64, 4, 16) and ts[m + ".weight_scales"].shape == (64, 4)
        assert qc == {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.1.mlp.*", "lm_head"]}
    else:
        assert ts[m + ".weight"].dtype == torch.float8_e4m3fn and ts[m + ".weight_scale_inv"].shape == (1, 1)
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert ts["model.embed_tokens.weight"].dtype == torch.bfloat16 and ts["lm_head.weight"].dtype == torch.bfloat16
    assert ts["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    # held quantized: the same logits
    held, _ = load_target(out, "fp32", progress=False, weights_resident="quantized")
    ids = torch.tensor([PROMPTS[1]])
    pos = torch.arange(ids.shape[1])[None]
    assert torch.equal(held(ids, pos, held.new_kv(16)).logits, model(ids, pos, model.new_kv(16)).logits)


# -- the seed's case on a tiny model ------------------------------------------------------------------------------

def _dspark(t, layers=2, seed=0) -> BlockDraftModel:
    c = t.model.config
    cfg = BlockDraftConfig(
        hidden_size=c.hidden_size, num_layers=layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, intermediate_size=96, vocab_size=c.vocab_size, block_size=4, mask_token_id=3,
        feature_ids=(1, 2, 3), target_hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, anchor_predicts=True, markov_rank=8, markov_head_type="vanilla",
        confidence_head=True)
    m = BlockDraftModel(cfg)
    init_weights(m, seed, std=0.3)
    m.attach_target(t.model)
    return m


@pytest.fixture(scope="module")
def with_builtin(tiny, tmp_path_factory):
    """The tiny Llama with a built-in DSpark (2 stages) and 1 MTP layer, dense fp32."""
    t = tiny("llama")
    d = str(tmp_path_factory.mktemp("builtin") / "target")
    shutil.copytree(t.path, d)
    mtp = MTPModel(t.model.config, 1)
    init_mtp(mtp, seed=0, std=0.3)
    save_into_target(mtp, d, specloom_meta("mtp", t.model, t.tokenizer, (3,)), dtype=torch.float32)
    ds = _dspark(t)
    add_to_target_dir(ds, d, specloom_meta("dspark", t.model, t.tokenizer, ds.config.feature_ids),
                      dtype=torch.float32)
    return t, d


def _plain(path, ids):
    model, tok = load_target(path, "fp32", progress=False)
    return Engine(model, tok).generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids


def _spec(path, spec, ids):
    e = specloom.load(path, spec, dtype="fp32", progress=False, speculation="fixed")
    got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
    assert got.num_draft_tokens > 0
    return e, got.token_ids


def test_nvfp4_target_with_mxfp4_builtin_dspark_and_mtp(with_builtin, tmp_path):
    t, src = with_builtin
    out = str(tmp_path / "nvfp4")
    rep = quantize(src, "nvfp4", out, with_drafters="dspark,mtp", drafter_format="mxfp4", keep_refs=True,
                   progress=False)
    raw = json.load(open(os.path.join(out, "config.json")))
    hq = json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]
    ql = hq["quantized_layers"]
    assert hq["quant_algo"] == "MIXED_PRECISION" and raw["quantization_config"]["quantized_layers"] == ql
    assert ql["model.layers.0.mlp.down_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert ql["mtp.0.self_attn.q_proj"] == {"quant_algo": "MXFP4"} and ql["mtp.0.main_proj"] == {"quant_algo": "MXFP4"}
    assert ql["model.layers.3.eh_proj"] == {"quant_algo": "MXFP4"}
    assert ql["model.layers.3.mlp.down_proj"] == {"quant_algo": "MXFP4"}
    assert "mtp.1.markov_head.markov_w2" not in ql  # heads stay dense
    assert raw["num_nextn_predict_layers"] == 1 and raw["dspark_block_size"] == 4 and raw["n_mtp_layers"] == 2
    assert raw["specloom_dspark"]["kind"] == "dspark" and raw["specloom_mtp"]["kind"] == "mtp"
    ds = _tensors(out, "model-dspark.safetensors")
    assert ds["mtp.0.self_attn.q_proj.weight_blocks"].dtype == torch.uint8 and "mtp.0.main_proj.weight_scales" in ds
    assert "model.layers.3.eh_proj.weight_blocks" in _tensors(out, "model-mtp.safetensors")
    assert "model.layers.0.mlp.down_proj.weight_scale_2" in _tensors(out)
    # the drafter loaders read them back as the writer dequantised them
    back = read_prefixed(out, ("mtp.", "model.layers.3."))
    for m in ("mtp.0.main_proj", "mtp.1.mlp.down_proj", "model.layers.3.eh_proj", "model.layers.3.self_attn.k_proj"):
        assert torch.equal(back[m + ".weight"], rep.quantized.refs[m]), m
    # exact decoding, both drafters, against plain decoding of the same directory
    for ids in PROMPTS:
        want = _plain(out, ids)
        e, got = _spec(out, {"method": "dspark"}, ids)
        assert got == want
        assert torch.equal(e.drafter.model.fc.weight, rep.quantized.refs["mtp.0.main_proj"])
        _, got = _spec(out, {"method": "mtp"}, ids)
        assert got == want


def test_same_format_drafters_and_dense_drafters(with_builtin, tmp_path):
    t, src = with_builtin
    out = str(tmp_path / "mx")
    quantize(src, "mxfp4", out, with_drafters=["dspark"], progress=False)  # one format: gpt-oss's config
    raw = json.load(open(os.path.join(out, "config.json")))
    assert raw["quantization_config"]["quant_method"] == "mxfp4" and "num_nextn_predict_layers" not in raw
    assert not os.path.isfile(os.path.join(out, "model-mtp.safetensors"))
    assert _spec(out, {"method": "dspark"}, PROMPTS[0])[1] == _plain(out, PROMPTS[0])
    out2 = str(tmp_path / "fp8_dense_drafter")
    quantize(src, "fp8", out2, with_drafters="mtp", drafter_format="bf16", progress=False)
    qc = json.load(open(os.path.join(out2, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "fp8" and "model.layers.3" in qc["modules_to_not_convert"]
    assert _tensors(out2, "model-mtp.safetensors")["model.layers.3.eh_proj.weight"].dtype == torch.bfloat16
    assert _spec(out2, {"method": "mtp"}, PROMPTS[1])[1] == _plain(out2, PROMPTS[1])


def test_fp8_target_with_bf16_eagle3_directory(tiny, tmp_path):
    t = tiny("llama")
    out = str(tmp_path / "fp8")
    quantize(t.path, "fp8", out, progress=False)
    L = t.model.config.num_layers
    cfg = eagle_config_for(t.model.config, True, (1, L // 2, L - 1), t.model.config.vocab_size)
    m = EagleDraftModel(cfg)
    init_weights(m, 0, std=0.3)
    e3 = str(tmp_path / "eagle3")
    save_drafter("eagle3", m, e3, specloom_meta("eagle3", t.model, t.tokenizer, (1, L // 2, L - 1)),
                 dtype=torch.bfloat16)
    for ids in PROMPTS:
        assert _spec(out, {"method": "eagle3", "model": e3}, ids)[1] == _plain(out, ids)


def test_dense_target_with_nvfp4_dflash_directory(tiny, tmp_path):
    t = tiny("llama")
    c = t.model.config
    cfg = BlockDraftConfig(
        hidden_size=c.hidden_size, num_layers=1, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, intermediate_size=96, vocab_size=c.vocab_size, block_size=5, mask_token_id=3,
        feature_ids=(1, 2, 3), target_hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta)
    m = BlockDraftModel(cfg)
    init_weights(m, 0, std=0.3)
    src, out = str(tmp_path / "dflash"), str(tmp_path / "dflash_nvfp4")
    save_drafter("dflash", m, src, specloom_meta("dflash", t.model, t.tokenizer, cfg.feature_ids),
                 dtype=torch.bfloat16)
    rep = quantize(src, "nvfp4", out, keep_refs=True, progress=False)  # a drafter directory: found by its config
    ts = _tensors(out)
    assert ts["fc.weight"].dtype == torch.uint8 and ts["layers.0.mlp.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert ts["norm.weight"].dtype == torch.bfloat16
    assert json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]["quant_algo"] == "NVFP4"
    raw = json.load(open(os.path.join(out, "config.json")))
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["quantization_config"]["quant_method"] == "modelopt"
    for ids in PROMPTS:
        e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "dflash", "model": out}),
                   speculation="fixed")
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=N,
                                                                      ignore_eos=True).token_ids
        assert torch.equal(e.drafter.model.fc.weight, rep.quantized.refs["fc"])
    # the quantized drafter without its declarations: one message naming the directory and the module
    os.remove(os.path.join(out, "hf_quant_config.json"))
    raw.pop("quantization_config")
    json.dump(raw, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(SpecloomError, match=r"dflash_nvfp4: module 'fc': .*declares no quantization"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "dflash", "model": out}))


# -- bad input ----------------------------------------------------------------------------------------------------

def test_bad_input(tiny, tmp_path, capsys):
    from specloom.cli import main

    t = tiny("llama")
    cases = [
        (["--format", "int3"], "unknown format 'int3' (choose fp8, mxfp4, nvfp4)"),
        (["--format", "nvfp4", "--drafter-format", "int2"], "--drafter-format: unknown format 'int2'"),
        (["--format", "nvfp4", "--with-drafters", "eagle3"], "'eagle3' is not a drafter a target checkpoint carries"),
        (["--format", "nvfp4", "--with-drafters", "mtp"], "--with-drafters mtp: the target checkpoint"),
        (["--format", "fp8", "--exclude", "*"], "nothing to quantize"),
    ]
    capsys.readouterr()
    for i, (extra, msg) in enumerate(cases):
        assert main(["quantize", t.path, "--out", str(tmp_path / f"o{i}"), *extra]) == 2
        lines = capsys.readouterr().err.splitlines()  # (after "specloom: quantizing ..." where it got that far)
        assert lines[-1].startswith("specloom: error: ") and msg in lines[-1], lines
        assert sum("error" in line for line in lines) == 1 and len(lines) <= 2, lines
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["quantize", t.path, "--format", "fp8", "--out", str(tmp_path / "full")]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert main(["quantize", t.path, "--format", "fp8", "--out", t.path]) == 2
    assert "is the source itself" in capsys.readouterr().err


# -- the real SmolLM2-135M ----------------------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.skipif(not os.environ.get("SPECLOOM_SLOW_TESTS"),
                    reason="~2-4 min and 1.7 GB: set SPECLOOM_SLOW_TESTS=1 (the tiny-model cases above run always)")
def test_smollm2_nvfp4_with_mxfp4_dspark_and_mtp(tmp_path):
    from specloom.loading import resolve

    try:
        resolve("smollm2-135m")
    except SpecloomError as e:
        pytest.skip(str(e))
    out = str(tmp_path / "smollm2_nvfp4")
    rep = quantize("smollm2-135m", "nvfp4", out, with_drafters="dspark,mtp", drafter_format="mxfp4", progress=False)
    assert {w.name for w in rep.quantized.formats.values()} == {"nvfp4", "mxfp4"}
    model, tok = load_target(out, "fp32", progress=False)
    ids = tok.encode("The capital of France is")
    want = Engine(model, tok).generate(prompt_token_ids=ids, max_tokens=32).token_ids
    for method in ("dspark", "mtp"):
        e = specloom.load(out, {"method": method}, dtype="fp32", progress=False, speculation="fixed")
        got = e.generate(prompt_token_ids=ids, max_tokens=32)
        assert got.token_ids == want and got.num_draft_tokens > 0, method
