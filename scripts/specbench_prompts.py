"""The Spec-Bench prompts the policy scripts run (`ab_policy.py`, `realized_steps.py`, `auto_trace.py`): the first
`per_category` first turns of each category of ../shared/data/eval/spec_bench.jsonl, in file order."""
import json
import os

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval", "spec_bench.jsonl")


def prompts(per_category: int = 2, skip: int = 0) -> list[str]:
    """`skip` leaves out the first prompts of each category (a held-out slice for checking a policy change)."""
    per: dict = {}
    for r in map(json.loads, open(BENCH)):
        per.setdefault(r["category"], []).append(r)
    return [r["turns"][0] for rows in per.values() for r in rows[skip:skip + per_category]]
