"""Bad input through the CLI: one clear message, non-zero exit, no traceback. Plus a real `generate --json`."""

import json
import subprocess
import sys

import numpy as np
import pytest


def run_cli(*args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "specloom", *args], capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def run_in_process(capsys, *args):
    """Same entry point without a new interpreter (for the cheap argument checks)."""
    from specloom.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc, err, *needles):
    assert rc != 0
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if "error" in ln]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


def test_unknown_model():
    rc, _, err = run_cli("generate", "no-such-model", "--prompt", "hi")
    assert_clean_error(rc, err, "unknown model 'no-such-model'")


def test_missing_file(tmp_path):
    rc, _, err = run_cli("generate", str(tmp_path / "missing.gguf"), "--prompt", "hi")
    assert_clean_error(rc, err, "no such file or directory")


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, _, err = run_cli("generate", str(path), "--prompt", "hi")
    assert_clean_error(rc, err, "'mamba'", "not supported")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    rc, _, err = run_cli("generate", str(path), "--prompt", "hi")
    assert_clean_error(rc, err, "not a readable GGUF file")


@pytest.mark.parametrize("value", ["0", "-3", "lots"])
def test_bad_max_tokens(capsys, value):
    rc, _, err = run_in_process(capsys, "generate", "smollm2-135m", "--prompt", "hi", "--max-tokens", value)
    assert_clean_error(rc, err, "--max-tokens")


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("{not json", "not valid JSON"),
        ('["ngram"]', "must be a JSON object"),
        ('{"method": "mtp", "model": "/no/such/dir"}', "not a checkpoint directory"),
        ('{"method": "dspark", "num_speculative_tokens": 7}', "block of 5 and drafts exactly 5 tokens"),
        ('{"method": "telepathy"}', "unknown speculative method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "speculative_tokens": 3}', "unknown --speculative-config keys"),
    ],
)
def test_bad_speculative_config(capsys, spec, needle):
    rc, _, err = run_in_process(capsys, "generate", "smollm2-135m", "--prompt", "hi", "--speculative-config", spec)
    assert_clean_error(rc, err, needle)


DEVICE_COMMANDS = [
    ("generate", "smollm2-135m", "--prompt", "hi"),
    ("bench", "smollm2-135m", "--prompts", "p.jsonl"),
    ("serve", "smollm2-135m"),
    ("bench-serve", "smollm2-135m", "--prompts", "p.jsonl"),
    ("data", "--target", "smollm2-135m", "--prompts", "p.jsonl", "--out", "d"),
    ("train", "eagle3", "--target", "smollm2-135m", "--data", "d", "--out", "o"),
]


@pytest.mark.parametrize("command", DEVICE_COMMANDS, ids=[c[0] for c in DEVICE_COMMANDS])
@pytest.mark.parametrize("device, needle", [("tpu", "unknown device 'tpu'"), ("cuda:x", "unknown device"),
                                            ("cuda", "use --device cpu")])
def test_bad_device(capsys, command, device, needle):
    """Checked before anything loads: an unknown name, or CUDA on a machine (or torch build) without it."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        device, needle = f"cuda:{torch.cuda.device_count()}", "CUDA device(s)"
    rc, _, err = run_in_process(capsys, *command, "--device", device)
    assert rc == 2
    assert_clean_error(rc, err, needle)


def test_bad_temperature(capsys):
    rc, _, err = run_in_process(capsys, "generate", "smollm2-135m", "--prompt", "hi", "--temperature", "-1")
    assert_clean_error(rc, err, "temperature")


@pytest.fixture
def no_weight_load(monkeypatch):
    """The weights must not load: a bad prompt is refused from the tokenizer and the config alone."""
    import specloom.loading

    def refuse(*a, **kw):
        raise AssertionError("the weights loaded before the prompt was checked")

    monkeypatch.setattr(specloom.loading, "load_target", refuse)


@pytest.mark.real
def test_prompt_longer_than_context(capsys, no_weight_load):
    rc, _, err = run_in_process(capsys, "generate", "smollm2-135m", "--prompt", "hello " * 9000, "--max-tokens", "4")
    assert_clean_error(rc, err, "exceed the model's context of 8192 tokens")


@pytest.mark.real
def test_chat_on_model_without_template(capsys, no_weight_load):
    rc, _, err = run_in_process(capsys, "generate", "gemma3-270m", "--prompt", "hi", "--chat", "--max-tokens", "2")
    assert_clean_error(rc, err, "no chat template")


def test_malformed_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
        "intermediate_size": 16, "vocab_size": 32}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    rc, _, err = run_cli("generate", str(tmp_path), "--prompt", "hi")
    assert_clean_error(rc, err, "model.safetensors")


@pytest.mark.real
def test_generate_json_plain_greedy():
    rc, out, err = run_cli("generate", "smollm2-135m", "--prompt", "What is the capital of France?", "--chat",
                           "--max-tokens", "12", "--dtype", "fp32", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert "Paris" in d["text"]
    assert d["num_target_passes"] == len(d["token_ids"]) <= 12
    assert d["mean_accepted_length"] == 1.0
    assert d["tokens_per_second"] > 0


def test_serve_bad_memory_budget(capsys):
    rc, _, err = run_in_process(capsys, "serve", "smollm2-135m", "--memory-budget", "lots")
    assert_clean_error(rc, err, "memory size 'lots'")


def test_serve_budget_too_small():
    rc, _, err = run_cli("serve", "smollm2-135m", "--memory-budget", "60MiB", "--port", "0")
    assert_clean_error(rc, err, "too small", "target weights")
