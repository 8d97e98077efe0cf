"""Suffix decoding in front of a model drafter (`"suffix_decoding": true`, drafters/suffix/hybrid.py) on a tiny
fp32 target: greedy output identical to plain greedy decoding for hidden-state drafters of every shape (chains,
trees, Medusa), with both halves really drafting (suffix trees where the context repeats, the model drafter
elsewhere, the model drafter catching up over positions a suffix tree won); a cached answer drafted by the
suffix side is all accepted; sampling keeps the target's distribution with a near-target model drafter; the
batch scheduler gives each request its alone output; bad keys are refused with one message."""

import pytest

from specloom import Engine, SpecloomError
from specloom.drafters.suffix.hybrid import SuffixFirst
from specloom.sampling import SamplingParams
from specloom.scheduler import BatchScheduler, Sequence
from specloom.speculative import SpeculativeConfig

from test_hidden_drafters import drafters, make_eagle, make_medusa  # noqa: F401  (module fixture)

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
           [9, 200, 9, 200, 9, 200, 17]]
N = 29


def plain(t, ids, n=N):
    return Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=n, ignore_eos=True).token_ids


def hybrid(t, path, method, **keys) -> Engine:
    spec = SpeculativeConfig.parse({"method": method, "model": path, "suffix_decoding": True, **keys})
    return Engine(t.model, t.tokenizer, spec, max_model_len=256)


@pytest.mark.parametrize("method,extra", [
    ("eagle", {"num_speculative_tokens": 3, "tree_width": 1}),
    ("eagle3", {"num_speculative_tokens": 4, "tree_width": 3, "num_draft_tokens": 9}),
    ("medusa", {}),
])
def test_greedy_identical_and_both_halves_draft(drafters, method, extra):
    t, paths = drafters
    e = hybrid(t, paths[method], method, suffix_decoding_min_score=0.5, **extra)
    assert isinstance(e.drafter, SuffixFirst) and e.drafter.method == f"{method}+suffix"
    drafted = 0
    for ids in PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert r.token_ids == plain(t, ids)
        drafted += r.num_draft_tokens
    d = e.drafter
    assert d.suffix_steps > 0 and d.inner_steps > 0, (d.suffix_steps, d.inner_steps)
    assert drafted > 0


def test_cached_answer_drafted_by_the_suffix_side_is_all_accepted(drafters):
    """Self-draft through the suffix half: with the true answer in the global cache, every step's suffix tree
    scores high and is verified; all its drafts are accepted (the model drafter, random, would accept almost
    nothing), and the model drafter still catches up over those steps (a later step of its own stays exact)."""
    t, paths = drafters
    ids = PROMPTS[1]
    truth = plain(t, ids, 24)
    e = hybrid(t, paths["eagle3"], "eagle3", num_speculative_tokens=2, tree_width=1)
    e.drafter.suffix.add_response(truth[:12])  # the first half only: the second half is the model drafter's
    r = e.generate(prompt_token_ids=ids, max_tokens=24, ignore_eos=True)
    assert r.token_ids == truth
    assert e.drafter.suffix_steps >= 2 and e.drafter.inner_steps >= 2
    assert r.num_accepted_tokens >= 9  # the cached half: drafted 8 deep (not the model drafter's 2) and accepted


def test_choice_starts_from_the_measured_tau_and_follows_what_each_side_delivers(drafters):
    """The threshold starts at the model drafter's measured tau - 1 and follows its accepted tokens; a suffix
    tree's score is scaled by how many of its claimed tokens earlier suffix trees got accepted."""
    from specloom.tree import DraftTree
    from specloom.verify import VerifyResult

    t, paths = drafters
    e = hybrid(t, paths["eagle"], "eagle", num_speculative_tokens=2)
    assert e.drafter.threshold(e.drafter.new_state().tally) == 1.0  # no measured tau in a test checkpoint
    d = SuffixFirst(e.drafter.inner, e.drafter.suffix, prior_tau=1.8)
    assert d.num_speculative_tokens == 2 and d.needs_hidden == e.drafter.inner.needs_hidden
    assert d.memory() == e.drafter.inner.memory()
    st = d.new_state()
    assert d.threshold(st.tally) == pytest.approx(0.8)
    tree = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2], score=3.0)
    assert d.takes_suffix(tree, st.tally) and not d.takes_suffix(DraftTree([1], [-1]), st.tally)

    from specloom.drafters import DraftContext

    ctx = DraftContext([1], 1, SamplingParams(), None, 0, state=st)
    for _ in range(6):  # suffix trees claiming 3.0 that get nothing accepted: the claim is discounted
        st.last = (True, 3.0)
        d.inner.on_verified = lambda *a: None
        d.on_verified([ctx], [VerifyResult([0], [7], False)], None)
    assert st.tally.calibration < 0.8 / 3.0 and not d.takes_suffix(tree, st.tally)
    for _ in range(6):  # the model's trees now get nothing accepted either: the bar falls with them
        st.last = (False, 0.0)
        d.on_verified([ctx], [VerifyResult([0], [7], False)], None)
    assert st.tally.model_mean < 0.3 and d.takes_suffix(tree, st.tally)
    fixed = SuffixFirst(e.drafter.inner, e.drafter.suffix, min_score=2.5, prior_tau=1.8)
    assert fixed.threshold(fixed.new_state().tally) == 2.5


def test_sampling_distribution(drafters, sampling_tv):
    """q != p on the model half (EAGLE-1 scoring with the target's logits plus noise) and one-hot drafts from an
    earlier-answer cache on the suffix half, both within the same requests: still the target's distribution.
    (The cached answers' trees score 1.55 or 1.78 here: a threshold of 1.7 splits the steps about evenly.)"""
    from conftest import near_target_scores

    t, paths = drafters
    ids = PROMPTS[0]
    e = hybrid(t, paths["eagle"], "eagle", num_speculative_tokens=2, tree_width=1, suffix_decoding_min_score=1.7,
               suffix_decoding_max_spec_factor=4.0, suffix_decoding_min_token_prob=0.0)
    near_target_scores(e.drafter.inner, t.model, noise=1.0)
    p = Engine(t.model, t.tokenizer)
    for s in range(20):
        e.drafter.suffix.add_response(p.generate(prompt_token_ids=ids, max_tokens=6, temperature=1.0, top_k=2,
                                                 seed=70_000 + s, ignore_eos=True).token_ids)
    tv = sampling_tv(e, p, ids)
    assert e.drafter.suffix_steps > 0 and e.drafter.inner_steps > 0
    assert tv < 0.12, tv


def test_batch_scheduler_alone_outputs(drafters):
    t, paths = drafters
    e = hybrid(t, paths["eagle3"], "eagle3", num_speculative_tokens=3, tree_width=2, num_draft_tokens=6,
               suffix_decoding_min_score=0.5)
    want = [plain(t, p, 20) for p in PROMPTS]
    sch = BatchScheduler(e, rows=3, mode="fixed")
    try:
        seqs = [Sequence(p, 20, SamplingParams(), ignore_eos=True) for p in PROMPTS]
        sch.submit(seqs)
        assert [s.wait(120).token_ids for s in seqs] == want
    finally:
        sch.close()
    assert e.drafter.suffix_steps > 0 and e.drafter.inner_steps > 0


@pytest.mark.parametrize("spec, needle", [
    ({"method": "eagle3", "suffix_decoding_min_score": 1.0}, 'need "suffix_decoding": true'),
    ({"method": "eagle3", "suffix_decoding_max_tree_depth": 8}, 'need "suffix_decoding": true'),
    ({"method": "suffix", "suffix_decoding": True}, "with method 'suffix' drop it"),
    ({"method": "eagle3", "suffix_decoding": "yes"}, "suffix_decoding must be true or false"),
    ({"method": "eagle3", "suffix_decoding": True, "suffix_decoding_min_score": -1}, "in [0, 256]"),
    ({"method": "eagle3", "suffix_decoding": True, "suffix_decoding_max_tree_depth": 0}, "in [1, 256]"),
])
def test_bad_keys(spec, needle):
    with pytest.raises(SpecloomError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.parse(spec)
