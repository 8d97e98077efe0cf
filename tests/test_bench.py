"""The benchmark harness on a tiny model: report keys, interleaving, identity check, both baselines."""

import json

import pytest

from specloom.bench.harness import read_prompts, run_bench
from specloom.errors import SpecloomError


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8"]},
        {"question_id": 2, "category": "math", "turns": ["w9 w10 w11", "second turn ignored"]},
        {"prompt": "w12 w13 w14 w15 w16"},
        {"question_id": 4, "category": "qa", "turns": ["w20 w21"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("baseline", ["plain", "hf"])
def test_bench_report(tiny, prompts_file, tmp_path, baseline):
    t = tiny("llama")
    out = tmp_path / "report.json"
    report = run_bench(t.path, prompts=str(prompts_file), limit=3, max_tokens=8, dtype="fp32",
                       baseline=baseline, json_out=str(out), progress=False)
    saved = json.loads(out.read_text())
    assert saved["num_prompts"] == report["num_prompts"] == 3
    for key in ("speedup", "baseline_tokens_per_second", "candidate_tokens_per_second", "mean_accepted_length",
                "acceptance_per_position", "identical_outputs", "prompts"):
        assert key in saved, key
    assert saved["mean_accepted_length"] == 1.0  # plain decoding: one token per target pass
    assert saved["identical_outputs"] == 3  # fp32 greedy: specloom == itself, and == HF on the same weights
    assert [p["category"] for p in saved["prompts"]] == ["writing", "math", None]
    assert all(p["baseline_tokens_per_second"] > 0 and p["candidate_tokens_per_second"] > 0 for p in saved["prompts"])
    assert saved["speedup"] > 0


def test_read_prompts_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"nothing": 1}\n')
    with pytest.raises(SpecloomError, match="bad.jsonl:2"):
        read_prompts(str(bad))
    with pytest.raises(SpecloomError, match="no such prompts file"):
        read_prompts(str(tmp_path / "missing.jsonl"))
    assert [r["text"] for r in read_prompts(str(bad), limit=1)] == ["ok"]


def test_per_category(prompts_file):
    rows = read_prompts(str(prompts_file), per_category=1)
    assert [r["category"] for r in rows] == ["writing", "math", None, "qa"]
    rows = read_prompts(str(prompts_file), per_category=1, limit=2)
    assert len(rows) == 2


def test_divergence_margin_is_the_top2_gap(tiny):
    import torch

    from specloom import Engine
    from specloom.bench.harness import divergence_margin

    t = tiny("llama")
    e = Engine(t.model, t.tokenizer)
    ids = [5, 6, 7]
    a = e.generate(prompt_token_ids=ids, max_tokens=6, ignore_eos=True).token_ids
    b = a[:3] + [(a[3] + 1) % 256] + a[4:]
    seq = ids + a[:3]
    kv = t.model.new_kv(16)
    logits = t.model(torch.tensor([seq]), torch.arange(len(seq))[None], kv).logits[0, -1]
    top = logits.topk(2).values
    assert abs(divergence_margin(e, ids, a, b) - float(top[0] - top[1])) < 1e-6
    assert divergence_margin(e, ids, a, a) is None


def test_plot_acceptance(tmp_path):
    from specloom.bench.plots import plot_acceptance

    report = {"acceptance_per_position": [0.5, 0.25], "speculative_config": {"method": "ngram",
              "num_speculative_tokens": 2}, "dtype": "bf16", "num_prompts": 3, "mean_accepted_length": 1.6,
              "speedup": 1.2}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(report))
    out = tmp_path / "plot.png"
    plot_acceptance([str(src)], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SpecloomError, match="not a specloom bench report"):
        plot_acceptance([str(tmp_path / "bad.json")], str(out))


def test_compare_fixed_and_auto_in_one_run(tiny, prompts_file, tmp_path):
    """`--compare` candidates may each carry their own speculation mode: fixed and auto of one drafter in one run,
    each reported with its mode, both identical to plain decoding (fp32 greedy)."""
    from specloom.bench.multi import run_compare

    t = tiny("llama")
    out = tmp_path / "compare.json"
    cands = {"ngram fixed": {"method": "ngram", "num_speculative_tokens": 3, "speculation": "fixed"},
             "ngram auto": {"method": "ngram", "num_speculative_tokens": 3}}
    run_compare(t.path, str(prompts_file), cands, limit=3, max_tokens=8, dtype="fp32", json_out=str(out),
                progress=False, speculation="auto")
    saved = json.loads(out.read_text())["candidates"]
    assert saved["ngram fixed"]["speculation"] == "fixed" and saved["ngram auto"]["speculation"] == "auto"
    assert "speculation" not in saved["ngram fixed"]["speculative_config"]
    assert all(c["identical_outputs"] == 3 for c in saved.values())
    with pytest.raises(SpecloomError, match="speculation 'sometimes'"):
        run_compare(t.path, str(prompts_file), {"x": {"method": "ngram", "speculation": "sometimes"}}, limit=1,
                    max_tokens=4, dtype="fp32", progress=False)
