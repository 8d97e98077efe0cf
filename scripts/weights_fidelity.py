"""How close a GGUF target runs to its published weights, and what it holds in memory (issue 37, items 2 and 5).

Fidelity: the reference is the fp32 model dequantised from the GGUF (every weight exactly as the `gguf` package
computes it, fp32 activations). Against it, over the first N Spec-Bench prompts (one teacher-forced pass over each
prompt's chat-formatted tokens, every position):
* bf16 dequantised (`--linear-kernel onednn`: today's path, weights rounded to bf16);
* bf16 as shipped (`--linear-kernel ggml`: the blocks, exact weights, bf16 activations).
Reported: max |delta logit| over every position and vocabulary entry, its mean over positions, the mean KL divergence
KL(reference || run) per position, and top-1 agreement (over all positions, and over those where the reference's top
two logits are >= 0.25 apart: below that, which of two near-tied tokens comes first is decided by rounding noise).
Two pairs: with fp32 activations (the weights' representation alone: rounded to bf16 vs the blocks as shipped), and
as the engine runs (bf16 activations, whose rounding then dominates both).

Memory (`--memory`): resident set size of a fresh process after loading the target with each kernel, minus the
same process's size before the load (Python, torch and specloom imported).

    python scripts/weights_fidelity.py smollm2-135m gemma3-270m --prompts 20
    python scripts/weights_fidelity.py smollm2-135m gemma3-270m --memory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EVAL = os.path.join(HERE, "..", "..", "shared", "data", "eval", "spec_bench.jsonl")


def prompts(n: int) -> list[str]:
    with open(EVAL) as f:
        return [json.loads(line)["turns"][0] for line in f][:n]


def fidelity(alias: str, n: int) -> list[dict]:
    import torch

    from specloom.loading import load_target

    ref, tok = load_target(alias, "fp32", progress=False, kernel="native")
    texts = prompts(n)
    ids = [tok.encode_chat([{"role": "user", "content": t}]) if tok.has_chat_template else tok.encode(t)
           for t in texts]

    def logits(model):
        out = []
        with torch.inference_mode():
            for x in ids:
                kv = model.new_kv(len(x) + 1)
                out.append(model(torch.tensor([x]), torch.arange(len(x))[None], kv).logits[0].float())
        return out

    base = logits(ref)
    rows = []

    def row(label, got):
        diffs = [(a - b).abs() for a, b in zip(got, base)]
        n = sum(d.shape[0] for d in diffs)
        # positions where the reference's top two logits are 0.25 or more apart: top-1 there is not a near-tie's coin
        sure = [b.topk(2, -1).values.diff(dim=-1).abs()[:, 0] >= 0.25 for b in base]
        n_sure = sum(s.sum().item() for s in sure)
        rows.append({"target": alias, "weights": label, "prompts": len(ids), "positions": n,
                     "max_abs_dlogit": max(d.max().item() for d in diffs),
                     "mean_max_abs_dlogit": sum(d.max(-1).values.sum().item() for d in diffs) / n,
                     "kl_ref_to_run": sum(torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1),
                                                                     log_target=True, reduction="sum").item()
                                          for a, b in zip(got, base)) / n,
                     "top1_agreement": sum((a.argmax(-1) == b.argmax(-1)).sum().item()
                                           for a, b in zip(got, base)) / n,
                     "top1_agreement_margin_0.25": sum(((a.argmax(-1) == b.argmax(-1)) & s).sum().item()
                                                       for a, b, s in zip(got, base, sure)) / max(n_sure, 1),
                     "positions_margin_0.25": n_sure})

    # weights alone (fp32 activations): the weights rounded to bf16 vs the blocks as shipped
    with torch.no_grad():
        for mod in ref.modules():
            for name, p in mod.named_parameters(recurse=False):
                if name == "weight" and p.dim() == 2:
                    p.copy_(p.bfloat16().float())
    row("fp32 activations, weights rounded to bf16", logits(ref))
    del ref
    model, _ = load_target(alias, "fp32", progress=False, kernel="ggml")
    row("fp32 activations, weights as shipped (ggml)", logits(model))
    del model
    for label, kernel in (("bf16 activations, weights dequantised to bf16 (onednn)", "onednn"),
                          ("bf16 activations, weights as shipped (ggml)", "ggml")):
        model, _ = load_target(alias, "bf16", progress=False, kernel=kernel)
        row(label, logits(model))
        del model
    return rows


_PROBE = """
import json, sys
def rss():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith('VmRSS')) * 1024
import torch, specloom.loading as L
before = rss()
model, tok = L.load_target(sys.argv[1], sys.argv[2], progress=False, kernel=sys.argv[3])
print(json.dumps({"before": before, "after": rss(), "choice": model.kernel_choice.tag}))
"""


def memory(alias: str) -> list[dict]:
    rows = []
    for label, dtype, kernel in (("fp32 dequantised", "fp32", "native"), ("bf16 dequantised (onednn)", "bf16", "onednn"),
                                 ("bf16 dequantised (native)", "bf16", "native"),
                                 ("bf16 as shipped (ggml)", "bf16", "ggml")):
        r = subprocess.run([sys.executable, "-c", _PROBE, alias, dtype, kernel], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(r.stderr[-2000:])
        d = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append({"target": alias, "weights": label, "rss_mib": (d["after"] - d["before"]) / 2 ** 20})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--memory", action="store_true", help="measure resident memory instead of fidelity")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [r for t in a.targets for r in (memory(t) if a.memory else fidelity(t, a.prompts))]
    if a.memory:
        print("| target | weights | resident MiB after load |\n|---|---|---|")
        for r in rows:
            print(f"| {r['target']} | {r['weights']} | {r['rss_mib']:.0f} |")
    else:
        print("| target | weights | prompts (positions) | max abs dlogit | mean per-position max | mean KL | top-1 "
              "agreement | top-1 where the reference's margin >= 0.25 (positions) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['target']} | {r['weights']} | {r['prompts']} ({r['positions']}) | {r['max_abs_dlogit']:.3g} "
                  f"| {r['mean_max_abs_dlogit']:.3g} | {r['kl_ref_to_run']:.3g} | {r['top1_agreement']:.2%} "
                  f"| {r['top1_agreement_margin_0.25']:.2%} ({r['positions_margin_0.25']}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
