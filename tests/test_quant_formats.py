"""Quantized weight formats decided per module (issue 15, item 1): the E2M1 / E8M0 / E4M3 tables, FP8 / MXFP4 /
NVFP4 dequantisation against references written here in plain Python/numpy on known bytes, per-module detection
from tensors plus config (exclude patterns, MIXED_PRECISION), a mixed checkpoint that loads exactly like the dense
model made of the same dequantised weights (dequantised at load and held quantized), and every bad input."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specloom.errors import SpecloomError
from specloom.loading import load_target
from specloom.loading.formats import FORMATS, format_for
from specloom.loading.lowbit import e2m1_unpack, e4m3_decode, e8m0_decode
from specloom.loading.mxfp4 import dequantize_experts
from specloom.loading.quant_base import QuantLinear
from specloom.loading.quant_config import read_quant_config

# -- independent references: hand tables and loops over bytes ---------------------------------------------------

FP4_HAND = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # E2M1 magnitudes of codes 0..7


def ref_fp4(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * FP4_HAND[code & 7]


def ref_e4m3(b: int) -> float:
    b = int(b)
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 0xF and m == 7:
        return math.nan
    if e == 0:
        return sign * (m / 8) * 2.0 ** -6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def ref_unpack(packed: np.ndarray) -> np.ndarray:
    """[N, M] bytes -> [N, 2M] float64: element 2j from the low nibble of byte j, 2j+1 from its high nibble."""
    n, m = packed.shape
    out = np.zeros((n, 2 * m))
    for i in range(n):
        for j in range(m):
            out[i, 2 * j] = ref_fp4(int(packed[i, j]) & 0xF)
            out[i, 2 * j + 1] = ref_fp4(int(packed[i, j]) >> 4)
    return out


def ref_nvfp4(w: np.ndarray, s: np.ndarray, s2: float, group: int = 16) -> np.ndarray:
    v = ref_unpack(w)
    scale = np.vectorize(ref_e4m3)(s)
    for j in range(v.shape[1]):
        v[:, j] *= scale[:, j // group] * s2
    return v.astype(np.float32)


def ref_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n, g, _ = blocks.shape
    v = ref_unpack(blocks.reshape(n, g * 16))
    for j in range(v.shape[1]):
        v[:, j] *= 2.0 ** (scales[:, j // 32].astype(np.float64) - 127)
    return v.astype(np.float32)


def ref_fp8(w: np.ndarray, scale: np.ndarray, block=(128, 128)) -> np.ndarray:
    """w: [N, K] e4m3 bytes; scale: a scalar, [N, 1] or per-block [ceil(N/bn), ceil(K/bk)]."""
    v = np.vectorize(ref_e4m3)(w)
    n, k = v.shape
    for i in range(n):
        for j in range(k):
            if scale.size == 1:
                s = scale.reshape(-1)[0]
            elif scale.shape == (n, 1):
                s = scale[i, 0]
            else:
                s = scale[i // block[0], j // block[1]]
            v[i, j] *= float(s)
    return v.astype(np.float32)


# -- random known bytes -------------------------------------------------------------------------------------------

def rng(seed=0):
    return np.random.default_rng(seed)


def nvfp4_tensors(n, k, r, group=16):
    w = r.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s = r.integers(0x30, 0x41, (n, k // group), dtype=np.uint8)  # E4M3 0.5 .. 2.25
    s2 = np.float32(r.uniform(0.01, 0.03))
    t = {"weight": torch.from_numpy(w), "weight_scale": torch.from_numpy(s).view(torch.float8_e4m3fn),
         "weight_scale_2": torch.tensor(s2), "input_scale": torch.tensor(0.5)}
    return t, ref_nvfp4(w, s, float(s2), group)


def mxfp4_tensors(n, k, r):
    blocks = r.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    scales = r.integers(118, 123, (n, k // 32), dtype=np.uint8)
    t = {"weight_blocks": torch.from_numpy(blocks), "weight_scales": torch.from_numpy(scales)}
    return t, ref_mxfp4(blocks, scales)


def fp8_bytes(n, k, r):
    # sign, exponent field 4..9 (values 2^-3 .. 2^2 with mantissa), any mantissa: no NaN
    return (r.integers(0, 2, (n, k)) * 0x80 + r.integers(4, 10, (n, k)) * 8 + r.integers(0, 8, (n, k))).astype(np.uint8)


def fp8_tensors(n, k, r, kind="block", name="weight_scale_inv"):
    w = fp8_bytes(n, k, r)
    shape = {"tensor": (), "channel": (n, 1), "block": (-(-n // 128), -(-k // 128))}[kind]
    s = r.uniform(0.01, 0.05, shape).astype(np.float32)
    t = {"weight": torch.from_numpy(w).view(torch.float8_e4m3fn), name: torch.from_numpy(np.array(s))}
    return t, ref_fp8(w, np.array(s))


# -- tables -------------------------------------------------------------------------------------------------------

def test_e2m1_table_and_nibble_order():
    got = e2m1_unpack(torch.arange(256, dtype=torch.uint8)[None]).reshape(256, 2)
    for b in range(256):
        assert got[b, 0].item() == ref_fp4(b & 0xF) and got[b, 1].item() == ref_fp4(b >> 4)
    # by hand: 0x21 -> first 0.5 (code 1), second 1.0 (code 2); 0xF7 -> 6, -6; 0x8A -> -1, -0
    assert e2m1_unpack(torch.tensor([0x21, 0xF7, 0x8A], dtype=torch.uint8)).tolist() == [0.5, 1.0, 6.0, -6.0,
                                                                                           -1.0, -0.0]
    assert math.copysign(1, e2m1_unpack(torch.tensor([0x08], dtype=torch.uint8))[0].item()) == -1  # -0


def test_e8m0_table():
    got = e8m0_decode(torch.tensor([127, 128, 126, 0, 254, 255, 120], dtype=torch.uint8)).tolist()
    assert got[:5] == [1.0, 2.0, 0.5, 2.0 ** -127, 2.0 ** 127] and math.isnan(got[5]) and got[6] == 1 / 128
    assert e8m0_decode(torch.tensor([130], dtype=torch.uint8).view(torch.float8_e8m0fnu)).item() == 8.0


def test_e4m3_table():
    got = e4m3_decode(torch.arange(256, dtype=torch.uint8)).tolist()
    for b in range(256):
        want = ref_e4m3(b)
        assert (math.isnan(got[b]) and math.isnan(want)) or got[b] == want, b
    # by hand: 0x38 = 1.0, 0x7E = 448 (the max), 0x08 = 2^-6 (smallest normal), 0x01 = 2^-9, 0xC0 = -2
    assert [got[0x38], got[0x7E], got[0x08], got[0x01], got[0xC0]] == [1.0, 448.0, 2.0 ** -6, 2.0 ** -9, -2.0]


# -- dequantisation against the references ------------------------------------------------------------------------

def _load(name, tensors, qc=None):
    fmt = format_for("m", tensors, qc)
    assert fmt.name == name
    return fmt.load("m", tensors, torch.float32, "cpu", quant_config=qc)["weight"]


def test_nvfp4_dequant():
    t, ref = nvfp4_tensors(6, 64, rng(1))
    assert torch.equal(_load("nvfp4", t, {"quant_method": "modelopt", "quant_algo": "NVFP4"}), torch.from_numpy(ref))


def test_mxfp4_dense_and_deepseek_and_experts():
    r = rng(2)
    t, ref = mxfp4_tensors(5, 96, r)
    qc = {"quant_method": "mxfp4"}
    assert torch.equal(_load("mxfp4", t, qc), torch.from_numpy(ref))
    # DeepSeek-V4: int8 [N, K/2] + E8M0 `scale` [N, K/32]: the same bytes, the same values
    ds = {"weight": t["weight_blocks"].reshape(5, 48).view(torch.int8),
          "scale": t["weight_scales"].view(torch.float8_e8m0fnu)}
    assert torch.equal(_load("mxfp4", ds, qc), torch.from_numpy(ref))
    # gpt-oss fused experts [E, N, K/32, 16]: per expert the dense reference
    blocks = r.integers(0, 256, (3, 4, 2, 16), dtype=np.uint8)
    scales = r.integers(118, 123, (3, 4, 2), dtype=np.uint8)
    got = dequantize_experts(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert got.shape == (3, 4, 64)
    for e in range(3):
        assert torch.equal(got[e], torch.from_numpy(ref_mxfp4(blocks[e], scales[e])))
    with pytest.raises(SpecloomError, match="gate_up_proj_scales is uint8"):
        dequantize_experts(torch.from_numpy(blocks), torch.from_numpy(scales[:, :2]), "gate_up_proj")


@pytest.mark.parametrize("kind,name", [("tensor", "weight_scale"), ("channel", "weight_scale"),
                                       ("block", "weight_scale"), ("block", "weight_scale_inv")])
def test_fp8_dequant(kind, name):
    n, k = (200, 300) if kind == "block" else (6, 40)  # blocks: N and K not multiples of 128 (partial blocks)
    t, ref = fp8_tensors(n, k, rng(3), kind, name)
    assert torch.equal(_load("fp8", t, {"quant_method": "fp8", "weight_block_size": [128, 128]}),
                       torch.from_numpy(ref))


def test_held_quantized_module_equals_dequantised_at_load():
    r = rng(4)
    for t, qc in ((nvfp4_tensors(8, 32, r)[0], {"quant_method": "modelopt", "quant_algo": "NVFP4"}),
                  (mxfp4_tensors(8, 64, r)[0], {"quant_method": "mxfp4"}),
                  (fp8_tensors(130, 140, r)[0], {"quant_method": "fp8"})):
        fmt = format_for("m", t, qc)
        dense = fmt.load("m", t, torch.float32, quant_config=qc)["weight"]
        lin = fmt.load_quantized("m", t, torch.float32, quant_config=qc).module(torch.float32)
        x = torch.randn(3, dense.shape[1])
        assert torch.equal(lin(x), torch.nn.functional.linear(x, dense))


# -- per-module detection -----------------------------------------------------------------------------------------

def _qc(tmp_path, hf_quant=None, quantization_config=None, **raw):
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    if quantization_config is not None:
        raw["quantization_config"] = quantization_config
    return read_quant_config(raw, str(tmp_path))


def _err(module, tensors, qc) -> str:
    with pytest.raises(SpecloomError) as e:
        format_for(module, tensors, qc)
    msg = str(e.value)
    assert "\n" not in msg and repr(module) in msg, msg
    return msg


def test_detection_with_exclude_patterns(tmp_path):
    r = rng(5)
    nv, _ = nvfp4_tensors(4, 32, r)
    qc = _qc(tmp_path, {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "model.layers.1.mlp*"]}})
    assert format_for("model.layers.0.mlp.down_proj", nv, qc).name == "nvfp4"
    assert format_for("model.layers.1.mlp.down_proj", {"weight": torch.zeros(4, 32)}, qc).name == "dense"
    assert format_for("model.norm", {"weight": torch.ones(4)}, qc).name == "dense"
    msg = _err("model.layers.1.mlp.down_proj", nv, qc)
    assert "excludes it (pattern 'model.layers.1.mlp*')" in msg and "found nvfp4" in msg
    assert "nvfp4" in _err("lm_head", nv, qc)
    # compressed-tensors: `ignore` with a regular expression; FP8 blocks from `block_structure`
    f8, _ = fp8_tensors(4, 32, r, "block", "weight_scale")
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["re:.*mlp\\.gate$"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}}
    (tmp_path / "ct").mkdir()
    qc = _qc(tmp_path / "ct", quantization_config=ct)
    assert format_for("model.layers.0.mlp.up_proj", f8, qc).name == "fp8"
    assert "excludes it" in _err("model.layers.0.mlp.gate", f8, qc)


def test_detection_mixed_precision_per_module(tmp_path):
    r = rng(6)
    nv, mx = nvfp4_tensors(4, 32, r)[0], mxfp4_tensors(4, 64, r)[0]
    f8 = fp8_tensors(4, 32, r, "channel", "weight_scale")[0]
    qc = _qc(tmp_path, {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
        "model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
        "model.layers.0.mlp.up_proj": {"quant_algo": "MXFP4"}}}})
    assert format_for("model.layers.0.self_attn.q_proj", f8, qc).name == "fp8"
    assert format_for("model.layers.0.mlp.down_proj", nv, qc).name == "nvfp4"
    assert format_for("model.layers.0.mlp.up_proj", mx, qc).name == "mxfp4"
    assert format_for("model.layers.0.self_attn.k_proj", {"weight": torch.zeros(4, 32)}, qc).name == "dense"
    # config and tensors disagree: one message each, naming what the config said and what was found
    msg = _err("model.layers.0.mlp.down_proj", mx, qc)
    assert "lists it as NVFP4" in msg and "expected nvfp4" in msg and "found mxfp4" in msg and "weight_blocks" in msg
    assert "found dense" in _err("model.layers.0.self_attn.q_proj", {"weight": torch.zeros(4, 32)}, qc)
    assert "lists it in no quantized_layers entry" in _err("model.layers.0.self_attn.k_proj", f8, qc)


def test_detection_deepseek_fp8_with_mxfp4_experts(tmp_path):
    r = rng(7)
    f8, _ = fp8_tensors(200, 300, r)
    t, _ = mxfp4_tensors(4, 64, r)
    ds = {"weight": t["weight_blocks"].reshape(4, 32).view(torch.int8),
          "scale": t["weight_scales"].view(torch.float8_e8m0fnu)}
    qc = _qc(tmp_path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
             expert_dtype="fp4")
    assert format_for("layers.0.ffn.shared_experts.w1", f8, qc).name == "fp8"
    assert format_for("mtp.0.ffn.experts.3.w1", ds, qc).name == "mxfp4"
    assert "declares MXFP4" in _err("layers.0.ffn.experts.3.w1", f8, qc)


# -- bad input: one clear message each -----------------------------------------------------------------------------

def test_bad_inputs(tmp_path):
    r = rng(8)
    nv_qc = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    nv, _ = nvfp4_tensors(4, 32, r)
    msg = _err("layers.0.mlp.down_proj", {k: v for k, v in nv.items() if k != "weight_scale_2"}, nv_qc)
    assert "weight_scale_2 is missing" in msg
    msg = _err("layers.0.mlp.down_proj", {k: v for k, v in nv.items() if k != "weight_scale"}, nv_qc)
    assert "weight_scale is missing" in msg
    msg = _err("layers.0.mlp.down_proj", {**nv, "weight_scale": nv["weight_scale"][:, :1]}, nv_qc)
    assert "weight_scale has shape [4, 1] (expected [4, 2]" in msg
    f8, _ = fp8_tensors(4, 32, r, "channel", "weight_scale")
    assert "weight_scale (or DeepSeek's weight_scale_inv) is missing" in _err("q", {"weight": f8["weight"]},
                                                                             {"quant_method": "fp8"})
    assert "has shape [3, 1]" in _err("q", {**f8, "weight_scale": torch.ones(3, 1)}, {"quant_method": "fp8"})
    mx, _ = mxfp4_tensors(4, 64, r)
    assert "weight_scales has shape [4, 1]" in _err("e", {**mx, "weight_scales": mx["weight_scales"][:, :1]},
                                                    {"quant_method": "mxfp4"})
    # an unknown quant_algo / quant_method
    assert "unknown quant_algo 'INT3_FANCY'" in _err("m", nv, {"quant_method": "modelopt", "quant_algo": "INT3_FANCY"})
    with pytest.raises(SpecloomError, match="unknown quant_method 'bitsy'"):
        format_for("m", nv, {"quant_method": "bitsy"})
    # quantized tensors that no config declares (a drafter directory without its quantization config)
    msg = _err("layers.0.mlp.down_proj", nv, None)
    assert "are nvfp4 but the checkpoint's config declares no quantization" in msg


# -- a mixed checkpoint, end to end -------------------------------------------------------------------------------

MIXED = {  # module -> format; every other module stays dense
    "model.layers.0.self_attn.q_proj": "NVFP4", "model.layers.0.self_attn.k_proj": "NVFP4",
    "model.layers.0.self_attn.v_proj": "NVFP4", "model.layers.0.self_attn.o_proj": "NVFP4",
    "model.layers.0.mlp.gate_proj": "MXFP4", "model.layers.0.mlp.up_proj": "MXFP4",
    "model.layers.0.mlp.down_proj": "MXFP4", "model.layers.1.mlp.gate_proj": "FP8",
    "model.layers.1.mlp.up_proj": "FP8", "model.layers.2.mlp.down_proj": "NVFP4",
}


def _mixed_checkpoint(tiny, tmp_path):
    """The tiny Llama with the MIXED modules replaced by random known bytes (NVFP4 / MXFP4 / FP8 blocks), and the
    dense checkpoint made of the reference dequantisation of those bytes."""
    src = tiny("llama").path
    qdir, ddir = tmp_path / "mixed", tmp_path / "dense"
    shutil.copytree(src, qdir)
    shutil.copytree(src, ddir)
    sd = load_file(str(qdir / "model.safetensors"))
    dense = dict(sd)
    r = rng(9)
    for module, algo in MIXED.items():
        n, k = sd.pop(f"{module}.weight").shape
        t, ref = {"NVFP4": nvfp4_tensors, "MXFP4": mxfp4_tensors, "FP8": fp8_tensors}[algo](n, k, r)
        sd.update({f"{module}.{key}": v for key, v in t.items()})
        dense[f"{module}.weight"] = torch.from_numpy(ref)
    save_file(sd, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    hq = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "MIXED_PRECISION", "exclude_modules": ["lm_head", "model.layers.9.*"],
        "quantized_layers": {m: {"quant_algo": a} for m, a in MIXED.items()}}}
    (qdir / "hf_quant_config.json").write_text(json.dumps(hq))
    return qdir, ddir


def test_mixed_checkpoint_loads_exactly(tiny, tmp_path, capfd):
    qdir, ddir = _mixed_checkpoint(tiny, tmp_path)
    capfd.readouterr()
    ref, _ = load_target(str(ddir), "fp32", progress=False)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8]])
    pos = torch.arange(ids.shape[1])[None]
    want = ref(ids, pos, ref.new_kv(16)).logits
    for resident in ("dequantized", "quantized"):
        model, _ = load_target(str(qdir), "fp32", progress=False, weights_resident=resident)
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "'model.layers.9.*'" in err and "match no module" in err, err
        got = model(ids, pos, model.new_kv(16)).logits
        assert torch.equal(got, want), (resident, (got - want).abs().max())
        held = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        if resident == "quantized":
            assert held == {"layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj",
                            "layers.0.mlp.down_proj", "layers.1.mlp.gate_up_proj", "layers.2.mlp.down_proj"}
            assert model.layers[0].mlp.gate_up_proj.q_blocks.dtype == torch.uint8
        else:
            assert not held


def test_mixed_checkpoint_disagreeing_config_names_the_module(tiny, tmp_path):
    qdir, _ = _mixed_checkpoint(tiny, tmp_path)
    hq = json.loads((qdir / "hf_quant_config.json").read_text())
    hq["quantization"]["quantized_layers"]["model.layers.0.mlp.down_proj"] = {"quant_algo": "NVFP4"}
    (qdir / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(SpecloomError, match=r"'layers\.0\.mlp\.down_proj'.*lists it as NVFP4.*found mxfp4"):
        load_target(str(qdir), "fp32", progress=False)
    (qdir / "hf_quant_config.json").unlink()
    with pytest.raises(SpecloomError, match="declares no quantization"):
        load_target(str(qdir), "fp32", progress=False)


def test_drafter_directory_tensors(tmp_path):
    """A drafter's tensors go through the same per-module decision, with its own directory's declarations."""
    from specloom.loading.dequant import dense_tensors

    r = rng(10)
    nv, ref = nvfp4_tensors(4, 32, r)
    tensors = {f"layers.0.mlp.down_proj.{k}": v for k, v in nv.items()}
    tensors.update({"fc.weight": torch.ones(4, 8), "d2t": torch.arange(3)})
    with pytest.raises(SpecloomError) as e:
        dense_tensors(tensors, {}, str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(str(tmp_path)) and "'layers.0.mlp.down_proj'" in msg and "declares no quantization" in msg
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    out = dense_tensors(tensors, {}, str(tmp_path))
    assert set(out) == {"layers.0.mlp.down_proj.weight", "fc.weight", "d2t"}
    assert torch.equal(out["layers.0.mlp.down_proj.weight"], torch.from_numpy(ref)) and out["d2t"] is tensors["d2t"]
