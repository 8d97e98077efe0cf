"""probs_from_logits (temperature -> top-k -> top-p), sample_token and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from specloom.errors import SpecloomError
from specloom.sampling import SamplingParams, probs_from_logits, sample_token


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 4.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert p.dtype == torch.float32
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    # greedy ignores top-k / top-p
    p = probs_from_logits(logits[0], SamplingParams(temperature=0.0, top_k=2, top_p=0.1))
    assert torch.equal(p, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert sample_token(logits[1], SamplingParams(), None) == 0


def test_bf16_logits_give_fp32_probs():
    logits = torch.randn(10, generator=torch.Generator().manual_seed(0)).bfloat16()
    p = probs_from_logits(logits, SamplingParams(temperature=1.0))
    assert p.dtype == torch.float32
    assert torch.allclose(p, logits.float().softmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature):
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1)) * 3
    p = probs_from_logits(logits, SamplingParams(temperature=temperature))
    assert torch.allclose(p, (logits / temperature).softmax(-1), atol=1e-7)
    assert torch.allclose(p.sum(-1), torch.ones(2))


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = probs_from_logits(logits, SamplingParams(temperature=0.5))
    warm = probs_from_logits(logits, SamplingParams(temperature=2.0))
    assert cold[0] > logits.softmax(-1)[0] > warm[0]
    # hand-worked: T=2 -> softmax([1, .5, 0])
    e = [math.exp(1.0), math.exp(0.5), 1.0]
    assert torch.allclose(warm, torch.tensor([x / sum(e) for x in e]), atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k(k):
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    p = probs_from_logits(logits, SamplingParams(temperature=0.7, top_k=k))
    for row in range(3):
        kept = (p[row] > 0).nonzero().flatten()
        assert len(kept) == k
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())
        expect = (logits[row, kept] / 0.7).softmax(-1)
        assert torch.allclose(p[row, kept], expect, atol=1e-6)
        assert abs(p[row].sum().item() - 1) < 1e-6


@pytest.mark.parametrize("k", [0, -1, 20, 50])
def test_top_k_off(k):
    logits = torch.randn(20, generator=torch.Generator().manual_seed(3))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
    assert torch.allclose(p, logits.softmax(-1), atol=1e-7)


# hand-worked top-p: probabilities 0.1, 0.4, 0.3, 0.2 (tokens 0..3); sorted: 0.4 (t1), 0.3 (t2), 0.2 (t3), 0.1 (t0)
# cumulative mass 0.4, 0.7, 0.9, 1.0.
@pytest.mark.parametrize(
    "top_p, expect",
    [
        (0.3, [0.0, 1.0, 0.0, 0.0]),  # 0.4 alone reaches 0.3
        (0.65, [0.0, 4 / 7, 3 / 7, 0.0]),  # needs t1 + t2 (0.7)
        (0.75, [0.0, 4 / 9, 3 / 9, 2 / 9]),  # needs t1 + t2 + t3 (0.9)
        (0.95, [0.1, 0.4, 0.3, 0.2]),  # needs every token
        (1.0, [0.1, 0.4, 0.3, 0.2]),  # off
    ],
)
def test_top_p_smallest_prefix_reaching_p(top_p, expect):
    p = probs_from_logits(logits_of([0.1, 0.4, 0.3, 0.2]), SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.allclose(p, torch.tensor(expect), atol=1e-6), p


def test_top_p_applies_after_temperature_and_top_k():
    logits = logits_of([0.1, 0.4, 0.3, 0.2])
    # top_k=3 drops t0 -> renormalised 0.4/.9, 0.3/.9, 0.2/.9 = .444, .333, .222; top_p 0.7 then needs t1 + t2
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.0, 4 / 7, 3 / 7, 0.0]), atol=1e-6), p
    # temperature 0.5 squares the probabilities: .01, .16, .09, .04 (/.30) -> t1 alone is .533 >= 0.5
    p = probs_from_logits(logits, SamplingParams(temperature=0.5, top_p=0.5))
    assert torch.allclose(p, torch.tensor([0.0, 1.0, 0.0, 0.0]), atol=1e-6), p
    # ... while at temperature 1, t1 alone (0.4) does not reach 0.5
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([0.0, 4 / 7, 3 / 7, 0.0]), atol=1e-6), p


def test_top_p_batched_rows_are_independent():
    rows = torch.stack([logits_of([0.1, 0.4, 0.3, 0.2]), logits_of([0.7, 0.1, 0.1, 0.1])])
    p = probs_from_logits(rows, SamplingParams(temperature=1.0, top_p=0.6))
    assert torch.allclose(p, torch.tensor([[0.0, 4 / 7, 3 / 7, 0.0], [1.0, 0.0, 0.0, 0.0]]), atol=1e-6), p


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    g = params.generator()
    return [sample_token(logits, params, g) for _ in range(n)]


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(4))
    a = draws(SamplingParams(temperature=1.0, seed=7), logits, 30)
    b = draws(SamplingParams(temperature=1.0, seed=7), logits, 30)
    c = draws(SamplingParams(temperature=1.0, seed=8), logits, 30)
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # really sampling, not argmax


def test_seeded_generator_is_independent_of_global_rng():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=11)
    torch.manual_seed(0)
    a = draws(params, logits, 10)
    torch.manual_seed(123)
    torch.rand(100)
    b = draws(params, logits, 10)
    assert a == b


def test_samples_respect_filters_and_frequencies():
    logits = logits_of([0.1, 0.4, 0.3, 0.2])
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    got = draws(params, logits, 3000)
    assert 0 not in got
    freq = torch.bincount(torch.tensor(got), minlength=4).float() / len(got)
    assert torch.allclose(freq, torch.tensor([0.0, 4 / 9, 3 / 9, 2 / 9]), atol=0.04), freq

    params = SamplingParams(temperature=1.0, top_p=0.3, seed=0)
    assert set(draws(params, logits, 200)) == {1}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=-0.5),
        dict(top_p=1.5),
        dict(top_p=float("nan")),
        dict(top_k=-2),
    ],
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(SpecloomError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(temperature=0.7, top_k=-1, top_p=1.0), dict(top_k=0, top_p=0.01, seed=3)]
)
def test_sampling_params_accept_good_values(kwargs):
    SamplingParams(**kwargs)


def test_engine_seeded_generation_is_reproducible(tiny):
    from specloom.engine import Engine

    t = tiny("llama")
    engine = Engine(t.model, t.tokenizer)
    ids = list(range(10, 30))
    run = lambda seed: engine.generate(prompt_token_ids=ids, max_tokens=12, temperature=1.0, seed=seed,
                                       ignore_eos=True).token_ids
    a, b, c = run(5), run(5), run(6)
    assert a == b
    assert a != c
    greedy = engine.generate(prompt_token_ids=ids, max_tokens=12, ignore_eos=True).token_ids
    assert greedy == engine.generate(prompt_token_ids=ids, max_tokens=12, ignore_eos=True, seed=99).token_ids
