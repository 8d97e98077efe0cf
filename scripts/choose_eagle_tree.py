"""Choose an EAGLE drafter's default tree shape (depth, tree_width, num_draft_tokens) on this host from its
verify-cost curve, the drafter's measured acceptance per depth and its measured drafting cost (the method is in
specloom/bench/eagle_shape.py); optionally store it in the drafter's config.json (`--write`), where
`--speculative-config` defaults come from. Run it again for a retrained drafter or another machine.

    python scripts/choose_eagle_tree.py smollm2-135m [--method eagle3] [--model DIR] \
        [--prompts ../shared/data/train/arena-hard-v2.jsonl:8 ../shared/data/train/mbpp.jsonl:1 ...] \
        [--num-prompts 8] [--max-tokens 96] \
        [--threads N] [--refresh-curve] [--json out/tree_choice.json] [--write [--keep-shape]]

Calibration prompts are training prompts (never the benchmark set). Without --model the bundled drafter is used
(and written, with --write).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from specloom.cost import verify_cost_curve  # noqa: E402
from specloom.bench import eagle_shape as shape  # noqa: E402
from specloom.engine import load  # noqa: E402


def read_prompts(files, engine, count: int, max_len: int) -> list[list[int]]:
    """`FILE:N`: N prompts of that file (from its end); plain `FILE`s fill up to `count` prompts in all, round
    robin."""
    fixed, free = [], []
    for spec in files:
        path, _, n = spec.partition(":")
        with open(path) as f:
            texts = [json.loads(line)["turns"][0] for line in f if line.strip()]
        ids = [x for x in (engine.encode(t, chat=True) for t in texts[::-1]) if len(x) <= max_len]
        if n:
            fixed.append(ids[:int(n)])
        else:
            free.append(ids)
    out = [x for p in fixed for x in p]
    i = 0
    while len(out) < count and any(i < len(p) for p in free):
        out += [p[i] for p in free if i < len(p)][:count - len(out)]
        i += 1
    return out


def shape_rows(table: list[dict], max_nodes: int = 16) -> list[list]:
    """Every evaluated shape as [depth, width, nodes, tau, passes]: what does not depend on the host, from which
    the engine re-chooses the tree for another host's verify-cost curve (drafters/eagle/drafter.py, ShapeTable)."""
    return [[r["depth"], r["tree_width"], r["num_draft_tokens"], round(r["tau"], 4), round(r["passes"], 4)]
            for r in table if r["num_draft_tokens"] <= max_nodes]


def compact(info: dict, table: list[dict]) -> dict:
    """What goes into the drafter's config.json: the choice, the runner-up rows and the measurements, without
    the per-prompt detail, and the shape table."""
    def row(r):
        return None if r is None else {k: v for k, v in r.items() if k != "tau_by_prompt"}

    out = {k: v for k, v in info.items() if k not in ("top", "chosen", "best_predicted", "previous")}
    out.update(chosen=row(info["chosen"]), best_predicted=row(info["best_predicted"]),
               previous=row(info["previous"]), top=[row(r) for r in info["top"][:8]], shapes=shape_rows(table))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--method", default="eagle3", choices=("eagle", "eagle3"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", nargs="+", default=["../shared/data/train/arena-hard-v2.jsonl"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--max-depth", type=int, default=7)
    ap.add_argument("--widths", type=int, nargs="+", default=list(shape.WIDTHS))
    ap.add_argument("--cost-samples", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--refresh-curve", action="store_true", help="measure the verify-cost curve again")
    ap.add_argument("--json", default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--keep-shape", action="store_true",
                    help="with --write: store the shape table (what every host re-chooses from) but keep the "
                         "drafter's default shape (e.g. a retrained drafter measured on another host than its "
                         "default was chosen on)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    engine = load(a.target, {"method": a.method, **({"model": a.model} if a.model else {})}, dtype=a.dtype,
                  progress=False, speculation="fixed")
    d = engine.drafter
    curve = verify_cost_curve(engine.model, refresh=a.refresh_curve)
    print("verify cost v(n):", {n: round(x, 2) for n, x in curve.relative().items()}, file=sys.stderr, flush=True)
    prompts = read_prompts(a.prompts, engine, a.num_prompts, a.max_len)
    costs = shape.drafting_costs(engine, prompts[0], a.widths, samples=a.cost_samples)
    print(f"drafting cost (target steps): c0 {costs.c0:.3f}, c1 " +
          ", ".join(f"w{w} {c:.3f}" for w, c in costs.c1.items()) + f"; target step {costs.target_step_s * 1e3:.1f} ms",
          file=sys.stderr, flush=True)
    records = shape.replay(engine, prompts, a.widths, a.max_depth, a.max_tokens, a.stride,
                           progress=lambda i, n: print(f"replayed {i}/{n} prompts", file=sys.stderr, flush=True))
    table = shape.evaluate(records, costs, curve)
    best = shape.choose(table)
    current = (d.depth, d.width, d.num_nodes)
    cur = next((r for r in table if (r["depth"], r["tree_width"], r["num_draft_tokens"]) == current), None)
    print(f"{'depth':>5} {'width':>5} {'nodes':>5} {'tau':>6} {'passes':>6} {'draft c':>7} {'v(n+1)':>6} {'pred':>6} "
          f"{'se':>5}  acceptance per depth")
    shown = table[:15] + [r for r in (best, cur) if r is not None and r not in table[:15]]
    for r in shown:
        mark = (" <- chosen" if r is best else "") + (" <- current" if r is cur else "")
        print(f"{r['depth']:>5} {r['tree_width']:>5} {r['num_draft_tokens']:>5} {r['tau']:>6.3f} {r['passes']:>6.2f} "
              f"{r['draft_cost']:>7.3f} {r['verify_cost']:>6.2f} {r['predicted_speedup']:>6.3f} {r['se_vs_best']:>5.3f}  "
              + " ".join(f"{x:.2f}" for x in r["acceptance_per_depth"]) + mark)
    choice = {k: best[k] for k in ("depth", "tree_width", "num_draft_tokens")}
    print("chosen:", json.dumps(choice))
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                         cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except Exception:
        commit = None
    info = {"command": " ".join(["python scripts/choose_eagle_tree.py", *sys.argv[1:]]), "commit": commit,
            "threads": torch.get_num_threads(), "verify_cost": curve.relative(), "costs": shape.costs_dict(costs),
            "positions": len(records) // len(a.widths), "prompts": len(prompts), "chosen": best,
            "best_predicted": table[0], "previous": cur, "top": table[:15], "seconds": round(time.time() - t0, 1)}
    if a.json:
        info_all = dict(info, table=table)
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(info_all, f, indent=1)
    if a.write:
        from specloom.drafters.checkpoint import find_drafter_dir

        path = os.path.join(find_drafter_dir(a.model, a.method, engine.model.config), "config.json")
        with open(path) as f:
            raw = json.load(f)
        keep = {k: raw.get("specloom", {}).get(k) for k in ("depth", "tree_width", "num_draft_tokens")}
        raw.setdefault("specloom", {}).update(keep if a.keep_shape and all(keep.values()) else choice,
                                              tree_choice=compact(info, table))
        with open(path, "w") as f:
            json.dump(raw, f, indent=1)
        print("written to", path, file=sys.stderr)


if __name__ == "__main__":
    main()
