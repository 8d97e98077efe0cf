"""draft_model with a reduced, frequency-ranked draft vocabulary (`"draft_vocab": N`, FR-Spec): the head scores N
tokens only, and the output is still the target's own -- greedy identical to plain, sampling distributed as plain.
A self-draft whose reduced vocabulary holds every token of the greedy continuation accepts everything (so the
draft ids are mapped back to the target's); one that lacks the continuation's tokens accepts less, output
unchanged."""

import json
import random

import pytest

from specloom import Engine, SpecloomError
from specloom.drafters.token_map import FORMAT, build_token_map
from specloom.fingerprint import vocab_sha
from specloom.speculative import SpeculativeConfig

from conftest import VOCAB

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
N = 25


def write_map(path, tok, ranked, vocab_size=VOCAB):
    path.write_text(json.dumps({"format": FORMAT, "vocab_size": vocab_size, "vocab_sha": vocab_sha(tok),
                                "ranked": ranked, "counts": [1] * len(ranked), "tokens_counted": len(ranked)}))
    return str(path)


def engine(t, **spec):
    return Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "draft_model", "model": t.path, **spec}))


def plain(t, ids, **kw):
    return Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True, **kw)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_reduced_vocabulary_self_draft(tiny, family, tmp_path):
    t = tiny(family)
    refs = [plain(t, ids).token_ids for ids in PROMPTS]
    used = sorted({x for r in refs for x in r})
    path = write_map(tmp_path / "m.json", t.tokenizer, used + [i for i in range(VOCAB) if i not in used])
    n = len(used) + 3
    e = engine(t, num_speculative_tokens=3, draft_vocab=n, token_map=path)
    assert e.drafter.head is not None and tuple(e.drafter.head.weight.shape) == (n, t.model.config.hidden_size)
    assert set(used) <= set(e.drafter.vocab.tolist()) and len(e.drafter.vocab) == n
    for ids, ref in zip(PROMPTS, refs):
        r = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert r.token_ids == ref
        assert r.acceptance_per_position == [1.0] * 3  # the drafts are the target's argmaxes, as target ids

    # a reduced vocabulary without the continuation's most frequent tokens: fewer accepted, output unchanged
    missing = [i for i in range(VOCAB) if i not in used]
    e = engine(t, num_speculative_tokens=3, draft_vocab=len(missing), token_map=write_map(
        tmp_path / "m2.json", t.tokenizer, missing + used))
    for ids, ref in zip(PROMPTS, refs):
        r = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert r.token_ids == ref
        assert r.num_accepted_tokens == 0


def test_reduced_vocabulary_tree(tiny, tmp_path):
    t = tiny("llama")
    path = write_map(tmp_path / "m.json", t.tokenizer, random.Random(0).sample(range(VOCAB), VOCAB))
    e = engine(t, num_speculative_tokens=3, tree_width=2, draft_vocab=96, token_map=path)
    for ids in PROMPTS:
        assert e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids == plain(t, ids).token_ids


def test_reduced_vocabulary_sampling_distribution(tiny, tmp_path, sampling_tv):
    """Self-draft over a random half of the vocabulary: q (renormalised over it) differs from p, so drafts are
    both accepted and rejected, and the output must still follow p."""
    t = tiny("llama")
    path = write_map(tmp_path / "m.json", t.tokenizer, random.Random(1).sample(range(VOCAB), VOCAB))
    e = engine(t, num_speculative_tokens=2, draft_vocab=VOCAB // 2, token_map=path)
    tv = sampling_tv(e, Engine(t.model, t.tokenizer), PROMPTS[0])
    assert tv < 0.12, tv


def test_token_map_built_from_text_and_checked(tiny, tmp_path):
    t = tiny("llama")
    m = build_token_map(t.tokenizer, ["abc abc abc", "hello abc"], VOCAB, ["x"])
    assert m["ranked"] and m["counts"] == sorted(m["counts"], reverse=True) and m["tokens_counted"] == sum(m["counts"])
    good = write_map(tmp_path / "good.json", t.tokenizer, list(range(VOCAB)))
    cases = [
        ({"draft_vocab": 8}, "none is bundled"),  # the tiny tokenizer has no bundled map
        ({"draft_vocab": 8, "token_map": str(tmp_path / "nope.json")}, "no such file"),
        ({"draft_vocab": VOCAB, "token_map": good}, "not smaller than the vocabulary"),
        ({"token_map": good}, "give \"draft_vocab\""),
        ({"draft_vocab": 8, "token_map": write_map(tmp_path / "other.json", t.tokenizer, [1, 2], VOCAB + 1)},
         "another tokenizer"),
        ({"draft_vocab": 8, "token_map": write_map(tmp_path / "dup.json", t.tokenizer, [1, 1])}, "distinct"),
    ]
    (tmp_path / "junk.json").write_text("[1, 2")
    cases.append(({"draft_vocab": 8, "token_map": str(tmp_path / "junk.json")}, "not a readable JSON"))
    for spec, msg in cases:
        with pytest.raises(SpecloomError, match=msg):
            engine(t, **spec)
    with pytest.raises(SpecloomError, match="draft_vocab must be an integer"):
        SpeculativeConfig.parse({"method": "draft_model", "model": t.path, "draft_vocab": 0})
    with pytest.raises(SpecloomError, match="does not take 'draft_vocab'"):
        SpeculativeConfig.parse({"method": "ngram", "draft_vocab": 8})


def test_token_map_command_writes_a_map_the_drafter_reads(tiny, tmp_path, capsys):
    from specloom.cli import main
    from specloom.drafters.token_map import reduced_vocabulary

    t = tiny("llama")
    train = tmp_path / "train"
    train.mkdir()
    (train / "p.jsonl").write_text('{"turns": ["abc abc abc"]}\n{"prompt": "hello abc"}\n')
    out = tmp_path / "map.json"
    assert main(["token-map", t.path, "--prompts", str(train), "--out", str(out)]) == 0
    assert "distinct tokens" in capsys.readouterr().out
    m = json.loads(out.read_text())
    assert m["vocab_size"] == VOCAB and m["tokens_counted"] == sum(m["counts"]) > 0
    n = len(m["ranked"])
    ids = reduced_vocabulary(n + 2, str(out), t.tokenizer, VOCAB)  # the ranked tokens, then ids in order
    rest = [i for i in range(VOCAB) if i not in m["ranked"]][:2]
    assert set(ids.tolist()) == set(m["ranked"]) | set(rest)
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "b.jsonl").write_text('{"turns": ["x"]}\n')
    assert main(["token-map", t.path, "--prompts", str(ev), "--out", str(tmp_path / "m2.json")]) == 2
    assert "benchmark prompts are never training data" in capsys.readouterr().err


def test_draft_kernel_int8_keeps_the_output(tiny, tmp_path):
    """`"draft_kernel": "int8"` runs a separate draft model (here a copy of the target) on weight-only int8:
    its guesses move a little, the output stays the target's own; a bad name or a self-draft is refused."""
    import shutil

    from specloom.models import cpu_packing

    if not cpu_packing.int8_supported():
        pytest.skip("torch._weight_int8pack_mm is not available on this host")
    t = tiny("llama")
    copy = shutil.copytree(t.path, tmp_path / "copy")
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(
        {"method": "draft_model", "model": str(copy), "num_speculative_tokens": 3, "draft_kernel": "int8"}))
    assert e.drafter.model is not t.model
    linears = [m for m in e.drafter.model.modules() if isinstance(m, cpu_packing.RowSplitLinear)]
    assert linears and all(cpu_packing.kernel_of(m.single) == "int8" for m in linears)  # one-row drafting passes
    assert all(cpu_packing.kernel_of(m.multi) == t.model.kernel_choice.multi for m in linears)  # catch-up feeds
    accepted = 0
    for ids in PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert r.token_ids == plain(t, ids).token_ids
        accepted += r.num_accepted_tokens
    assert accepted > 0  # an int8 copy of the target still guesses it well
    every = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(
        {"method": "draft_model", "model": str(copy), "num_speculative_tokens": 3, "draft_kernel": "int8+int8"}))
    assert {cpu_packing.kernel_of(m) for m in every.drafter.model.modules()
            if isinstance(m, cpu_packing.Int8Linear)} == {"int8"}
    assert not any(isinstance(m, cpu_packing.RowSplitLinear) for m in every.drafter.model.modules())
    assert every.generate(prompt_token_ids=PROMPTS[0], max_tokens=N, ignore_eos=True).token_ids == \
        plain(t, PROMPTS[0]).token_ids
    for bad in ("fp4", "auto+int8", "int8+int8+int8", 8):
        with pytest.raises(SpecloomError, match="draft_kernel must be auto, a kernel"):
            SpeculativeConfig.parse({"method": "draft_model", "model": str(copy), "draft_kernel": bad})
    with pytest.raises(SpecloomError, match="the target itself"):
        engine(t, draft_kernel="int8")
