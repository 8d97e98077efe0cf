"""MTP layers in the DeepSeek layout inside a (tiny, fp32) target checkpoint: found by `method: "mtp"` without a
separate model, exact against plain greedy with random-init layers, all accepted with an oracle, sampling
distribution, reuse of layers past their count, trees, format round trip and bad checkpoints."""

import json
import os
import shutil
import warnings

import pytest
import torch

import specloom
from specloom import Engine, SpecloomError
from specloom.drafters.checkpoint import specloom_meta
from specloom.drafters.mtp.format import MTP_FILE, load_mtp, save_into_target, save_overlay
from specloom.drafters.mtp.model import MTPModel, init_mtp

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
N = 25


def random_mtp(t, layers: int, seed=0):
    m = MTPModel(t.model.config, layers)
    init_mtp(m, seed=seed, std=0.3)
    return m


@pytest.fixture(scope="module")
def mtp_target(tiny, tmp_path_factory):
    t = tiny("llama")
    d = str(tmp_path_factory.mktemp("mtp") / "target_with_mtp")
    shutil.copytree(t.path, d)
    save_into_target(random_mtp(t, 2), d, specloom_meta("mtp", t.model, t.tokenizer, (3,)), dtype=torch.float32)
    return t, d


def plain(t, ids, **kw):
    return Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True, **kw)


def engine(t, d, **spec):
    return specloom.load(d, {"method": "mtp", **spec}, dtype="fp32", progress=False, speculation="fixed")


CASES = [{}, {"num_speculative_tokens": 1}, {"num_speculative_tokens": 5},
         {"num_speculative_tokens": 3, "tree_width": 3, "num_draft_tokens": 7}]


@pytest.mark.parametrize("extra", CASES)
def test_random_mtp_identical_to_plain(mtp_target, extra):
    t, d = mtp_target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = engine(t, d, **extra)
    assert e.drafter.mtp.num_layers == 2
    for ids in PROMPTS:
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == plain(t, ids).token_ids


def test_reusing_layers_warns(mtp_target):
    t, d = mtp_target
    with pytest.warns(UserWarning, match="reuse the layers"):
        engine(t, d, num_speculative_tokens=4)


@pytest.mark.parametrize("extra", [{}, {"num_speculative_tokens": 4}, {"num_speculative_tokens": 3, "tree_width": 2}])
def test_oracle_mtp_all_accepted(mtp_target, extra):
    t, d = mtp_target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = engine(t, d, **extra)
    dr = e.drafter
    for ids in PROMPTS:
        truth = ids + plain(t, ids).token_ids
        orig_propose = dr.propose
        state = {}

        def propose(ctxs, orig=orig_propose):
            state["n"] = len(ctxs[0].tokens) - 1
            return orig(ctxs)

        def logits(h, depth):
            rows = h.shape[0] if h.dim() == 2 else 1
            out = torch.zeros(rows, t.model.config.vocab_size)
            out[:, truth[min(state["n"] + 1 + depth, len(truth) - 1)]] = 10.0
            return out

        dr.propose, dr._logits = propose, logits
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        dr.propose = orig_propose
        del dr._logits
        assert got.token_ids == truth[len(ids):]
        assert got.mean_accepted_length == pytest.approx(dr.num_speculative_tokens + 1, rel=0.15)


@pytest.mark.parametrize("extra,near", [({}, True), ({"num_speculative_tokens": 3, "tree_width": 2}, False)])
def test_mtp_sampling_distribution(mtp_target, extra, near, sampling_tv):
    from conftest import near_target_scores

    t, d = mtp_target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = engine(t, d, **extra)
    if near:  # drafts close to the target's distribution: accepted and rejected often
        near_target_scores(e.drafter, e.model)
    assert sampling_tv(e, Engine(t.model, t.tokenizer), PROMPTS[0]) < 0.12


def test_target_loads_with_mtp_layers_and_round_trip(mtp_target, tmp_path):
    t, d = mtp_target
    e = engine(t, d)  # the target itself loads (MTP tensors skipped) and equals the original
    for a, b in zip(e.model.state_dict().values(), t.model.state_dict().values()):
        assert torch.equal(a, b)
    m, _ = load_mtp(d, t.model, t.tokenizer)
    out = str(tmp_path / "overlay")
    save_overlay(m, out, {"kind": "mtp"}, dtype=torch.float32)
    again, _ = load_mtp(out, t.model)
    for (k, v), (k2, v2) in zip(sorted(m.state_dict().items()), sorted(again.state_dict().items())):
        assert k == k2 and torch.equal(v, v2), k
    from safetensors import safe_open

    with safe_open(os.path.join(d, MTP_FILE), "pt") as f:
        names = set(f.keys())
    L = t.model.config.num_layers
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "self_attn.q_proj.weight", "mlp.gate_proj.weight", "input_layernorm.weight"):
        assert f"model.layers.{L}.{n}" in names and f"model.layers.{L + 1}.{n}" in names


def test_bad_mtp_checkpoints(mtp_target, tmp_path, tiny):
    t, d = mtp_target
    # declared layers whose tensors are missing
    bad = str(tmp_path / "missing")
    shutil.copytree(d, bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(bad, MTP_FILE))
    L = t.model.config.num_layers
    del tensors[f"model.layers.{L + 1}.eh_proj.weight"]
    save_file(tensors, os.path.join(bad, MTP_FILE))
    with pytest.raises(SpecloomError, match=rf"declares 2 MTP layer.*'model.layers.{L + 1}.eh_proj.weight' is missing"):
        specloom.load(bad, {"method": "mtp"}, dtype="fp32", progress=False)
    # a checkpoint declaring more layers than it has
    cfg = json.load(open(os.path.join(d, "config.json")))
    more = str(tmp_path / "more")
    shutil.copytree(d, more)
    json.dump({**cfg, "num_nextn_predict_layers": 3}, open(os.path.join(more, "config.json"), "w"))
    with pytest.raises(SpecloomError, match=f"model.layers.{L + 2}"):
        specloom.load(more, {"method": "mtp"}, dtype="fp32", progress=False)
    # a target without MTP layers, no bundled ones
    with pytest.raises(SpecloomError, match="has no built-in mtp drafter"):
        specloom.load(t.path, {"method": "mtp"}, dtype="fp32", progress=False)
    # MTP layers of another model shape
    other = tiny("qwen3")
    with pytest.raises(SpecloomError, match="layers"):
        specloom.load(other.path, {"method": "mtp", "model": d}, dtype="fp32", progress=False)
