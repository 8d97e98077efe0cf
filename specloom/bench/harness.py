"""`specloom bench`: a candidate (specloom, optionally with a drafter) against a baseline, side by side.

Protocol (../shared/reference/benchmarking.md): one warm-up generation each, then for every prompt the baseline
and the candidate run back to back, alternating which goes first (A B, B A, ...) so drift cancels. Tokens/s
count generated tokens over wall time *including prefill*. The report records the host
(CPU model and flags, oneDNN bf16, threads, torch: `host.py`), the target's linear kernel and the speculation
mode (`auto` by default: depth per step from the host's verify-cost curve and the acceptance). `speedup` is the median of the per-prompt ratios;
`speedup_aggregate` the ratio of total throughputs. Greedy outputs are compared token by token.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..engine import Engine, acceptance_rates, load, mean_accepted_length
from ..errors import SpecloomError


def read_prompts(
    path: str, limit: int | None = None, per_category: int | None = None, categories: list[str] | None = None
) -> list[dict]:
    """JSONL with `turns[0]` (Spec-Bench, MT-bench) or `prompt`; keeps `category` and an id when present.
    `categories` keeps only those; `per_category` the first N of each (in file order); `limit` caps the total."""
    if not os.path.isfile(path):
        raise SpecloomError(f"{path}: no such prompts file")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecloomError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            text = (obj.get("turns") or [None])[0] if isinstance(obj, dict) else None
            text = text if isinstance(text, str) else (obj.get("prompt") if isinstance(obj, dict) else None)
            if not isinstance(text, str) or not text:
                raise SpecloomError(f"{path}:{lineno}: needs a non-empty turns[0] or prompt")
            row = {"id": obj.get("question_id", obj.get("id", lineno)), "category": obj.get("category"), "text": text}
            if categories and row["category"] not in categories:
                continue
            if per_category and sum(r["category"] == row["category"] for r in rows) >= per_category:
                continue
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    if not rows:
        raise SpecloomError(f"{path}: no prompts")
    return rows


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    passes: int = 0
    proposed: list[int] | None = None
    accepted: list[int] | None = None
    tau: float = 1.0
    draft_seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def tps(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


class EngineRunner:
    def __init__(self, engine: Engine, name: str):
        self.engine, self.name = engine, name

    def run(self, ids: list[int], max_tokens: int) -> Run:
        r = self.engine.generate(prompt_token_ids=ids, max_tokens=max_tokens)
        return Run(r.token_ids, r.total_seconds, r.num_target_passes, r.proposed_per_position,
                   r.accepted_per_position, r.mean_accepted_length, r.draft_seconds, r.prefill_seconds)


class HFRunner:
    def __init__(self, hf, name: str = "hf"):
        self.hf, self.name = hf, name

    def run(self, ids: list[int], max_tokens: int) -> Run:
        tokens, seconds = self.hf.run(ids, max_tokens)
        return Run(tokens, seconds, len(tokens))


def add_per_position(acc: list[int], xs: list[int] | None) -> None:
    """acc[i] += xs[i], growing acc as needed (per-position counts summed over requests)."""
    for i, x in enumerate(xs or []):
        if i == len(acc):
            acc.append(0)
        acc[i] += x


def run_bench(
    model: str,
    prompts: str,
    limit: int | None = None,
    max_tokens: int = 128,
    dtype: str = "bf16",
    speculative_config=None,
    baseline: str = "plain",
    chat: bool = True,
    json_out: str | None = None,
    progress: bool = True,
    kv_dtype: str | None = None,
    per_category: int | None = None,
    categories: list[str] | None = None,
    device: str | None = "cpu",
    speculation: str = "auto",
    linear_kernel: str = "auto",
) -> dict:
    rows = read_prompts(prompts, limit, per_category, categories)
    engine = load(model, speculative_config=speculative_config, dtype=dtype, progress=progress, kv_dtype=kv_dtype,
                  device=device, speculation=speculation, linear_kernel=linear_kernel)
    host = print_host(engine.model, file=sys.stderr)
    candidate = EngineRunner(engine, "specloom" + (f"+{engine.speculative_config.method}"
                                                   if engine.speculative_config else ""))
    if baseline == "hf":
        from .hf_baseline import HFBaseline

        base = HFRunner(HFBaseline(model, engine.tokenizer.eos_token_ids))
    elif baseline == "plain":
        base = EngineRunner(Engine(engine.model, engine.tokenizer, None, engine.max_model_len,
                                   kv_dtype=engine.kv_dtype), "specloom-plain")
    else:
        raise SpecloomError(f"unknown baseline {baseline!r} (plain or hf)")
    use_chat = chat and engine.tokenizer.has_chat_template
    encoded = [engine.encode(r["text"], chat=use_chat) for r in rows]
    for ids in encoded:
        if len(ids) + max_tokens > engine.max_model_len:
            raise SpecloomError(f"a prompt of {len(ids)} tokens + {max_tokens} exceeds the context")

    warm = encoded[0][:64]
    base.run(warm, 8)
    candidate.run(warm, 8)

    per_prompt = []
    tot = {"b_tok": 0, "b_s": 0.0, "c_tok": 0, "c_s": 0.0, "c_pass": 0}
    proposed: list[int] = []
    accepted: list[int] = []
    for i, (row, ids) in enumerate(tqdm(list(zip(rows, encoded)), desc="bench", unit="prompt",
                                        disable=not progress, file=sys.stderr)):
        if i % 2 == 0:
            b = base.run(ids, max_tokens)
            c = candidate.run(ids, max_tokens)
        else:
            c = candidate.run(ids, max_tokens)
            b = base.run(ids, max_tokens)
        tot["b_tok"] += len(b.tokens)
        tot["b_s"] += b.seconds
        tot["c_tok"] += len(c.tokens)
        tot["c_s"] += c.seconds
        tot["c_pass"] += c.passes
        add_per_position(proposed, c.proposed)
        add_per_position(accepted, c.accepted)
        diverged = b.tokens != c.tokens
        margin = divergence_margin(engine, ids, b.tokens, c.tokens) if diverged and baseline == "plain" else None
        per_prompt.append({
            "id": row["id"],
            "category": row["category"],
            "prompt_tokens": len(ids),
            "baseline_tokens": len(b.tokens),
            "candidate_tokens": len(c.tokens),
            "baseline_tokens_per_second": b.tps,
            "candidate_tokens_per_second": c.tps,
            "speedup": c.tps / b.tps if b.tps else 0.0,
            "mean_accepted_length": c.tau,
            "acceptance_per_position": acceptance_rates(c.accepted or [], c.proposed or []),
            "identical": not diverged,
            "top2_margin_at_divergence": margin,
            "first_difference": next((j for j, (x, y) in enumerate(zip(b.tokens, c.tokens)) if x != y),
                                     None if b.tokens == c.tokens else min(len(b.tokens), len(c.tokens))),
        })
    b_tps = tot["b_tok"] / tot["b_s"]
    c_tps = tot["c_tok"] / tot["c_s"]
    report = {
        "model": model,
        "dtype": dtype,
        "kv_dtype": engine.model.new_kv(1, engine.kv_dtype).kv_type.label,
        "baseline": base.name + (" (fp32)" if baseline == "hf" else f" ({dtype})"),
        "candidate": candidate.name,
        "speculative_config": engine.speculative_config.__dict__ if engine.speculative_config else None,
        "speculation": engine.speculation if engine.drafter is not None else "off",
        "max_tokens": max_tokens,
        "chat_template": use_chat,
        "num_prompts": len(rows),
        "speedup": statistics.median(p["speedup"] for p in per_prompt),
        "speedup_aggregate": c_tps / b_tps,
        "baseline_tokens_per_second": b_tps,
        "candidate_tokens_per_second": c_tps,
        "candidate_ms_per_token": 1000 / c_tps,
        "mean_accepted_length": mean_accepted_length(tot["c_tok"], tot["c_pass"], len(rows)),
        "acceptance_per_position": acceptance_rates(accepted, proposed),
        "identical_outputs": sum(p["identical"] for p in per_prompt),
        "prefill_included": True,
        "host": host,
        "linear_kernel": kernel_report(engine.model),
        "environment": {
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or
            platform.machine(), "python": platform.python_version(), "device": str(engine.model.device),
            **({"gpu": torch.cuda.get_device_name(engine.model.device)} if engine.model.device.type == "cuda" else {}),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "prompts": per_prompt,
    }
    print_table(report, file=sys.stderr if json_out is None else sys.stdout)
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
    else:
        print(json.dumps({k: v for k, v in report.items() if k != "prompts"}))
    return report


def kernel_report(model) -> dict | None:
    choice = getattr(model, "kernel_choice", None)
    return choice.to_dict() if choice is not None else None


def print_host(model, file=sys.stderr) -> dict:
    """Print the host's capability and the target's linear kernel (a report's header); return `host_info`."""
    from ..host import host_info, host_line

    info = host_info(model.device)
    choice = getattr(model, "kernel_choice", None)
    file.write(f"{host_line(info)}\n{choice.describe() if choice is not None else 'linear kernel: default'}\n")
    for note in choice.notes if choice is not None else []:
        file.write(f"  {note}\n")
    file.flush()
    return info


@torch.inference_mode()
def divergence_margin(engine: Engine, ids: list[int], a: list[int], b: list[int]) -> float | None:
    """The target's top-1 minus top-2 logit at the first position where two greedy outputs part: a near-tie
    (small margin) means the split comes from rounding, not from a bug."""
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return None
    model = engine.model
    seq = ids + a[:j]
    kv = model.new_kv(len(seq) + 1, engine.kv_dtype)
    out = model(torch.tensor([seq]), torch.arange(len(seq))[None], kv, num_logits=1).logits[0, -1]
    top = out.topk(2).values
    return float(top[0] - top[1])


def print_table(report: dict, file=sys.stdout) -> None:
    w = file.write
    w(f"\n{'id':>6} {'category':<15} {'base tok/s':>10} {'cand tok/s':>10} {'speedup':>8} {'tau':>5} {'same':>5}\n")
    for p in report["prompts"]:
        w(f"{str(p['id']):>6} {str(p['category'] or '-'):<15} {p['baseline_tokens_per_second']:>10.1f} "
          f"{p['candidate_tokens_per_second']:>10.1f} {p['speedup']:>7.2f}x {p['mean_accepted_length']:>5.2f} "
          f"{'yes' if p['identical'] else 'no':>5}"
          + (f"  (top-2 margin {p['top2_margin_at_divergence']:.3f})" if p.get("top2_margin_at_divergence") is not None
             else "") + "\n")
    w(f"\n{report['candidate']} vs {report['baseline']}: speedup {report['speedup']:.2f}x (median), "
      f"{report['speedup_aggregate']:.2f}x (aggregate); {report['candidate_tokens_per_second']:.1f} vs "
      f"{report['baseline_tokens_per_second']:.1f} tokens/s; tau {report['mean_accepted_length']:.2f}; "
      f"identical outputs {report['identical_outputs']}/{report['num_prompts']}\n")
