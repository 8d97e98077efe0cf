"""Mixture-of-experts targets (models/moe.py, moe_config.py, the llama_moe.py families) against HF transformers on
tiny random Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral models written by `save_pretrained`: fp32 logits to
1e-4 for a prefill and for decode steps through the KV cache; the router variants (DeepSeek-V3 sigmoid scoring with
a selection bias, groups, scaling and shared experts) against HF's own MoE module; speculative decoding of every
drafter kind on an MoE target identical to plain greedy decoding, including MTP layers that are themselves MoE;
bad MoE config fields fail with one line naming the field."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

import specloom
from conftest import EOS, PAD, BOS, SEED, VOCAB, Tiny, hf_greedy, model_from_hf, randomize_, save_tiny_tokenizer
from specloom import Engine, SpecloomError
from specloom.config import ModelConfig
from specloom.loading import load_target
from specloom.models.layers import GatedMLP
from specloom.models.moe import SparseMoE
from specloom.speculative import SpeculativeConfig

TOL = 1e-4
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS,
              bos_token_id=BOS, num_hidden_layers=3, tie_word_embeddings=False)


def moe_hf_config(family: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), 0 and 2 sparse; renormalised top-k
        return Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen2_moe":  # every other layer sparse, shared expert with its sigmoid gate, raw top-k weights
        return Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                              shared_expert_intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "mixtral":
        return MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(family)


def make_moe(family: str, root: str) -> Tiny:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    hf = AutoModelForCausalLM.from_config(moe_hf_config(family), dtype=torch.float32)
    randomize_(hf, gemma=False)
    hf.eval().requires_grad_(False)
    path = os.path.join(root, family)
    hf.save_pretrained(path)
    save_tiny_tokenizer(path)
    model, tokenizer = load_target(path, "fp32", progress=False)
    return Tiny(family, hf, model, tokenizer, path)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_models"))
    cache: dict[str, Tiny] = {}

    def get(family: str) -> Tiny:
        if family not in cache:
            cache[family] = make_moe(family, root)
        return cache[family]

    return get


def prompt(seed: int = 0, n: int = 20) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the model against HF -----------------------------------------------------------------------------------------

def test_checkpoint_layout_is_per_expert(moe):
    """Guard for the setup: save_pretrained writes one tensor per expert and projection (Mixtral: w1/w2/w3 under
    block_sparse_moe), which is the layout the loader reads."""
    from safetensors import safe_open

    for family, name in (("qwen3_moe", "model.layers.0.mlp.experts.7.gate_proj.weight"),
                         ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight"),
                         ("mixtral", "model.layers.2.block_sparse_moe.experts.3.w2.weight")):
        with safe_open(os.path.join(moe(family).path, "model.safetensors"), "pt") as f:
            assert name in set(f.keys()), family


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_layers_follow_the_config(moe, family):
    m = moe(family).model
    kinds = [type(layer.mlp) for layer in m.layers]
    expect = {"qwen3_moe": [SparseMoE, GatedMLP, SparseMoE], "qwen2_moe": [GatedMLP, SparseMoE, GatedMLP],
              "mixtral": [SparseMoE] * 3}[family]
    assert kinds == expect
    sparse = next(layer.mlp for layer in m.layers if isinstance(layer.mlp, SparseMoE))
    assert len(sparse.experts) == m.config.moe.num_experts
    assert (getattr(sparse, "shared_expert", None) is not None) == (family == "qwen2_moe")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_match_hf_prefill_and_decode(moe, family):
    """Prefill of 16 tokens, then 6 decode steps one token at a time through the KV cache: every position's logits
    equal HF's full forward over the same tokens."""
    t = moe(family)
    ids = prompt(1, 22)
    with torch.no_grad():
        ref = t.hf(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 1.0
    kv = t.model.new_kv(len(ids))
    n0 = 16
    with torch.inference_mode():
        got = [t.model(torch.tensor([ids[:n0]]), torch.arange(n0)[None], kv).logits[0]]
        kv.commit()
        for p in range(n0, len(ids)):
            got.append(t.model(torch.tensor([[ids[p]]]), torch.tensor([[p]]), kv).logits[0])
            kv.commit()
    got = torch.cat(got)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"{family}: max |logits - HF| = {diff}"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_is_not_trivial(moe, family):
    """Guard: the random routers spread the prompt's tokens over most experts, and the top-k weights matter (the
    logits change when every chosen expert gets equal weight)."""
    t = moe(family)
    layer = next(i for i, x in enumerate(t.model.layers) if isinstance(x.mlp, SparseMoE))
    mlp = t.model.layers[layer].mlp
    x = torch.randn(40, t.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    w, ids = mlp.gate(x)
    assert len(set(ids.flatten().tolist())) >= mlp.moe.num_experts - 1
    assert (w.max(-1).values - w.min(-1).values).abs().max() > 0.05


def test_in_memory_state_dict_with_fused_experts(moe):
    """transformers 5 holds experts fused as 3-D tensors in memory; a state dict taken from the model loads to the
    same model as the per-expert checkpoint on disk."""
    for family in ("qwen3_moe", "mixtral"):
        t = moe(family)
        assert any(k.endswith("experts.gate_up_proj") for k in t.hf.state_dict())
        a, b = model_from_hf(t.hf), t.model
        for k, v in b.state_dict().items():
            assert torch.equal(a.state_dict()[k], v), (family, k)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_greedy_matches_hf_generate(moe, family):
    t = moe(family)
    ids = prompt(2, 12)
    ref = hf_greedy(t.hf, ids, 16)
    assert len(set(ref)) >= 4
    res = Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=16, ignore_eos=True)
    assert res.token_ids == ref


def test_batch_of_two_rows(moe):
    """Two rows in one pass route their tokens together and still equal HF row by row."""
    t = moe("qwen3_moe")
    a, b = prompt(4), prompt(5)
    kv = t.model.new_kv(32, batch=2)
    with torch.inference_mode():
        out = t.model(torch.tensor([a, b]), torch.arange(len(a)).expand(2, len(a)), kv).logits
    with torch.no_grad():
        for row, ids in enumerate((a, b)):
            assert (out[row] - t.hf(torch.tensor([ids])).logits[0]).abs().max() <= TOL


def _deepseek_like(scoring_keys: dict) -> ModelConfig:
    raw = {"model_type": "qwen3_moe", **{k: v for k, v in COMMON.items() if k not in ("pad_token_id",)},
           "moe_intermediate_size": 16, **scoring_keys}
    return ModelConfig.from_hf(raw)


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_sigmoid_router_matches_deepseek_v3(groups):
    """DeepSeek-V3 routing (sigmoid scores, e_score_correction_bias for the choice only, group-limited top-k,
    renormalised, routed_scaling_factor, shared experts) against HF's DeepseekV3MoE with the same weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    n_group, topk_group = groups
    keys = dict(n_routed_experts=8, num_experts_per_tok=3, scoring_func="sigmoid", topk_method="noaux_tc",
                n_group=n_group, topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5,
                n_shared_experts=2)
    config = _deepseek_like(keys)
    m = config.moe
    assert (m.scoring, m.score_correction_bias, m.shared_name, m.shared_intermediate_size) == \
        ("sigmoid", True, "shared_experts", 32)
    hf = DeepseekV3MoE(DeepseekV3Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                                        **keys)).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in [*hf.parameters(), *hf.buffers()]:
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
    ours = SparseMoE(config).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        for e, ex in enumerate(ours.experts):
            ex.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
            ex.down_proj.weight.copy_(hf.experts.down_proj[e])
        s = hf.shared_experts
        ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
        ours.shared_experts.down_proj.weight.copy_(s.down_proj.weight)
    x = torch.randn(2, 25, 64, generator=g)
    with torch.no_grad():
        ref, got = hf(x), ours(x)
        # the correction bias changes which experts are chosen (so the test sees it is used for the choice)
        bias = ours.gate.e_score_correction_bias.clone()
        ours.gate.e_score_correction_bias.zero_()
        moved = (ours(x) - got).abs().max()
        ours.gate.e_score_correction_bias.copy_(bias)
    assert (got - ref).abs().max() <= TOL
    assert moved > 1e-2


# -- speculative decoding on an MoE target ------------------------------------------------------------------------

SPEC_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
N = 25


@pytest.fixture(scope="module")
def drafters(moe, tmp_path_factory):
    """Random-init drafters of every hidden-state kind for the Qwen3-MoE target, and the target directory with two
    MoE MTP layers built in (DeepSeek layout)."""
    from test_block_drafters import make_block, save
    from test_hidden_drafters import make_eagle, make_medusa
    from test_mtp import random_mtp

    from specloom.drafters.checkpoint import specloom_meta
    from specloom.drafters.mtp.format import save_into_target

    t = moe("qwen3_moe")
    root = tmp_path_factory.mktemp("moe_drafters")
    mtp_dir = str(root / "with_mtp")
    shutil.copytree(t.path, mtp_dir)
    mtp = random_mtp(t, 2)
    assert all(isinstance(layer.block.mlp, SparseMoE) for layer in mtp.layers)  # MTP layers L, L+1 are sparse
    save_into_target(mtp, mtp_dir, specloom_meta("mtp", t.model, t.tokenizer, (3,)), dtype=torch.float32)
    return t, {
        "eagle": make_eagle(t, str(root / "eagle"), False),
        "eagle3": make_eagle(t, str(root / "eagle3"), True, draft_vocab=200),
        "medusa": make_medusa(t, str(root / "medusa")),
        "dflash": save(t, make_block(t, False, 5), "dflash", str(root / "dflash")),
        "dspark": save(t, make_block(t, True, 4, "vanilla", confidence=True), "dspark", str(root / "dspark")),
        "mtp": mtp_dir,
    }


def _plain(t, ids):
    return Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids


SPEC_CASES = [
    ("ngram", {"num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    ("suffix", {}),
    ("draft_model:self", {"num_speculative_tokens": 3}),  # N - 1 = 6 full steps of 3 + 1
    ("draft_model:mixtral", {"num_speculative_tokens": 3, "tree_width": 2}),
    ("eagle", {"num_speculative_tokens": 3, "tree_width": 1}),
    ("eagle3", {"num_speculative_tokens": 4, "tree_width": 3, "num_draft_tokens": 9}),
    ("medusa", {}),
    ("dflash", {}),
    ("dspark", {}),
    ("mtp", {"num_speculative_tokens": 2}),
    ("mtp", {"num_speculative_tokens": 3, "tree_width": 2, "num_draft_tokens": 6}),
]


@pytest.mark.parametrize("method,extra", SPEC_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(SPEC_CASES)])
def test_every_drafter_exact_on_moe_target(moe, drafters, method, extra):
    t, paths = drafters
    if method == "mtp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e = specloom.load(paths["mtp"], {"method": "mtp", **extra}, dtype="fp32", progress=False,
                              speculation="fixed")
        assert isinstance(e.drafter.mtp.layers[0].block.mlp, SparseMoE)
        assert isinstance(e.model.layers[0].mlp, SparseMoE)
    else:
        spec = {"method": method.split(":")[0], **extra}
        if method == "draft_model:self":
            spec["model"] = t.path
        elif method == "draft_model:mixtral":
            spec["model"] = moe("mixtral").path  # another MoE model drafting (same vocabulary)
        elif method in paths:
            spec["model"] = paths[method]
        e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(spec))
    drafted = 0
    for ids in SPEC_PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert r.token_ids == _plain(t, ids), method
        drafted += r.num_draft_tokens
        if method == "draft_model:self":  # the target drafting for itself: everything accepted
            assert r.mean_accepted_length == extra["num_speculative_tokens"] + 1
    if method != "suffix":  # (suffix drafts only from earlier repetitions)
        assert drafted > 0


def test_moe_mtp_layers_round_trip(drafters):
    """The MoE MTP layers are written per expert under model.layers.{L+i}.mlp.experts.{e}.* and read back equal."""
    from safetensors import safe_open

    from specloom.drafters.mtp.format import MTP_FILE, load_mtp
    from specloom.drafters.mtp.model import MTPModel

    t, paths = drafters
    L = t.model.config.num_layers
    with safe_open(os.path.join(paths["mtp"], MTP_FILE), "pt") as f:
        names = set(f.keys())
    for name in ("mlp.gate.weight", "mlp.experts.7.gate_proj.weight", "mlp.experts.0.up_proj.weight",
                 "mlp.experts.3.down_proj.weight"):
        assert f"model.layers.{L}.{name}" in names and f"model.layers.{L + 1}.{name}" in names
    m, _ = load_mtp(paths["mtp"], t.model, t.tokenizer)
    assert isinstance(m, MTPModel) and isinstance(m.layers[1].block.mlp, SparseMoE)


# -- bad configs --------------------------------------------------------------------------------------------------

def _raw(family: str, **changes) -> dict:
    raw = moe_hf_config(family).to_dict()
    raw.update(changes)
    return raw


@pytest.mark.parametrize("family,changes,needle", [
    ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok must be an integer in \[1, 8\]"),
    ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("qwen3_moe", {"num_experts_per_tok": "2"}, "num_experts_per_tok must be an integer"),
    ("mixtral", {"num_local_experts": 1 << 20}, "num_local_experts must be an integer in"),
    ("mixtral", {"num_local_experts": -1}, "num_local_experts"),
    ("qwen3_moe", {"num_local_experts": 2.5}, "num_local_experts must be an integer"),
    ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ("qwen3_moe", {"mlp_only_layers": [5]}, r"mlp_only_layers must list layer ids in \[0, 2\]"),
    ("qwen3_moe", {"mlp_only_layers": "1"}, "mlp_only_layers must be a list"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ("qwen3_moe", {"scoring_func": "tanh"}, "scoring_func must be one of softmax, sigmoid"),
    ("qwen3_moe", {"scoring_func": "sigmoid", "n_group": 3}, r"n_group \(3\) must divide"),
    ("qwen3_moe", {"scoring_func": "sigmoid", "n_group": 4, "topk_group": 5}, "topk_group must be"),
    ("qwen3_moe", {"routed_scaling_factor": -1}, "routed_scaling_factor must be a positive number"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 1 << 30}, "shared_expert_intermediate_size"),
])
def test_bad_moe_config_fields(family, changes, needle):
    with pytest.raises(SpecloomError, match=needle) as err:
        ModelConfig.from_hf(_raw(family, **changes))
    assert "\n" not in str(err.value)


def test_bad_moe_checkpoint_names_the_tensor(moe, tmp_path):
    """An expert missing from the checkpoint is one message naming its tensor."""
    from safetensors.torch import load_file, save_file

    t = moe("mixtral")
    bad = str(tmp_path / "bad")
    shutil.copytree(t.path, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(SpecloomError, match=r"layers\.1\.mlp\.experts\.2\.up_proj\.weight' is missing"):
        load_target(bad, "fp32", progress=False)
    cfg = json.load(open(os.path.join(t.path, "config.json")))
    assert cfg["model_type"] == "mixtral"


# -- quantized experts --------------------------------------------------------------------------------------------

def test_quantized_experts_load_exactly(moe, tmp_path):
    """Experts are plain linears to the weight-format registry: layer 0's experts stored as NVFP4 and layer 2's
    as MXFP4 (a MIXED_PRECISION ModelOpt config naming each expert projection) load to the same model as a dense
    checkpoint of their reference dequantisation, dequantised at load or held quantized."""
    from safetensors.torch import load_file, save_file
    from test_quant_formats import mxfp4_tensors, nvfp4_tensors, rng

    from specloom.loading.quant_base import QuantLinear

    src = moe("qwen3_moe")
    qdir, ddir = tmp_path / "quant", tmp_path / "dense"
    shutil.copytree(src.path, qdir)
    shutil.copytree(src.path, ddir)
    sd = load_file(str(qdir / "model.safetensors"))
    dense = dict(sd)
    r, layers = rng(3), {}
    for layer, algo in ((0, "NVFP4"), (2, "MXFP4")):
        for e in range(src.model.config.moe.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                module = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                n, k = sd.pop(f"{module}.weight").shape
                t, ref = (nvfp4_tensors if algo == "NVFP4" else mxfp4_tensors)(n, k, r)
                sd.update({f"{module}.{key}": v for key, v in t.items()})
                dense[f"{module}.weight"] = torch.from_numpy(ref)
                layers[module] = {"quant_algo": algo}
    save_file(sd, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    (qdir / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}))
    ref, _ = load_target(str(ddir), "fp32", progress=False)
    ids = torch.tensor([prompt(6, 12)])
    pos = torch.arange(ids.shape[1])[None]
    want = ref(ids, pos, ref.new_kv(16)).logits
    for resident in ("dequantized", "quantized"):
        model, _ = load_target(str(qdir), "fp32", progress=False, weights_resident=resident)
        got = model(ids, pos, model.new_kv(16)).logits
        assert torch.equal(got, want), (resident, (got - want).abs().max())
        held = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        assert len(held) == (2 * 8 * 2 if resident == "quantized" else 0)  # gate_up and down per expert, 2 layers
