"""Acceptance and speed of the two sampling rules on the same drafter (sampling.py): "coupled" (position-keyed
Gumbel noise: the text depends on the seed alone) against "rejection" (min(1, p/q)), interleaved prompt by prompt,
plus whether each coupled text equals plain decoding's under the same seed.

    python scripts/coupled_vs_rejection.py --spec '{"method": "eagle3", "suffix_decoding": true}' --prompts 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import specloom  # noqa: E402
from specloom.engine import Engine  # noqa: E402
from specloom.host import host_line  # noqa: E402
from specloom.prompts import read_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--spec", default='{"method": "eagle3"}')
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    a = ap.parse_args()
    eng = specloom.load(a.target, json.loads(a.spec), progress=False, speculation="fixed")
    plain = Engine(eng.model, eng.tokenizer, None, eng.max_model_len, kv_dtype=eng.kv_dtype)
    rows = read_prompts("../shared/data/eval/spec_bench.jsonl")
    rows = rows[::max(1, len(rows) // a.prompts)][:a.prompts]
    stats = {r: {"tokens": 0, "passes": 0, "drafted": 0, "accepted": 0, "seconds": 0.0} for r in ("coupled", "rejection")}
    same = 0
    for i, row in enumerate(rows):
        ids = eng.encode(row["text"], chat=True)
        kw = dict(prompt_token_ids=ids, max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=i)
        order = ("coupled", "rejection") if i % 2 == 0 else ("rejection", "coupled")
        for rule in order:
            t = time.perf_counter()
            r = eng.generate(sampling_rule=rule, **kw)
            s = stats[rule]
            s["seconds"] += time.perf_counter() - t
            s["tokens"] += len(r.token_ids)
            s["passes"] += r.num_target_passes
            s["drafted"] += r.num_draft_tokens
            s["accepted"] += r.num_accepted_tokens
            if rule == "coupled":
                same += r.token_ids == plain.generate(sampling_rule="coupled", **kw).token_ids
    out = {"target": a.target, "spec": json.loads(a.spec), "prompts": len(rows), "max_tokens": a.max_tokens,
           "temperature": a.temperature, "top_p": a.top_p, "host": host_line(),
           "coupled_equal_to_plain": f"{same}/{len(rows)}"}
    for rule, s in stats.items():
        out[rule] = {"tau": round(s["tokens"] / max(s["passes"], 1), 3),
                     "acceptance": round(s["accepted"] / max(s["drafted"], 1), 3),
                     "tok_s": round(s["tokens"] / s["seconds"], 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
