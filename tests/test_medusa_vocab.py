"""Medusa with a truncated head vocabulary (`token_map`) on the tiny fp32 target: greedy output identical to plain
greedy, the heads' scores are the full-vocabulary scores of the token_map ids, a save -> load round trip drafts
the same, and a malformed token_map is one clear error."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from specloom import Engine, SpecloomError
from specloom.drafters.checkpoint import load_drafter, save_drafter
from specloom.speculative import SpeculativeConfig

from test_hidden_drafters import N, PROMPTS, make_medusa, plain


def _token_map(V, n, seed=1):
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n].sort().values


@pytest.fixture(scope="module")
def medusa_tv(tiny, tmp_path_factory):
    t = tiny("llama")
    root = tmp_path_factory.mktemp("medusa_tv")
    V = t.model.config.vocab_size
    tm = _token_map(V, 64)
    return t, tm, {
        "full": make_medusa(t, str(root / "full")),
        "shared": make_medusa(t, str(root / "shared"), token_map=tm),  # same ResBlocks as "full" (same seed)
        "own": make_medusa(t, str(root / "own"), token_map=tm, own=True),
    }


@pytest.mark.parametrize("which", ["shared", "own"])
@pytest.mark.parametrize("extra", [{}, {"num_speculative_tokens": 2}])
def test_truncated_medusa_identical_to_plain(medusa_tv, which, extra):
    t, _, paths = medusa_tv
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "medusa", "model": paths[which], **extra}))
    for ids in PROMPTS:
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == plain(t, ids).token_ids
        assert got.num_target_passes <= N


def test_truncated_scores_are_the_full_scores_of_the_map(medusa_tv):
    t, tm, paths = medusa_tv
    full, _ = load_drafter(paths["full"], "medusa", t.model, t.tokenizer)
    sub, _ = load_drafter(paths["shared"], "medusa", t.model, t.tokenizer)
    assert torch.equal(sub.token_map, tm)
    h = torch.randn(5, t.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    lf, ls = full.logits(h), sub.logits(h)
    assert ls.shape == (sub.num_heads, 5, tm.numel())
    torch.testing.assert_close(ls, lf[..., tm])
    top = sub.target_ids(ls.topk(10, dim=-1).indices)
    assert torch.equal(top, tm[lf[..., tm].topk(10, dim=-1).indices])
    assert bool(torch.isin(top, tm).all())


@pytest.mark.parametrize("which,fmt", [("shared", "v2"), ("shared", "v0.1"), ("own", "v0.1")])
def test_truncated_round_trip_same_drafts(medusa_tv, tmp_path, which, fmt):
    t, tm, paths = medusa_tv
    src, _ = load_drafter(paths[which], "medusa", t.model, t.tokenizer)
    out = str(tmp_path / "again")
    save_drafter("medusa", src, out, {"kind": "medusa"}, dtype=torch.float32, fmt=fmt)
    assert json.load(open(os.path.join(out, "config.json")))["medusa_vocab_size"] == tm.numel()
    again, _ = load_drafter(out, "medusa", t.model, t.tokenizer)
    assert again.token_map.dtype == torch.int64 and torch.equal(again.token_map, tm)
    for (k, v), (k2, v2) in zip(sorted(src.state_dict().items()), sorted(again.state_dict().items())):
        assert k == k2 and torch.equal(v, v2), k
    h = torch.randn(3, t.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    assert torch.equal(src.target_ids(src.logits(h).topk(10, dim=-1).indices),
                       again.target_ids(again.logits(h).topk(10, dim=-1).indices))
    runs = []
    for p in (paths[which], out):
        e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "medusa", "model": p}))
        r = e.generate(prompt_token_ids=PROMPTS[1], max_tokens=N, ignore_eos=True)
        runs.append((r.token_ids, r.num_target_passes))
    assert runs[0] == runs[1]


def _tamper_v2(src, dst, token_map=None, config=None):
    import shutil

    shutil.copytree(src, dst)
    f = os.path.join(dst, "medusa_lm_head.safetensors")
    sd = load_file(f)
    if token_map is not None:
        sd["token_map"] = token_map
    save_file(sd, f)
    if config is not None:
        raw = json.load(open(os.path.join(dst, "config.json")))
        raw.update(config)
        raw = {k: v for k, v in raw.items() if v is not None}
        json.dump(raw, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_malformed_token_map_one_clear_error(medusa_tv, tmp_path):
    t, tm, paths = medusa_tv
    V = t.model.config.vocab_size
    bad = tm.clone()
    bad[-1] = V + 3
    cases = [
        (_tamper_v2(paths["shared"], str(tmp_path / "range"), token_map=bad), r"token_map ids must lie in \[0, 256\)"),
        (_tamper_v2(paths["shared"], str(tmp_path / "order"), token_map=tm.flip(0).contiguous()),
         "distinct target ids in increasing order"),
        (_tamper_v2(paths["shared"], str(tmp_path / "len"), token_map=tm[:50].contiguous()),
         "token_map holds 50 ids but config.json sets medusa_vocab_size 64"),
        (_tamper_v2(paths["shared"], str(tmp_path / "float"), token_map=tm.float()), "1-D integer tensor"),
        (_tamper_v2(paths["full"], str(tmp_path / "nomap"), config={"medusa_vocab_size": 64}),
         "medusa_vocab_size 64 but there is no token_map tensor"),
    ]
    own = str(tmp_path / "rows")  # own output layers of 64 rows, a token_map of 50 (and no config field to agree)
    import shutil

    shutil.copytree(paths["own"], own)
    pt = os.path.join(own, "medusa_lm_head.pt")
    sd = torch.load(pt)
    sd["token_map"] = tm[:50].clone()
    torch.save(sd, pt)
    raw = json.load(open(os.path.join(own, "config.json")))
    del raw["medusa_vocab_size"]
    json.dump(raw, open(os.path.join(own, "config.json"), "w"))
    cases.append((own, r"head 0's output layer has shape \(64, 64\); expected \(50, 64\) -- one row per token_map"))
    for path, msg in cases:
        with pytest.raises(SpecloomError, match=msg):
            load_drafter(path, "medusa", t.model, t.tokenizer)
        with pytest.raises(SpecloomError, match=msg):  # the engine reports the same single error
            Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "medusa", "model": path}))
