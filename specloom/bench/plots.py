"""Pictures of benchmark reports: acceptance per position (one line per report). Needs matplotlib
(`pip install specloom[plot]`)."""

from __future__ import annotations

import json
import os

from ..errors import SpecloomError


def plot_acceptance(report_paths: list[str], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecloomError("plotting needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for path in report_paths:
        try:
            with open(path) as f:
                report = json.load(f)
            if "candidates" in report:  # a `bench --compare` report: one line per drafter
                for name, c in report["candidates"].items():
                    a = c["acceptance_per_position"]
                    ax.plot(range(1, len(a) + 1), a, marker="o",
                            label=f"{name}: tau {c['mean_accepted_length']:.2f}, {c['speedup']:.2f}x")
                continue
            alpha = report["acceptance_per_position"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise SpecloomError(f"{path}: not a specloom bench report ({e})") from None
        if not alpha:
            continue
        spec = report.get("speculative_config") or {}
        label = (f"{spec.get('method')} k={spec.get('num_speculative_tokens')}"
                 + (f" w={spec['prompt_lookup_max']}" if spec.get("prompt_lookup_max") else "")
                 + f" ({report['dtype']}, {report['num_prompts']} prompts): tau {report['mean_accepted_length']:.2f}, "
                 f"{report['speedup']:.2f}x")
        ax.plot(range(1, len(alpha) + 1), alpha, marker="o", label=label)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance per position (alpha_k)")
    ax.set_xlabel("draft depth k (for trees: the accepted path's k-th token)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Acceptance per position")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
