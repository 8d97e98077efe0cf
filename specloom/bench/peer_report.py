"""`specloom report OUT.md --bench A.json [B.json ...]`: the peer report, one table per target, from `specloom bench
--baseline plain,hf,...,llama.cpp --json` runs (each run times specloom and every peer on the same prompts,
interleaved), plus a bar chart of tokens/s.

Rows: specloom plain, specloom with the run's drafter (the bench candidate), every other peer. Columns: tokens/s
(generated tokens over wall time including prefill, summed over the prompts), the ratio to specloom plain, the ratio
to the fastest peer (every row that is not specloom), tau where it can be counted, and how many outputs equal
specloom plain's. The figures are the run's own: nothing is measured here.
"""

from __future__ import annotations

import json
import os

from ..errors import SpecloomError


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            rep = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecloomError(f"{path}: not a readable bench report ({e})") from None
    if not isinstance(rep, dict) or "candidate_tokens_per_second" not in rep or not rep.get("peers"):
        raise SpecloomError(f"{path}: not a `specloom bench --baseline ... --json` report with peers "
                            "(run bench with --baseline plain,<peers> --json)")
    if "plain" not in rep["peers"]:
        raise SpecloomError(f"{path}: the run has no specloom plain row (add plain to --baseline)")
    return rep


def rows_of(rep: dict) -> list[dict]:
    """The report's rows in table order: specloom plain, specloom + drafter, then the peers by name order given."""
    peers = rep["peers"]
    plain_tps = peers["plain"]["tokens_per_second"]
    n = rep.get("num_prompts") or peers["plain"].get("num_prompts")
    rows = [{"name": "specloom plain", "specloom": True, "tokens_per_second": plain_tps,
             "tau": None, "identical": peers["plain"].get("identical_to_specloom_plain", n), "prompts": n}]
    rows.append({"name": f"specloom {rep.get('candidate', 'candidate')}", "specloom": True,
                 "tokens_per_second": rep["candidate_tokens_per_second"], "tau": rep.get("mean_accepted_length"),
                 "identical": rep.get("candidate_identical_to_specloom_plain", rep.get("identical_outputs")),
                 "prompts": n})
    for name, p in peers.items():
        if name == "plain":
            continue
        rows.append({"name": p.get("label") or name, "specloom": False, "tokens_per_second": p["tokens_per_second"],
                     "tau": p.get("mean_accepted_length"), "identical": p.get("identical_to_specloom_plain"),
                     "prompts": p.get("num_prompts", n), "acceptance": p.get("draft_acceptance")})
    best_peer = max((r["tokens_per_second"] for r in rows if not r["specloom"]), default=None)
    for r in rows:
        r["ratio_to_plain"] = r["tokens_per_second"] / plain_tps if plain_tps else None
        r["ratio_to_best_peer"] = r["tokens_per_second"] / best_peer if best_peer else None
    return rows


def _fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def markdown(reports: list[tuple[str, dict]]) -> str:
    out = ["# Peer report", "",
           "Each table is one `specloom bench` run: specloom and every peer decode the same prompts greedily, "
           "interleaved prompt by prompt after one warm-up each. tokens/s = generated tokens / wall time including "
           "prefill, summed over the prompts. 'Identical' counts outputs equal to specloom plain's.", ""]
    for path, rep in reports:
        host = rep.get("host") or {}
        out += [f"## {rep.get('model', '?')}", "",
                f"{rep.get('num_prompts')} prompts, {rep.get('max_tokens', '?')} tokens, specloom "
                f"{rep.get('dtype', '?')}; host: {host.get('cpu', '?')} ({host.get('kind', '?')}), "
                f"{host.get('threads', '?')} threads. Source: `{os.path.basename(path)}`"
                + (f"; command: `{rep['command']}`" if rep.get("command") else ""), "",
                "| engine | tokens/s | × specloom plain | × best peer | τ | identical |",
                "|---|---|---|---|---|---|"]
        for r in rows_of(rep):
            out.append(f"| {r['name']} | {r['tokens_per_second']:.1f} | {_fmt(r['ratio_to_plain'], '.2f')}× | "
                       f"{_fmt(r['ratio_to_best_peer'], '.2f')}× | {_fmt(r['tau'], '.2f')} | "
                       f"{_fmt(r['identical'], 'd')}/{r['prompts']} |")
        out.append("")
    return "\n".join(out) + "\n"


def bar_chart(reports: list[tuple[str, dict]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SpecloomError("the bar chart needs matplotlib: pip install 'specloom[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.2), squeeze=False)
    for ax, (_, rep) in zip(axes[0], reports):
        rows = rows_of(rep)
        ys = [r["tokens_per_second"] for r in rows]
        colors = ["tab:blue" if r["specloom"] else "tab:grey" for r in rows]
        ax.barh([r["name"] for r in rows][::-1], ys[::-1], color=colors[::-1])
        for i, y in enumerate(ys[::-1]):
            ax.text(y, i, f" {y:.1f}", va="center", fontsize=8)
        ax.set_xlabel("tokens/s (wall, prefill included)")
        ax.set_title(str(rep.get("model", "?")), fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out_md: str, bench_paths: list[str], png: str | None = None) -> str:
    reports = [(p, _load(p)) for p in bench_paths]
    png = png or os.path.splitext(out_md)[0] + ".png"
    bar_chart(reports, png)
    text = markdown(reports) + f"\n![tokens/s per engine]({os.path.basename(png)})\n"
    from ..atomic import write_text

    write_text(out_md, text)
    return png
