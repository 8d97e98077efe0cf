"""Training smoke tests on a tiny random target: `specloom data` then `specloom train KIND` for a few steps; the
loss goes down, the checkpoint loads through the normal `--speculative-config` path and drafts exactly.
Also: resuming, bad input (fingerprint mismatch warns, impossible shapes and corrupt files fail clearly)."""

import json
import os
import random

import pytest
import torch

from specloom import Engine, SpecloomError
from specloom.cli import main
from specloom.speculative import SpeculativeConfig


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    t = tiny("llama")
    root = tmp_path_factory.mktemp("train")
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for _ in range(48):
            words = " ".join(f"w{rng.randrange(4, 60)}" for _ in range(rng.randrange(4, 20)))
            f.write(json.dumps({"turns": [words]}) + "\n")
    data = str(root / "data")
    assert main(["data", "--target", t.path, "--prompts", str(prompts), "--out", data, "--max-new-tokens", "12",
                 "--batch-size", "16", "--dtype", "fp32"]) == 0
    return t, data, root


def _train(t, data, out, kind, *extra):
    args = ["train", kind, "--target", t.path, "--data", data, "--out", out, "--steps", "40", "--lr", "3e-3",
            "--tokens-per-batch", "256", "--warmup", "2", "--save-every", "20", "--loss-fraction", "1.0", *extra]
    assert main(args) == 0
    hist = json.load(open(os.path.join(out, "history.json")))
    return hist


@pytest.mark.parametrize("kind,extra", [
    ("eagle3", ["--draft-vocab", "64", "--ttt-steps", "2"]),
    ("eagle", ["--ttt-steps", "2"]),
    ("medusa", ["--medusa-heads", "3"]),
    ("draft_model", ["--draft-layers", "1"]),
    ("mtp", ["--mtp-layers", "2"]),
])
def test_train_loss_decreases_and_checkpoint_drafts(dataset, kind, extra):
    t, data, root = dataset
    out = str(root / f"ckpt_{kind}")
    hist = _train(t, data, out, kind, *extra)
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < first - 0.1, (first, last)  # soft-label CE never drops below the target's own entropy
    acc_first = sum(h["acc0"] for h in hist[:5]) / 5
    acc_last = sum(h["acc0"] for h in hist[-5:]) / 5
    if kind != "medusa":  # Medusa guesses t+2.. from one feature: on a random target its accuracy stays noise
        assert acc_last > acc_first, (acc_first, acc_last)
    assert os.path.isfile(os.path.join(out, "loss.png"))
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["specloom"]["kind"] == kind and cfg["specloom"]["manifest"]["steps"] == 40
    spec = {"method": kind, "model": out, "num_speculative_tokens": 3}
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(spec))
    plain = Engine(t.model, t.tokenizer)
    for ids in ([5, 6, 7, 8, 9], [30, 31, 12, 40]):
        a = e.generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True)
        b = plain.generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True)
        assert a.token_ids == b.token_ids


def test_train_medusa_truncated_vocab(dataset, capsys):
    """`--draft-vocab N`: the heads score the N most frequent answer tokens (token_map in the checkpoint); the
    loss falls, the held-out top-k accuracies are measured through the map and the drafter decodes exactly."""
    from specloom.drafters.checkpoint import load_drafter

    t, data, root = dataset
    out = str(root / "ckpt_medusa_tv")
    hist = _train(t, data, out, "medusa", "--medusa-heads", "2", "--draft-vocab", "32")
    assert sum(h["loss"] for h in hist[-5:]) < sum(h["loss"] for h in hist[:5]) - 0.1
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["medusa_vocab_size"] == 32 and 0 < cfg["specloom"]["draft_vocab_coverage"] < 1
    assert len(cfg["specloom"]["topk_accuracy"]) == 2
    heads, _ = load_drafter(out, "medusa", t.model, t.tokenizer)
    tm = heads.token_map
    assert tm.numel() == 32 and bool((tm[1:] > tm[:-1]).all())
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "medusa", "model": out}))
    plain = Engine(t.model, t.tokenizer)
    for ids in ([5, 6, 7, 8, 9], [30, 31, 12, 40]):
        a = e.generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True)
        assert a.token_ids == plain.generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True).token_ids
    capsys.readouterr()
    assert main(["train", "medusa", "--target", t.path, "--data", data, "--out", str(root / "tv_bad"),
                 "--draft-vocab", "4", "--steps", "1"]) == 2
    assert "--draft-vocab must be at least 10 for Medusa" in capsys.readouterr().err


def test_training_resumes(dataset):
    t, data, root = dataset
    out = str(root / "resume")
    args = ["train", "medusa", "--target", t.path, "--data", data, "--out", out, "--tokens-per-batch", "256",
            "--save-every", "5", "--medusa-heads", "2"]
    assert main(args + ["--steps", "5"]) == 0
    assert main(args + ["--steps", "8"]) == 0
    hist = json.load(open(os.path.join(out, "history.json")))
    assert [h["step"] for h in hist] == list(range(1, 9))


def test_fingerprint_mismatch_warns_shape_mismatch_errors(dataset, tiny, capsys):
    t, data, root = dataset
    out = str(root / "ckpt_eagle3")
    if not os.path.isdir(out):
        pytest.skip("needs the eagle3 checkpoint of the parametrized test")
    cfg_path = os.path.join(out, "config.json")
    raw = json.load(open(cfg_path))
    other = json.loads(json.dumps(raw))
    other["specloom"]["target_fingerprint"]["embed_sha"] = "0" * 16
    alt = str(root / "other_target")
    os.makedirs(alt, exist_ok=True)
    json.dump(other, open(os.path.join(alt, "config.json"), "w"))
    os.link(os.path.join(out, "model.safetensors"), os.path.join(alt, "model.safetensors"))
    with pytest.warns(UserWarning, match="trained for another target.*embedding weights"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle3", "model": alt}))
    q = tiny("qwen3")  # same hidden size, other weights: a warning; a target with another width: an error
    with pytest.warns(UserWarning, match="another target"):
        Engine(q.model, q.tokenizer, SpeculativeConfig.parse({"method": "eagle3", "model": out}))
    wide = json.loads(json.dumps(raw))
    wide["target_hidden_size"] = 96
    bad = str(root / "wide")
    os.makedirs(bad, exist_ok=True)
    json.dump(wide, open(os.path.join(bad, "config.json"), "w"))
    os.link(os.path.join(out, "model.safetensors"), os.path.join(bad, "model.safetensors"))
    with pytest.raises(SpecloomError, match="features of width 96"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle3", "model": bad}))


def test_corrupt_and_wrong_kind_checkpoints(dataset, tmp_path, capsys):
    t, data, root = dataset
    out = str(root / "ckpt_eagle3")
    if not os.path.isdir(out):
        pytest.skip("needs the eagle3 checkpoint of the parametrized test")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text(open(os.path.join(out, "config.json")).read())
    blob = open(os.path.join(out, "model.safetensors"), "rb").read()
    (cut / "model.safetensors").write_bytes(blob[: len(blob) - 1000])
    with pytest.raises(SpecloomError, match=r"tensor '.*' is truncated"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle3", "model": str(cut)}))
    (cut / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(SpecloomError, match="corrupt safetensors header"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle3", "model": str(cut)}))
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(out, "model.safetensors"))
    sd.pop("layers.0.mlp.down_proj.weight")
    save_file(sd, str(cut / "model.safetensors"))
    with pytest.raises(SpecloomError, match="layers.0.mlp.down_proj.weight' is missing"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle3", "model": str(cut)}))
    # a Medusa checkpoint given as eagle3, and a missing directory: one clear line from the CLI
    med = str(root / "ckpt_medusa")
    rc = main(["generate", t.path, "--prompt", "w5 w6", "--max-tokens", "3",
               "--speculative-config", json.dumps({"method": "eagle3", "model": med})])
    assert rc == 2 and "this is a medusa checkpoint" in capsys.readouterr().err
    rc = main(["generate", t.path, "--prompt", "w5 w6", "--max-tokens", "3",
               "--speculative-config", json.dumps({"method": "eagle", "model": str(tmp_path / "nope")})])
    assert rc == 2 and "no such file or directory" in capsys.readouterr().err
    _ = torch  # (imported for fixtures' dtype use)


def test_train_mtp_init_from(dataset):
    """`train mtp --init-from` starts from an MTP checkpoint (it had no loader for its own kind before): with a
    learning rate of ~0 the saved layers are the checkpoint's."""
    from specloom.drafters.mtp.format import load_mtp

    t, data, root = dataset
    first = str(root / "mtp_first")
    _train(t, data, first, "mtp", "--mtp-layers", "1")
    again = str(root / "mtp_again")
    assert main(["train", "mtp", "--target", t.path, "--data", data, "--out", again, "--steps", "2", "--lr", "1e-12",
                 "--tokens-per-batch", "256", "--warmup", "1", "--loss-fraction", "1.0", "--mtp-layers", "1",
                 "--init-from", first]) == 0
    a, _ = load_mtp(first, t.model)
    b, _ = load_mtp(again, t.model)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-3, msg=k)


def test_train_mtp_into_a_target_copy_and_target_with_mtp(dataset):
    """`train mtp --target-copy` writes a HF copy of the target with the MTP layers inside (found by
    `method: "mtp"` alone); `train target --mtp 2` trains a new small model jointly with its MTP layers."""
    import specloom

    t, data, root = dataset
    copy = str(root / "target_copy")
    _train(t, data, str(root / "mtp_overlay"), "mtp", "--mtp-layers", "1", "--target-copy", copy, "--no-bf16")
    e = specloom.load(copy, {"method": "mtp"}, dtype="fp32", progress=False)  # the copy is stored in bf16
    ids = [5, 6, 7, 8, 9]
    assert (e.generate(prompt_token_ids=ids, max_tokens=16, ignore_eos=True).token_ids
            == Engine(e.model, e.tokenizer).generate(prompt_token_ids=ids, max_tokens=16, ignore_eos=True).token_ids)
    new = str(root / "new_target")
    args = ["train", "target", "--target", t.path, "--data", data, "--out", new, "--steps", "40", "--lr", "1e-2",
            "--tokens-per-batch", "512", "--warmup", "2", "--loss-fraction", "1.0", "--mtp", "2",
            "--model-layers", "2", "--model-hidden", "32", "--model-heads", "2"]
    assert main(args) == 0
    hist = json.load(open(os.path.join(new, "history.json")))
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < first - 0.5, (first, last)
    cfg = json.load(open(os.path.join(new, "config.json")))
    assert cfg["num_nextn_predict_layers"] == 2 and cfg["specloom_mtp"]["trained_with_target"]
    e = specloom.load(new, {"method": "mtp"}, dtype="fp32", progress=False)
    assert e.drafter.mtp.num_layers == 2
    plain = Engine(e.model, e.tokenizer)
    for ids in ([5, 6, 7, 8, 9], [30, 31, 12, 40]):
        a = e.generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True)
        assert a.token_ids == plain.generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True).token_ids


def test_eagle3_init_from_another_draft_vocabulary(dataset, capsys):
    """`--init-from` an EAGLE-3 checkpoint with another draft vocabulary: the layer, fc and norms are copied, the
    draft head's rows for tokens in both vocabularies too, and the run keeps its own vocabulary."""
    from specloom.drafters.checkpoint import load_drafter

    t, data, root = dataset
    a = str(root / "e3_vocab64")
    _train(t, data, a, "eagle3", "--draft-vocab", "64", "--ttt-steps", "1", "--steps", "4")
    b = str(root / "e3_vocab32")
    assert main(["train", "eagle3", "--target", t.path, "--data", data, "--out", b, "--steps", "1", "--lr", "1e-9",
                 "--tokens-per-batch", "256", "--warmup", "1", "--draft-vocab", "32", "--ttt-steps", "1",
                 "--init-from", a]) == 0
    assert "draft-head rows carried over" in capsys.readouterr().err
    ma, _ = load_drafter(a, "eagle3", t.model, t.tokenizer)
    mb, _ = load_drafter(b, "eagle3", t.model, t.tokenizer)
    assert mb.d2t.numel() == 32 and ma.d2t.numel() == 64
    torch.testing.assert_close(mb.fc.weight.float(), ma.fc.weight.float(), atol=1e-3, rtol=1e-2)
    ua = (torch.arange(64) + ma.d2t).tolist()
    ub = (torch.arange(32) + mb.d2t).tolist()
    both = [i for i, tok in enumerate(ub) if tok in ua]
    assert both  # the 32 most frequent tokens are among the 64 most frequent
    for i in both:
        torch.testing.assert_close(mb.lm_head.weight[i].float(), ma.lm_head.weight[ua.index(ub[i])].float(),
                                   atol=1e-3, rtol=1e-2)


def test_eagle3_init_from_keeps_its_vocabulary_and_new_rows_start_at_the_mean(dataset, capsys):
    """Continuing an EAGLE-3 (`--init-from`, no vocabulary option) keeps the source's draft vocabulary -- every
    head row carries over, even where the data would now rank other tokens first; a larger vocabulary's new rows
    start from the mean carried row (the target's rows had outscored the trained ones: top-1 restarted near 0.2)."""
    from specloom.drafters.checkpoint import load_drafter

    t, data, root = dataset
    a = str(root / "e3_keep_src")
    _train(t, data, a, "eagle3", "--draft-vocab", "24", "--ttt-steps", "1", "--steps", "2")
    same = str(root / "e3_keep_same")
    args = ["train", "eagle3", "--target", t.path, "--data", data, "--steps", "1", "--lr", "1e-9",
            "--tokens-per-batch", "256", "--warmup", "1", "--ttt-steps", "1", "--init-from", a]
    assert main(args + ["--out", same]) == 0
    assert "24 of 24 draft-head rows carried over)" in capsys.readouterr().err
    ma, _ = load_drafter(a, "eagle3", t.model, t.tokenizer)
    ms, _ = load_drafter(same, "eagle3", t.model, t.tokenizer)
    assert torch.equal(ms.d2t, ma.d2t)
    torch.testing.assert_close(ms.lm_head.weight.float(), ma.lm_head.weight.float(), atol=1e-3, rtol=1e-2)
    big = str(root / "e3_keep_big")
    assert main(args + ["--out", big, "--draft-vocab", "48"]) == 0
    assert "the rest start from their mean" in capsys.readouterr().err
    mb, _ = load_drafter(big, "eagle3", t.model, t.tokenizer)
    ua = set((torch.arange(24) + ma.d2t).tolist())
    ub = (torch.arange(48) + mb.d2t).tolist()
    new = [i for i, tok in enumerate(ub) if tok not in ua]
    assert len(new) == 24
    mean = ma.lm_head.weight.float().mean(0)
    for i in new:
        torch.testing.assert_close(mb.lm_head.weight[i].float(), mean, atol=1e-3, rtol=1e-2)


def test_init_from_carries_the_source_tree_shape_not_its_measurement(dataset, capsys):
    """A drafter continued with `--init-from` decodes with its source's tuned tree (depth, width, nodes, shape
    table), not the kind's generic 6-deep 24-node default; the source's measured tau is not carried over."""
    import json

    from specloom.drafters.checkpoint import carried_settings
    from specloom.drafters import create_drafter
    from specloom.speculative import SpeculativeConfig

    t, data, root = dataset
    a = str(root / "e3_shape_src")
    _train(t, data, a, "eagle3", "--draft-vocab", "24", "--ttt-steps", "1", "--steps", "1")
    cfg_path = root / "e3_shape_src" / "config.json"
    raw = json.loads(cfg_path.read_text())
    table = {"shapes": [[2, 4, 4, 1.9, 2.0], [1, 1, 1, 1.5, 1.0]], "costs": {"c0": 0.05, "c1": {"1": 0.1, "4": 0.12}}}
    raw["specloom"].update(depth=2, tree_width=4, num_draft_tokens=4, tree_choice=table,
                           measured={"mean_accepted_length": 1.9})
    cfg_path.write_text(json.dumps(raw))
    assert carried_settings(a, "eagle") == {}  # another kind's settings are not taken
    out = str(root / "e3_shape_cont")
    assert main(["train", "eagle3", "--target", t.path, "--data", data, "--steps", "1", "--tokens-per-batch", "256",
                 "--warmup", "1", "--ttt-steps", "1", "--init-from", a, "--out", out]) == 0
    assert "decoding settings carried from" in capsys.readouterr().err
    block = json.loads((root / "e3_shape_cont" / "config.json").read_text())["specloom"]
    assert (block["depth"], block["tree_width"], block["num_draft_tokens"]) == (2, 4, 4)
    assert block["tree_choice"] == table and block["settings_from"] == a
    assert "measured" not in block
    d = create_drafter(SpeculativeConfig.parse({"method": "eagle3", "model": out}), t.model, t.tokenizer)
    assert (d.depth, d.width, d.num_nodes) == (2, 4, 4) and d.shape_table is not None


def _timed(t, data, out, save_every: str, minutes: str) -> list[str]:
    """An EAGLE-3 run cut by --max-minutes long before its --steps, its rate annealed by time."""
    return ["train", "eagle3", "--target", t.path, "--data", data, "--out", out, "--steps", "100000", "--lr", "1e-3",
            "--tokens-per-batch", "256", "--warmup", "2", "--draft-vocab", "32", "--ttt-steps", "1",
            "--save-every", save_every, "--max-minutes", minutes, "--anneal-by-time"]


def test_anneal_by_time_ends_a_time_limited_run_at_the_floor_rate(dataset, capsys):
    """`--anneal-by-time`: a run cut by --max-minutes long before its --steps still decays its learning rate to
    the floor (0.1 x lr) as the time runs out; without it the rate would still be near the peak. It needs
    --max-minutes (one clear line otherwise)."""
    from specloom.training.common import _lr_at

    assert _lr_at(50, 1000, 1.0, 10) > 0.95  # by steps: barely decayed
    assert _lr_at(50, 1000, 1.0, 10, time_frac=1.0) == pytest.approx(0.1)  # the time budget spent: the floor
    assert _lr_at(5, 1000, 1.0, 10, time_frac=1.0) == pytest.approx(0.6)  # warm-up is by steps
    t, data, root = dataset
    out = str(root / "e3_timed")
    args = _timed(t, data, out, "1000", "0.04")
    assert main(args) == 0
    hist = json.load(open(os.path.join(out, "history.json")))
    assert 5 < len(hist) < 100000
    assert hist[-1]["lr"] < 2.5e-4 < 9e-4 < max(h["lr"] for h in hist)  # from near the peak down near the floor
    rc = main(["train", "eagle3", "--target", t.path, "--data", data, "--out", str(root / "e3_timed2"),
               "--steps", "2", "--anneal-by-time"])
    assert rc == 2 and "give --max-minutes" in capsys.readouterr().err


def test_a_time_limited_run_resumes_within_its_budget(dataset):
    """--max-minutes is a run's budget across resumes: its checkpoint records the time spent, so rerunning the
    same command after the budget ran out goes on at the annealed rate for what little is left (it used to start
    a fresh budget and a fresh time-annealed schedule from near the peak rate)."""
    t, data, root = dataset
    out = str(root / "e3_timed_resume")
    args = _timed(t, data, out, "1", "0.03")
    assert main(args) == 0
    first = json.load(open(os.path.join(out, "history.json")))
    st = torch.load(os.path.join(out, "train_state.pt"), map_location="cpu", weights_only=False)
    assert st["step"] == len(first) and 0 < st["spent_s"] <= 0.03 * 60 + 5
    assert main(args) == 0
    again = json.load(open(os.path.join(out, "history.json")))
    assert again[:len(first)] == first
    # at most the sliver of budget left after the last checkpoint, at the annealed rate (a fresh budget would
    # restart the schedule near the 1e-3 peak)
    assert all(h["lr"] < 2.5e-4 for h in again[len(first):])


def test_finetune_target_keeps_embedding_and_head_and_moves_behaviour(dataset, capsys):
    """`train target --init-from` fine-tunes the existing target on answer tokens: the loss falls, the output is a
    HF directory specloom loads, the embedding/head (so the structural fingerprint) stay, `--train-layers 1` leaves
    the other layers alone, and the behavioural distance to the original sees the move."""
    import specloom
    from specloom.behaviour import behavioural_distance, record_probe
    from specloom.fingerprint import compare, fingerprint

    t, data, root = dataset
    out = str(root / "finetuned")
    assert main(["train", "target", "--init-from", t.path, "--target", t.path, "--data", data, "--out", out,
                 "--steps", "30", "--lr", "2e-3", "--tokens-per-batch", "256", "--warmup", "2", "--no-bf16",
                 "--train-layers", "1", "--eval-fraction", "0.2"]) == 0
    hist = json.load(open(os.path.join(out, "history.json")))
    assert sum(h["loss"] for h in hist[-5:]) / 5 < sum(h["loss"] for h in hist[:5]) / 5 - 0.3
    manifest = json.load(open(os.path.join(out, "config.json")))["specloom"]["manifest"]
    assert manifest["fine_tuned_from"] == t.path
    assert manifest["held_out_after"]["loss"] < manifest["held_out_before"]["loss"]
    e = specloom.load(out, dtype="fp32", progress=False)
    orig = {k: v for k, v in t.model.state_dict().items()}
    new = e.model.state_dict()
    L = t.model.config.num_layers
    bf16 = lambda x: x.to(torch.bfloat16).float()  # noqa: E731  (the directory stores bf16)
    for k, v in new.items():
        same = torch.equal(bf16(orig[k]), v.float())
        if not k.startswith(f"layers.{L - 1}."):
            assert same, k  # frozen: the embedding, the head, the final norm and the other layers
        elif "proj" in k:
            assert not same, k
    assert compare(fingerprint(t.model, t.tokenizer), fingerprint(e.model, e.tokenizer)) == []
    d = behavioural_distance(e.model, e.tokenizer, record_probe(t.model, t.tokenizer))
    assert d["kl_mean"] > 1e-3
    # data made with another tokenizer: one clear line
    bad = str(root / "finetune_bad")
    rc = main(["train", "target", "--init-from", t.path, "--target", t.path, "--data", str(root / "nope"),
               "--out", bad, "--steps", "1"])
    assert rc == 2 and "not a specloom data directory" in capsys.readouterr().err
