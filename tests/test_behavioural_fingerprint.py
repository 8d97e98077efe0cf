"""The behavioural fingerprint (specloom/behaviour.py) on tiny random targets: the target's top-k log-probabilities on
the packaged probe, recorded with every drafter checkpoint and dataset, and the distance of the loaded target to
that recording -- 0 for the same model, quiet for a bf16 load, well beyond the warning limits for a copy whose
middle layer was changed (which the structural fingerprint cannot see), silent for checkpoints without one."""

import copy
import json
import logging
import os
import random
import shutil
import warnings

import pytest
import torch

from specloom import Engine
from specloom.behaviour import (KL_WARN, TOP1_WARN, behavioural_distance, check_behaviour, decode_probe,
                                probe_ids, record_probe)
from specloom.drafters.checkpoint import check_target, load_drafter, save_drafter, specloom_meta
from specloom.drafters.eagle.model import EagleDraftModel, eagle_config_for, init_weights
from specloom.fingerprint import compare, fingerprint
from specloom.loading import load_target
from specloom.speculative import SpeculativeConfig


@pytest.fixture(scope="module")
def target(tiny):
    return tiny("llama")


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    """A random EAGLE drafter for the tiny target, written by specloom (so it records the probe)."""
    t = target
    L = t.model.config.num_layers
    m = EagleDraftModel(eagle_config_for(t.model.config, False, (L,), t.model.config.vocab_size))
    init_weights(m, 0, std=0.3)
    path = str(tmp_path_factory.mktemp("behaviour") / "eagle")
    save_drafter("eagle", m, path, specloom_meta("eagle", t.model, t.tokenizer, (L,)), dtype=torch.float32)
    return path


def perturbed(model, scale=1.0, seed=0):
    """A copy of `model` with noise on one middle layer's linear weights (of their own size): embedding, head and
    every other layer untouched."""
    m = copy.deepcopy(model)
    mid = m.layers[len(m.layers) // 2]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mid.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return m


def test_probe_is_small_and_varied(target):
    rec = record_probe(target.model, target.tokenizer)
    assert len(json.dumps(rec)) < 100_000
    arr = decode_probe(rec)
    T, k = rec["positions"], rec["k"]
    assert T >= 150 and k == 8
    assert arr["topk_ids"].shape == arr["topk_logprobs"].shape == (T, k) and arr["rest_logprob"].shape == (T,)
    # the toy word-level tokenizer cannot spell the probe: its bytes stand in, so the positions are varied
    assert len(set(arr["input_ids"].tolist())) > 20
    assert arr["input_ids"].tolist() == probe_ids(target.tokenizer, target.model.config.vocab_size)
    assert (arr["topk_logprobs"][:, :-1] >= arr["topk_logprobs"][:, 1:]).all()  # sorted, best first
    assert rec["dtype"] == "float32"


def test_same_model_distance_zero(target):
    rec = record_probe(target.model, target.tokenizer)
    d = behavioural_distance(target.model, target.tokenizer, rec)
    assert d["kl_mean"] < 1e-5 and d["kl_max"] < 1e-4
    assert d["top1_agreement"] == 1.0 and d["topk_overlap"] == 1.0
    assert not d["exceeds"]
    assert behavioural_distance(target.model, None, rec)["top1_agreement"] == 1.0  # the ids are recorded


def test_bf16_load_is_quiet_and_records_in_fp32(target):
    rec = record_probe(target.model, target.tokenizer)
    bf16, tok = load_target(target.path, "bf16", progress=False)
    d = behavioural_distance(bf16, tok, rec)
    assert d["kl_mean"] < KL_WARN / 5 and d["top1_agreement"] >= TOP1_WARN, d
    again = record_probe(bf16, tok)  # a bf16 target is reloaded in fp32 from its source for the recording
    assert again["dtype"] == "float32 (reloaded)"
    assert {k: v for k, v in again.items() if k != "dtype"} == {k: v for k, v in rec.items() if k != "dtype"}


def test_perturbed_middle_layer_is_seen(target):
    rec = record_probe(target.model, target.tokenizer)
    other = perturbed(target.model)
    assert compare(fingerprint(target.model, target.tokenizer), fingerprint(other, target.tokenizer)) == []
    d = behavioural_distance(other, target.tokenizer, rec)
    # a random tiny target predicts almost uniformly over its 256 tokens, so the KL stays moderate; its argmax moves
    assert d["kl_mean"] > 2 * KL_WARN and d["top1_agreement"] < TOP1_WARN / 2, d
    assert d["exceeds"]


def test_probe_round_trips_through_a_drafter_checkpoint(target, drafter_dir):
    raw = json.load(open(os.path.join(drafter_dir, "config.json")))
    rec = raw["specloom"]["target_probe"]
    assert rec == record_probe(target.model, target.tokenizer)
    _, meta = load_drafter(drafter_dir, "eagle", target.model, target.tokenizer)
    assert meta["target_probe"] == rec
    for a, b in zip(decode_probe(rec).values(), decode_probe(meta["target_probe"]).values()):
        assert torch.equal(a, b)


def test_drafter_load_logs_the_distance(target, drafter_dir, caplog):
    with caplog.at_level(logging.INFO, logger="specloom"), warnings.catch_warnings():
        warnings.simplefilter("error")  # the same target: no warning of either kind
        e = Engine(target.model, target.tokenizer, SpeculativeConfig.parse({"method": "eagle", "model": drafter_dir}))
    lines = [r.getMessage() for r in caplog.records if "target behaviour vs the recorded target" in r.getMessage()]
    assert len(lines) == 1 and "KL 0.0000 nats, top-1 agreement 100.0%" in lines[0]
    assert e.generate(prompt_token_ids=[5, 6, 7, 8], max_tokens=6, ignore_eos=True).token_ids


def test_drafter_load_on_perturbed_target_warns(target, drafter_dir, caplog):
    other = perturbed(target.model)
    with caplog.at_level(logging.INFO, logger="specloom"), warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        e = Engine(other, target.tokenizer, SpeculativeConfig.parse({"method": "eagle", "model": drafter_dir}))
    msgs = [str(w.message) for w in got]
    assert any("behaves differently from the one this drafter was made with" in m for m in msgs), msgs
    assert not any("trained for another target" in m for m in msgs)  # the structural fingerprint matches
    ids = [5, 6, 7, 8, 9]
    plain = Engine(other, target.tokenizer).generate(prompt_token_ids=ids, max_tokens=8, ignore_eos=True)
    assert e.generate(prompt_token_ids=ids, max_tokens=8, ignore_eos=True).token_ids == plain.token_ids


def test_old_checkpoint_without_probe_loads_silently(target, drafter_dir, tmp_path, caplog):
    old = str(tmp_path / "old")
    shutil.copytree(drafter_dir, old)
    cfg = os.path.join(old, "config.json")
    raw = json.load(open(cfg))
    del raw["specloom"]["target_probe"]
    json.dump(raw, open(cfg, "w"))
    with caplog.at_level(logging.INFO, logger="specloom"), warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(perturbed(target.model), target.tokenizer, SpeculativeConfig.parse({"method": "eagle", "model": old}))
    assert not [r for r in caplog.records if "behaviour" in r.getMessage()]
    assert check_target(raw["specloom"], target.model, target.tokenizer, old) is None


def test_memoised_distance_follows_weight_edits(target):
    rec = record_probe(target.model, target.tokenizer)
    m = copy.deepcopy(target.model)
    assert check_behaviour(rec, m, "here")["kl_mean"] < 1e-5
    with torch.no_grad():
        m.layers[1].mlp.down_proj.weight.mul_(3.0)  # in place: the memo must not answer for the old weights
    with pytest.warns(UserWarning, match="behaves differently"):
        assert check_behaviour(rec, m, "here")["exceeds"]


def test_malformed_or_foreign_recording(target, caplog):
    rec = record_probe(target.model, target.tokenizer)
    with pytest.raises(ValueError, match="malformed"):
        behavioural_distance(target.model, None, {**rec, "topk_ids": rec["topk_ids"][:-8]})
    with caplog.at_level(logging.INFO, logger="specloom"):  # on load: a log line, never an error
        assert check_behaviour({**rec, "positions": 3}, target.model, "x") is None
    assert any("not compared" in r.getMessage() for r in caplog.records)


def test_dataset_records_the_probe(target, tmp_path):
    from specloom.cli import main

    rng = random.Random(0)
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for _ in range(4):
            f.write(json.dumps({"turns": [" ".join(f"w{rng.randrange(4, 60)}" for _ in range(6))]}) + "\n")
    out = str(tmp_path / "data")
    args = ["data", "--target", target.path, "--prompts", str(prompts), "--out", out, "--max-new-tokens", "4",
            "--dtype", "fp32"]
    assert main(args) == 0
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["target_probe"] == record_probe(target.model, target.tokenizer)
    assert main(args) == 0  # a rerun keeps the first recording
    assert json.load(open(os.path.join(out, "meta.json")))["target_probe"] == meta["target_probe"]


def test_bundled_drafters_carry_a_recording():
    from specloom.drafters.checkpoint import bundled_dirs

    dirs = [d for m in ("eagle3", "eagle", "medusa", "dflash", "dflash2", "dspark", "mtp") for d in bundled_dirs(m)]
    assert dirs
    for d in dirs:
        assert os.path.getsize(os.path.join(d, "config.json")) < 100_000
        rec = json.load(open(os.path.join(d, "config.json")))["specloom"]["target_probe"]
        arr = decode_probe(rec)
        # recorded in fp32: the model itself, or reloaded / copied to fp32 from a bf16 load ("float32 (reloaded)")
        assert rec["dtype"].startswith("float32") and rec["k"] == 8 and arr["topk_ids"].shape == (rec["positions"], 8)
