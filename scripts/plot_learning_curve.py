"""Held-out top-1 agreement per draft position against answer tokens seen, from `specloom train --eval-every`.

    python scripts/plot_learning_curve.py OUT.png RUN_DIR[=LABEL] [RUN_DIR[=LABEL] ...]

Each RUN_DIR holds the evals.json a training run writes (held-out metrics at every --eval-every step and at the
end). One line per run and draft position (acc0 = the first drafted token, acc1 = the second, ...)."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]
    for n, arg in enumerate(argv[1:]):
        path, _, label = arg.partition("=")
        evals = json.load(open(os.path.join(path, "evals.json")))
        keys = sorted(k for k in evals[-1] if k.startswith("acc"))
        for i, k in enumerate(keys):
            xs = [e["answer_tokens_seen"] / 1e6 for e in evals if k in e]
            ys = [e[k] for e in evals if k in e]
            ax.plot(xs, ys, styles[n % len(styles)], marker="o", color=f"C{i}",
                    label=f"{label or os.path.basename(path)} position {i + 1}")
            for x, y in zip(xs, ys):
                print(f"{label or path}\t{k}\t{x:.3f}M\t{y:.3f}")
    ax.set_xlabel("answer tokens seen in training (M)")
    ax.set_ylabel("held-out top-1 agreement with the target")
    ax.set_title("Drafter learning curves (SmolLM2-135M)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
