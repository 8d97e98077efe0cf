"""Block drafters (DFlash, DFlash 2, DSpark) with a reduced, frequency-ranked draft vocabulary (`"draft_vocab": N`,
FR-Spec; or the checkpoint's own `specloom.draft_vocab`): the slots score N tokens through those rows of the
target's head (the Markov bias and the selector's candidates too), the drafts are mapped back to target ids, and
the output is still the target's own -- greedy identical to plain, sampling distributed as plain, an oracle over
the reduced vocabulary all accepted."""

import json
import random

import pytest
import torch

from specloom import Engine, SpecloomError

from conftest import VOCAB
from test_block_drafters import N, PROMPTS, blocks, engine, plain  # noqa: F401 (the module fixture)
from test_draft_vocab import write_map


def _half(t, tmp_path, seed=0, keep=()):
    """A map ranking a random order of the vocabulary with `keep` first; with it, draft_vocab VOCAB // 2 keeps
    `keep` and a random rest."""
    rest = [i for i in random.Random(seed).sample(range(VOCAB), VOCAB) if i not in keep]
    return write_map(tmp_path / f"map{seed}.json", t.tokenizer, list(keep) + rest)


CASES = [("dflash", {}), ("dspark", {}), ("dspark_gated", {"tree_width": 2, "num_draft_tokens": 6}),
         ("dspark_rnn", {}), ("dflash2", {}), ("dflash2", {"tree_width": 3, "num_draft_tokens": 8})]


@pytest.mark.parametrize("name,extra", CASES)
def test_reduced_vocabulary_identical_and_drafts_inside_it(blocks, name, extra, tmp_path):
    t, paths = blocks
    e = engine(t, paths[name], name.split("_")[0], draft_vocab=VOCAB // 2, token_map=_half(t, tmp_path), **extra)
    m = e.drafter.model
    vocab = set(m.draft_vocab.tolist())
    assert len(vocab) == VOCAB // 2
    drafted = []
    orig = e.drafter.propose

    def spy(ctxs):
        trees = orig(ctxs)
        drafted.extend(tok for tr in trees for tok in tr.tokens[1:])
        return trees

    e.drafter.propose = spy
    for ids in PROMPTS:
        assert e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids == plain(t, ids).token_ids
    assert drafted and set(drafted) <= vocab
    extra_bytes = sum(p.numel() * 4 for mod in (m._shared["head"], m._shared.get("markov_w2")) if mod is not None
                      for p in mod.parameters())
    assert e.drafter.memory()["weights"] == sum(p.numel() * 4 for p in m.parameters()) + extra_bytes


def test_sliced_rows_score_as_the_full_head(blocks, tmp_path):
    """The reduced head, Markov bias and selector give exactly the full vocabulary's scores at those tokens."""
    t, paths = blocks
    for name in ("dspark_gated", "dflash2"):
        full = engine(t, paths[name], name.split("_")[0]).drafter.model
        red = engine(t, paths[name], name.split("_")[0], draft_vocab=VOCAB // 2,
                     token_map=_half(t, tmp_path, 1)).drafter.model
        ids = red.draft_vocab
        h = torch.randn(3, t.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        prev = torch.tensor([5, 17, 200])
        lf, lr = full.draft_logits(h), red.draft_logits(h)
        torch.testing.assert_close(lr, lf[:, ids], rtol=0, atol=0)
        if name == "dspark_gated":
            torch.testing.assert_close(red.chain_logits(lr, h, prev)[0], full.chain_logits(lf, h, prev)[0][:, ids],
                                       rtol=1e-6, atol=1e-6)
        else:  # the selector: its candidates are the reduced vocabulary's top-k, scored as the full one scores them
            sr, cr = red.candidate_selector.scores(lr, h, prev, vocab=ids)
            sf, _ = full.candidate_selector.scores(lf, h, prev, cand=ids[cr])
            torch.testing.assert_close(sr, sf, rtol=1e-6, atol=1e-6)


class _Oracle:
    """Slot j of a step with root position n scores the true token x_{n+1+j} far above the rest -- over the
    reduced vocabulary (its draft id), so only a correct draft-to-target mapping gets it accepted."""

    def __init__(self, drafter, truth):
        d = drafter
        orig = d.propose
        ids = d.model.draft_vocab

        def propose(ctxs):
            self.n = len(ctxs[0].tokens) - 1
            return orig(ctxs)

        def draft_logits(h):
            out = torch.zeros(*h.shape[:-1], len(ids))
            for j in range(h.shape[-2]):
                tok = truth[min(self.n + 1 + j, len(truth) - 1)]
                out[..., j, int(torch.searchsorted(ids, tok))] = 100.0
            return out

        d.propose = propose
        d.model.draft_logits = draft_logits


@pytest.mark.parametrize("name,extra", [("dflash", {}), ("dspark_rnn", {}), ("dflash", {"tree_width": 2})])
def test_oracle_over_the_reduced_vocabulary_all_accepted(blocks, name, extra, tmp_path):
    t, paths = blocks
    for ids in PROMPTS:
        truth = ids + plain(t, ids).token_ids
        e = engine(t, paths[name], name.split("_")[0], draft_vocab=VOCAB // 2,
                   token_map=_half(t, tmp_path, 2, keep=sorted(set(truth))), **extra)
        _Oracle(e.drafter, truth)
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == truth[len(ids):]
        assert got.mean_accepted_length == pytest.approx(e.drafter.num_speculative_tokens + 1, rel=0.15)


@pytest.mark.parametrize("name", ["dspark_gated", "dflash2"])
def test_reduced_vocabulary_sampling_distribution(blocks, name, sampling_tv, tmp_path):
    """q renormalised over half the vocabulary (zero elsewhere) is the q verification divides by: the output
    follows p."""
    t, paths = blocks
    e = engine(t, paths[name], name.split("_")[0], draft_vocab=VOCAB // 2, token_map=_half(t, tmp_path, 3))
    tv = sampling_tv(e, Engine(t.model, t.tokenizer), PROMPTS[0])
    assert tv < 0.12, tv


def test_checkpoint_default_and_bad_settings(blocks, tmp_path):
    import shutil

    t, paths = blocks
    good = _half(t, tmp_path)
    with pytest.raises(SpecloomError, match='give "draft_vocab"'):
        engine(t, paths["dflash"], "dflash", token_map=good)
    with pytest.raises(SpecloomError, match="not smaller than the vocabulary"):
        engine(t, paths["dflash"], "dflash", draft_vocab=VOCAB + 1, token_map=good)
    assert engine(t, paths["dflash"], "dflash", draft_vocab=VOCAB).drafter.model.draft_vocab is None  # = all
    # a checkpoint's own default (the tiny tokenizer has no bundled map: the request's map ranks it)
    d = tmp_path / "own"
    shutil.copytree(paths["dspark"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["specloom"]["draft_vocab"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecloomError, match="none is bundled"):
        engine(t, str(d), "dspark")
    assert len(engine(t, str(d), "dspark", draft_vocab=32, token_map=good).drafter.model.draft_vocab) == 32
    assert engine(t, str(d), "dspark", draft_vocab=VOCAB).drafter.model.draft_vocab is None
    cfg["specloom"]["draft_vocab"] = "many"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecloomError, match="draft_vocab.*integer"):
        engine(t, str(d), "dspark", token_map=good)


def _reduced_speculators(t, src, dst, ids):
    """A speculators DSpark checkpoint with a reduced vocabulary made from `src` (full): lm_head = the target head's
    rows `ids`, markov_w2 those rows, d2t = ids - arange, t2d, draft_vocab_size."""
    from safetensors.torch import load_file, save_file

    raw = json.loads(open(f"{src}/config.json").read())
    raw["draft_vocab_size"] = len(ids)
    sd = load_file(f"{src}/model.safetensors")
    sd["lm_head.weight"] = t.model.lm_head.weight.detach()[ids].clone()
    sd["markov_head.markov_w2.weight"] = sd["markov_head.markov_w2.weight"][ids].clone()
    sd["d2t"] = ids - torch.arange(len(ids))
    sd["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    sd["t2d"][ids] = True
    import os

    os.makedirs(dst)
    save_file(sd, f"{dst}/model.safetensors")
    open(f"{dst}/config.json", "w").write(json.dumps(raw))
    return dst


def test_speculators_checkpoint_with_a_reduced_vocabulary(blocks, tmp_path):
    """speculators' `draft_vocab_size` < V with `d2t` and an own `lm_head` (what vLLM requires of a reduced DSpark):
    read, served exactly (greedy identical, drafts inside the vocabulary), scoring as the full checkpoint served
    with the same reduced vocabulary, and written back the same; a broken d2t, a draft_vocab on top, and the
    layouts that cannot hold one fail with one line."""
    from specloom.drafters.block.format import save_speculators, save_zlab

    t, paths = blocks
    ids = torch.tensor(sorted(random.Random(4).sample(range(VOCAB), 96)))
    red = _reduced_speculators(t, paths["dspark_gated"], str(tmp_path / "red"), ids)
    e = engine(t, red, "dspark")
    m = e.drafter.model
    assert m.config.draft_vocab_size == 96 and torch.equal(m.draft_vocab, ids)
    for extra in ({}, {"tree_width": 2}):
        ee = engine(t, red, "dspark", **extra)
        for p in PROMPTS:
            assert ee.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids == plain(t, p).token_ids
    # the same scores as the full checkpoint reduced at run time to these ids
    ranked = ids.tolist() + [i for i in range(VOCAB) if i not in set(ids.tolist())]
    runtime = engine(t, paths["dspark_gated"], "dspark", draft_vocab=96,
                     token_map=write_map(tmp_path / "r.json", t.tokenizer, ranked)).drafter.model
    h = torch.randn(2, t.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    prev = torch.tensor([7, 90])
    a, b = m.draft_logits(h), runtime.draft_logits(h)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(m.chain_logits(a, h, prev)[0], runtime.chain_logits(b, h, prev)[0], rtol=0, atol=0)
    # written back: the same tensors (d2t integer, t2d rebuilt)
    from safetensors.torch import load_file

    meta = json.loads(open(f"{red}/config.json").read())["specloom"]
    save_speculators(m, str(tmp_path / "again"), meta, "dspark", dtype=torch.float32)
    sa, sb = load_file(f"{red}/model.safetensors"), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["draft_vocab_size"] == 96
    with pytest.raises(ValueError, match="speculators layout only"):
        save_zlab(m, str(tmp_path / "z"), meta)
    with pytest.raises(SpecloomError, match="already reduced to 96"):
        engine(t, red, "dspark", draft_vocab=32, token_map=str(tmp_path / "r.json"))
    from safetensors.torch import save_file

    sa["d2t"] = torch.zeros(96, dtype=torch.long)  # every draft id to target id = itself: not the vocabulary's
    sa["d2t"][5] = -10
    save_file(sa, f"{red}/model.safetensors")
    with pytest.raises(SpecloomError, match="d2t does not map") as err:
        engine(t, red, "dspark")
    assert "\n" not in str(err.value)


def test_export_writes_the_served_reduced_vocabulary(blocks, tmp_path):
    """`specloom export` of a block drafter served with a reduced vocabulary writes speculators' reduced form
    (draft_vocab_size, lm_head rows, markov_w2 rows, d2t, t2d), which speculators' own classes accept and specloom
    reads back scoring exactly as the run-time reduction -- what vLLM would serve is what specloom served."""
    pytest.importorskip("speculators")
    from safetensors.torch import load_file

    from specloom.export import export

    t, paths = blocks
    good = _half(t, tmp_path, 5)
    spec = {"method": "dspark", "model": paths["dspark_gated"], "draft_vocab": 128, "token_map": good}
    out = str(tmp_path / "exp")
    r = export(t.path, spec, out, dtype="fp32")
    assert r["validated"]["model_class"]
    raw = json.loads(open(f"{out}/config.json").read())
    sd = load_file(f"{out}/model.safetensors")
    assert raw["draft_vocab_size"] == 128 and sd["lm_head.weight"].shape == (128, t.model.config.hidden_size)
    assert sd["markov_head.markov_w2.weight"].shape[0] == 128 and int(sd["t2d"].sum()) == 128
    served = engine(t, paths["dspark_gated"], "dspark", draft_vocab=128, token_map=good).drafter.model
    back = engine(t, out, "dspark").drafter.model
    assert torch.equal(back.draft_vocab, served.draft_vocab)
    h = torch.randn(2, t.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    prev = torch.tensor([3, 77])
    a, b = back.draft_logits(h), served.draft_logits(h)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(back.chain_logits(a, h, prev)[0], served.chain_logits(b, h, prev)[0], rtol=0, atol=0)
