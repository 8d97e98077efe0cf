"""Malformed model configs and paths through the CLI (issue 14): one line on stderr naming the field or the path,
no traceback, nothing allocated for sizes the checkpoint does not hold."""

import json
import os
import shutil

import pytest

from test_cli import assert_clean_error, run_in_process


def _edit(config: dict, key, value):
    c = dict(config)
    c[key] = value
    return c


CASES = [
    ("hidden_huge", lambda c: _edit(c, "hidden_size", 10 ** 9), "hidden_size must be an integer in [1, "),
    ("vocab_huge", lambda c: _edit(c, "vocab_size", 10 ** 12), "vocab_size must be an integer in [1, "),
    ("config_is_a_list", lambda c: [c], "model config must be a JSON object, got list"),
    ("config_is_a_string", lambda c: "llama", "model config must be a JSON object, got str"),
    ("hidden_is_a_string", lambda c: _edit(c, "hidden_size", "64"), "hidden_size must be an integer, got '64'"),
    ("layers_is_a_bool", lambda c: _edit(c, "num_hidden_layers", True), "num_hidden_layers must be an integer"),
    ("zero_heads", lambda c: _edit(c, "num_attention_heads", 0), "num_attention_heads must be an integer in [1, "),
    ("heads_do_not_divide", lambda c: {**{k: v for k, v in c.items() if k != "head_dim"},
                                       "num_attention_heads": 5}, "num_attention_heads (5) must divide hidden_size"),
    ("kv_heads_do_not_divide", lambda c: _edit(c, "num_key_value_heads", 3), "num_key_value_heads (3) must divide"),
    ("eps_negative", lambda c: _edit(c, "rms_norm_eps", -1), "rms_norm_eps must be a positive number"),
    ("rope_not_an_object", lambda c: _edit(c, "rope_parameters", "big"), "rope_parameters must be an object"),
    ("layer_types_short", lambda c: {**c, "model_type": "gemma3_text", "layer_types": ["full_attention"]},
     "layer_types must list 3 entries"),
    # within the sanity bounds, but far larger than the tensors: refused by shape before anything is allocated
    # (allocated first, these sizes would ask for terabytes)
    ("bigger_than_the_tensors", lambda c: {**c, "hidden_size": 65536, "intermediate_size": 1 << 20,
                                           "vocab_size": 1 << 22}, "malformed checkpoint"),
]


@pytest.fixture(scope="module")
def base(tiny):
    path = tiny("llama").path
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)


@pytest.mark.parametrize("edit, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_is_one_clear_line(base, tmp_path, capsys, edit, needle):
    path, config = base
    bad = tmp_path / "model"
    shutil.copytree(path, bad)
    (bad / "config.json").write_text(json.dumps(edit(config)))
    rc, _, err = run_in_process(capsys, "generate", str(bad), "--prompt", "hi", "--max-tokens", "2")
    assert_clean_error(rc, err, needle)
    assert "allocate" not in err


def test_config_not_json(base, tmp_path, capsys):
    path, _ = base
    bad = tmp_path / "model"
    shutil.copytree(path, bad)
    (bad / "config.json").write_bytes(b"\xff{" + b"[" * 100_000)
    rc, _, err = run_in_process(capsys, "generate", str(bad), "--prompt", "hi")
    assert_clean_error(rc, err, "config.json: unreadable")


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_device_file_as_model(capsys):
    rc, _, err = run_in_process(capsys, "generate", "/dev/null", "--prompt", "hi")
    assert_clean_error(rc, err, "/dev/null: not a regular file or a directory")


def test_directory_without_a_model(tmp_path, capsys):
    rc, _, err = run_in_process(capsys, "generate", str(tmp_path), "--prompt", "hi")
    assert_clean_error(rc, err, "neither config.json nor exactly one .gguf file")


def test_empty_gguf(tmp_path, capsys):
    (tmp_path / "empty.gguf").write_bytes(b"")
    rc, _, err = run_in_process(capsys, "generate", str(tmp_path / "empty.gguf"), "--prompt", "hi")
    assert_clean_error(rc, err, "empty.gguf")


BUNDLED = os.path.join(os.path.dirname(__file__), "..", "specloom", "bundled", "smollm2-135m")
DRAFTER_CASES = [
    ("draft_hidden_huge", lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"],
                                                                         "hidden_size": 10 ** 9}},
     "drafter config field hidden_size must be an integer in [1, "),
    ("draft_zero_heads", lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"],
                                                                        "num_attention_heads": 0}},
     "drafter config field num_attention_heads must be an integer in [1, "),
    ("draft_vocab_string", lambda c: {**c, "draft_vocab_size": "many"},
     "drafter config field draft_vocab_size must be an integer, got 'many'"),
    ("draft_layer_config_list", lambda c: {**c, "transformer_layer_config": [1]},
     "drafter config must be a JSON object"),
    ("draft_feature_ids_strings", lambda c: {**c, "eagle_aux_hidden_state_layer_ids": ["a"]},
     "eagle_aux_hidden_state_layer_ids must be a list of layer ids"),
    ("medusa_heads_huge", lambda c: {**c, "medusa_num_heads": 10 ** 6},
     "medusa_num_heads must be an integer in [1, 64]"),
    ("medusa_layers_string", lambda c: {**c, "medusa_num_layers": "2"}, "medusa_num_layers must be an integer"),
    # MTP (a config overlay of the target's layout)
    ("mtp_layers_huge", lambda c: {**c, "num_nextn_predict_layers": 10 ** 6},
     "mtp drafter config field num_nextn_predict_layers must be an integer in [1, 64]"),
    ("mtp_layers_string", lambda c: {**c, "num_nextn_predict_layers": "1"},
     "num_nextn_predict_layers must be an integer, got '1'"),
    # within the bound but more layers than the checkpoint holds: refused by the tensors, nothing allocated
    ("mtp_more_layers_than_tensors", lambda c: {**c, "num_nextn_predict_layers": 64},
     "declares 64 MTP layer(s) (num_nextn_predict_layers) but tensor"),
    ("mtp_hidden_string", lambda c: {**c, "hidden_size": "576"}, "field hidden_size must be an integer, got '576'"),
    ("mtp_depth_string", lambda c: {**c, "specloom": {**c["specloom"], "depth": "deep"}},
     "field specloom.depth must be an integer, got 'deep'"),
    # DFlash (z-lab layout: a Qwen3 config at the top level, dflash_config)
    ("dflash_zero_heads", lambda c: {**c, "num_attention_heads": 0},
     "dflash drafter config field num_attention_heads must be an integer in [1, "),
    ("dflash_kv_heads_do_not_divide", lambda c: {**c, "num_key_value_heads": 2},
     "num_key_value_heads (2) must divide num_attention_heads (9)"),
    ("dflash_layers_huge", lambda c: {**c, "num_hidden_layers": 10 ** 9},
     "field num_hidden_layers must be an integer in [1, "),
    ("dflash_block_huge", lambda c: {**c, "dflash_config": {**c["dflash_config"], "block_size": 10 ** 6}},
     "field dflash_config.block_size must be an integer in [1, 256]"),
    ("dflash_mask_string", lambda c: {**c, "dflash_config": {**c["dflash_config"], "mask_token_id": "16"}},
     "field dflash_config.mask_token_id must be an integer, got '16'"),
    ("dflash_layer_ids_strings", lambda c: {**c, "dflash_config": {**c["dflash_config"],
                                                                    "target_layer_ids": ["a"]}},
     "field dflash_config.target_layer_ids must be a list of layer ids"),
    ("dflash_config_not_an_object", lambda c: {**c, "dflash_config": [6]}, "field dflash_config must be an object"),
    # DSpark (the built-in layout's config keys)
    ("dspark_block_string", lambda c: {**c, "dspark_block_size": "5"},
     "dspark drafter config field dspark_block_size must be an integer, got '5'"),
    ("dspark_markov_rank_negative", lambda c: {**c, "dspark_markov_rank": -1},
     "field dspark_markov_rank must be an integer in [0, "),
    ("dspark_confidence_string", lambda c: {**c, "enable_confidence_head": "yes"},
     "field enable_confidence_head must be true or false, got 'yes'"),
    ("dspark_layers_huge", lambda c: {**c, "n_mtp_layers": 10 ** 9}, "field n_mtp_layers must be an integer in [1, "),
    ("dspark_intermediate_huge", lambda c: {**c, "dspark_intermediate_size": 10 ** 9},
     "field dspark_intermediate_size must be an integer in [1, "),
]


def _method(case_id: str) -> str:
    head = case_id.split("_")[0]
    return head if head in ("medusa", "mtp", "dflash", "dspark") else "eagle3"


@pytest.mark.parametrize("method, edit, needle", [(_method(c[0]), *c[1:]) for c in DRAFTER_CASES],
                         ids=[c[0] for c in DRAFTER_CASES])
def test_bad_drafter_config_is_one_clear_line(tmp_path, capsys, method, edit, needle):
    from specloom.errors import SpecloomError
    from specloom.loading import resolve

    try:
        resolve("smollm2-135m")
    except SpecloomError as e:
        pytest.skip(str(e))
    bad = tmp_path / method
    shutil.copytree(os.path.join(BUNDLED, method), bad)
    with open(bad / "config.json") as f:
        config = json.load(f)
    (bad / "config.json").write_text(json.dumps(edit(config)))
    spec = json.dumps({"method": method, "model": str(bad)})
    rc, _, err = run_in_process(capsys, "generate", "smollm2-135m", "--speculative-config", spec, "--prompt",
                                "hi", "--max-tokens", "2")
    assert_clean_error(rc, err, needle)
