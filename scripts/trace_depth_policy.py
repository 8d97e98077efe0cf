"""Trace the auto depth policy step by step on a few prompts: per step the chosen depth, the row's judged
acceptance, drafting cost, backlog, accepted drafts and the step's wall time; plain decoding timed beside it.

    python scripts/trace_depth_policy.py qwen2.5-coder-1.5b --ids 85,81 --max-tokens 96 \
        --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3,
        "draft_vocab": 32768, "draft_kernel": "int8"}'
"""

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from specloom.bench.harness import read_prompts  # noqa: E402
from specloom.engine import load  # noqa: E402
from specloom.depth import DepthPolicy  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--speculative-config", required=True)
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench.jsonl")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quiet", action="store_true", help="per-prompt summary only, no per-step lines")
    a = ap.parse_args()
    torch.set_num_threads(2)
    ids = {int(x) for x in a.ids.split(",")}
    rows = [r for r in read_prompts(a.prompts) if int(r.get("id", -1)) in ids]
    eng = load(a.model, speculative_config=a.speculative_config, progress=False)
    from specloom.engine import Engine

    plain = Engine(eng.model, eng.tokenizer, None, eng.max_model_len, kv_dtype=eng.kv_dtype)  # the bench's plain
    trace = []
    orig_plan, orig_observe = DepthPolicy.plan, DepthPolicy.observe

    def plan(self, stepper, rs, caps=None):
        self._t0 = time.perf_counter()
        return orig_plan(self, stepper, rs, caps)

    def observe(self, rs, p, rep):
        orig_observe(self, rs, p, rep)
        ks, alphas, t0 = p.depths, p.alphas, self._t0
        trace.append(dict(k=ks[0], alpha=round(alphas[0], 2), dc=round(self.draft_cost, 3), backlog=p.backlog,
                          acc=rep.accepted[0], draft_ms=round(rep.draft_seconds * 1e3), pass_ms=round(rep.pass_seconds * 1e3),
                          ms=round((time.perf_counter() - t0) * 1e3), idle=rs[0].acc.idle, period=rs[0].acc.period))

    DepthPolicy.plan, DepthPolicy.observe = plan, observe
    w = eng.encode(rows[0]["text"], chat=True)[:64]
    eng.generate(prompt_token_ids=w, max_tokens=8)
    plain.generate(prompt_token_ids=w, max_tokens=8)
    for r in [r for r in rows for _ in range(a.repeats)]:
        p = eng.encode(r["text"], chat=True)
        trace.clear()
        t0 = time.perf_counter()
        ref = plain.generate(prompt_token_ids=p, max_tokens=a.max_tokens)
        tp = time.perf_counter() - t0
        plain_pass = statistics.median(t["pass_ms"] for t in trace)
        trace.clear()
        t0 = time.perf_counter()
        out = eng.generate(prompt_token_ids=p, max_tokens=a.max_tokens)
        ts = time.perf_counter() - t0
        idle = [t["pass_ms"] for t in trace if t["k"] == 0]
        print(f"id {r['id']} {r.get('category')}: plain {tp:.2f}s spec {ts:.2f}s -> {tp / ts:.2f}x, "
              f"steps {len(trace)} ({len(idle)} at k=0), same {out.token_ids == ref.token_ids}; median pass ms: "
              f"plain {plain_pass:.0f}, spec k=0 {statistics.median(idle) if idle else float('nan'):.0f}; "
              f"draft ms {sum(t['draft_ms'] for t in trace)}")
        if not a.quiet:
            for i, t in enumerate(trace):
                print(i, json.dumps(t))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
