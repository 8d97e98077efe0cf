"""Presence, frequency and repetition penalties and logit bias (specloom/penalties.py): plain decoding follows the
definitions (checked against a naive loop that recomputes every step from scratch), and speculative decoding gives
plain decoding's output for every drafter kind -- each draft-tree node is penalised by the tokens on its own path,
the classic place for such a bug -- and, when sampling, plain decoding's distribution."""

from collections import Counter

import pytest
import torch

from specloom import Engine
from specloom.errors import SpecloomError
from specloom.speculative import SpeculativeConfig

from test_kv_types import KINDS, kinds  # noqa: F401  (fixture: a spec for every drafter kind on the tiny target)

SETTINGS = {
    "presence+frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.8),
    "bias+frequency": dict(logit_bias={7: 4.0, 9: -100.0, 41: 2.5}, frequency_penalty=2.0),
    "negative": dict(presence_penalty=-1.0, frequency_penalty=-0.5),  # rewards repeats: drafts that repeat pass
}
COMBINED = {  # every drafter kind runs these two (each mixes the four fields)
    "bias+presence+frequency": dict(logit_bias={7: 4.0, 9: -100.0, 41: 2.5}, presence_penalty=1.5,
                                    frequency_penalty=0.7),
    "repetition+rewarded repeats": dict(repetition_penalty=1.8, frequency_penalty=-0.5),
}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [9, 200, 9, 200, 17]]
N = 20


def _naive(model, prompt, n, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None):
    """Greedy decoding from scratch each step, the penalties applied token by token as OpenAI / HF define them;
    stops at the first step whose top two processed logits are within 1e-4 (a tie either order may break)."""
    seq, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.tensor([seq])
            logits = model(ids, torch.arange(len(seq))[None], model.new_kv(len(seq) + 1)).logits[0, -1].clone()
            for t, b in (logit_bias or {}).items():
                logits[t] += b
            for t in set(prompt) | set(out):
                if repetition_penalty != 1.0:
                    v = logits[t]
                    logits[t] = v / repetition_penalty if v > 0 else v * repetition_penalty
            for t, c in Counter(out).items():
                logits[t] -= frequency_penalty * c + presence_penalty
            top = logits.topk(2).values
            if top[0] - top[1] < 1e-4:
                break
            out.append(int(logits.argmax()))
            seq.append(out[-1])
    return out


@pytest.mark.parametrize("setting", SETTINGS)
def test_plain_decoding_follows_the_definitions(kinds, setting):
    t = kinds[0]
    engine = Engine(t.model, t.tokenizer)
    for p in PROMPTS:
        want = _naive(t.model, p, N, **SETTINGS[setting])
        got = engine.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True, **SETTINGS[setting]).token_ids
        assert got[:len(want)] == want and len(want) >= 5, (p, got, want)
        plain = engine.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids
        assert got != plain or setting == "negative"  # the penalties did something


@pytest.mark.parametrize("kind", KINDS)
def test_every_drafter_gives_plain_output_under_penalties(kinds, kind):
    t, (mtp_model, mtp_tok), specs = kinds
    target, tok = (mtp_model, mtp_tok) if kind.startswith("mtp") else (t.model, t.tokenizer)
    plain = Engine(target, tok)
    spec = Engine(target, tok, SpeculativeConfig.parse(specs[kind]), speculation="fixed")
    drafted = 0
    for name, setting in COMBINED.items():
        for p in PROMPTS:
            want = plain.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True, **setting).token_ids
            got = spec.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True, **setting)
            assert got.token_ids == want, (name, p)
            drafted += got.num_draft_tokens
    if kind != "suffix":
        assert drafted > 0


def test_a_tree_node_is_penalised_by_its_own_path():
    """The unit itself: a 3-node tree root -> a -> b and root -> c; node b's row must count a (its parent), node
    c's row must not."""
    from specloom import penalties
    from specloom.sampling import SamplingParams
    from specloom.tree import DraftTree

    tree = DraftTree([1, 2, 3, 4], [-1, 0, 1, 0])  # root 1; 2 -> 3 on one branch, 4 on another
    logits = torch.zeros(4, 8)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    penalties.apply(logits, params, tree, prompt=[6], output=[5, 1, 5])
    want = torch.zeros(4, 8)
    want[:, 5] -= 1.0 + 0.5 * 2  # output so far: 5 twice, the root 1 once
    want[:, 1] -= 1.5
    want[1:3, 2] -= 1.5  # node 2 and its child 3 see 2
    want[2, 3] -= 1.5  # node 3 sees itself
    want[3, 4] -= 1.5  # node 4 sees itself only
    assert torch.equal(logits, want)
    rep = torch.tensor([[2.0, -2.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0]] * 4)
    penalties.apply(rep, SamplingParams(repetition_penalty=2.0), tree, prompt=[6], output=[1])
    assert rep[0, 6] == 1.5 and rep[0, 1] == -4.0 and rep[0, 2] == 1.0 and rep[1, 2] == 0.5  # prompt, output, path


def test_sampling_distribution_under_penalties(kinds):
    """Temperature-1 samples with penalties: a self-drafting engine (q = the unpenalised target, so drafts are
    often rejected and residuals drawn) against plain decoding, total variation over the first three tokens (top-k 2:
    8 outcomes; two plain runs differ by about 0.06 at 400 samples, as in conftest._sampling_tv)."""
    t, _, specs = kinds
    setting = dict(presence_penalty=1.2, logit_bias={7: 1.0})
    spec = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(specs["self_draft"]), speculation="fixed")
    plain = Engine(t.model, t.tokenizer)

    def run(engine, base, rule):
        outs, drafted = Counter(), 0
        for s in range(400):
            r = engine.generate(prompt_token_ids=PROMPTS[0], max_tokens=4, temperature=1.0, top_k=2, seed=base + s,
                                sampling_rule=rule, ignore_eos=True, **setting)
            outs[tuple(r.token_ids[:3])] += 1
            drafted += r.num_draft_tokens
        return outs, drafted

    a, drafted = run(spec, 0, "rejection")
    b, _ = run(plain, 10_000, "rejection")
    assert drafted >= 400
    tv = 0.5 * sum(abs(a[x] - b[x]) for x in set(a) | set(b)) / 400
    assert tv < 0.12, tv
    for s in range(40):  # the coupled rule: the same seed gives plain decoding's text exactly
        kw = dict(prompt_token_ids=PROMPTS[0], max_tokens=6, temperature=1.0, seed=s, sampling_rule="coupled",
                  ignore_eos=True, **setting)
        assert spec.generate(**kw).token_ids == plain.generate(**kw).token_ids


def test_bad_penalties_are_one_clear_error(kinds):
    t = kinds[0]
    engine = Engine(t.model, t.tokenizer)
    for kw, words in ((dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
                      (dict(repetition_penalty=0.0), "repetition_penalty must be in (0, 100]"),
                      (dict(logit_bias={3: 101.0}), "logit_bias takes token ids"),
                      (dict(logit_bias={10 ** 6: 1.0}), "outside the vocabulary")):
        with pytest.raises(SpecloomError, match=words.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            engine.generate(prompt_token_ids=[5, 6], max_tokens=2, **kw)
