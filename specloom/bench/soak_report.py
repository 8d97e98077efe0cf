"""The soak test's summary (bench/soak.py): counts by request kind, the checks, and the table it prints."""

from __future__ import annotations

import statistics
import sys

KINDS = ("valid", "stream", "disconnect", "malformed", "poisoned")
GREEDY = ("valid", "stream", "disconnect")
LOST = ("lost", "truncated", "error_event", "no_answer", "client_exception")
WINDOW_TOLERANCE = 0.05  # |measured/predicted tau, last half - first half|: requests recorded across a sample


def tau(drafts: float, accepted: float) -> float:
    """Mean tokens per drafted step: 1 + accepted / drafts (1 when nothing was drafted)."""
    return 1.0 + accepted / drafts if drafts else 1.0


def summarize(records, samples, alone, alone_end, warmup_s: float, seconds: float) -> dict:
    kinds = {k: {"sent": 0, "ok": 0, "problems": {}, "statuses": {}} for k in KINDS}
    for r in records:
        k = kinds[r["kind"]]
        k["sent"] += 1
        k["ok"] += r["ok"]
        if r["problem"]:
            k["problems"][r["problem"]] = k["problems"].get(r["problem"], 0) + 1
        st = str(r["status"])
        k["statuses"][st] = k["statuses"].get(st, 0) + 1
    greedy = [r for r in records if r["kind"] in GREEDY]
    answered = [r for r in greedy if r["answered"]]
    completed = [r for r in answered if r["completed"]]
    bad = [r for r in records if r["kind"] in ("malformed", "poisoned")]
    server_5xx = sum(n - samples[0]["errors"].get(s, 0) for s, n in samples[-1]["errors"].items() if s >= 500)

    post = [s for s in samples if s["t"] >= warmup_s] or samples[-1:]
    base = statistics.median(s["rss_kib"] for s in post[:3])
    rss_max = max(s["rss_kib"] for s in post)

    def window(a, b):
        """Measured tau between samples a and b, and the measured / predicted ratio."""
        drafts, accepted = b["drafts"] - a["drafts"], b["accepted"] - a["accepted"]
        done = [alone[r["prompt"]] for r in completed if a["t"] < r["t1"] <= b["t"]]
        pd, pa = sum(x["drafts"] for x in done), sum(x["accepted"] for x in done)
        measured, predicted = tau(drafts, accepted), tau(pd, pa)
        return {"tau": measured, "predicted_tau": predicted, "ratio": measured / predicted, "from_s": a["t"],
                "to_s": b["t"], "completed": len(done)}

    mid = len(post) // 2
    first, last = (window(post[0], post[mid]), window(post[mid], post[-1])) if len(post) > 2 else ({}, {})
    t_alone = tau(sum(x["drafts"] for x in alone if x), sum(x["accepted"] for x in alone if x))
    t_end = tau(sum(x["drafts"] for x in alone_end if x), sum(x["accepted"] for x in alone_end if x))
    tokens = sum(alone[r["prompt"]]["tokens"] for r in completed)
    out = {
        "seconds": seconds, "warmup_s": warmup_s, "kinds": kinds, "requests": len(records),
        "answered_greedy": len(answered), "identical_to_alone": len(completed),
        "corrupted": sum(r["problem"] == "corrupted" for r in greedy),
        "lost": sum(r["problem"] in LOST for r in records if r["kind"] in GREEDY),
        "valid_5xx_client": sum(r["problem"] == "5xx" or (r["status"] or 0) >= 500 for r in greedy),
        "valid_refused_4xx": sum(str(r["problem"]).startswith("refused_") for r in greedy),
        "valid_5xx_server": server_5xx,
        "bad_requests": len(bad), "bad_requests_4xx": sum(r["ok"] for r in bad),
        "aborted_server": samples[-1]["aborted"] - samples[0]["aborted"],
        "mean_batch": (samples[-1]["batch_sum"] - samples[0]["batch_sum"]) / max(1.0, samples[-1]["steps"]
                                                                                 - samples[0]["steps"]),
        "completed_tokens_per_second": tokens / seconds, "completed_requests_per_second": len(completed) / seconds,
        "rss_mib": {"warm": base / 1024, "max": rss_max / 1024, "end": post[-1]["rss_kib"] / 1024,
                    "growth": rss_max / base - 1 if base else float("inf")},
        "acceptance": {"tau_alone_start": t_alone, "tau_alone_end": t_end, "soak_first_half": first,
                       "soak_last_half": last},
        "alone_end_identical": sum(a is not None and b is not None and a["text"] == b["text"]
                                   for a, b in zip(alone, alone_end)),
        "samples": [{k: s[k] for k in ("t", "rss_kib", "drafts", "accepted", "sent")} for s in samples],
    }
    return out


def learns_from_history(speculative_config: str | None) -> bool:
    """Whether the drafter learns from what the server has served (suffix decoding's server-wide tries): its
    acceptance may then rise over a soak by design, and only a fall is a fault."""
    import json

    try:
        spec = json.loads(speculative_config) if speculative_config else {}
    except ValueError:
        return False
    return isinstance(spec, dict) and (spec.get("method") == "suffix" or spec.get("suffix_decoding") is True)


def checks(s: dict, alone, health_after: int | None, tracebacks: int, exit_code: int) -> dict:
    acc = s["acceptance"]
    first, last = acc["soak_first_half"], acc["soak_last_half"]
    if learns_from_history(s.get("speculative_config")):  # acceptance may only rise (the tries keep learning)
        windows_equal = bool(first) and last["ratio"] >= first["ratio"] - WINDOW_TOLERANCE
        alone_equal = acc["tau_alone_end"] >= acc["tau_alone_start"] - 1e-9
    else:
        windows_equal = bool(first) and abs(last["ratio"] - first["ratio"]) <= WINDOW_TOLERANCE
        alone_equal = abs(acc["tau_alone_end"] - acc["tau_alone_start"]) < 1e-9
    return {
        "no_lost_completions": s["lost"] == 0,
        "no_corrupted_completions": s["corrupted"] == 0 and s["identical_to_alone"] == s["answered_greedy"] > 0,
        "no_5xx_for_valid_requests": s["valid_5xx_client"] == s["valid_5xx_server"] == s["valid_refused_4xx"] == 0,
        "malformed_and_poisoned_get_4xx": s["bad_requests_4xx"] == s["bad_requests"] > 0,
        "rss_flat_within_5pct": s["rss_mib"]["growth"] <= 0.05,
        "acceptance_end_equals_start": alone_equal and windows_equal,
        "alone_outputs_same_after_soak": s["alone_end_identical"] == sum(a is not None for a in alone),
        "every_kind_sent": all(k["sent"] > 0 for k in s["kinds"].values()),
        "server_healthy_and_clean_exit": health_after == 200 and tracebacks == 0 and exit_code == 0,
    }


def print_table(s: dict, file=None) -> None:
    k, acc, rss = s["kinds"], s["acceptance"], s["rss_mib"]
    first, last = acc["soak_first_half"], acc["soak_last_half"]
    bad: dict[str, int] = {}
    for kind in ("malformed", "poisoned"):
        for st, n in k[kind]["statuses"].items():
            bad[st] = bad.get(st, 0) + n
    rows = [
        ("duration, concurrency", f"{s['seconds'] / 60:.1f} min, {s['concurrency']} ({s['prompts']} prompts, "
                                  f"{s['max_tokens']} tokens, {s['dtype']}, {s['speculative_config']})"),
        ("requests sent", f"{s['requests']} (" + ", ".join(f"{n} {k[n]['sent']}" for n in KINDS) + ")"),
        ("answered greedy responses = their alone output", f"{s['identical_to_alone']} / {s['answered_greedy']}"),
        ("lost / corrupted", f"{s['lost']} / {s['corrupted']}"),
        ("5xx for valid requests (client / server metrics)", f"{s['valid_5xx_client']} / {s['valid_5xx_server']}"),
        ("malformed + poisoned answered 4xx", f"{s['bad_requests_4xx']} / {s['bad_requests']} "
                                               f"(statuses {dict(sorted(bad.items()))})"),
        ("disconnects sent / aborts the server counted", f"{k['disconnect']['sent']} / {s['aborted_server']:.0f}"),
        ("RSS after warm-up: warm / max / end", f"{rss['warm']:.0f} / {rss['max']:.0f} / {rss['end']:.0f} MiB "
                                                 f"({100 * rss['growth']:+.1f} %)"),
        ("tau alone: before / after the soak", f"{acc['tau_alone_start']:.3f} / {acc['tau_alone_end']:.3f}"),
        ("tau soak: first / last half after warm-up (/ predicted)",
         f"{first.get('tau', 0):.3f} ({first.get('ratio', 0):.3f}) / {last.get('tau', 0):.3f} "
         f"({last.get('ratio', 0):.3f})"),
        ("throughput (completed), mean batch", f"{s['completed_requests_per_second']:.2f} req/s, "
                                               f"{s['completed_tokens_per_second']:.1f} tok/s, "
                                               f"{s['mean_batch']:.1f} sequences per step"),
    ]
    out = ["", "| soak | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    out += ["", "| check | result |", "|---|---|"]
    out += [f"| {name} | {'pass' if ok else 'FAIL'} |" for name, ok in s["checks"].items()]
    print("\n".join(out), file=file or sys.stdout, flush=True)
