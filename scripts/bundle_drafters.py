"""Copy trained drafters into specloom/bundled/<target>/<kind>/ and write the manifest.

    python scripts/bundle_drafters.py smollm2-135m runs/eagle3 runs/eagle runs/medusa [--bench out/bench.json]

Copies config.json + weights (+ loss.png), adds measured tau / speed-up from a `bench --compare` report when given,
writes specloom/bundled/MANIFEST.md, and refuses when the bundle would exceed 60 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specloom", "bundled")
LIMIT = 60 * 2**20
FILES = ("config.json", "model.safetensors", "medusa_lm_head.safetensors", "model-mtp.safetensors",
         "model-dspark.safetensors", "loss.png")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--bench", default=None, help="bench --compare JSON")
    ap.add_argument("--names", nargs="*", default=[], help="kind=candidate name in the bench report")
    a = ap.parse_args()
    bench = json.load(open(a.bench))["candidates"] if a.bench else {}
    for pair in a.names:
        kind, name = pair.split("=", 1)
        bench[kind] = bench[name]
    for ck in a.checkpoints:
        raw = json.load(open(os.path.join(ck, "config.json")))
        kind = raw["specloom"]["kind"]
        dst = os.path.join(ROOT, a.target, kind)
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        for f in FILES:
            if os.path.isfile(os.path.join(ck, f)):
                shutil.copy(os.path.join(ck, f), os.path.join(dst, f))
        if kind in bench:
            b = bench[kind]
            raw["specloom"]["measured"] = {k: b[k] for k in ("mean_accepted_length", "speedup", "speedup_aggregate",
                                                             "acceptance_per_position", "num_prompts")}
            json.dump(raw, open(os.path.join(dst, "config.json"), "w"), indent=1)
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ROOT) for f in fs)
    lines = ["# Bundled drafters", "", f"Total size: {total / 2**20:.1f} MB (limit 60 MB).", "",
             "| target | kind | parameters file | size | steps | data tokens | train wall time | held-out top-1 by step | "
             "measured tau | speed-up | command |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for target in sorted(os.listdir(ROOT)):
        tdir = os.path.join(ROOT, target)
        if not os.path.isdir(tdir):
            continue
        for kind in sorted(os.listdir(tdir)):
            d = os.path.join(tdir, kind)
            raw = json.load(open(os.path.join(d, "config.json")))
            m = raw["specloom"].get("manifest", {})
            meas = raw["specloom"].get("measured", {})
            w = next(f for f in os.listdir(d) if f.endswith(".safetensors"))
            held = m.get("held_out", {})
            accs = ", ".join(f"{held[k]:.2f}" for k in sorted(held) if k.startswith("acc"))
            lines.append(
                f"| {target} | {kind} | {w} | {os.path.getsize(os.path.join(d, w)) / 2**20:.1f} MB | {m.get('steps')} | "
                f"{m.get('data_tokens')} | {m.get('train_seconds_total', m.get('train_seconds_this_run', 0)) / 60:.1f} min | {accs} | "
                f"{meas.get('mean_accepted_length', float('nan')):.2f} | {meas.get('speedup', float('nan')):.2f}x | "
                f"`{m.get('command')}` |")
    lines += ["", "Data: `specloom data --target smollm2-135m --prompts ../shared/data/train --out data/smollm2` "
              "(self-distilled: the target answers the training prompts greedily; see BENCHMARKS.md).",
              "Measured tau / speed-up: Spec-Bench, bf16, greedy, batch 1, 128 tokens, interleaved with plain decoding "
              "(BENCHMARKS.md)."]
    open(os.path.join(ROOT, "MANIFEST.md"), "w").write("\n".join(lines) + "\n")
    print(f"bundle: {total / 2**20:.1f} MB")
    if total > LIMIT:
        raise SystemExit(f"bundle is {total / 2**20:.1f} MB > 60 MB")


if __name__ == "__main__":
    main()
