"""A drafter kind is one record filled from its own folder: adding tests/kinds/pebble/ (a drafter with its own
--speculative-config key, a checkpoint format, an export form and a trainer with its own `specloom train` option)
makes it work everywhere -- config parsing, generation (exact), checkpoints, export, the train command -- with no
edit outside the folder: nothing in specloom/ names it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import specloom.drafters as drafters
from specloom.drafters import KINDS
from specloom.engine import Engine
from specloom.errors import SpecloomError
from specloom.speculative import SpeculativeConfig

KINDS_DIR = os.path.join(os.path.dirname(__file__), "kinds")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def pebble():
    """The pebble kind's folder on the drafters package's path, discovered; removed again afterwards."""
    drafters.__path__.append(KINDS_DIR)
    try:
        assert "pebble" in drafters.discover()
        yield KINDS["pebble"]
    finally:
        drafters.__path__.remove(KINDS_DIR)
        KINDS.pop("pebble", None)
        for name in [m for m in sys.modules if m.startswith("specloom.drafters.pebble")]:
            del sys.modules[name]


def test_nothing_outside_the_folder_names_the_kind():
    out = subprocess.run(["grep", "-rIlw", "pebble", os.path.join(REPO, "specloom")], capture_output=True, text=True)
    assert out.stdout == ""  # grep prints the files that name it


def test_a_kind_folder_is_the_whole_kind(pebble, tiny, tmp_path):
    from specloom.cli import build_parser
    from specloom.drafters.checkpoint import load_drafter, save_drafter
    from specloom.export import write_speculators

    assert pebble.drafter.__name__ == "PebbleDrafter" and pebble.format is not None and pebble.export is not None
    # its own key, checked by its record; refused for another kind, which names its own keys
    spec = SpeculativeConfig.parse({"method": "pebble", "pebble_repeat": 3})
    assert spec.pebble_repeat == 3 and spec.tree_width is None
    with pytest.raises(SpecloomError, match="does not take 'pebble_repeat'"):
        SpeculativeConfig.parse({"method": "ngram", "pebble_repeat": 3})
    with pytest.raises(SpecloomError, match=r"pebble_repeat must be an integer in \[1, 8\]"):
        SpeculativeConfig.parse({"method": "pebble", "pebble_repeat": 99})
    # generation: exact, and the drafts really run (repeats are sometimes right)
    t = tiny("llama")
    ids = [5, 6, 7, 7, 7, 7, 8]
    plain = Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=24, ignore_eos=True)
    out = Engine(t.model, t.tokenizer, spec).generate(prompt_token_ids=ids, max_tokens=24, ignore_eos=True)
    assert out.token_ids == plain.token_ids and out.num_draft_tokens > 0
    # its checkpoint format: written, read back, and read by the drafter from a "model" directory
    net = pebble.drafter(2).model
    net.value.data.fill_(0.25)
    save_drafter("pebble", net, str(tmp_path / "ckpt"), {"kind": "pebble"})
    assert float(load_drafter(str(tmp_path / "ckpt"), "pebble", t.model, t.tokenizer)[0].value.detach()) == 0.25
    d = drafters.create_drafter(SpeculativeConfig.parse({"method": "pebble", "model": str(tmp_path / "ckpt")}),
                                t.model, t.tokenizer)
    assert float(d.model.value.detach()) == 0.25
    # its export form
    write_speculators("pebble", d.model, str(tmp_path / "export"), {})
    assert os.path.exists(tmp_path / "export" / "pebble-export.json")
    # its trainer and its option, in `specloom train`
    args = build_parser().parse_args(["train", "pebble", "--target", "x", "--data", "d", "--out", "o", "--pebble-steps", "3"])
    assert args.kind == "pebble" and args.pebble_steps == 3
    from specloom.jobs.train import load_trainers

    assert load_trainers()["pebble"].__name__ == "PebbleTrainer"
