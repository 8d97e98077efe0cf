"""Medusa drafting cost at the full vocabulary vs a truncated head vocabulary (`token_map`), side by side.

    OMP_NUM_THREADS=1 python scripts/bench_medusa_vocab.py smollm2-135m --data /work/data/smollm2-v2 \
        --vocab 4096 --prompts ../shared/data/eval/spec_bench.jsonl --per-category 1 --max-tokens 64

The truncated drafter is the given Medusa checkpoint (default: the bundled one) with its ResBlocks unchanged and a
token_map of the `--vocab` most frequent answer tokens of `--data` (written to a temporary checkpoint and loaded
through the normal path), so the two differ only in the output layer. Two measurements, in one process:
* heads: `logits -> top-10 -> target ids` on real hidden states, full and truncated calls alternating (hot cache);
* decoding (the same tree for both, from the source's measured top-k accuracies): per prompt, plain, full-vocab Medusa and truncated Medusa one after the other (greedy, fixed depth);
  drafting ms per step from the step's own accounting (`draft_seconds / target passes`), divided by the plain
  step of the same prompt (the ratio holds on a loaded host; absolute times do not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from ab_eagle_drafting import read_prompts  # noqa: E402  (scripts/: the same prompt selection)
from specloom import Engine  # noqa: E402
from specloom.drafters.checkpoint import find_drafter_dir, save_drafter  # noqa: E402
from specloom.drafters.medusa.drafter import TOPK, MedusaHeads  # noqa: E402
from specloom.engine import load  # noqa: E402
from specloom.speculative import SpeculativeConfig  # noqa: E402
from specloom.training.common import draft_vocabulary  # noqa: E402
from specloom.training.dataset import DistillData  # noqa: E402


def truncated_copy(heads: MedusaHeads, token_map, src: str, path: str) -> None:
    """`heads` with `token_map` at `path`, keeping the source's meta (its top-k accuracies: the same tree)."""
    sub = MedusaHeads(heads.hidden, heads.num_heads, heads.num_layers, None, token_map)
    sub.load_state_dict({**heads.state_dict(), "token_map": token_map})
    with open(os.path.join(src, "config.json")) as f:
        meta = json.load(f).get("specloom") or {}
    save_drafter("medusa", sub, path, meta, dtype=next(heads.parameters()).dtype)


@torch.inference_mode()
def heads_bench(a, b, hs, reps):
    times = {"full": [], "truncated": []}
    for _ in range(reps):
        for name, heads in (("full", a), ("truncated", b)):
            for h in hs:
                t = time.perf_counter()
                heads.target_ids(heads.logits(h[None]).topk(TOPK, dim=-1).indices).tolist()
                times[name].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--medusa", default=None, help="Medusa checkpoint (default: the bundled one)")
    ap.add_argument("--data", required=True, help="`specloom data` directory: the answer-token frequencies")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench.jsonl")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="fp32: the exactness check")
    ap.add_argument("--heads-reps", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    full_spec = {"method": "medusa", **({"model": a.medusa} if a.medusa else {})}
    eng = load(a.model, full_spec, dtype=a.dtype, progress=False, speculation="fixed")
    target, tok = eng.model, eng.tokenizer
    V = target.config.vocab_size
    data = DistillData(a.data, (target.config.num_layers,))
    token_map, coverage = draft_vocabulary(data, V, a.vocab, None)
    tmp = tempfile.mkdtemp(prefix="medusa_tv_")
    truncated_copy(eng.drafter.heads, token_map, find_drafter_dir(a.medusa, "medusa", target.config), tmp)
    sub = Engine(target, tok, SpeculativeConfig.parse({"method": "medusa", "model": tmp}), speculation="fixed")
    assert sub.drafter.choices == eng.drafter.choices, "the two drafters must use the same tree"
    plain = Engine(target, tok)
    print(f"token_map: {token_map.numel()} of {V} tokens, {coverage:.1%} of the answer tokens of {a.data} "
          f"({data.num_answer_tokens} answer tokens)", flush=True)
    prompts = read_prompts(a.prompts, eng, a.per_category, a.limit, 600)

    hs = []  # the real post-norm hidden states the full drafter scores during decoding (for the heads-alone run)
    logits = eng.drafter.heads.logits

    def recording(h):
        if len(hs) < 64:
            hs.extend(h.clone())
        return logits(h)

    eng.drafter.heads.logits = recording
    rows = []
    for i, ids in enumerate(prompts):
        r = {}
        p = plain.generate(prompt_token_ids=ids, max_tokens=a.max_tokens, ignore_eos=True)
        r["plain_step_ms"] = 1e3 * (p.total_seconds - p.prefill_seconds) / max(1, len(p.token_ids) - 1)
        for name, e in (("full", eng), ("truncated", sub)):
            g = e.generate(prompt_token_ids=ids, max_tokens=a.max_tokens, ignore_eos=True)
            steps = max(1, g.num_target_passes - 1)  # the prefill pass drafts nothing
            r[name] = {"draft_ms": 1e3 * g.draft_seconds / steps, "tau": g.mean_accepted_length,
                       "tok_s": g.decode_tokens_per_second, "identical": g.token_ids == p.token_ids}
            r[name]["x_plain"] = r[name]["draft_ms"] / r["plain_step_ms"]
        print(f"prompt {i}: plain step {r['plain_step_ms']:.1f} ms | " + " | ".join(
            f"{n} draft {r[n]['draft_ms']:.2f} ms ({r[n]['x_plain']:.3f} x plain), tau {r[n]['tau']:.2f}, "
            f"{'identical' if r[n]['identical'] else 'DIFFERS'}" for n in ("full", "truncated")), flush=True)
        rows.append(r)
    eng.drafter.heads.logits = logits
    heads = heads_bench(eng.drafter.heads, sub.drafter.heads, hs, a.heads_reps)
    print(f"heads alone (hot, {len(hs)} states x {a.heads_reps}): full {heads['full']:.2f} ms, "
          f"truncated {heads['truncated']:.2f} ms", flush=True)
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    print("\n| head vocabulary | heads alone, hot (ms) | drafting ms/step | x plain step | tau | decode tok/s "
          "| identical to plain |")
    print("|---|---|---|---|---|---|---|")
    for n, label in (("full", f"full ({V})"), ("truncated", f"token_map {token_map.numel()}")):
        print(f"| {label} | {heads[n]:.2f} | {med(lambda r: r[n]['draft_ms']):.2f} | "
              f"{med(lambda r: r[n]['x_plain']):.3f} | {med(lambda r: r[n]['tau']):.2f} | "
              f"{med(lambda r: r[n]['tok_s']):.1f} | {sum(r[n]['identical'] for r in rows)}/{len(rows)} |")
    print(f"plain step (median over prompts): {med(lambda r: r['plain_step_ms']):.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"heads_ms": heads, "rows": rows, "vocab": token_map.numel(), "coverage": coverage}, f,
                      indent=1)


if __name__ == "__main__":
    main()
