"""Two checkouts of specloom side by side: the same `specloom bench --compare` run alternately from each (A B, B A,
...), so drift on a shared machine cancels; prints plain and drafter tokens/s per checkout and their ratios.

    git worktree add /tmp/old <commit>
    python scripts/ab_commits.py --old /tmp/old --new . --rounds 3 -- smollm2-135m \
        --prompts ../shared/data/eval/spec_bench.jsonl --per-category 1 --compare '{"eagle3": {"method": "eagle3"}}'

Each round runs one process per checkout (PYTHONPATH points at it; the script checks which package it imported).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(tree: str, bench_args: list[str]) -> dict:
    tree = os.path.abspath(tree)
    bench_args = [os.path.abspath(a) if os.path.exists(a) else a for a in bench_args]  # paths survive the cwd
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        env = dict(os.environ, PYTHONPATH=tree)
        code = ("import sys, specloom, os; assert os.path.dirname(specloom.__file__).startswith(sys.argv[1]), "
                "specloom.__file__; sys.argv = ['specloom', 'bench'] + sys.argv[2:]; "
                "from specloom.cli import main; main()")
        subprocess.run([sys.executable, "-c", code, tree, *bench_args, "--json", out], env=env, check=True,
                       stdout=subprocess.DEVNULL, cwd=tree)  # cwd: `python -c` puts it first on sys.path
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("bench", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.bench[1:] if a.bench and a.bench[0] == "--" else a.bench
    rows = []
    for r in range(a.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        got = {}
        for which in order:
            rep = run(getattr(a, which), args)
            got[which] = {"plain": None, **{n: c["candidate_tokens_per_second"] for n, c in rep["candidates"].items()}}
            got[which]["plain"] = statistics.median(c["baseline_tokens_per_second"] for c in rep["candidates"].values())
        rows.append(got)
        print(f"round {r + 1}: " + "; ".join(f"{k}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in got[k].items())
                                             for k in ("old", "new")), flush=True)
    names = list(rows[0]["old"])
    summary = {}
    for n in names:
        ratios = [g["new"][n] / g["old"][n] for g in rows]
        summary[n] = {"old": statistics.median(g["old"][n] for g in rows),
                      "new": statistics.median(g["new"][n] for g in rows), "new_vs_old": statistics.median(ratios),
                      "ratios": ratios}
        print(f"{n:8s} old {summary[n]['old']:.1f} tok/s, new {summary[n]['new']:.1f} tok/s: new/old "
              f"{summary[n]['new_vs_old']:.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)})")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"rounds": rows, "summary": summary, "bench": args}, f, indent=1)


if __name__ == "__main__":
    main()
