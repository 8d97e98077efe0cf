"""EAGLE drafting cost, old code against new, in one process on the same prompts: the EAGLE drafter of an older
commit (its drafter.py, model.py, rows.py and tree.py, read with `git show`) and this checkout's, on the same target
weights and settings, run in lockstep with plain decoding: each prompt goes through the three at once, one step
each in rotating order, so every drafting time is compared with a plain target step taken a moment before or after
it (on a shared, noisy machine the ratio is what holds; absolute times drift).

    python scripts/ab_eagle_drafting.py smollm2-135m --old a6b0c16 --prompts ../shared/data/eval/spec_bench.jsonl \
        --per-category 1 --max-tokens 64 --rounds 2 [--threads 1] [--spec '{"num_speculative_tokens": 4}'] \
        [--profile 20] [--json out/ab_drafting.json]

Per code path and prompt: drafting ms per step (the step's own accounting: propose + on_verified; the mean over
all steps, the first included, whose catch-up runs the whole prompt), the median per-step ratio of drafting to the
plain step beside it (first step left out: "steady"), drafter passes per step, tau, and whether tokens and every
draft tree are identical to the other path's. Summary: medians over prompts and rounds.
`--profile N`: torch.profiler over an N-token generation of each path afterwards (top ops by self time).
`--sections`: wall time per part of the drafting step (layer passes, heads, catch-up, tree bookkeeping, ...),
summed over all steps of the run, in plain decode steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from specloom.engine import Engine, load  # noqa: E402
from specloom.sampling import SamplingParams  # noqa: E402
from specloom.speculative import SpeculativeConfig  # noqa: E402
from specloom.step import Request, StepPlan, Stepper  # noqa: E402
from specloom.kv import TREE_SLACK  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _module(commit: str, path: str, name: str, package: str, patch: dict | None = None):
    src = subprocess.check_output(["git", "show", f"{commit}:{path}"], cwd=REPO).decode()
    mod = types.ModuleType(name)
    mod.__package__ = package
    mod.__file__ = f"{commit}:{path}"
    sys.modules[name] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    for k, v in (patch or {}).items():
        if k in mod.__dict__:
            mod.__dict__[k] = v
    return mod


def old_drafter(commit: str, new):
    """The drafter of `commit` (same kind, settings and weights as `new`), from that commit's sources."""
    import specloom.drafters.base as base
    from specloom.models.cpu_packing import pack_linears

    tree = _module(commit, "specloom/tree.py", "_old_tree", "specloom")
    rows = _module(commit, "specloom/drafters/rows.py", "_old_rows", "specloom.drafters")
    rows.DraftTree = tree.DraftTree
    model_mod = _module(commit, "specloom/drafters/eagle/model.py", "_old_eagle_model", "specloom.drafters.eagle")
    register = base.register
    base.register = lambda name, keys=None, trainers=(): (lambda cls: setattr(cls, "method", name) or cls)
    try:
        dr = _module(commit, "specloom/drafters/eagle/drafter.py", "_old_eagle_drafter", "specloom.drafters.eagle")
    finally:
        base.register = register
    for k in ("Span", "chains", "draw", "fitting_groups", "own_store"):
        dr.__dict__[k] = getattr(rows, k)
    dr.DraftTree = tree.DraftTree
    m = new.model
    with torch.device("meta"):
        om = model_mod.EagleDraftModel(m.config)
    om.to_empty(device=m.fc.weight.device)
    om.load_state_dict(m.state_dict(), strict=True, assign=True)
    om.eval().requires_grad_(False)
    om._shared = dict(m._shared)
    pack_linears(om)
    cls = dr.Eagle3Drafter if m.config.eagle3 else dr.Eagle1Drafter
    return cls(om, new.depth, new.width, new.num_nodes)


def read_prompts(path: str, engine, per_category: int, limit: int | None, max_len: int) -> list[list[int]]:
    seen: dict[str, int] = {}
    out = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            cat = d.get("category", "")
            if seen.get(cat, 0) >= per_category:
                continue
            ids = engine.encode(d["turns"][0], chat=True)
            if len(ids) > max_len:
                continue
            seen[cat] = seen.get(cat, 0) + 1
            out.append(ids)
    return out[:limit] if limit else out


class Timed:
    """Counts a drafter's `_rows` calls (drafter passes after the catch-up) and keeps the trees it proposed."""

    def __init__(self, drafter):
        self.n = 0
        self.trees: list[tuple] = []
        propose, rows = drafter.propose, drafter._rows

        def p(ctxs):
            out = propose(ctxs)
            self.trees.extend((tuple(tr.tokens), tuple(tr.parents)) for tr in out)
            return out

        def r(*a, **k):
            self.n += 1
            return rows(*a, **k)

        drafter.propose, drafter._rows = p, r


@torch.inference_mode()
def lockstep(engines: dict, ids: list[int], max_tokens: int, first: int) -> dict:
    """One prompt through every engine at once, one step each in rotating order (so the steps compared ran
    within a fraction of a second of each other). Returns per engine its result and per-step seconds: the target
    step (plain) or the drafting of the step (propose + update, the step's own accounting)."""
    names = list(engines)
    rows, steppers, times, passes = {}, {}, {k: [] for k in names}, {k: [] for k in names}
    for k, e in engines.items():
        kv = e._kv_for(len(ids) + max_tokens + TREE_SLACK)
        st = Stepper(e.model, e.drafter, kv, e.tokenizer, e.prefill_chunk)
        row = st.new_row(Request(list(ids), max_tokens, SamplingParams()), 0)
        while not row.finish and row.prefilled < len(ids):
            st.prefill(row, len(ids))
        rows[k], steppers[k] = row, st
    i = first
    both = []  # steps at which every engine stepped
    while not all(r.finish for r in rows.values()):
        step = {}
        for k in names[i % len(names):] + names[:i % len(names)]:
            row = rows[k]
            if row.finish:
                continue
            t0 = time.perf_counter()
            n0 = engines[k].timed.n if engines[k].drafter is not None else 0
            rep = steppers[k].step([row], StepPlan([row.cap(engines[k].drafter)]))
            dt = time.perf_counter() - t0
            step[k] = dt if engines[k].drafter is None else rep.draft_seconds
            if engines[k].drafter is not None:
                passes[k].append(engines[k].timed.n - n0 + 1)
        i += 1
        for k, v in step.items():
            times[k].append(v)
        if len(step) == len(names):
            both.append(step)
    return {"results": {k: r.result() for k, r in rows.items()}, "times": times, "both": both, "passes": passes}


def profile_drafting(engines, ids: list[int], max_tokens: int) -> None:
    """torch.profiler over one generation per path; only the ops run inside propose / on_verified are counted
    (self time per op name, per drafting step)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for k in ("old", "new"):
        e = engines[k]
        d = e.drafter
        propose, on_verified = d.propose, d.on_verified

        def p(ctxs, f=propose):
            with record_function("specloom:drafting"):
                return f(ctxs)

        def v(ctxs, results, out, f=on_verified):
            with record_function("specloom:drafting"):
                return f(ctxs, results, out)

        d.propose, d.on_verified = p, v
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r = e.generate(prompt_token_ids=ids, max_tokens=max_tokens)
        d.propose, d.on_verified = propose, on_verified
        acc, count, steps = {}, {}, r.num_target_passes - 1

        def walk(ev):
            for c in ev.cpu_children:
                acc[c.name] = acc.get(c.name, 0) + c.self_cpu_time_total
                count[c.name] = count.get(c.name, 0) + 1
                walk(c)

        roots = [ev for ev in prof.events() if ev.name == "specloom:drafting"]
        for ev in roots:
            walk(ev)
        wall = sum(ev.cpu_time_total for ev in roots)
        total = sum(acc.values())
        lin = sum(t for n, t in acc.items() if "linear" in n or n in ("aten::addmm", "aten::mm"))
        print(f"== {k}: drafting under the profiler, {steps} steps: {wall / steps / 1e3:.2f} ms/step, "
              f"{sum(count.values()) / steps:.0f} ops/step, matmuls {lin / max(total, 1):.0%} of op self time")
        for n, t in sorted(acc.items(), key=lambda x: -x[1])[:15]:
            print(f"   {n:50s} {t / steps / 1e3:7.3f} ms/step  {count[n] / steps:6.1f} calls/step")


SECTIONS = ("propose", "_catch_up", "_tree", "_rows", "_logits", "on_verified")


def time_sections(drafter, acc: dict) -> None:
    """Accumulate wall seconds of the drafter's parts into `acc` (wrapping its methods and its model's)."""
    def wrap(obj, name, label):
        f = getattr(obj, name)

        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, name, g)

    for name in SECTIONS:
        wrap(drafter, name, name)
    wrap(drafter.model, "forward", "layer")
    wrap(drafter.model, "input_hidden", "fc")


def section_table(acc: dict, steps: int, plain_s: float) -> list[tuple[str, float]]:
    """Parts of a drafting step in plain decode steps (`plain_s` the summed plain-step seconds beside them)."""
    g = acc.get
    tree_fwd = g("_rows", 0.0)  # the tree passes (their forwards and setup)
    rows = [("drafter layer forwards (all passes)", g("layer", 0.0)),
            ("heads (norm + draft-vocabulary matmul)", g("_logits", 0.0)),
            ("catch-up fc", g("fc", 0.0)),
            ("catch-up bookkeeping", g("_catch_up", 0.0) - g("fc", 0.0) - (g("layer", 0.0) - tree_fwd)),
            ("tree bookkeeping (top-k, frontier, masks, rerank)", g("_tree", 0.0) - tree_fwd - g("_logits", 0.0)),
            ("propose state, truncation", g("propose", 0.0) - g("_tree", 0.0) - g("_catch_up", 0.0)),
            ("on_verified", g("on_verified", 0.0))]
    return [(n, v / plain_s) for n, v in rows] + [("total", sum(v for _, v in rows) / plain_s)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--old", required=True, help="commit whose EAGLE drafter code is the baseline")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--spec", default="{}", help="extra --speculative-config keys (JSON) for both paths")
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench.jsonl")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--sections", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    spec = SpeculativeConfig.parse({"method": a.method, **json.loads(a.spec)})
    base = load(a.target, dtype=a.dtype, progress=False)
    m, tok = base.model, base.tokenizer
    plain = Engine(m, tok, None)
    new = Engine(m, tok, spec)
    old = Engine(m, tok, None)
    old.drafter = old_drafter(a.old, new.drafter)
    old.speculative_config = spec
    d = new.drafter
    print(f"tree: depth {d.depth}, width {d.width}, nodes {d.num_nodes}; threads {torch.get_num_threads()}; "
          f"old code {a.old}", file=sys.stderr)
    prompts = read_prompts(a.prompts, base, a.per_category, a.limit, a.max_len)
    engines = {"plain": plain, "old": old, "new": new}
    for e in engines.values():  # warm-up
        e.generate(prompt_token_ids=prompts[0][:48], max_tokens=8)
    plain.timed = None
    for k in ("old", "new"):
        engines[k].timed = Timed(engines[k].drafter)
    sections = {"old": {}, "new": {}}
    if a.sections:
        for k in ("old", "new"):
            time_sections(engines[k].drafter, sections[k])
    plain_beside = {"old": 0.0, "new": 0.0}  # plain-step seconds beside each path's drafting steps
    rec = []
    for r in range(a.rounds):
        for i, ids in enumerate(prompts):
            got = lockstep(engines, ids, a.max_tokens, first=r + i)
            res, both = got["results"], got["both"]
            row = {"round": r, "prompt": i, "prompt_tokens": len(ids),
                   "plain_step_ms": 1e3 * statistics.median(s["plain"] for s in both)}
            for k in ("old", "new"):
                steps = got["times"][k]
                row[k] = {"draft_ms_per_step": 1e3 * sum(steps) / len(steps),
                          "steady_draft_ms": 1e3 * statistics.median(steps[1:] or steps),
                          # the step's drafting over the plain step that ran beside it (first step: catch-up of
                          # the whole prompt, left out)
                          "steady_ratio": statistics.median(s[k] / s["plain"] for s in both[1:] or both),
                          "passes_per_step": statistics.mean(got["passes"][k]),
                          "tau": res[k].mean_accepted_length, "steps": len(steps), "token_ids": res[k].token_ids}
                row[k]["ratio"] = row[k]["draft_ms_per_step"] / row["plain_step_ms"]
            for k in ("old", "new"):
                plain_beside[k] += row["plain_step_ms"] / 1e3 * len(got["times"][k])
            row["identical_tokens"] = res["old"].token_ids == res["new"].token_ids
            row["identical_plain"] = res["new"].token_ids == res["plain"].token_ids
            rec.append(row)
            print(f"r{r} p{i} ({len(ids)} tok): plain {row['plain_step_ms']:.1f} ms/step | draft per step old "
                  f"{row['old']['draft_ms_per_step']:.1f} ms ({row['old']['ratio']:.3f}, steady "
                  f"{row['old']['steady_ratio']:.3f}) new {row['new']['draft_ms_per_step']:.1f} ms "
                  f"({row['new']['ratio']:.3f}, steady {row['new']['steady_ratio']:.3f}) | passes/step "
                  f"{row['old']['passes_per_step']:.2f} -> {row['new']['passes_per_step']:.2f} | tau "
                  f"{row['new']['tau']:.2f} | same tokens {row['identical_tokens']}", file=sys.stderr, flush=True)
    same_trees = engines["old"].timed.trees == engines["new"].timed.trees

    def med(k, f):
        return statistics.median(x[k][f] for x in rec)

    summary = {
        "target": a.target, "method": a.method, "old_commit": a.old, "threads": torch.get_num_threads(),
        "tree": {"depth": d.depth, "tree_width": d.width, "num_draft_tokens": d.num_nodes},
        "prompts": len(prompts), "rounds": a.rounds, "max_tokens": a.max_tokens,
        "plain_step_ms_median": statistics.median(x["plain_step_ms"] for x in rec),
        "identical_tokens": sum(x["identical_tokens"] for x in rec), "runs": len(rec),
        "identical_trees": same_trees, "trees_compared": len(engines["new"].timed.trees),
    }
    for k in ("old", "new"):
        summary[k] = {f: med(k, f) for f in ("draft_ms_per_step", "steady_draft_ms", "ratio", "steady_ratio",
                                             "passes_per_step", "tau")}
    summary["new_over_old_draft_ms"] = statistics.median(x["new"]["draft_ms_per_step"] / x["old"]["draft_ms_per_step"]
                                                         for x in rec)
    if a.sections:
        summary["sections"] = {}
        for k in ("old", "new"):
            steps = sum(x[k]["steps"] for x in rec)
            table = section_table(sections[k], steps, plain_beside[k])
            summary["sections"][k] = dict(table)
            print(f"== {k}: parts of a drafting step, in plain decode steps ({steps} steps)", file=sys.stderr)
            for n, v in table:
                print(f"   {n:52s} {v:.3f}", file=sys.stderr)
    print(json.dumps(summary, indent=1))
    if a.profile:
        profile_drafting(engines, prompts[0], a.profile)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "rows": rec}, f, indent=1)


if __name__ == "__main__":
    main()
