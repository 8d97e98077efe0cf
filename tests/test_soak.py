"""The soak and fault test (issue 14), short: `specloom bench-soak`'s run_soak for ~25 s at concurrency 16 against a
real `specloom serve` child process (the tiny random Llama over SmolLM2's tokenizer, fp32, n-gram speculation at a
fixed depth) with random client disconnects, malformed and poisoned requests. Every invariant of the 10-minute
benchmark is asserted: no lost or corrupted completion (each completed greedy response equals its alone output), no
5xx for a valid request, every bad request a 4xx, RSS flat within 5 % after the warm-up, acceptance after the soak
equal to before, the server healthy and exiting 0 on SIGTERM."""

import json
import os

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

PROMPTS = ["Tell me about the sea and the ships on it.", "hi", "Write a short poem about rain falling on roofs.",
           "What is two plus two?", "List three colours, then repeat them.", "Say hello to the world, twice."]


def test_soak_short(tiny_smol, tmp_path, capsys):
    from specloom.bench.soak import run_soak

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p], "category": "x"}) + "\n" for p in PROMPTS))
    out = tmp_path / "soak.json"
    s = run_soak(tiny_smol[2], str(prompts), '{"method": "ngram", "num_speculative_tokens": 3}', minutes=0.4,
                 concurrency=16, num_prompts=len(PROMPTS), max_tokens=24, max_model_len=512,
                 malformed_fraction=0.08, poisoned_fraction=0.05, json_out=str(out),
                 # the RSS baseline after 40 % of a 24-second soak, not 20 % (~5 s): under a loaded host the
                 # allocator was still growing at 5 s once in six full runs (RSS +5 %, passed alone twice)
                 warmup_fraction=0.4,
                 server_log=str(tmp_path / "serve.log"), env={**os.environ, "OMP_NUM_THREADS": "1"})
    table = capsys.readouterr().out
    assert "| no_lost_completions | pass |" in table
    assert json.loads(out.read_text())["passed"] == s["passed"]
    assert s["checks"] == {name: True for name in s["checks"]}, (s["checks"], s["problems"][:5], s["rss_mib"],
                                                                  s["acceptance"])
    assert s["prompts"] == len(PROMPTS)
    assert s["identical_to_alone"] == s["answered_greedy"] >= 50, s["answered_greedy"]
    assert s["kinds"]["disconnect"]["sent"] >= 5 and s["aborted_server"] >= 1
    assert s["bad_requests"] >= 10
    assert s["acceptance"]["tau_alone_start"] > 1.0  # the drafter drafted and was accepted: the check is not vacuous
