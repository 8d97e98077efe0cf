"""Record the target's behaviour on the probe (specloom/behaviour.py) into drafter checkpoints made before it.

    python scripts/record_target_probe.py smollm2-135m specloom/bundled/smollm2-135m/*
    python scripts/record_target_probe.py smollm2-135m --check specloom/bundled/smollm2-135m/*

Loads the target (fp32, for the recording), records `target_probe` once and writes it into the `specloom` block
of each directory's config.json, right after `target_fingerprint` (the block under `specloom_mtp` /
`specloom_dspark` of a target's own config.json when the drafter is built into it). Weights and every other key
are left as they are. A directory whose structural fingerprint is not this target's is refused (its drafter was
trained for another model: recording this one's behaviour would hide that). `--force` replaces a recording that
is there already; `--check` writes nothing and prints each directory's distance to the target instead.

The bundled SmolLM2 drafters were trained against the Q4_1 GGUF of the `smollm2-135m` alias, so that is the
target to record them with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specloom.behaviour import behavioural_distance, record_probe  # noqa: E402
from specloom.fingerprint import compare, fingerprint  # noqa: E402
from specloom.loading import load_target  # noqa: E402

META_KEYS = ("specloom", "specloom_mtp", "specloom_dspark")


def with_probe(meta: dict, probe: dict) -> dict:
    """`meta` with `target_probe` right after `target_fingerprint` (key order kept for a readable diff)."""
    out = {}
    for k, v in meta.items():
        if k != "target_probe":
            out[k] = v
        if k == "target_fingerprint":
            out["target_probe"] = probe
    out.setdefault("target_probe", probe)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="alias, .gguf file or HF directory the drafters were trained against")
    ap.add_argument("dirs", nargs="+", help="drafter checkpoint directories")
    ap.add_argument("--force", action="store_true", help="replace a recording that is there already")
    ap.add_argument("--check", action="store_true", help="write nothing; print each directory's distance")
    a = ap.parse_args()
    model, tok = load_target(a.target, "fp32", progress=False)
    actual = fingerprint(model, tok)
    probe = None if a.check else record_probe(model, tok)
    bad = 0
    for d in a.dirs:
        path = os.path.join(d, "config.json")
        if not os.path.isfile(path):
            continue  # MANIFEST.md and the like under a glob
        with open(path) as f:
            text = f.read()
        raw = json.loads(text)
        key = next((k for k in META_KEYS if isinstance(raw.get(k), dict) and "target_fingerprint" in raw[k]), None)
        if key is None:
            print(f"{d}: no specloom block with a target fingerprint; skipped", file=sys.stderr)
            bad += 1
            continue
        meta = raw[key]
        diff = compare(meta["target_fingerprint"], actual)
        if diff:
            print(f"{d}: trained for another target ({'; '.join(diff)} differ); refused", file=sys.stderr)
            bad += 1
            continue
        if a.check:
            if "target_probe" not in meta:
                print(f"{d}: no recording")
                continue
            r = behavioural_distance(model, tok, meta["target_probe"])
            print(f"{d}: KL {r['kl_mean']:.6f} nats (max {r['kl_max']:.4f}), top-1 {r['top1_agreement']:.4f}, "
                  f"top-k overlap {r['topk_overlap']:.4f}, {r['positions']} positions, {r['seconds']:.2f}s")
            continue
        if "target_probe" in meta and not a.force:
            print(f"{d}: recorded already (--force replaces it)")
            continue
        raw[key] = with_probe(meta, probe)
        end = "\n" if text.endswith("\n") else ""
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(raw, indent=1) + end)
        os.replace(path + ".tmp", path)
        print(f"{d}: recorded ({os.path.getsize(path)} bytes of config.json)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
