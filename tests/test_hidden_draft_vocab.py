"""EAGLE-1, EAGLE-3 and MTP with a reduced, frequency-ranked draft vocabulary (`"draft_vocab": N`, FR-Spec).
EAGLE-1 and MTP score through the target's head: they score only those N rows of it. EAGLE-3's own head already
covers its draft vocabulary (`d2t`): it keeps the N most frequent of its rows. Either way the drafts are mapped
back to target ids and a sampled q is zero outside the N tokens, so the output is still the target's own --
greedy identical to plain, sampling distributed as plain, an oracle whose tokens lie inside the N all accepted."""

import os
import random
import warnings

import pytest
import torch

from specloom import Engine, SpecloomError
from specloom.drafters.token_map import ranked_rows
from specloom.speculative import SpeculativeConfig

from conftest import VOCAB
from test_draft_vocab import write_map
from test_hidden_drafters import N, PROMPTS, drafters, plain  # noqa: F401 (the module fixture)
from test_mtp import engine as mtp_engine, mtp_target  # noqa: F401 (the module fixture)


def _map(t, tmp_path, seed=0, keep=()):
    rest = [i for i in random.Random(seed).sample(range(VOCAB), VOCAB) if i not in keep]
    return write_map(tmp_path / f"map{seed}.json", t.tokenizer, list(keep) + rest)


def _engine(t, path, method, **spec):
    return Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": method, "model": path, **spec}))


def _spy(drafter, drafted):
    orig = drafter.propose

    def propose(ctxs):
        trees = orig(ctxs)
        drafted.extend(tok for tr in trees for tok in tr.tokens[1:])
        return trees

    drafter.propose = propose


@pytest.mark.parametrize("method,extra", [("eagle", {"num_speculative_tokens": 3, "tree_width": 1}),
                                          ("eagle", {"num_speculative_tokens": 3, "tree_width": 3,
                                                     "num_draft_tokens": 7}),
                                          ("eagle3", {"num_speculative_tokens": 3, "tree_width": 1}),
                                          ("eagle3", {"num_speculative_tokens": 4, "tree_width": 3,
                                                      "num_draft_tokens": 9})])
def test_identical_and_drafts_inside_the_reduced_vocabulary(drafters, method, extra, tmp_path):
    t, paths = drafters
    size = VOCAB // 2 if method == "eagle" else 80  # eagle3's own vocabulary: 200 tokens
    tmap = _map(t, tmp_path)
    e = _engine(t, paths[method], method, draft_vocab=size, token_map=tmap, **extra)
    m = e.drafter.model
    if method == "eagle":
        vocab = set(m._shared["vocab"].tolist())
        assert len(vocab) == size
    else:
        full = _engine(t, paths[method], method).drafter.model
        ids = torch.arange(200) + full.d2t
        want = ids[ranked_rows(ids, size, tmap, t.tokenizer, VOCAB)]
        vocab = set(want.tolist())
        assert m.config.draft_vocab_size == size and m.lm_head.out_features == size
        assert set((torch.arange(size) + m.d2t).tolist()) == vocab and int(m.t2d.sum()) == size
        # the kept rows score as in the full head
        h = torch.randn(3, t.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        rows = torch.searchsorted(ids, want)
        torch.testing.assert_close(m.draft_logits(h), full.draft_logits(h)[:, rows], rtol=0, atol=0)
    drafted = []
    _spy(e.drafter, drafted)
    for ids in PROMPTS:
        assert e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids == plain(t, ids).token_ids
    assert drafted and set(drafted) <= vocab


def test_ranked_rows_follow_the_map_and_keep_eos(drafters, tmp_path):
    t, _ = drafters
    ids = torch.tensor([3, 9, 20, 50, 77])
    tmap = write_map(tmp_path / "m.json", t.tokenizer, [77, 1, 9, 2, 50])  # 3 and 20 unseen: after the ranked
    assert ranked_rows(ids, 2, tmap, t.tokenizer, VOCAB).tolist() == [1, 4]  # 9 and 77
    assert ranked_rows(ids, 4, tmap, t.tokenizer, VOCAB).tolist() == [0, 1, 3, 4]  # then 50, then 3 (lower id)
    assert ranked_rows(ids, 5, tmap, t.tokenizer, VOCAB) is None
    eos = [k for k in (t.tokenizer.eos_token_ids or ()) if k < VOCAB]
    if eos:
        with_eos = torch.tensor(sorted({eos[0], 9, 77, 50}))
        kept = with_eos[ranked_rows(with_eos, 1, tmap, t.tokenizer, VOCAB)].tolist()
        assert kept == [eos[0]]


def test_eagle_oracle_inside_the_reduced_vocabulary_all_accepted(drafters, tmp_path):
    """The oracle scores the true token over the reduced vocabulary (its draft id): only a correct mapping back to
    target ids gets it accepted."""
    t, paths = drafters
    for ids in PROMPTS:
        truth = ids + plain(t, ids).token_ids
        e = _engine(t, paths["eagle"], "eagle", num_speculative_tokens=3, tree_width=1, draft_vocab=VOCAB // 2,
                    token_map=_map(t, tmp_path, 1, keep=sorted(set(truth))))
        d, m = e.drafter, e.drafter.model
        vocab = m._shared["vocab"]
        state = {"calls": 0}
        orig = d.propose

        def propose(ctxs, orig=orig):
            state["n"], state["calls"] = len(ctxs[0].tokens) - 1, 0
            return orig(ctxs)

        def draft_logits(h):
            tok = truth[min(state["n"] + 1 + state["calls"], len(truth) - 1)]
            state["calls"] += 1
            out = torch.zeros(h.shape[0] if h.dim() == 2 else 1, vocab.numel())
            out[:, int(torch.searchsorted(vocab, tok))] = 10.0
            return out

        d.propose, m.draft_logits = propose, draft_logits
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == truth[len(ids):]
        assert got.mean_accepted_length == pytest.approx(4, rel=0.15)


@pytest.mark.parametrize("method,extra", [("eagle", {"tree_width": 1}), ("eagle3", {"tree_width": 3})])
def test_reduced_vocabulary_sampling_distribution(drafters, method, extra, sampling_tv, tmp_path):
    t, paths = drafters
    e = _engine(t, paths[method], method, num_speculative_tokens=3, draft_vocab=VOCAB // 2 if method == "eagle"
                else 100, token_map=_map(t, tmp_path, 2), **extra)
    assert sampling_tv(e, Engine(t.model, t.tokenizer), PROMPTS[0]) < 0.12


@pytest.mark.parametrize("extra", [{}, {"num_speculative_tokens": 3, "tree_width": 2}])
def test_mtp_reduced_vocabulary_identical(mtp_target, extra, tmp_path):
    t, d = mtp_target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mtp_engine(t, d, draft_vocab=VOCAB // 2, token_map=_map(t, tmp_path, 3), **extra)
    vocab = set(e.drafter.mtp.draft_vocab.tolist())
    assert len(vocab) == VOCAB // 2
    drafted = []
    _spy(e.drafter, drafted)
    for ids in PROMPTS:
        assert e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids == plain(t, ids).token_ids
    assert drafted and set(drafted) <= vocab
    full = e.drafter.memory()["weights"]
    assert full > sum(p.numel() * p.element_size() for p in e.drafter.mtp.parameters())  # the rows' copy counted


def test_bad_settings(drafters, tmp_path):
    t, paths = drafters
    with pytest.raises(SpecloomError, match='give "draft_vocab"'):
        _engine(t, paths["eagle"], "eagle", token_map=_map(t, tmp_path))
    with pytest.raises(SpecloomError, match="not smaller than the vocabulary"):
        _engine(t, paths["eagle"], "eagle", draft_vocab=VOCAB + 5, token_map=_map(t, tmp_path))
    with pytest.raises(SpecloomError, match="no such file"):
        _engine(t, paths["eagle3"], "eagle3", draft_vocab=50, token_map=str(tmp_path / "missing.json"))
    e = _engine(t, paths["eagle3"], "eagle3", draft_vocab=500, token_map=_map(t, tmp_path))  # >= its 200: all kept
    assert e.drafter.model.config.draft_vocab_size == 200


def test_sliced_checkpoint_drafts_as_the_load_time_slice(drafters, tmp_path):
    """scripts/slice_eagle3_vocab.py stores the rows `draft_vocab` keeps at load: the same d2t and head scores."""
    import subprocess
    import sys

    t, paths = drafters
    tmap = _map(t, tmp_path, 4)
    out = tmp_path / "sliced"
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "slice_eagle3_vocab.py")
    subprocess.run([sys.executable, script, paths["eagle3"], "--draft-vocab", "64", "--token-map", tmap, "--out",
                    str(out)], check=True, capture_output=True)
    a = _engine(t, paths["eagle3"], "eagle3", draft_vocab=64, token_map=tmap).drafter.model
    b = _engine(t, str(out), "eagle3").drafter.model
    assert b.config.draft_vocab_size == 64 and torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)
    h = torch.randn(2, t.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(b.draft_logits(h), a.draft_logits(h), rtol=0, atol=0)
