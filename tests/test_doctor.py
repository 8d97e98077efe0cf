"""`specloom doctor` (specloom/doctor.py) on tiny targets: each verdict for the case it names -- a drafter that
pays on a flat verify-cost curve, the same drafter where every verified token costs a full pass, and a drafter
made for another copy of the target (structural fingerprint alike, behaviour not) -- the JSON keys, the exit
status, and bad input as one line."""

import json

import pytest
import torch

from specloom import Engine
from specloom.cli import main
from specloom.doctor import run_doctor
from specloom.errors import SpecloomError
from specloom.cost import BatchCost
from specloom.speculative import SpeculativeConfig

from test_behavioural_fingerprint import drafter_dir, perturbed, target  # noqa: F401  (fixtures)

PROMPTS = ["hello there", "one two three four"]
KEYS = {"verdict", "reason", "predicted_speedup", "best_config", "tau", "tau_expected", "behavioural_distance",
        "differences"}


def curve(per_token: float) -> BatchCost:
    """c(1, T) = 1 + per_token * (T - 1), frozen (no calibration from this host's passes)."""
    return BatchCost({(1, t): 1e-3 * (1 + per_token * (t - 1)) for t in (1, 2, 4, 8, 16)}, frozen=True)


def self_draft(t):
    return Engine(t.model, t.tokenizer, SpeculativeConfig.parse(
        {"method": "draft_model", "model": t.path, "num_speculative_tokens": 3}), speculation="fixed")


def test_self_draft_pays_on_a_flat_curve_and_not_on_a_steep_one(target):  # noqa: F811
    e = self_draft(target)
    r = run_doctor(e, PROMPTS, max_tokens=12, measure_plain=False, cost=curve(0.0))
    # the target drafting for itself: every draft accepted (tau < 4 only where the token budget cut a step short)
    assert r.acceptance_per_position == [1.0, 1.0, 1.0] and r.tau > 2
    # flat curve: drafting is the only cost, and here it costs about a pass per depth (the draft model is the
    # target), so the prediction follows it: E[tokens] at the measured tau for 1 + 3 * draft_cost passes
    want = r.tau / (1 + 3 * r.draft_cost)
    assert r.predicted_by_depth[3] == pytest.approx(want, rel=1e-2)
    assert r.verdict == ("pays" if max(r.predicted_by_depth.values()) > 1.02 else "does_not_pay")
    steep = run_doctor(e, PROMPTS, max_tokens=12, measure_plain=False, cost=curve(1.0))
    assert steep.verdict == "does_not_pay" and steep.best_config is None  # k+1 tokens cost k+1 passes + drafting
    assert steep.predicted_speedup < 1.0 and "no depth beats plain decoding" in steep.reason


def test_cheap_drafter_pays_on_a_flat_curve(target):  # noqa: F811
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    e = Engine(target.model, target.tokenizer, spec, speculation="fixed")
    # a repetitive prompt: n-gram drafts and the target (a tiny random model) repeats
    r = run_doctor(e, ["a b a b a b a b a b a b"], max_tokens=16, measure_plain=False, cost=curve(0.0))
    assert r.differences == [] and r.behavioural_distance is None and r.checkpoint is None
    if r.tau > 1.2:
        assert r.verdict == "pays" and r.best_config["method"] == "ngram" and r.predicted_speedup > 1.02


def test_drafter_for_another_copy_is_a_mismatch(target, drafter_dir):  # noqa: F811
    same = Engine(target.model, target.tokenizer, SpeculativeConfig.parse({"method": "eagle", "model": drafter_dir}),
                  speculation="fixed")
    ok = run_doctor(same, PROMPTS, max_tokens=8, measure_plain=False, cost=curve(0.0))
    assert ok.verdict != "mismatch" and ok.differences == []
    assert ok.behavioural_distance["kl_mean"] < 1e-4 and ok.checkpoint == drafter_dir
    with pytest.warns(UserWarning, match="behaves differently"):
        other = Engine(perturbed(target.model), target.tokenizer,
                       SpeculativeConfig.parse({"method": "eagle", "model": drafter_dir}), speculation="fixed")
    bad = run_doctor(other, PROMPTS, max_tokens=8, measure_plain=False, cost=curve(0.0))
    assert bad.verdict == "mismatch" and bad.differences == []  # the structural fingerprint cannot see it
    assert bad.behavioural_distance["exceeds"] and "fine-tune or another quantization" in bad.reason
    assert KEYS <= set(bad.to_json()) and json.dumps(bad.to_json())
    # with a manifest tau: a moved target whose acceptance held is judged on speed (and the move named) ...
    other.drafter.prior_tau = bad.tau
    held = run_doctor(other, PROMPTS, max_tokens=8, measure_plain=False, cost=curve(0.0))
    assert held.verdict != "mismatch" and "acceptance held" in held.reason and held.tau_expected == bad.tau
    # ... one whose acceptance fell below the manifest's is a mismatch
    other.drafter.prior_tau = bad.tau + 2.0
    fell = run_doctor(other, PROMPTS, max_tokens=8, measure_plain=False, cost=curve(0.0))
    assert fell.verdict == "mismatch" and "below the manifest" in fell.reason


def test_doctor_needs_a_drafter(target):  # noqa: F811
    with pytest.raises(SpecloomError, match="doctor needs a drafter"):
        run_doctor(Engine(target.model, target.tokenizer), PROMPTS)


def test_cli_json_and_exit_status(target, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "doctor.json"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    spec = json.dumps({"method": "draft_model", "model": target.path, "num_speculative_tokens": 2})
    rc = main(["doctor", target.path, "--speculative-config", spec, "--dtype", "fp32", "--prompts", str(prompts),
               "--max-tokens", "8", "--json", str(out)])
    report = json.loads(out.read_text())
    assert KEYS <= set(report) and report["verdict"] in ("pays", "does_not_pay")
    assert rc == (0 if report["verdict"] == "pays" else 1)
    assert "verdict:" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [
    (["--speculative-config", '{"method": "ngram"}', "--prompts", "/nonexistent.jsonl"], "no such prompts file"),
    (["--speculative-config", '{"method": "nope"}'], "method"),
])
def test_cli_bad_input_one_line(target, capsys, argv, msg):  # noqa: F811
    assert main(["doctor", target.path, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specloom: error:") and msg in err and "Traceback" not in err


def test_drafter_for_another_vocabulary_is_refused_as_mismatch(target, drafter_dir, tmp_path, capsys):  # noqa: F811
    """A drafter whose config names another vocabulary: verdict mismatch from its config alone (no weights read:
    the weights file here is not even valid), JSON written, exit status 1."""
    import shutil

    bad = tmp_path / "other_vocab"
    shutil.copytree(drafter_dir, bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["vocab_size"] += 8
    json.dump(cfg, open(bad / "config.json", "w"))
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"not weights")
    out = tmp_path / "report.json"
    rc = main(["doctor", target.path, "--speculative-config", json.dumps({"method": "eagle", "model": str(bad)}),
               "--json", str(out)])
    report = json.load(open(out))
    assert rc == 1 and report["verdict"] == "mismatch" and KEYS <= set(report)
    assert "refused before loading weights" in report["reason"] and "vocabulary" in report["reason"]
    assert "verdict: mismatch" in capsys.readouterr().out
