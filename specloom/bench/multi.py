"""Several drafters against plain decoding in one run: `specloom bench MODEL --compare '{"name": spec, ...}'`.

The target loads once; every candidate is an `Engine` sharing its weights. For each prompt the plain baseline and
every candidate run back to back, in an order rotated per prompt (drift spreads evenly). Per candidate the report
has the same keys as a single `bench` report (speed-up = median of per-prompt ratios, aggregate ratio, tau,
acceptance per position, identical fraction with the top-2 margin at each divergence) plus per-category figures.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from tqdm import tqdm

from ..engine import Engine, load
from ..results import acceptance_rates, mean_accepted_length
from ..errors import SpecloomError
from ..speculative import SpeculativeConfig
from .harness import EngineRunner, add_per_position, divergence_margin, kernel_report, print_host, read_prompts


def _summary(rows: list[dict], base_key="b", name="") -> dict:
    b_tok = sum(r["b_tokens"] for r in rows)
    b_s = sum(r["b_seconds"] for r in rows)
    c_tok = sum(r["c_tokens"] for r in rows)
    c_s = sum(r["c_seconds"] for r in rows)
    passes = sum(r["passes"] for r in rows)
    proposed, accepted = [], []
    for r in rows:
        add_per_position(proposed, r["proposed"])
        add_per_position(accepted, r["accepted"])
    return {
        "num_prompts": len(rows),
        "speedup": statistics.median(r["speedup"] for r in rows),
        "speedup_aggregate": (c_tok / c_s) / (b_tok / b_s),
        "baseline_tokens_per_second": b_tok / b_s,
        "candidate_tokens_per_second": c_tok / c_s,
        "mean_accepted_length": mean_accepted_length(c_tok, passes, len(rows)),
        "acceptance_per_position": acceptance_rates(accepted, proposed),
        "identical_outputs": sum(r["identical"] for r in rows),
        **_costs(rows),
    }


def _costs(rows: list[dict]) -> dict:
    """Drafting cost per verification step, in ms and as a fraction of one plain decoding step (plain decode
    seconds per token after its prefill, same run)."""
    steps = sum(r["passes"] - 1 for r in rows)
    draft_s = sum(r.get("draft_seconds", 0.0) for r in rows)
    b_tok = sum(r["b_tokens"] - 1 for r in rows)
    b_s = sum(r["b_seconds"] - r.get("b_prefill_seconds", 0.0) for r in rows)
    plain_ms = 1000 * b_s / b_tok if b_tok else 0.0
    draft_ms = 1000 * draft_s / steps if steps else 0.0
    return {"draft_ms_per_step": draft_ms, "plain_ms_per_step": plain_ms,
            "draft_fraction_of_target_step": draft_ms / plain_ms if plain_ms else 0.0}


def run_compare(model: str, prompts: str, candidates: dict, limit=None, per_category=None, categories=None,
                max_tokens: int = 128, dtype: str = "bf16", chat: bool = True, json_out: str | None = None,
                progress: bool = True, device: str | None = "cpu", speculation: str = "auto",
                linear_kernel: str = "auto", kv_dtype=None) -> dict:
    if not isinstance(candidates, dict) or not candidates:
        raise SpecloomError('--compare needs a JSON object {"name": {speculative config}, ...}')
    # a candidate may carry its own "speculation" (auto / fixed / off): a bench key, not a speculative-config one,
    # so that fixed and auto depths of one drafter are measured in the same run
    modes, specs = {}, {}
    for name, spec in candidates.items():
        if isinstance(spec, dict) and "speculation" in spec:
            spec = {k: v for k, v in spec.items() if k != "speculation"}
            modes[name] = candidates[name]["speculation"]
            if modes[name] not in ("auto", "fixed", "off"):
                raise SpecloomError(f'--compare: candidate {name!r} has speculation {modes[name]!r}; use "auto", '
                                    '"fixed" or "off"')
        specs[name] = SpeculativeConfig.parse(spec)
    rows = read_prompts(prompts, limit, per_category, categories)
    plain_engine = load(model, dtype=dtype, progress=progress, device=device, linear_kernel=linear_kernel,
                        kv_dtype=kv_dtype)
    m, tok = plain_engine.model, plain_engine.tokenizer
    host = print_host(m, file=sys.stderr)
    from ..drafters import DRAFTERS

    engines = {}
    for name, spec in specs.items():
        DRAFTERS[spec.method].check(spec, m.config)
        engines[name] = EngineRunner(Engine(m, tok, spec, plain_engine.max_model_len,
                                            speculation=modes.get(name, speculation),
                                            kv_dtype=plain_engine.kv_dtype), name)
    memory = {name: r.engine.drafter.memory() for name, r in engines.items()}
    base = EngineRunner(plain_engine, "plain")
    use_chat = chat and tok.has_chat_template
    encoded = [plain_engine.encode(r["text"], chat=use_chat) for r in rows]
    warm = encoded[0][:64]
    for r in [base, *engines.values()]:
        r.run(warm, 8)
    runners = [base, *engines.values()]
    per: dict[str, list[dict]] = {name: [] for name in engines}
    for i, (row, ids) in enumerate(tqdm(list(zip(rows, encoded)), desc="bench", unit="prompt",
                                        disable=not progress, file=sys.stderr)):
        k = i % len(runners)
        results = {}
        for r in runners[k:] + runners[:k]:
            results[r.name] = r.run(ids, max_tokens)
        b = results["plain"]
        for name in engines:
            c = results[name]
            diverged = b.tokens != c.tokens
            per[name].append({
                "id": row["id"], "category": row["category"], "prompt_tokens": len(ids),
                "b_tokens": len(b.tokens), "b_seconds": b.seconds, "c_tokens": len(c.tokens),
                "c_seconds": c.seconds, "passes": c.passes, "proposed": c.proposed, "accepted": c.accepted,
                "draft_seconds": c.draft_seconds, "b_prefill_seconds": b.prefill_seconds,
                "speedup": c.tps / b.tps if b.tps else 0.0, "mean_accepted_length": c.tau,
                "identical": not diverged,
                "top2_margin_at_divergence": divergence_margin(plain_engine, ids, b.tokens, c.tokens)
                if diverged else None,
            })
    report = {"model": model, "dtype": dtype, "kv_dtype": m.new_kv(1, plain_engine.kv_dtype).kv_type.label,
              "max_tokens": max_tokens, "chat_template": use_chat,
              "num_prompts": len(rows), "prefill_included": True, "speculation": speculation, "host": host,
              "linear_kernel": kernel_report(m), "candidates": {}}
    for name, rs in per.items():
        cats = sorted({r["category"] for r in rs if r["category"]})
        report["candidates"][name] = {
            "speculative_config": {k: v for k, v in specs[name].__dict__.items() if v is not None},
            "speculation": modes.get(name, speculation),
            "drafter_memory_bytes": memory[name],
            **_summary(rs),
            "per_category": {c: _summary([r for r in rs if r["category"] == c]) for c in cats},
            "max_top2_margin_at_divergence": max((r["top2_margin_at_divergence"] for r in rs
                                                  if r["top2_margin_at_divergence"] is not None), default=None),
            "prompts": rs,
        }
    print_compare(report, sys.stderr if json_out is None else sys.stdout)
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)) or ".", exist_ok=True)
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def print_compare(report: dict, file=sys.stdout) -> None:
    w = file.write
    kv = f", KV {report['kv_dtype']}" if report.get("kv_dtype") else ""
    w(f"\n{report['model']} {report['dtype']}{kv}, {report['num_prompts']} prompts x {report['max_tokens']} tokens, "
      "greedy, batch 1, interleaved with plain decoding\n")
    w(f"{'drafter':<16} {'speedup':>8} {'aggr':>6} {'tok/s':>7} {'plain':>7} {'tau':>5} {'same':>7}  "
      "draft ms (x step)  MB +KV/1k  acceptance per position\n")
    for name, c in report["candidates"].items():
        alpha = " ".join(f"{a:.2f}" for a in c["acceptance_per_position"][:8])
        mem = c.get("drafter_memory_bytes", {})
        w(f"{name:<16} {c['speedup']:>7.2f}x {c['speedup_aggregate']:>5.2f}x {c['candidate_tokens_per_second']:>7.1f} "
          f"{c['baseline_tokens_per_second']:>7.1f} {c['mean_accepted_length']:>5.2f} "
          f"{c['identical_outputs']:>3}/{c['num_prompts']:<3}  {c.get('draft_ms_per_step', 0):6.1f} "
          f"({c.get('draft_fraction_of_target_step', 0):.2f})  {mem.get('weights', 0) / 1e6:5.1f} "
          f"+{mem.get('kv_per_1k_tokens', 0) / 1e6:4.1f}  {alpha}\n")
    names = list(report["candidates"])
    cats = sorted({k for c in report["candidates"].values() for k in c["per_category"]})
    if cats:
        w("\nper category: speedup (tau)\n" + f"{'category':<16}" + "".join(f"{n:>18}" for n in names) + "\n")
        for cat in cats:
            cells = []
            for n in names:
                s = report["candidates"][n]["per_category"].get(cat)
                cells.append(f"{s['speedup']:.2f}x ({s['mean_accepted_length']:.2f})" if s else "-")
            w(f"{cat:<16}" + "".join(f"{c:>18}" for c in cells) + "\n")
