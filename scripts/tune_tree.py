"""Choose a drafter's tree shape from the measured verify-cost curve (benchmarking.md "Theory").

For each candidate shape (depth, tree_width, num_draft_tokens) this measures, on training prompts (never the
benchmark set), tau and the drafting time per step c (in target decode steps); with the cached verify-cost curve
v(n) the predicted speed-up is tau / (v(nodes + 1) + c). The best predicted shape is printed (and written into the
drafter's config.json with --write); the measured speed-up vs plain decoding is reported next to it as a check.

    python scripts/tune_tree.py smollm2-135m eagle3 [--model DIR] [--prompts FILE] [--write] [--png out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


from specloom.cost import verify_cost_curve
from specloom.engine import Engine, load
from specloom.speculative import SpeculativeConfig

SHAPES = {
    "eagle3": [(3, 1, 3), (4, 4, 8), (5, 4, 12), (6, 6, 16), (6, 6, 24), (7, 8, 32)],
    "eagle": [(3, 1, 3), (4, 4, 8), (5, 4, 12), (6, 6, 16), (6, 6, 24), (7, 8, 32)],
    "medusa": [(None, None, n) for n in (4, 8, 16, 24)],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("method")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default="../shared/data/train/arena-hard-v2.jsonl")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--write", action="store_true", help="store the chosen shape in the drafter's config.json")
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    plain = load(a.target)
    m, tok = plain.model, plain.tokenizer
    curve = verify_cost_curve(m)
    v = curve.relative()
    print("verify cost v(n):", {n: round(x, 2) for n, x in v.items()}, file=sys.stderr)
    with open(a.prompts) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()][-200:]
    ids = [x for x in (plain.encode(t, chat=True) for t in texts) if len(x) < 400][-a.num_prompts:]
    plain.generate(prompt_token_ids=ids[0][:32], max_tokens=4)
    t_plain = sum(plain.generate(prompt_token_ids=x, max_tokens=a.max_tokens).total_seconds for x in ids)
    step = statistics.median(
        r.total_seconds / max(r.num_target_passes, 1)
        for r in (plain.generate(prompt_token_ids=x, max_tokens=32) for x in ids[:3]))
    rows = []
    for depth, width, nodes in SHAPES[a.method]:
        spec = {"method": a.method, "model": a.model, "num_draft_tokens": nodes}
        if depth:
            spec.update(num_speculative_tokens=depth, tree_width=width)
        e = Engine(m, tok, SpeculativeConfig.parse(spec))
        draft_t = []
        orig = e.drafter.propose

        def timed(ctx, orig=orig):
            t = time.perf_counter()
            out = orig(ctx)
            draft_t.append(time.perf_counter() - t)
            return out

        e.drafter.propose = timed
        toks = passes = 0
        secs = 0.0
        for x in ids:
            r = e.generate(prompt_token_ids=x, max_tokens=a.max_tokens)
            toks += len(r.token_ids)
            passes += r.num_target_passes
            secs += r.total_seconds
        tau = (toks - len(ids)) / max(passes - len(ids), 1)
        c = statistics.mean(draft_t) / step
        n = nodes if nodes else len(e.drafter.choices)
        pred = tau / (curve(1, n + 1) + c)
        rows.append({"depth": depth, "tree_width": width, "num_draft_tokens": n, "tau": tau, "draft_cost": c,
                     "verify_cost": curve(1, n + 1), "predicted_speedup": pred,
                     "measured_speedup": t_plain / secs})
        print(f"depth {depth} width {width} nodes {n}: tau {tau:.2f}, drafting {c:.2f} steps, v {curve(1, n + 1):.2f}"
              f" -> predicted {pred:.2f}x, measured {t_plain / secs:.2f}x", file=sys.stderr, flush=True)
    best = max(rows, key=lambda r: r["predicted_speedup"])
    print("chosen:", json.dumps(best))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"verify_cost": v, "decode_step_s": step, "rows": rows, "chosen": best}, f, indent=1)
    if a.write and a.model:
        path = os.path.join(a.model, "config.json")
        raw = json.load(open(path))
        tree = {"depth": best["depth"], "tree_width": best["tree_width"], "num_draft_tokens": best["num_draft_tokens"]}
        raw.setdefault("specloom", {}).update({k: v for k, v in tree.items() if v is not None},
                                              tree_tuning={"rows": rows, "chosen": best})
        json.dump(raw, open(path, "w"), indent=1)
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
        ns = sorted(v)
        ax[0].plot(ns, [v[n] for n in ns], "o-")
        ax[0].set_xlabel("tokens verified in one pass")
        ax[0].set_ylabel("cost / single-token step")
        ax[0].set_title(f"verify cost, {a.target} {str(m.dtype).replace('torch.', '')}")
        xs = [r["num_draft_tokens"] for r in rows]
        ax[1].plot(xs, [r["predicted_speedup"] for r in rows], "o-", label="predicted tau/(v+c)")
        ax[1].plot(xs, [r["measured_speedup"] for r in rows], "s--", label="measured")
        ax[1].set_xlabel("draft tree nodes")
        ax[1].set_title(f"{a.method}: tree size")
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(a.png, dpi=90)


if __name__ == "__main__":
    main()
