"""`specloom bench`: a candidate (specloom, optionally with a drafter) against a baseline, side by side.

Protocol (../shared/reference/benchmarking.md): one warm-up generation each, then for every prompt the baseline
and the candidate run back to back, alternating which goes first (A B, B A, ...) so drift cancels. Tokens/s
count generated tokens over wall time *including prefill*. The report records the host
(CPU model and flags, oneDNN bf16, threads, torch: `host/`), the target's linear kernel and the speculation
mode (`auto` by default: depth per step from the host's verify-cost curve and the acceptance). `speedup` is the median of the per-prompt ratios;
`speedup_aggregate` the ratio of total throughputs. Greedy outputs are compared token by token.

Baselines come from the peer registry (`bench/peers/`): `--baseline plain,hf,hf-lookup,llama.cpp,...` times every
one of them with the candidate, prompt by prompt, in an order reversed every other prompt (A B C D, D C B A, ...),
after one warm-up each. The first named is the baseline of the report's original keys; every peer also gets an entry
under `peers` (tokens/s, ratio to specloom plain, the candidate's speed-up over it, tau and draft acceptance where
the peer can count them, outputs identical to specloom plain's).
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

from ..engine import Engine, load
from ..results import acceptance_rates, add_per_position, mean_accepted_length
from ..errors import SpecloomError
from ..prompts import read_prompts  # noqa: F401  (bench.multi, soak, serve_load, tests and scripts import it here)
from ..speculative import SpeculativeConfig


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
    text = None  # the candidate reports token ids (a peer may report text: peers.PeerRun)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

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


def run_bench(
    model: str,
    prompts: str,
    limit: int | None = None,
    max_tokens: int = 128,
    dtype: str = "bf16",
    speculative_config=None,
    baseline: "str | list[str]" = "plain",
    chat: bool = True,
    json_out: str | None = None,
    progress: bool = True,
    kv_dtype: str | None = None,
    per_category: int | None = None,
    categories: list[str] | None = None,
    device: str | None = "cpu",
    speculation: str = "auto",
    linear_kernel: str = "auto",
    baseline_draft: str | None = None,
    baseline_draft_tokens: int | None = None,
    baseline_lookup_tokens: int = 10,
    repeats: int = 1,
) -> dict:
    """`baseline`: one peer name or several, comma-separated (`peers.names()`); the first is *the* baseline of the
    report's top-level keys (speedup, baseline_tokens_per_second, identical_outputs, per-prompt baseline_*), every
    one gets its entry under `peers`. Each peer's output is compared with specloom plain's: the `plain` peer when
    listed, else the candidate itself when it does not speculate, else `plain` is added to the run (timed like
    the others, marked auto_added). `repeats`: each prompt is decoded that many times by every runner (rounds
    interleaved, the order reversed each round) and each runner's fastest run is the one reported."""
    from . import peers as peer_registry

    if not isinstance(repeats, int) or repeats < 1:
        raise SpecloomError(f"repeats must be a positive integer, got {repeats!r}")
    names = peer_registry.parse_baselines(baseline)
    spec = SpeculativeConfig.parse(speculative_config)
    draft = baseline_draft or (spec.model if spec is not None and spec.method == "draft_model" else None)
    for name in names:  # a missing package or program: one message before anything loads
        peer_registry.PEERS[name].preflight(model, draft)
    rows = read_prompts(prompts, limit, per_category, categories)
    engine = load(model, speculative_config=speculative_config, dtype=dtype, progress=progress, kv_dtype=kv_dtype,
                  device=device, speculation=speculation, linear_kernel=linear_kernel)
    host = print_host(engine.model, file=sys.stderr)
    candidate = EngineRunner(engine, "specloom" + (f"+{engine.speculative_config.method}"
                                                   if engine.speculative_config else ""))
    use_chat = chat and engine.tokenizer.has_chat_template
    encoded = [engine.encode(r["text"], chat=use_chat) for r in rows]
    for ids in encoded:
        if len(ids) + max_tokens > engine.max_model_len:
            raise SpecloomError(f"a prompt of {len(ids)} tokens + {max_tokens} exceeds the context")

    speculates = engine.drafter is not None
    run_names = list(names)
    auto_plain = speculates and "plain" not in names
    if auto_plain:
        run_names.append("plain")
    reference = "plain" if "plain" in run_names else "candidate"
    need = max(len(ids) for ids in encoded) + max_tokens + 8
    ctx = peer_registry.PeerContext(
        model=model, eos_token_ids=engine.tokenizer.eos_token_ids, threads=torch.get_num_threads(),
        n_ctx=min(engine.max_model_len, -(-need // 256) * 256), dtype=dtype, engine=engine, draft_model=draft,
        draft_tokens=baseline_draft_tokens, lookup_tokens=baseline_lookup_tokens)
    made: dict = {}
    try:
        for name in run_names:
            made[name] = peer_registry.create(name, ctx)
        return _bench_loop(model, dtype, engine, candidate, made, names, reference, auto_plain, rows, encoded,
                           max_tokens, use_chat, host, progress, json_out, repeats)
    finally:
        for peer in made.values():
            peer.close()


def _tps(r) -> float:
    return r.num_tokens / r.seconds if r.seconds > 0 else 0.0


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if a == b else min(len(a), len(b)))


def _same_as(engine: Engine, ref_tokens: list[int], run) -> bool:
    """A peer's output equal to specloom plain's: token for token, or as text for a peer that reports text."""
    if run.text is not None:
        ids = ref_tokens[:-1] if ref_tokens and ref_tokens[-1] in engine.tokenizer.eos_token_ids else ref_tokens
        return engine.tokenizer.decode(ids, skip_special_tokens=False) == run.text
    return list(run.tokens) == list(ref_tokens)


def _bench_loop(model, dtype, engine, candidate, made, names, reference, auto_plain, rows, encoded, max_tokens,
                use_chat, host, progress, json_out, repeats: int = 1) -> dict:
    primary = names[0]
    base = made[primary]
    runners = [(n, made[n]) for n in made] + [("candidate", candidate)]
    warm = encoded[0][:64]
    for _, r in runners:
        r.run(warm, 8)

    per_prompt = []
    tot = {"b_tok": 0, "b_s": 0.0, "c_tok": 0, "c_s": 0.0, "c_pass": 0}
    proposed: list[int] = []
    accepted: list[int] = []
    peer_rows: dict[str, list[dict]] = {n: [] for n in made}
    for i, (row, ids) in enumerate(tqdm(list(zip(rows, encoded)), desc="bench", unit="prompt",
                                        disable=not progress, file=sys.stderr)):
        runs = {name: [] for name, _ in runners}
        for rep in range(repeats):
            order = runners if (i * repeats + rep) % 2 == 0 else runners[::-1]  # A B C .., .. C B A: drift cancels
            for name, r in order:
                runs[name].append(r.run(ids, max_tokens))
        got = {name: min(rs, key=lambda x: x.seconds) for name, rs in runs.items()}  # the fastest of the repeats
        all_seconds = {name: [x.seconds for x in rs] for name, rs in runs.items()}
        b, c = got[primary], got["candidate"]
        ref = got[reference]
        tot["b_tok"] += b.num_tokens
        tot["b_s"] += b.seconds
        tot["c_tok"] += len(c.tokens)
        tot["c_s"] += c.seconds
        tot["c_pass"] += c.passes
        add_per_position(proposed, c.proposed)
        add_per_position(accepted, c.accepted)
        diverged = not _same_as(engine, c.tokens, b)
        margin = divergence_margin(engine, ids, b.tokens, c.tokens) if diverged and primary == "plain" else None
        peers_here = {}
        for name in made:
            p = got[name]
            same = _same_as(engine, ref.tokens, p)
            entry = {
                "tokens": p.num_tokens, "seconds": p.seconds, "tokens_per_second": _tps(p),
                "candidate_speedup": _tps(c) / _tps(p) if _tps(p) else 0.0,
                "ratio_to_specloom_plain": _tps(p) / _tps(ref) if _tps(ref) else 0.0,
                "identical_to_specloom_plain": same,
                "first_difference": None if same or p.text is not None else _first_difference(ref.tokens, p.tokens),
                "target_passes": p.passes, "prefill_pass": p.prefill_pass, "drafted": p.drafted,
                "accepted": p.accepted,
            }
            if p.prompt_tokens is not None:
                entry["prompt_tokens_seen"] = p.prompt_tokens
            if repeats > 1:
                entry["seconds_of_each_repeat"] = all_seconds[name]
            if p.wall_seconds is not None:
                entry["process_seconds"] = p.wall_seconds
            peers_here[name] = entry
            peer_rows[name].append(entry)
        per_prompt.append({
            "id": row["id"],
            "category": row["category"],
            "prompt_tokens": len(ids),
            "baseline_tokens": b.num_tokens,
            "candidate_tokens": len(c.tokens),
            "baseline_tokens_per_second": _tps(b),
            "candidate_tokens_per_second": c.tps,
            "speedup": c.tps / _tps(b) if _tps(b) else 0.0,
            "mean_accepted_length": c.tau,
            "acceptance_per_position": acceptance_rates(c.accepted or [], c.proposed or []),
            "identical": not diverged,
            "top2_margin_at_divergence": margin,
            "first_difference": None if not diverged or b.text is not None else _first_difference(b.tokens, c.tokens),
            "candidate_identical_to_specloom_plain": _same_as(engine, ref.tokens, c) if reference != "candidate"
            else True,
            **({"candidate_seconds_of_each_repeat": all_seconds["candidate"]} if repeats > 1 else {}),
            "peers": peers_here,
        })
    b_tps = tot["b_tok"] / tot["b_s"]
    c_tps = tot["c_tok"] / tot["c_s"]
    ref_tok = sum(p["candidate_tokens"] for p in per_prompt) if reference == "candidate" else \
        sum(e["tokens"] for e in peer_rows[reference])
    ref_s = tot["c_s"] if reference == "candidate" else sum(e["seconds"] for e in peer_rows[reference])
    report = {
        "model": model,
        "command": " ".join([os.path.basename(sys.argv[0]) or "specloom", *sys.argv[1:]]),
        "dtype": dtype,
        "kv_dtype": engine.model.new_kv(1, engine.kv_dtype).kv_type.label,
        "baseline": base.label,
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
        "repeats": repeats,
        "timing": "fastest of the repeats per prompt and runner" if repeats > 1 else "one run per prompt and runner",
        "baselines": list(names),
        "identity_reference": "specloom-plain" if reference == "plain" else "candidate (no speculation)",
        "candidate_identical_to_specloom_plain": sum(p["candidate_identical_to_specloom_plain"] for p in per_prompt),
        "peers": {name: _peer_summary(made[name], peer_rows[name], per_prompt, ref_tok / ref_s,
                                      auto_added=auto_plain and name == "plain") for name in made},
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


def _peer_tau(rows: list[dict], tok: int, passes: list) -> float | None:
    """tau as specloom counts it: generated tokens per verification pass. A peer whose first pass is a prefill
    yielding one token (specloom, llama-cpp-python, HF plain): (tokens - 1) / (passes - 1) per request summed;
    one whose every pass verifies a draft (HF assisted/lookup, llama-speculative-simple): tokens / passes."""
    if None in passes or not rows:
        return None
    if all(r["prefill_pass"] for r in rows):
        return mean_accepted_length(tok, sum(passes), len(rows))
    if not any(r["prefill_pass"] for r in rows):
        return tok / sum(passes) if sum(passes) else None
    return None


def _peer_summary(peer, rows: list[dict], per_prompt: list[dict], ref_tps: float, auto_added: bool) -> dict:
    tok = sum(r["tokens"] for r in rows)
    sec = sum(r["seconds"] for r in rows)
    tps = tok / sec if sec > 0 else 0.0
    c_tps = sum(p["candidate_tokens"] for p in per_prompt) / sum(
        p["candidate_tokens"] / p["candidate_tokens_per_second"] for p in per_prompt if p["candidate_tokens_per_second"])
    passes = [r["target_passes"] for r in rows]
    drafted = [r["drafted"] for r in rows]
    acc = [r["accepted"] for r in rows]
    out = {
        "label": peer.label,
        "settings": peer.settings(),
        "auto_added": auto_added,
        "tokens_per_second": tps,
        "ms_per_token": 1000 / tps if tps else None,
        "candidate_speedup": statistics.median(r["candidate_speedup"] for r in rows),
        "candidate_speedup_aggregate": c_tps / tps if tps else 0.0,
        "ratio_to_specloom_plain": statistics.median(r["ratio_to_specloom_plain"] for r in rows),
        "ratio_to_specloom_plain_aggregate": tps / ref_tps if ref_tps else 0.0,
        "mean_accepted_length": _peer_tau(rows, tok, passes),
        "draft_acceptance": (sum(acc) / sum(drafted)) if None not in drafted and None not in acc and sum(drafted)
        else None,
        "identical_to_specloom_plain": sum(r["identical_to_specloom_plain"] for r in rows),
        "num_prompts": len(rows),
    }
    seen = [(r["prompt_tokens_seen"], p["prompt_tokens"]) for r, p in zip(rows, per_prompt) if "prompt_tokens_seen" in r]
    if seen:
        out["prompt_tokenization_mismatches"] = sum(a != b for a, b in seen)
    return out


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
    peers = report.get("peers") or {}
    if len(peers) > 1 or any(n not in ("plain", "hf") for n in peers):
        w(f"\n{'peer':<34} {'tok/s':>7} {'vs plain':>8} {'cand. x':>8} {'tau':>5} {'accept':>6} {'same':>6}\n")
        for name, p in peers.items():
            tau = p["mean_accepted_length"]
            acc = p["draft_acceptance"]
            w(f"{p['label'] + (' (added)' if p['auto_added'] else ''):<34} {p['tokens_per_second']:>7.1f} "
              f"{p['ratio_to_specloom_plain']:>7.2f}x {p['candidate_speedup']:>7.2f}x "
              f"{'-' if tau is None else f'{tau:.2f}':>5} {'-' if acc is None else f'{acc:.0%}':>6} "
              f"{p['identical_to_specloom_plain']:>3}/{p['num_prompts']}\n")
        w(f"(vs plain: median per-prompt ratio of tokens/s to {report['identity_reference']}; cand. x: the "
          f"candidate's median speed-up over the peer; same: outputs identical to specloom plain)\n")
