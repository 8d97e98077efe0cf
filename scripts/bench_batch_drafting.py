"""Drafter time per step at 1, 4 and 8 concurrent rows: batch-first drafting vs the same drafter called row by row.

    python scripts/bench_batch_drafting.py smollm2-135m --kinds eagle3 mtp dflash dspark --rows 1 4 8 \
        --prompts ../shared/data/eval/spec_bench.jsonl --json out/batch_drafting.json

For each drafter kind and row count, fresh rows are prefilled with different prompts into one KV pool and then
run through the one speculative step (step.py) at the drafter's full depth, greedy. Drafter time per step =
propose + on_verified for all rows of the step (the step's own accounting). "per row" calls the same drafter
once per row (what the scheduler did before drafting was batched): same trees, same outputs. Both modes
alternate per repeat, in one process, so their ratio is measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from specloom.engine import load  # noqa: E402
from specloom.sampling import SamplingParams  # noqa: E402
from specloom.step import Request, StepPlan, Stepper  # noqa: E402
from specloom.kv import TREE_SLACK  # noqa: E402


def read_prompts(path: str, tokenizer, count: int, max_len: int) -> list[list[int]]:
    out = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            turns = d.get("turns") or [d.get("prompt") or d.get("text")]
            ids = tokenizer.encode_chat([{"role": "user", "content": turns[0]}])
            if len(ids) <= max_len:
                out.append(ids)
            if len(out) >= count:
                break
    return out


def per_row(drafter):
    """The drafter called once per row (the pre-batching behaviour), restored by the returned function."""
    propose, on_verified = drafter.propose, drafter.on_verified
    drafter.propose = lambda ctxs: [propose([c])[0] for c in ctxs]
    drafter.on_verified = lambda ctxs, results, out: [on_verified([c], [r], out) for c, r in zip(ctxs, results)]

    def undo():
        drafter.propose, drafter.on_verified = propose, on_verified
    return undo


@torch.inference_mode()
def measure(engine, prompts, n: int, steps: int, warmup: int) -> dict:
    row_len = 1024 + TREE_SLACK
    pool = engine.model.new_kv(row_len, batch=n, active=0)
    st = Stepper(engine.model, engine.drafter, pool, engine.tokenizer)
    rows = []
    for i in range(n):
        ids = prompts[i % len(prompts)]
        row = st.new_row(Request(ids, 1024 - len(ids), SamplingParams(), ignore_eos=True), pool.allocate())
        while row.prefilled < len(ids):
            st.prefill(row, 10 ** 9)
        rows.append(row)
    draft, total, accepted = [], [], 0
    for s in range(warmup + steps):
        t = time.perf_counter()
        rep = st.step(rows, StepPlan([engine.drafter.num_speculative_tokens] * len(rows)))
        if s >= warmup:
            draft.append(rep.draft_seconds)
            total.append(time.perf_counter() - t)
            accepted += sum(rep.accepted)
        if any(r.finish for r in rows):
            raise RuntimeError(f"a row finished early: {[r.finish for r in rows]}")
    return {"draft_ms": 1e3 * statistics.median(draft), "step_ms": 1e3 * statistics.median(total),
            "accepted_per_row_step": accepted / (steps * n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kinds", nargs="+", default=["eagle3", "mtp", "dflash", "dspark"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench.jsonl")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    results = {}
    for kind in a.kinds:
        engine = load(a.model, {"method": kind}, dtype=a.dtype, progress=False)
        prompts = read_prompts(a.prompts, engine.tokenizer, max(a.rows), 400)
        res = {}
        for n in a.rows:
            got = {"batched": [], "per_row": []}
            for _ in range(a.repeats):
                for mode in ("batched", "per_row"):
                    undo = per_row(engine.drafter) if mode == "per_row" else (lambda: None)
                    try:
                        got[mode].append(measure(engine, prompts, n, a.steps, a.warmup))
                    finally:
                        undo()
            res[n] = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in got.items()}
            b, p = res[n]["batched"], res[n]["per_row"]
            print(f"{kind:7s} rows {n}: drafter {b['draft_ms']:6.1f} ms/step batched, {p['draft_ms']:6.1f} per row; "
                  f"step {b['step_ms']:6.1f} / {p['step_ms']:6.1f} ms", flush=True)
        one = res[a.rows[0]]["batched"]["draft_ms"]
        for n in a.rows:
            res[n]["batched_vs_1_row"] = res[n]["batched"]["draft_ms"] / one
            res[n]["per_row_vs_1_row"] = res[n]["per_row"]["draft_ms"] / res[a.rows[0]]["per_row"]["draft_ms"]
        results[kind] = res
    print("\n| drafter | " + " | ".join(f"{n} rows: batched ms (x 1 row) / per row ms" for n in a.rows) + " |")
    print("|---|" + "---|" * len(a.rows))
    for kind, res in results.items():
        cells = [f"{res[n]['batched']['draft_ms']:.1f} ({res[n]['batched_vs_1_row']:.2f}x) / "
                 f"{res[n]['per_row']['draft_ms']:.1f}" for n in a.rows]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
