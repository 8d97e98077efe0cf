"""Seeded sampling that no drafter can change (sampling.py's "coupled" rule, the default for a seeded request): the
token at sequence index t is argmax(log p_t + G_t) with Gumbel noise keyed to (seed, t), a draft is kept iff it
equals it. So for every drafter kind, tree shape, batch and history the seeded text is plain decoding's own, and
the distribution is still the target's."""

from __future__ import annotations

import pytest
import torch

from specloom import Engine
from specloom.sampling import SamplingParams, coupled_token, position_noise, probs_from_logits
from specloom.scheduler import BatchScheduler, Sequence
from specloom.speculative import SpeculativeConfig

from test_batching import kinds  # noqa: F401  (fixture: a spec for every drafter kind on the tiny target)

IDS = [5, 6, 7, 8, 5, 6, 7, 9, 10]
KINDS = ["ngram", "self_draft", "draft_model_tree", "eagle_tree", "eagle3", "medusa", "dflash", "dspark", "mtp"]


def _engine(kinds, kind):
    t, mtp_dir, specs = kinds
    if kind == "mtp":
        import specloom

        e = specloom.load(mtp_dir, {"method": "mtp", "num_speculative_tokens": 3}, dtype="fp32", progress=False)
        e.model, e.tokenizer = t.model, t.tokenizer
        return e
    return Engine(t.model, t.tokenizer, SpeculativeConfig.parse(specs[kind]), max_model_len=256)


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_text_is_plain_decodings_for_every_drafter(kinds, kind):
    t = kinds[0]
    e, plain = _engine(kinds, kind), Engine(t.model, t.tokenizer)
    drafted = 0
    for seed in range(6):
        kw = dict(prompt_token_ids=IDS, max_tokens=24, temperature=1.0, top_k=8, seed=seed, ignore_eos=True)
        want = plain.generate(**kw).token_ids
        got = e.generate(**kw)
        assert got.token_ids == want, (kind, seed)
        drafted += got.num_draft_tokens
    assert drafted > 0  # the drafter really drafted


def test_self_draft_is_all_accepted(kinds):
    """The target drafting for itself, with the same noise, agrees on every token."""
    e = _engine(kinds, "self_draft")
    r = e.generate(prompt_token_ids=IDS, max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    assert r.num_draft_tokens > 0 and r.num_accepted_tokens == r.num_draft_tokens


def test_batched_beside_others_and_a_growing_suffix_cache_change_nothing(kinds):
    """A seeded request in a pool beside unrelated requests, and again after the server-wide suffix cache grew:
    the same text, plain decoding's."""
    t, _, specs = kinds
    spec = SpeculativeConfig.parse({**specs["eagle3"], "suffix_decoding": True})
    e = Engine(t.model, t.tokenizer, spec, max_model_len=256)
    want = Engine(t.model, t.tokenizer).generate(prompt_token_ids=IDS, max_tokens=20, temperature=1.0, seed=42,
                                                 ignore_eos=True).token_ids
    sch = BatchScheduler(e, rows=4, mode="fixed")
    try:
        outs = []
        for round_ in range(3):  # each round's responses feed the suffix cache the next round drafts from
            others = [Sequence([9 + round_, 8, 7, 6] * 3, 20, SamplingParams(temperature=0.8, seed=round_),
                               ignore_eos=True) for _ in range(3)]
            mine = Sequence(IDS, 20, SamplingParams(temperature=1.0, seed=42), ignore_eos=True)
            sch.submit(others + [mine])
            outs.append(mine.wait(120).token_ids)
            for s in others:
                s.wait(120)
    finally:
        sch.close()
    assert outs == [want] * 3


def test_coupled_sampling_keeps_the_target_distribution(kinds, sampling_tv):
    """Over many seeds the coupled rule samples the target's distribution (against plain rejection sampling),
    drafting all the while."""
    t = kinds[0]
    assert sampling_tv(_engine(kinds, "self_draft"), Engine(t.model, t.tokenizer), IDS[:7], rule="coupled") < 0.1


def test_gumbel_max_with_keyed_noise_samples_p():
    """The coupled token over 4000 keys follows p (top-k and temperature applied), and the noise depends on
    (seed, position) alone."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    params = SamplingParams(temperature=0.7, top_k=5, seed=0)
    p = probs_from_logits(logits, params)
    counts = torch.zeros(12)
    for key in range(4000):
        counts[coupled_token(logits, params, key, 17)] += 1
    assert 0.5 * float((counts / 4000 - p).abs().sum()) < 0.04
    assert counts[p == 0].sum() == 0  # never a token top-k removed
    assert torch.equal(position_noise(5, 9, 100), position_noise(5, 9, 100))
    assert not torch.equal(position_noise(5, 9, 100), position_noise(5, 10, 100))
    assert not torch.equal(position_noise(5, 9, 100), position_noise(6, 9, 100))


def test_rules_are_a_request_choice():
    assert SamplingParams(temperature=1.0, seed=1).coupled  # seeded: reproducible by default
    assert not SamplingParams(temperature=1.0).coupled  # unseeded: rejection sampling
    assert not SamplingParams(temperature=1.0, seed=1, rule="rejection").coupled
    assert SamplingParams(temperature=1.0, rule="coupled").noise_seed() is not None
    assert not SamplingParams(seed=1).coupled  # greedy has no rule
    with pytest.raises(Exception, match="sampling rule must be one of"):
        SamplingParams(rule="lucky")
