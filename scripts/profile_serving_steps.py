"""Where load-aware serving loses to off at 4 rows: per-step time split (target pass, drafting, the rest)."""
import json, sys, time, collections
import torch
import specloom
from specloom.scheduler import BatchScheduler, Sequence
from specloom.sampling import SamplingParams
from specloom import step as step_mod

eng = specloom.load("smollm2-135m", {"method": "eagle3"}, progress=False)
prompts = [json.loads(l)["turns"][0] for l in open("../shared/data/eval/spec_bench.jsonl")][::37][:8]
ids = [eng.encode(messages=[{"role": "user", "content": p}], chat=True) for p in prompts]
acc = collections.defaultdict(float)
orig = step_mod.Stepper.step
def timed(self, rows):
    t = time.perf_counter(); rep = orig(self, rows); dt = time.perf_counter() - t
    acc["steps"] += 1; acc["step_s"] += dt; acc["pass_s"] += rep.pass_seconds; acc["draft_s"] += rep.draft_seconds
    acc["width_sum"] += rep.width; acc["rows_sum"] += rep.rows
    return rep
step_mod.Stepper.step = timed
def run(mode, rows=4):
    acc.clear()
    from specloom.cost import batch_cost_cached
    cost = batch_cost_cached(eng.model, rows) if mode == "load_aware" else None
    s = BatchScheduler(eng, rows, mode=mode, cost=cost, start=False, max_queue=1 << 20)
    seqs = [Sequence(list(x), 64, SamplingParams(temperature=0.0)) for x in ids]
    left = [len(seqs)]
    def done(q):
        left[0] -= 1
        if not left[0]:
            s.close()
    for q in seqs:
        q.on_done = done
    t = time.perf_counter(); s.submit(seqs); s.run(); wall = time.perf_counter() - t
    toks = sum(len(q.result.token_ids) for q in seqs)
    return wall, toks, dict(acc)
import os
from specloom import depth as LA
if os.environ.get("TRIAL"):
    _init = LA.DepthPolicy.__init__
    def _i(self, *a, **k):
        _init(self, *a, **k); self.trial = int(os.environ["TRIAL"])
    LA.DepthPolicy.__init__ = _i
for rnd in range(2):
    for mode in ("off", "load_aware"):
        wall, toks, a = run(mode)
        st = a["steps"]
        print(f"{mode:10s} {toks / wall:6.1f} tok/s wall {wall:.2f}s  steps {st:.0f}  step {a['step_s']:.2f}s "
              f"(pass {a['pass_s']:.2f}, draft {a['draft_s']:.2f}, rest {a['step_s'] - a['pass_s'] - a['draft_s']:.2f})"
              f"  outside steps {wall - a['step_s']:.2f}s  mean width {a['width_sum'] / st:.2f} rows {a['rows_sum'] / st:.2f}")
