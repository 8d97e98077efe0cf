"""The weight-format seam (`specloom.loading.formats`) and the per-family records (`specloom.models.family`)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from specloom.config import ModelConfig
from specloom.errors import SpecloomError
from specloom.loading import formats, load_target
from specloom.loading.formats import apply_kernels, dense_kernel, format_for, format_names, split_tensor_name
from specloom.loading.gguf_file import GGUFTensor, _gguf_config, gguf_raw_tensors
from specloom.loading.weights import build_model, load_state_dict
from specloom.models import FAMILIES, FAMILY_SPECS, cpu_packing
from specloom.models.family import FamilySpec, register_family_spec, spec_for_gguf_arch, spec_for_model_type


class FakePacked(nn.Module):
    """Stands in for `PackedLinear` where this CPU's oneDNN has no bf16 (it cannot build the real one)."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)


@pytest.fixture
def onednn(monkeypatch):
    """onednn(supported): pretend this CPU's oneDNN does / does not run bf16."""

    def set_(supported: bool):
        monkeypatch.setattr(cpu_packing, "onednn_bf16_supported", lambda: supported)
        if supported and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            monkeypatch.setattr(cpu_packing, "PackedLinear", FakePacked)
        return cpu_packing.PackedLinear

    return set_


def test_registry_lists_dense_and_gguf():
    # the quantized formats (narrower layouts) are tried before dense
    assert format_names() == ["fp8", "mxfp4", "nvfp4", "dense", "gguf"]
    for name in format_names():
        fmt = formats.FORMATS[name]
        assert isinstance(fmt, formats.WeightFormat) and fmt.name == name and fmt.description


def test_split_tensor_name():
    assert split_tensor_name("layers.0.mlp.up_proj.weight") == ("layers.0.mlp.up_proj", "weight")
    assert split_tensor_name("layers.0.self_attn.q_proj.weight_scale_inv") == ("layers.0.self_attn.q_proj",
                                                                               "weight_scale_inv")
    assert split_tensor_name("layers.0.mlp.up_proj.weight.absmax") == ("layers.0.mlp.up_proj", "weight.absmax")
    assert split_tensor_name("norm.weight") == ("norm", "weight")


def test_dense_matches_float_weights_only():
    w, b = torch.zeros(4, 8), torch.zeros(4)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert format_for("m", {"weight": w.to(dt), "bias": b.to(dt)}).name == "dense"
    out = format_for("m", {"weight": w.bfloat16()}).load("m", {"weight": w.bfloat16()}, torch.float32, "cpu")
    assert out["weight"].dtype == torch.float32


def test_unknown_layout_names_module_tensors_and_formats():
    # fp8 weight with a block scale of the wrong shape ([1, 1] would be right for 4 x 8): read by no format
    tensors = {"weight": torch.zeros(4, 8, dtype=torch.float8_e4m3fn), "weight_scale_inv": torch.ones(2, 2)}
    with pytest.raises(SpecloomError) as e:
        format_for("layers.3.self_attn.q_proj", tensors, {"quant_method": "fp8"})
    msg = str(e.value)
    assert msg.count("\n") == 0
    for needle in ("'layers.3.self_attn.q_proj'", "weight: float8_e4m3fn[4, 8]", "weight_scale_inv: float32",
                   "'fp8'", "dense:", "gguf:"):
        assert needle in msg, msg
    # an integer tensor, and a stray tensor next to a dense weight, fit nothing either
    with pytest.raises(SpecloomError, match=r"'m'.*weight: int8"):
        format_for("m", {"weight": torch.zeros(2, 2, dtype=torch.int8)})
    with pytest.raises(SpecloomError, match=r"qzeros: int32"):
        format_for("m", {"weight": torch.zeros(2, 2), "qzeros": torch.zeros(2, dtype=torch.int32)})


def test_unknown_layout_in_a_checkpoint(tiny, tmp_path):
    """A HF checkpoint with one module stored in a layout no format reads: one error naming that module."""
    from safetensors.torch import load_file, save_file

    src = tiny("llama").path
    path = tmp_path / "odd"
    shutil.copytree(src, path)
    sd = load_file(str(path / "model.safetensors"))
    w = sd.pop("model.layers.1.mlp.down_proj.weight")
    sd["model.layers.1.mlp.down_proj.weight"] = w.to(torch.float8_e4m3fn)
    sd["model.layers.1.mlp.down_proj.weight_scale"] = torch.ones(())
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpecloomError, match=r"'layers\.1\.mlp\.down_proj'.*float8_e4m3fn.*weight_scale: float32"):
        load_target(str(path), "fp32", progress=False)


def test_kernel_choice(onednn):
    fp32 = nn.Linear(8, 4)
    bf16 = nn.Linear(8, 4).to(torch.bfloat16)
    packed_cls = onednn(True)
    assert isinstance(dense_kernel(bf16, torch.device("cpu")), packed_cls)
    assert isinstance(dense_kernel(bf16), packed_cls)  # default: where the weight is
    assert dense_kernel(fp32, torch.device("cpu")) is fp32  # fp32 packing rounds differently: never
    fp16 = nn.Linear(8, 4).half()
    assert dense_kernel(fp16, "cpu") is fp16
    for dev in (torch.device("cuda"), torch.device("cuda", 0), "cuda", torch.device("meta")):
        assert dense_kernel(bf16, dev) is bf16  # CUDA never gets oneDNN packing
        assert formats.FORMATS["gguf"].kernel(bf16, dev) is bf16
    onednn(False)
    assert dense_kernel(bf16, torch.device("cpu")) is bf16


def test_kernel_choice_with_real_onednn():
    bf16 = nn.Linear(8, 4).to(torch.bfloat16)
    kernel = dense_kernel(bf16, "cpu")
    if cpu_packing.onednn_bf16_supported():
        assert isinstance(kernel, cpu_packing.PackedLinear)
        x = torch.randn(3, 8).bfloat16()
        assert torch.equal(kernel(x), bf16(x))
    else:
        assert kernel is bf16


def test_apply_kernels_follows_the_plan(onednn, monkeypatch):
    packed_cls = onednn(True)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4))).to(torch.bfloat16)

    class Keep:  # a format whose kernel keeps the dense module
        name, description = "keep", "test"

        def matches(self, module, tensors, quant_config):
            return False

        def load(self, module, tensors, dtype, device):
            raise AssertionError

        def kernel(self, linear, device):
            return linear

    monkeypatch.setattr(formats, "FORMATS", dict(formats.FORMATS))
    formats.register_format(Keep(), before="dense")
    assert format_names().index("keep") == format_names().index("dense") - 1
    assert apply_kernels(model, {"0": "gguf", "1": "keep"}) == 2
    assert isinstance(model[0], packed_cls) and type(model[1]) is nn.Linear and isinstance(model[2][0], packed_cls)
    with pytest.raises(SpecloomError, match="unknown weight format 'nope'"):
        apply_kernels(nn.Sequential(nn.Linear(2, 2)), {"0": "nope"})
    # the drafters' `pack_linears` goes through the same choice; nothing on a CUDA-typed device
    m = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    assert cpu_packing.pack_linears(m) == 1 and isinstance(m[0], packed_cls)
    m = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    assert apply_kernels(m, device=torch.device("cuda")) == 0


@pytest.mark.parametrize("family", ["llama", "llama3", "gemma3"])
def test_tiny_loading_through_formats(tiny, family):
    """The state dict loaded through the registry is HF's, fused and folded; every linear is `dense`."""
    from specloom.loading import _hf_dir_tensors

    t = tiny(family)
    config = t.model.config
    state, plan = load_state_dict(config, _hf_dir_tensors(t.path), torch.float32)
    ref = {k.removeprefix("model."): v for k, v in t.hf.state_dict().items()}
    offset = config.family_spec.norm_weight_offset
    assert offset == (1.0 if family == "gemma3" else 0.0)
    assert torch.equal(state["layers.0.self_attn.qkv_proj.weight"],
                       torch.cat([ref[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(state["norm.weight"], ref["norm.weight"] + offset)
    for k, v in t.model.state_dict().items():
        assert torch.equal(state.get(k, v), v), k
    linears = [n for n, m in t.model.named_modules() if isinstance(m, (nn.Linear, cpu_packing.PackedLinear))]
    assert linears and all(plan[n] == "dense" for n in linears), plan
    # bf16: a folded norm is rounded once, from the checkpoint's fp32 value
    state16, _ = load_state_dict(config, _hf_dir_tensors(t.path), torch.bfloat16)
    assert torch.equal(state16["norm.weight"], (ref["norm.weight"].float() + offset).bfloat16())
    assert state16["layers.0.mlp.gate_up_proj.weight"].dtype == torch.bfloat16


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_blocks(w, name: str, arr: np.ndarray, type_name: str) -> None:
    """`arr` as a GGUF tensor of GGML type `type_name` (F32 as it is; IQ4_NL, which the gguf package cannot
    quantize, as random codes with a sane scale)."""
    import gguf

    if type_name == "F32":
        w.add_tensor(name, arr)
        return
    if type_name == "IQ4_NL":
        raw = np.random.default_rng(0).integers(0, 256, (arr.shape[0], arr.shape[1] // 32, 18), dtype=np.uint8)
        raw[:, :, :2] = np.full((arr.shape[0], arr.shape[1] // 32, 1), 0.01, np.float16).view(np.uint8)
        q = raw.reshape(arr.shape[0], -1)
    else:
        q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType[type_name])
    w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[type_name])


def _write_llama_gguf(hf, path: str, odd_down_proj=None, types: dict | None = None, tied: bool = False) -> None:
    """A Llama GGUF of `hf`'s weights: F32 with layer 0's down projection Q8_0, or every tensor named in
    `types` (GGUF short name -> GGML type, `token_embd` included) in that type; `tied`: no output.weight."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_context_length(c.max_position_embeddings)
    w.add_vocab_size(c.vocab_size)
    sd = {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    types = types or {}
    _add_blocks(w, "token_embd.weight", sd["model.embed_tokens.weight"], types.get("token_embd", "F32"))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf_name, g in names.items():
            arr = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g == "attn_q":
                arr = _llama_permute(arr, c.num_attention_heads)
            elif g == "attn_k":
                arr = _llama_permute(arr, c.num_key_value_heads)
            if g == "ffn_down" and i == 0 and not types:
                if odd_down_proj is not None:
                    w.add_tensor(f"blk.{i}.{g}.weight", odd_down_proj(arr))
                else:
                    _add_blocks(w, f"blk.{i}.{g}.weight", arr, "Q8_0")
                continue
            _add_blocks(w, f"blk.{i}.{g}.weight", arr, types.get(g, "F32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loading_through_formats(tiny, tmp_path):
    """A Llama GGUF (F32 + one Q8_0 tensor): the `gguf` format dequantizes, the family record's q/k permutation
    is undone, and the model matches HF's (exactly where F32, to Q8_0's precision for the quantized tensor)."""
    import gguf

    t = tiny("llama")
    path = str(tmp_path / "tiny-llama.gguf")
    _write_llama_gguf(t.hf, path)
    cfg = _gguf_config(path)
    config = ModelConfig.from_hf(cfg)
    assert config.family == "llama" and not config.tie_word_embeddings
    state, plan = load_state_dict(config, gguf_raw_tensors(path, cfg), torch.float32)
    ref = {k.removeprefix("model."): v for k, v in t.hf.state_dict().items()}
    assert torch.equal(state["layers.1.self_attn.qkv_proj.weight"],
                       torch.cat([ref[f"layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]))
    q8 = gguf.quants.dequantize(gguf.quants.quantize(ref["layers.0.mlp.down_proj.weight"].numpy(),
                                                     gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(state["layers.0.mlp.down_proj.weight"], torch.from_numpy(q8))
    model = build_model(config, state)
    assert all(plan[n] == "gguf" for n, m in model.named_modules() if isinstance(m, nn.Linear))
    ids = torch.arange(4, 24)[None]
    with torch.inference_mode():
        ours = model(ids, torch.arange(20)[None], model.new_kv(24)).logits
        ref_logits = t.hf(ids).logits
    assert (ours - ref_logits).abs().max() < 0.05


def test_gguf_tensor_of_unsupported_type(tiny, tmp_path):
    t = tiny("llama")
    path = str(tmp_path / "int8.gguf")
    _write_llama_gguf(t.hf, path, odd_down_proj=lambda a: np.round(a * 100).astype(np.int8))
    cfg = _gguf_config(path)
    with pytest.raises(SpecloomError, match=r"'layers\.0\.mlp\.down_proj'.*weight: GGUF I8.*known formats"):
        load_state_dict(ModelConfig.from_hf(cfg), gguf_raw_tensors(path, cfg), torch.float32)
    fake = GGUFTensor("blk.0.ffn_down.weight", type("T", (), {"tensor_type": gguf_type("Q8_K")})())
    with pytest.raises(SpecloomError, match="GGUF Q8_K"):
        format_for("layers.0.mlp.down_proj", {"weight": fake})


def gguf_type(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


# -- family records -------------------------------------------------------------------------------------------------

def test_family_records():
    assert set(FAMILY_SPECS) == set(FAMILIES) == {"llama", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral"}
    for spec in FAMILY_SPECS.values():
        assert FAMILIES[spec.name] is spec.model_cls
    assert spec_for_model_type("qwen2").name == "llama" and spec_for_model_type("gemma3_text").name == "gemma3"
    assert spec_for_model_type("mamba") is None
    assert spec_for_gguf_arch("gemma3").gguf_archs["gemma3"] == "gemma3_text"
    assert spec_for_gguf_arch("llama").gguf_permuted_qk_archs == {"llama"}
    gemma = FAMILY_SPECS["gemma3"]
    assert gemma.norm_weight_offset == 1.0 and gemma.tie_word_embeddings and gemma.sliding_layers
    assert gemma.embedding_scale(64) == 8.0 and FAMILY_SPECS["llama"].embedding_scale(64) == 1.0
    with pytest.raises(ValueError, match="already belong to family 'llama'"):
        register_family_spec(FamilySpec(name="other", model_cls=object, model_types=("qwen3",)))


def test_config_reads_the_record(monkeypatch):
    """A new family is one record: from_hf applies its defaults and rules with no code naming it."""
    cls = FAMILIES["llama"]
    spec = FamilySpec(name="toy", model_cls=cls, model_types=("toy",), tie_word_embeddings=True,
                      embedding_scale=lambda h: 2.0, qk_norm_model_types=frozenset({"toy"}), sliding_layers=True,
                      default_sliding_window_pattern=2, default_rope_local_theta=123.0, norm_weight_offset=1.0)
    monkeypatch.setitem(FAMILY_SPECS, "toy", spec)
    cfg = ModelConfig.from_hf({"model_type": "toy", "hidden_size": 8, "num_attention_heads": 2,
                               "num_hidden_layers": 4, "intermediate_size": 16, "vocab_size": 32,
                               "sliding_window": 4})
    assert cfg.family == "toy" and cfg.family_spec is spec
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.embedding_scale == 2.0
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.rope_local_theta == 123.0
    with pytest.raises(SpecloomError, match="unsupported architecture 'mamba'.*gemma3.*toy"):
        ModelConfig.from_hf({"model_type": "mamba"})
    llama = ModelConfig.from_hf({"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2,
                                 "num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 32})
    assert llama.attention_bias and not llama.o_proj_bias and not llama.qk_norm and llama.rope_local_theta is None
    with pytest.raises(SpecloomError, match="sliding-window attention is not supported for 'qwen2'"):
        ModelConfig.from_hf({"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2,
                             "num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 32,
                             "use_sliding_window": True, "sliding_window": 4})


def test_no_family_name_branches_left():
    import specloom.config
    import specloom.loading.gguf_file
    import specloom.loading.weights

    for mod in (specloom.config, specloom.loading.weights, specloom.loading.gguf_file):
        with open(mod.__file__) as f:
            src = f.read()
        for needle in ('== "gemma3"', '== "llama"', "== 'gemma3'", '== "qwen2"', 'arch == "'):
            assert needle not in src, f"{os.path.basename(mod.__file__)} branches on a family name: {needle}"
