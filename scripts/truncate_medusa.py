"""Give a Medusa checkpoint whose heads share the target's LM head a truncated head vocabulary (`token_map`):
the N most frequent answer tokens of `specloom data` directories. No training: the ResBlocks are unchanged and
the truncated head is the target's own rows for those tokens (copied at load).

    python scripts/truncate_medusa.py smollm2-135m --data data/smollm2-v2 data/smollm2-v3 --vocab 4096 --out DIR \
        [--medusa SRC]   # default: the bundled Medusa
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from bench_medusa_vocab import truncated_copy  # noqa: E402
from specloom.drafters.checkpoint import find_drafter_dir  # noqa: E402
from specloom.engine import load  # noqa: E402
from specloom.training.common import draft_vocabulary  # noqa: E402
from specloom.training.dataset import DistillData  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--medusa", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    eng = load(a.model, {"method": "medusa", **({"model": a.medusa} if a.medusa else {})}, progress=False,
               speculation="fixed")
    t = eng.model
    data = DistillData(a.data, (t.config.num_layers,))
    token_map, coverage = draft_vocabulary(data, t.config.vocab_size, a.vocab, None)
    truncated_copy(eng.drafter.heads, token_map, find_drafter_dir(a.medusa, "medusa", t.config), a.out)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    fn = os.path.join(a.out, "medusa_lm_head.safetensors")  # stored in bf16, as the bundled heads are
    with safe_open(fn, "pt") as f:
        meta = f.metadata()
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(fn).items()}, fn,
              metadata=meta)
    print(f"{a.out}: token_map of {token_map.numel()} tokens, {coverage:.1%} of {data.num_answer_tokens} answer "
          "tokens", file=sys.stderr)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
