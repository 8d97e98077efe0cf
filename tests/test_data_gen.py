"""Self-distillation data through the batch step (`specloom data`), Magpie queries, recomputed hidden states and the
EAGLE-3 recipe pieces (draft vocabulary from coverage, warm start), plus bad input: eval/ prompts, another target,
other settings on resume (data and training)."""

import json
import os
import random

import pytest
import torch

from specloom.cli import main
from specloom.training.magpie import ChatFrame, QueryFilter


def _prompts(path, n=24, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"turns": [" ".join(f"w{rng.randrange(4, 60)}" for _ in range(rng.randrange(3, 12)))]})
                    + "\n")
    return str(path)


def _shards(d):
    from specloom.training.shards import read_shard, shard_files

    out = []
    for fn in shard_files(d):
        t, meta = read_shard(fn, ("tokens", "offsets", "loss_mask", "job_ids"))
        out.append((t, json.loads(meta["specloom"])))
    return out


def test_data_through_the_batch_step_resumes_per_job(tiny, tmp_path, capsys):
    t = tiny("llama")
    prompts = _prompts(tmp_path / "p.jsonl")
    out = str(tmp_path / "d")
    args = ["data", "--target", t.path, "--prompts", prompts, "--out", out, "--max-new-tokens", "10", "--rows", "5",
            "--shard-tokens", "60", "--dtype", "fp32", "--kv-dtype", "fp32"]
    assert main(args) == 0
    shards = _shards(out)
    assert len(shards) >= 3
    jobs = sorted(j for d, _ in shards for j in d["job_ids"].tolist())
    assert jobs == list(range(24))  # every prompt answered once, in any order
    for d, info in shards:
        off = d["offsets"].tolist()
        assert off[-1] == d["tokens"].numel() == d["loss_mask"].numel() and len(info["sources"]) == len(off) - 1
        for a, b in zip(off[:-1], off[1:]):
            m = d["loss_mask"][a:b].tolist()
            n = sum(m)
            assert 1 <= n <= 10 and m == [0] * (b - a - n) + [1] * n  # answer tokens only, after the prompt
    card = open(os.path.join(out, "DATACARD.md")).read()
    assert "answer tokens" in card and "| p |" in card and "Command:" in card
    prog = json.load(open(os.path.join(out, "progress.json")))
    assert prog["conversations"] == 24 and prog["answer_tokens"] == sum(int(d["loss_mask"].sum()) for d, _ in shards)
    # resume: drop the last shard; only its conversations run again
    last = sorted(f for f in os.listdir(out) if f.startswith("shard_") and not f.endswith(".tmp"))[-1]
    lost = len(shards[-1][0]["job_ids"])
    os.remove(os.path.join(out, last))
    capsys.readouterr()
    assert main(args) == 0
    assert f"{24 - lost} stored already" in capsys.readouterr().err
    assert sorted(j for d, _ in _shards(out) for j in d["job_ids"].tolist()) == list(range(24))
    # other settings, another target, eval prompts: one clear message each
    assert main(args[:-6] + ["--max-new-tokens", "7", "--rows", "5", "--dtype", "fp32"]) == 2
    assert "other settings (max_new_tokens: 10 there, 7 now" in capsys.readouterr().err
    q = tiny("qwen3")
    assert main(["data", "--target", q.path, "--prompts", prompts, "--out", out, "--max-new-tokens", "10"]) == 2
    assert "another target" in capsys.readouterr().err
    ev = tmp_path / "eval"
    ev.mkdir()
    bad = _prompts(ev / "bench.jsonl", 2)
    assert main(["data", "--target", t.path, "--prompts", bad, "--out", str(tmp_path / "e")]) == 2
    assert "eval/ directory" in capsys.readouterr().err


def test_interrupted_data_run_keeps_finished_conversations(tiny, tmp_path, capsys, monkeypatch):
    """Ctrl-C (or SIGTERM) mid-run: the finished conversations still in the shard buffer are written, the exit
    status is 130, and the same command resumes with the rest."""
    from specloom.jobs import data as selfdistill

    t = tiny("llama")
    out = str(tmp_path / "d")
    args = ["data", "--target", t.path, "--prompts", _prompts(tmp_path / "p.jsonl", 12), "--out", out,
            "--max-new-tokens", "6", "--rows", "3", "--shard-tokens", "100000", "--dtype", "fp32"]
    real_add = selfdistill.ShardStore.add

    def add(self, *a):
        real_add(self, *a)
        if len(self.done_jobs) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(selfdistill.ShardStore, "add", add)
    assert main(args) == 130
    assert "interrupted; writing the finished conversations" in capsys.readouterr().err
    assert len([j for d, _ in _shards(out) for j in d["job_ids"].tolist()]) == 5
    monkeypatch.setattr(selfdistill.ShardStore, "add", real_add)
    assert main(args) == 0
    assert "5 stored already" in capsys.readouterr().err
    assert sorted(j for d, _ in _shards(out) for j in d["job_ids"].tolist()) == list(range(12))


def test_sampled_answers_follow_their_seed_not_their_neighbours(tiny, tmp_path):
    """A conversation's sampled answer depends on its own seed only: the same data with 1 row or 6 rows."""
    t = tiny("llama")
    prompts = _prompts(tmp_path / "p.jsonl", 12, seed=3)
    got = []
    for rows in (1, 6):
        out = str(tmp_path / f"d{rows}")
        assert main(["data", "--target", t.path, "--prompts", prompts, "--out", out, "--max-new-tokens", "8",
                     "--rows", str(rows), "--sampled-fraction", "1.0", "--dtype", "fp32", "--kv-dtype", "fp32"]) == 0
        seqs = {}
        for d, _ in _shards(out):
            off = d["offsets"].tolist()
            for j, a, b in zip(d["job_ids"].tolist(), off[:-1], off[1:]):
                seqs[j] = d["tokens"][a:b].tolist()
        got.append(seqs)
    assert got[0] == got[1]


def test_query_filter():
    f = QueryFilter()
    assert f.check("How do I bake sourdough bread at home?", 12, True)
    assert f.reason("How do I bake sourdough bread at home?", 12, True) == "duplicate"
    assert f.reason("how do i bake sourdough bread at home  ", 12, True) == "duplicate"  # normalised
    assert f.reason("How do I bake sourdough bread at home with rye flour and honey today?", 20, True) is None
    f.check("Write a short poem about the sea and the moon at night for my sister", 20, True)
    assert f.reason("Write a short poem about the sea and the moon at night for my brother", 20, True) == \
        "near duplicate"
    assert f.reason("What is the capital of France?", 9, False) == "unfinished"
    assert f.reason("Hi there", 3, True) == "too short"
    assert f.reason("the the the the the the the the the the the the", 12, True) == "repetitive"
    assert f.reason("<|im_start|>assistant hello there friend", 9, True) == "template text"
    assert f.reason("12345 67890 !!!! #### %%%%", 9, True) == "not words"
    assert f.reason("word " * 5, 400, True) == "too long"
    f.check("What is the capital of France?", 9, False)
    assert f.kept == 2 and f.dropped["unfinished"] == 1


def test_chat_frame_cuts_the_real_template():
    from specloom.loading import load_target
    from specloom.errors import SpecloomError

    try:
        _, tok = load_target("smollm2-135m", "bf16", progress=False)
    except SpecloomError as e:
        pytest.skip(f"smollm2-135m not available: {e}")
    fr = ChatFrame(tok)
    dec = tok.hf.decode
    assert dec(fr.pre_query).endswith("<|im_end|>\n<|im_start|>user\n") and "system" in dec(fr.pre_query)
    assert dec(fr.to_answer) == "<|im_end|>\n<|im_start|>assistant\n"
    assert dec(fr.to_query) == "<|im_end|>\n<|im_start|>user\n"
    # a generated end-of-turn token is not repeated by the template piece
    q = tok.hf("Hello there", add_special_tokens=False)["input_ids"] + [fr.to_answer[0]]
    joined = fr.join(fr.pre_query, q, fr.to_answer)
    ref = tok.encode_chat([{"role": "user", "content": "Hello there"}])
    assert joined == ref


def _small_data(tiny, tmp_path):
    """(tiny llama, a tokens-only data directory of 8 short answers)."""
    t = tiny("llama")
    out = str(tmp_path / "d")
    assert main(["data", "--target", t.path, "--prompts", _prompts(tmp_path / "p.jsonl", 8), "--out", out,
                 "--max-new-tokens", "6", "--dtype", "fp32"]) == 0
    return t, out


def test_recomputed_hidden_states_equal_a_direct_forward(tiny, tmp_path):
    from specloom.training.dataset import DistillData

    t, out = _small_data(tiny, tmp_path)
    L = t.model.config.num_layers
    data = DistillData(out, (1, L))
    data.attach(t.model)
    group = list(range(len(data.seqs)))
    batch = data.collate(group, 1024)
    for r, i in enumerate(group):
        ids = data.seqs[i][0]
        kv = t.model.new_kv(len(ids))
        ref = t.model(ids[None], torch.arange(len(ids))[None], kv, capture=(1, L), num_logits=1)
        for c in (1, L):
            got = batch["hidden"][c][r, :len(ids)]
            assert got.dtype == torch.bfloat16  # stored as the first data format stored them
            torch.testing.assert_close(got.float(), ref.hidden[c][0].float(), atol=1e-3, rtol=8e-3)  # bf16 rounding


def test_cache_only_keeps_the_named_sequences(tiny, tmp_path, monkeypatch):
    """`cache_only` (set by `specloom train` for a run of one pass over its data, or one a --max-minutes budget
    ends, under the default budget: the held-out sequences, which evaluations re-read) keeps those sequences'
    states and no others; a run of several epochs, or one given --cache-hidden-gb, keeps any."""
    from specloom.jobs import train as J
    from specloom.training.dataset import DistillData

    t, out = _small_data(tiny, tmp_path)
    L = t.model.config.num_layers
    data = DistillData(out, (1, L))
    data.attach(t.model, cache_bytes=1 << 30)
    data.cache_only = {1}
    data.collate(list(range(len(data.seqs))), 1024)
    assert [i for i, s in enumerate(data.seqs) if s[2] is not None] == [1]
    seen = []
    orig = DistillData.split

    def spy(self, *a, **k):
        seen.append(self)
        return orig(self, *a, **k)

    monkeypatch.setattr(DistillData, "split", spy)
    base = ["train", "medusa", "--target", t.path, "--data", out, "--tokens-per-batch", "64", "--warmup", "1",
            "--medusa-heads", "1", "--eval-fraction", "0.3"]
    for extra, one_pass in ((["--steps", "1"], True), (["--epochs", "2"], False),
                            (["--steps", "1", "--cache-hidden-gb", "1"], False),
                            (["--epochs", "2", "--max-minutes", "5"], True)):
        seen.clear()
        assert main(base + extra + ["--out", str(tmp_path / f"m{len(extra)}{one_pass}")]) == 0
        d = seen[0]
        _, held = orig(d, 0.3)
        assert (d.cache_only == set(held)) if one_pass else d.cache_only is None


def test_the_held_out_split_does_not_move_with_the_seed(tiny, tmp_path, monkeypatch):
    """--seed reorders the batches (a continued run reshuffles to read other data first) but never moves a
    sequence between the training and held-out sides: the split is the data's, fixed once."""
    from specloom.training.dataset import DistillData

    t, out = _small_data(tiny, tmp_path)
    splits, orders = [], []
    orig_split, orig_groups = DistillData.split, DistillData.groups
    monkeypatch.setattr(DistillData, "split", lambda self, *a: splits.append(orig_split(self, *a)) or splits[-1])
    monkeypatch.setattr(DistillData, "groups",
                        lambda self, idx, tpb, seed, *a: orders.append(orig_groups(self, idx, tpb, seed, *a))
                        or orders[-1])
    base = ["train", "medusa", "--target", t.path, "--data", out, "--tokens-per-batch", "16", "--warmup", "1",
            "--medusa-heads", "1", "--eval-fraction", "0.4", "--steps", "1"]
    for seed in (0, 1, 2, 3):
        assert main(base + ["--seed", str(seed), "--out", str(tmp_path / f"s{seed}")]) == 0
    assert len(splits) == 4 and all(s == splits[0] for s in splits) and splits[0][1]
    assert len({str(o) for o in orders[1::2]}) > 1  # the epoch's batch order does follow the seed


def test_recomputed_states_are_kept_within_the_budget_and_reread(tiny, tmp_path):
    """Later epochs read the states an earlier batch recomputed (equal to a fresh recompute), only within the
    memory budget; a budget of 0 keeps nothing; mixed groups (some kept, some not) recompute only the missing."""
    from specloom.training.dataset import DistillData

    t, out = _small_data(tiny, tmp_path)
    L = t.model.config.num_layers
    ref = DistillData(out, (1, L))
    ref.attach(t.model)  # budget 0
    group = list(range(len(ref.seqs)))
    want = ref.collate(group, 1024)
    assert ref.cached_bytes == 0 and all(h is None for _, _, h in ref.seqs)
    data = DistillData(out, (1, L))
    per_seq = [len(s[0]) * 2 * t.model.config.hidden_size * 2 for s in data.seqs]
    data.attach(t.model, cache_bytes=per_seq[0] + per_seq[1])
    first = data.collate(group[:2], 1024)
    assert data.cached_bytes == per_seq[0] + per_seq[1]
    assert data.seqs[0][2] is not None and data.seqs[2][2] is None
    calls = []
    orig = data.recompute
    data.recompute = lambda tok: (calls.append(tok.shape[0]), orig(tok))[1]
    got = data.collate(group, 1024)  # rows 0, 1 read back; the rest recomputed (budget spent: not kept)
    assert calls == [len(group) - 2] and data.cached_bytes == per_seq[0] + per_seq[1]
    for c in (1, L):
        for r, i in enumerate(group):
            n = len(data.seqs[i][0])
            torch.testing.assert_close(got["hidden"][c][r, :n].float(), want["hidden"][c][r, :n].float(),
                                       atol=1e-3, rtol=8e-3)
        n0 = len(data.seqs[0][0])
        assert torch.equal(first["hidden"][c][0, :n0], data.seqs[0][2][c])  # what was kept is what was served


def test_draft_vocab_from_coverage_and_warm_start(tiny):
    from specloom.drafters.eagle.model import EagleDraftModel, eagle_config_for
    from specloom.drafters.eagle.trainer import warm_start
    from specloom.training.common import draft_vocab_size
    from specloom.errors import SpecloomError

    counts = torch.zeros(2000, dtype=torch.long)
    counts[:300] = 100  # 300 tokens hold 30000 of 30300 counts
    counts[300:600] = 1
    assert draft_vocab_size(counts, 1024, None) == 1024
    assert draft_vocab_size(counts, 1024, 0.99) == 512  # 300 tokens reach 99.0 %: rounded up to 256s
    assert draft_vocab_size(counts, 1024, 1.0) == 768
    assert draft_vocab_size(counts, 256, 1.0) == 256  # capped
    with pytest.raises(SpecloomError, match="coverage"):
        draft_vocab_size(counts, 1024, 1.5)
    t = tiny("llama")
    c = t.model.config
    m = EagleDraftModel(eagle_config_for(c, True, (1, 1, 1), 32))
    warm_start(m, t.model, -1)
    src = t.model.layers[-1]
    H = c.hidden_size
    q = src.self_attn.qkv_proj.weight[:c.num_heads * c.head_dim]
    torch.testing.assert_close(m.layers[0].self_attn.q_proj.weight[:, H:], q.float())
    torch.testing.assert_close(m.layers[0].mlp.down_proj.weight, src.mlp.down_proj.weight.float())
    assert torch.equal(m.fc.weight[:, -H:], torch.eye(H)) and not m.fc.weight[:, :-H].any()
    with pytest.raises(SpecloomError, match="warm-start-layer"):
        warm_start(m, t.model, 99)


def test_training_resumed_with_other_settings_is_refused(tiny, tmp_path, capsys):
    t = tiny("llama")
    data = str(tmp_path / "d")
    assert main(["data", "--target", t.path, "--prompts", _prompts(tmp_path / "p.jsonl", 8), "--out", data,
                 "--max-new-tokens", "6", "--dtype", "fp32"]) == 0
    out = str(tmp_path / "run")
    base = ["train", "medusa", "--target", t.path, "--data", data, "--out", out, "--tokens-per-batch", "128",
            "--save-every", "2", "--medusa-heads", "2", "--steps", "3"]
    assert main(base + ["--eval-every", "2"]) == 0
    evals = json.load(open(os.path.join(out, "evals.json")))
    assert [e["step"] for e in evals] == [2, 3] and evals[0]["answer_tokens_seen"] > 0
    capsys.readouterr()
    assert main(base + ["--lr", "5e-4"]) == 2
    assert "other settings (lr: 0.001 there, 0.0005 now)" in capsys.readouterr().err


def test_token_map_from_the_answers_of_the_training_split(tiny, tmp_path, capsys):
    """`specloom token-map --data`: the answer tokens of the data's training split, counted (the held-out split
    `specloom train` evaluates on is left out); data of another tokenizer is refused."""
    from specloom.training.dataset import DistillData

    t, out = _small_data(tiny, tmp_path)
    m_path = tmp_path / "m.json"
    assert main(["token-map", t.path, "--data", out, "--out", str(m_path)]) == 0
    assert "training sequences" in capsys.readouterr().out
    m = json.loads(m_path.read_text())
    data = DistillData(out, ())
    train, held = data.split(0.02)
    want = torch.zeros(m["vocab_size"], dtype=torch.long)
    for i in train:
        toks, mask, _ = data.seqs[i]
        want += torch.bincount(toks[mask], minlength=m["vocab_size"])
    assert dict(zip(m["ranked"], m["counts"])) == {i: int(c) for i, c in enumerate(want.tolist()) if c}
    assert m["counts"] == sorted(m["counts"], reverse=True) and m["tokens_counted"] == int(want.sum())
    meta = json.loads(open(os.path.join(out, "meta.json")).read())
    meta["fingerprint"]["vocab_sha"] = "0" * 16
    open(os.path.join(out, "meta.json"), "w").write(json.dumps(meta))
    assert main(["token-map", t.path, "--data", out, "--out", str(m_path)]) != 0
    assert "another tokenizer" in capsys.readouterr().err


def test_a_larger_magpie_count_grows_the_data_a_smaller_one_is_refused(tiny_smol, tmp_path, capsys, monkeypatch):
    """`--magpie N` raised on resume appends conversations (the stored ones keep their ids and are not rerun);
    lowered, it is refused with the settings message, and nothing is lost."""
    _, _, path = tiny_smol
    # a random model writes no query the filter would keep; keep every query it writes (a count of one is too few)
    monkeypatch.setattr(QueryFilter, "reason", lambda self, text, n, ended: None if n > 1 else "too short")
    out = str(tmp_path / "d")
    base = ["data", "--target", path, "--prompts", _prompts(tmp_path / "p.jsonl", 4), "--out", out,
            "--max-new-tokens", "6", "--rows", "4", "--dtype", "fp32", "--kv-dtype", "fp32",
            "--multi-turn-fraction", "0"]
    assert main(base + ["--magpie", "3"]) == 0
    first = {j: d["tokens"][a:b].tolist() for d, _ in _shards(out)
             for j, a, b in zip(d["job_ids"].tolist(), d["offsets"].tolist()[:-1], d["offsets"].tolist()[1:])}
    capsys.readouterr()
    assert main(base + ["--magpie", "6"]) == 0
    err = capsys.readouterr().err
    assert "growing the Magpie conversations from 3 to 6" in err and f"{len(first)} stored already" in err
    grown = {j: d["tokens"][a:b].tolist() for d, _ in _shards(out)
             for j, a, b in zip(d["job_ids"].tolist(), d["offsets"].tolist()[:-1], d["offsets"].tolist()[1:])}
    assert all(grown[j] == seq for j, seq in first.items())  # the stored conversations are untouched
    assert set(first) - set(range(4)) and set(grown) - set(range(7))  # Magpie ones in both runs (ids 4-6, then 7-9)
    assert set(first) >= set(range(4)) and set(grown) <= set(range(10))
    assert json.load(open(os.path.join(out, "meta.json")))["magpie"] == 6
    assert main(base + ["--magpie", "5"]) == 2
    assert "other settings (magpie: 6 there, 5 now" in capsys.readouterr().err
    assert len(_shards(out)) and sum(len(d["job_ids"]) for d, _ in _shards(out)) == len(grown)
