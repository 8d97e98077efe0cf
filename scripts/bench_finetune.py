"""Issue 16, items 1 and 3: a fine-tuned target, the bundled drafters on it, an adapted drafter, what `doctor` says,
and how well the behavioural distance predicts the acceptance drop.

Sections (fp32 targets, greedy, speculation fixed at the drafter's depth, Spec-Bench prompts -- never trained on):

- `adapt`: original target + bundled EAGLE-3 -> fine-tuned target + bundled EAGLE-3 -> fine-tuned + adapted
  EAGLE-3: tau, acceptance per position, tokens/s against plain decoding of the same target (plain and speculative
  interleaved prompt by prompt), the share of the tau gap recovered, and `doctor`'s verdict at each stage.
- `doctor`: the five cases of the issue's "must show" (the three stages above are three of them; plus the adapted
  drafter on the original target, a drafter for another vocabulary, and `draft_model` with the target as its own
  drafter).
- `distance`: every separate bundled drafter (EAGLE-3, EAGLE, Medusa, DFlash) on targets moved step by step from
  the original to the fine-tune (weights interpolated, alpha = 0, 0.25, 0.5, 0.75, 1): the behavioural distance
  of each to the drafter's recording and the drop of its accepted tokens per step; the re-exports of the number
  formats issue (docs/formats_issue15.json) are added as further points. Table + plot.

    python scripts/bench_finetune.py --finetuned /work/runs/smollm2-pirate --adapted /work/runs/e3_pirate \\
        --json docs/finetune_issue16.json --plot docs/distance_vs_drop.png
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_formats import BUNDLED, bundled_meta, encode, log  # noqa: E402

from specloom.behaviour import behavioural_distance  # noqa: E402
from specloom.bench.harness import add_per_position, read_prompts  # noqa: E402
from specloom.engine import Engine  # noqa: E402
from specloom.loading import load_target  # noqa: E402
from specloom.speculative import SpeculativeConfig  # noqa: E402

SEPARATE = ["eagle3", "eagle", "medusa", "dflash"]  # the bundled drafters that are their own directories
ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]


def spec_engine(model, tok, config: dict) -> Engine:
    with contextlib.redirect_stderr(io.StringIO()):
        return Engine(model, tok, SpeculativeConfig.parse(config), speculation="fixed")


def run(engine: Engine, ids: list[int], max_tokens: int):
    return engine.generate(prompt_token_ids=ids, max_tokens=max_tokens)


def side_by_side(model, tok, configs: dict, ids: list[list[int]], max_tokens: int) -> dict:
    """Plain and every speculative engine, interleaved prompt by prompt; per engine tau (prefill excluded),
    acceptance per position, decode tokens/s, and how many outputs equal plain's."""
    engines = {"plain": Engine(model, tok, None)}
    engines.update({name: spec_engine(model, tok, c) for name, c in configs.items()})
    for e in engines.values():
        run(e, ids[0], 8)  # warm-up
    tot = {n: {"tokens": 0, "passes": 0, "seconds": 0.0, "acc": [], "prop": [], "same": 0} for n in engines}
    for p in ids:
        ref = None
        for n, e in engines.items():
            r = run(e, p, max_tokens)
            t = tot[n]
            t["tokens"] += len(r.token_ids) - 1
            t["passes"] += r.num_target_passes - 1
            t["seconds"] += r.total_seconds - r.prefill_seconds
            add_per_position(t["acc"], r.accepted_per_position)
            add_per_position(t["prop"], r.proposed_per_position)
            ref = r.token_ids if n == "plain" else ref
            t["same"] += r.token_ids == ref
    out = {}
    plain_tps = tot["plain"]["tokens"] / tot["plain"]["seconds"]
    for n, t in tot.items():
        tps = t["tokens"] / t["seconds"]
        out[n] = {"tau": round(t["tokens"] / max(t["passes"], 1), 3), "tokens_per_s": round(tps, 2),
                  "speedup": round(tps / plain_tps, 3), "identical_to_plain": t["same"], "prompts": len(ids),
                  "acceptance_per_position": [round(a / q, 3) if q else 0.0 for a, q in zip(t["acc"], t["prop"])]}
    return out


def doctor(target: str, config: dict) -> dict:
    """`specloom doctor TARGET --speculative-config ...` as a user runs it (CLI, fp32); its JSON report."""
    from specloom.cli import main

    path = f"/tmp/doctor_{os.getpid()}.json"
    if os.path.exists(path):
        os.remove(path)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["doctor", target, "--speculative-config", json.dumps(config), "--dtype", "fp32", "--json", path])
    if not os.path.isfile(path):
        return {"exit_status": rc, "verdict": None, "reason": "no report written"}
    with open(path) as f:
        rep = json.load(f)
    keep = ("verdict", "reason", "tau", "tau_expected", "predicted_speedup", "best_config", "measured_speedup",
            "differences", "seconds")
    b = rep.get("behavioural_distance") or {}
    return {"exit_status": rc, **{k: rep.get(k) for k in keep},
            "kl": b.get("kl_mean"), "top1_agreement": b.get("top1_agreement")}


def section_adapt(args, ids) -> dict:
    e3 = os.path.join(BUNDLED, "eagle3")
    rows = {}
    model, tok = load_target("smollm2-135m", "fp32", progress=False)
    r = side_by_side(model, tok, {"bundled": {"method": "eagle3", "model": e3}}, ids, args.max_tokens)
    rows["original"] = {"plain": r["plain"], "bundled": r["bundled"]}
    log(f"adapt: original target {r}")
    del model
    model, tok = load_target(args.finetuned, "fp32", progress=False)
    r = side_by_side(model, tok, {"bundled": {"method": "eagle3", "model": e3},
                                  "adapted": {"method": "eagle3", "model": args.adapted}}, ids, args.max_tokens)
    rows["finetuned"] = r
    log(f"adapt: fine-tuned target {r}")
    t0, t1, t2 = rows["original"]["bundled"]["tau"], r["bundled"]["tau"], r["adapted"]["tau"]
    return {"stages": rows, "tau_gap_recovered": round((t2 - t1) / (t0 - t1), 3) if t0 != t1 else None}


def section_doctor(args) -> list[dict]:
    e3 = os.path.join(BUNDLED, "eagle3")
    other = "/tmp/eagle3_other_vocab_151936"
    if not os.path.isdir(other):  # the bundled EAGLE-3 with its config saying another vocabulary
        import shutil

        shutil.copytree(e3, other)
        with open(os.path.join(other, "config.json")) as f:
            cfg = json.load(f)
        cfg["vocab_size"] = 151936  # Qwen2.5's (the speculators format keeps it in the layer config)
        cfg.setdefault("transformer_layer_config", {})["vocab_size"] = 151936
        with open(os.path.join(other, "config.json"), "w") as f:
            json.dump(cfg, f)
    cases = [
        ("bundled EAGLE-3 on SmolLM2-135M", "smollm2-135m", {"method": "eagle3", "model": e3}),
        ("EAGLE-3 adapted to the fine-tune, on the original", "smollm2-135m", {"method": "eagle3", "model": args.adapted}),
        ("bundled EAGLE-3 on the fine-tuned target", args.finetuned, {"method": "eagle3", "model": e3}),
        ("adapted EAGLE-3 on the fine-tuned target", args.finetuned, {"method": "eagle3", "model": args.adapted}),
        ("EAGLE-3 for another vocabulary", "smollm2-135m", {"method": "eagle3", "model": other}),
        ("draft_model: the target drafting for itself", "smollm2-135m",
         {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3}),
    ]
    rows = []
    for name, target, config in cases:
        r = {"case": name, "target": target, "config": config, **doctor(target, config)}
        log(f"doctor: {r}")
        rows.append(r)
    return rows


def tau_of(model, tok, config, ids, max_tokens) -> dict:
    e = spec_engine(model, tok, config)
    tokens = passes = 0
    acc, prop = [], []
    for p in ids:
        r = run(e, p, max_tokens)
        tokens += len(r.token_ids) - 1
        passes += r.num_target_passes - 1
        add_per_position(acc, r.accepted_per_position)
        add_per_position(prop, r.proposed_per_position)
    return {"tau": round(tokens / max(passes, 1), 3),
            "acceptance_per_position": [round(a / q, 3) if q else 0.0 for a, q in zip(acc, prop)]}


def section_distance(args, ids) -> list[dict]:
    # unpacked (plain nn.Linear weights): the interpolation below writes the weights the passes read
    orig, tok = load_target("smollm2-135m", "fp32", progress=False, pack=False)
    ft, _ = load_target(args.finetuned, "fp32", progress=False, pack=False)
    a_sd = {k: v.clone() for k, v in orig.state_dict().items()}
    b_sd = ft.state_dict()
    del ft
    rows = []
    for alpha in ALPHAS:
        with torch.no_grad():
            for k, v in orig.state_dict().items():
                if v.is_floating_point():
                    v.copy_((1 - alpha) * a_sd[k] + alpha * b_sd[k])
        for d in SEPARATE:
            meta = bundled_meta(d)
            b = behavioural_distance(orig, tok, meta["target_probe"])
            r = tau_of(orig, tok, {"method": d, "model": os.path.join(BUNDLED, d)}, ids[:args.distance_prompts],
                       args.distance_tokens)
            row = {"target": f"fine-tune alpha {alpha}", "alpha": alpha, "drafter": d, **r,
                   "kl": round(b["kl_mean"], 5), "top1_agreement": round(b["top1_agreement"], 4)}
            log(f"distance: {row}")
            rows.append(row)
    base = {r["drafter"]: r["tau"] for r in rows if r["alpha"] == 0.0}
    for r in rows:
        r["tau_drop"] = round(1 - (r["tau"] - 1) / (base[r["drafter"]] - 1), 3)  # share of accepted tokens lost
        r["source"] = "fine-tune"
    fmt = os.path.join(os.path.dirname(__file__), "..", "docs", "formats_issue15.json")
    if os.path.isfile(fmt):  # the re-exports (bf16 targets, their own prompt set): drop against their Q4_1 row
        with open(fmt) as f:
            oc = json.load(f).get("other_copy", [])
        ref = {r["drafter"]: r["tau"] for r in oc if r["target"] == "q4_1"}
        for r in oc:
            if r["target"] == "q4_1":
                continue
            b = r["behavioural_distance"]
            rows.append({"target": f"{r['target']} re-export", "drafter": r["drafter"], "tau": r["tau"],
                         "kl": round(b["kl_mean"], 5), "top1_agreement": round(b["top1_agreement"], 4),
                         "tau_drop": round(1 - (r["tau"] - 1) / (ref[r["drafter"]] - 1), 3),
                         "source": "re-export (docs/formats_issue15.json)"})
    return rows


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else 0.0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    marks = {"eagle3": "o", "eagle": "s", "medusa": "^", "dflash": "D", "mtp": "v", "dspark": "P"}
    for src, color in (("fine-tune", "tab:red"), ("re-export (docs/formats_issue15.json)", "tab:blue")):
        for d, m in marks.items():
            pts = [r for r in rows if r["source"] == src and r["drafter"] == d]
            if not pts:
                continue
            lab = f"{d} ({'fine-tune path' if src == 'fine-tune' else 're-exports'})"
            axes[0].scatter([max(r["kl"], 1e-5) for r in pts], [r["tau_drop"] for r in pts], marker=m, c=color,
                            label=lab, alpha=0.8)
            axes[1].scatter([1 - r["top1_agreement"] for r in pts], [r["tau_drop"] for r in pts], marker=m,
                            c=color, alpha=0.8)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("behavioural distance: mean KL on the probe (nats)")
    axes[1].set_xlabel("1 - top-1 agreement on the probe")
    for ax in axes:
        ax.set_ylabel("share of accepted tokens per step lost")
        ax.axhline(0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].axvline(0.05, color="grey", ls="--", lw=0.8)
    axes[1].axvline(0.10, color="grey", ls="--", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M: behavioural distance vs acceptance drop (dashed: the warning limits)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--finetuned", required=True)
    ap.add_argument("--adapted", required=True)
    ap.add_argument("--prompts", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                                      "eval", "spec_bench.jsonl"))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--distance-prompts", type=int, default=12, help="distance section: the first N prompts")
    ap.add_argument("--distance-tokens", type=int, default=48)
    ap.add_argument("--sections", default="adapt,doctor,distance")
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    prompts = read_prompts(args.prompts, per_category=args.per_category)
    tok = load_target("smollm2-135m", "fp32", progress=False)[1]
    ids = encode(tok, prompts)
    report = {"command": " ".join(["python"] + sys.argv), "prompts": len(ids), "max_tokens": args.max_tokens,
              "host_threads": torch.get_num_threads()}
    if os.path.isfile(args.json):
        with open(args.json) as f:
            report = {**json.load(f), **report}
    for s in args.sections.split(","):
        t0 = time.perf_counter()
        report[s] = {"adapt": lambda: section_adapt(args, ids), "doctor": lambda: section_doctor(args),
                     "distance": lambda: section_distance(args, ids)}[s]()
        log(f"section {s}: {time.perf_counter() - t0:.0f} s")
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if "distance" in report:
        rows = [r for r in report["distance"] if r["kl"] is not None]
        report["distance_correlation"] = {
            "spearman_kl_vs_drop": round(spearman([r["kl"] for r in rows], [r["tau_drop"] for r in rows]), 3),
            "spearman_top1_disagreement_vs_drop": round(spearman([1 - r["top1_agreement"] for r in rows],
                                                                 [r["tau_drop"] for r in rows]), 3),
            "points": len(rows)}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        if args.plot:
            plot(rows, args.plot)
    print(json.dumps({k: v for k, v in report.items() if k != "distance"}, indent=1))


if __name__ == "__main__":
    main()
