"""Write an EAGLE-3 checkpoint whose draft head keeps only its N most frequent rows (by a token map): the same rows
`{"draft_vocab": N}` keeps at load (EagleDraftModel.keep_head_rows), stored, so a drafter trained with a wide draft
vocabulary fits a smaller file. Every other tensor is copied unchanged; `d2t` / `t2d` and `draft_vocab_size` follow
the kept rows.

    python scripts/slice_eagle3_vocab.py RUN_DIR --draft-vocab 8192 --out DIR \
        [--token-map specloom/bundled/token_maps/3b25a8a8f01c11d5.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from specloom.drafters.token_map import ranked_rows  # noqa: E402

DEFAULT_MAP = os.path.join(os.path.dirname(__file__), "..", "specloom", "bundled", "token_maps",
                           "3b25a8a8f01c11d5.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--draft-vocab", type=int, required=True)
    ap.add_argument("--token-map", default=DEFAULT_MAP)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.src, "config.json")))
    w = load_file(os.path.join(a.src, "model.safetensors"))
    V = int(cfg["transformer_layer_config"]["vocab_size"])
    ids = torch.arange(w["d2t"].numel()) + w["d2t"]
    rows = ranked_rows(ids, a.draft_vocab, a.token_map, None, V)
    if rows is None:
        sys.exit(f"--draft-vocab {a.draft_vocab} keeps all {ids.numel()} rows: nothing to slice")
    kept = ids[rows]
    w["lm_head.weight"] = w["lm_head.weight"][rows].contiguous()
    w["d2t"] = kept - torch.arange(kept.numel())
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    w["t2d"] = t2d
    cfg["draft_vocab_size"] = int(kept.numel())
    sp = cfg.setdefault("specloom", {})
    sp["draft_vocab_size"] = int(kept.numel())
    sp["sliced_from"] = {"draft_vocab_size": int(ids.numel()), "token_map": os.path.basename(a.token_map),
                         "command": "python scripts/slice_eagle3_vocab.py " + " ".join(sys.argv[1:])}
    os.makedirs(a.out, exist_ok=True)
    save_file(w, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for name in os.listdir(a.src):
        if name.endswith(".png"):
            shutil.copy2(os.path.join(a.src, name), os.path.join(a.out, name))
    print(f"wrote {a.out}: {kept.numel()} of {ids.numel()} head rows")


if __name__ == "__main__":
    main()
