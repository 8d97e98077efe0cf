"""Load-aware serving vs off at ROWS rows (default 4): per step the policy's expectation (tokens, pass cost) against
what the step did; modes interleaved twice. `ROWS=16 python scripts/profile_serving_policy.py` for 16 rows."""
import json, sys, time, collections, os
import torch
import specloom
from specloom.scheduler import BatchScheduler, Sequence
from specloom.sampling import SamplingParams
from specloom import depth as LA
ROWS = int(os.environ.get("ROWS", 4))
eng = specloom.load("smollm2-135m", {"method": "eagle3"}, progress=False)
prompts = [json.loads(l)["turns"][0] for l in open("../shared/data/eval/spec_bench.jsonl")][::(37 if ROWS <= 4 else 13)][:2 * ROWS]
ids = [eng.encode(messages=[{"role": "user", "content": p}], chat=True) for p in prompts]
log = []
orig = LA.DepthPolicy.observe
def rs(self, rows, plan, rep):
    alphas, ks = plan.alphas, plan.depths
    own = [r.acc.alpha for r in rows]
    ns = [r.acc.n for r in rows]
    orig(self, rows, plan, rep)
    n = len(rows)
    pred_c = self.cost(n, rep.width) if self.cost else 1; pred_c1 = self.cost(n, 1) if self.cost else 1
    
    exp = sum(LA.geometric_tokens(a, k) for a, k in zip(alphas, ks))
    got = sum(1 + a for a in rep.accepted)
    log.append(dict(n=n, ks=ks, alphas=alphas, own=own, ns=ns, width=rep.width, exp=exp, got=got,
                    pass_s=rep.pass_seconds, draft_s=rep.draft_seconds, pred_ratio=pred_c / pred_c1, t1=0, dc=self.draft_cost))
LA.DepthPolicy.observe = rs
def run(mode, rows=ROWS):
    cost = LA.batch_cost_cached(eng.model, rows) if mode == "load_aware" else None
    s = BatchScheduler(eng, rows, mode=mode, cost=cost, start=False, max_queue=1 << 20)
    seqs = [Sequence(list(x), 64, SamplingParams(temperature=0.0)) for x in ids]
    left = [len(seqs)]
    def done(q):
        left[0] -= 1
        if not left[0]: s.close()
    for q in seqs: q.on_done = done
    t = time.perf_counter(); s.submit(seqs); s.run(); wall = time.perf_counter() - t
    return wall, sum(len(q.result.token_ids) for q in seqs)
for rnd in range(2):
    for mode in ("off", "load_aware"):
        log.clear()
        wall, toks = run(mode)
        tp=sum(l['pass_s'] for l in log); td=sum(l['draft_s'] for l in log)
        print(mode, f"{toks/wall:.1f} tok/s wall {wall:.2f} steps {len(log)} pass {tp:.2f} draft {td:.2f} rest {wall-tp-td:.2f}")
        if mode == "load_aware":
            dr = [l for l in log if max(l['ks']) > 0]
            pl = [l for l in log if max(l['ks']) == 0]
            import statistics as st
            print(" drafted steps", len(dr), "plain", len(pl))
            if dr:
                print(" drafted: exp tokens", sum(l['exp'] for l in dr), "got", sum(l['got'] for l in dr),
                      "mean width", st.mean(l['width'] for l in dr), "pass s", st.mean(l['pass_s'] for l in dr),
                      "draft s", st.mean(l['draft_s'] for l in dr), "pred ratio", st.mean(l['pred_ratio'] for l in dr))
            if pl: print(" plain pass s", st.mean(l['pass_s'] for l in pl), 'n', st.mean(l['n'] for l in pl))
            json.dump(log, open(f"/tmp/policy_log_r{ROWS}_{rnd}.json", "w"))
