"""Issue 15's benchmark tables: per KV cache type, per weight format of the target, and the "drafter for another
copy of the model" experiment (the bundled EAGLE-3, MTP and DSpark against SmolLM2 as shipped and re-exported).

    specloom quantize smollm2-135m --format fp8 --out DIR/smollm2_fp8 --with-drafters dspark,mtp --drafter-format bf16
    (likewise mxfp4, nvfp4)
    OMP_NUM_THREADS=2 python scripts/bench_formats.py --formats-dir DIR --json docs/formats_issue15.json

Sections (`--sections`, default all):
  kv         per KV type: bytes per 1k tokens (target, EAGLE-3 drafter), max |dlogit| against fp32 KV (fp32 compute,
             teacher-forced through one-token decode passes over the fp32-KV greedy continuation), tau of the bundled
             EAGLE-3 (speculation fixed) and tokens/s plain and with EAGLE-3 (bf16 compute).
  weights    per target weight format, each in a fresh process: resident memory (RSS after load minus before), load
             time, plain tokens/s (bf16), max |dlogit| against the dequantised Q4_1 original (fp32 compute, prompt
             logits); `--resident quantized` rows hold the weights in their format (SPECLOOM_WEIGHTS_RESIDENT).
  other_copy for each target copy x drafter: tau, acceptance per position, and what the fingerprint checks say (the
             structural one, the behavioural distance to the recording in the drafter's config, load warnings).
Greedy decoding, chat template, Spec-Bench prompts (eval set: measured on, never trained on).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import warnings

import torch

from specloom.behaviour import behavioural_distance
from specloom.bench.harness import add_per_position, read_prompts
from specloom.drafters.base import module_bytes
from specloom.engine import Engine
from specloom.fingerprint import compare, fingerprint
from specloom.kv import kv_bytes_per_token
from specloom.loading import load_target
from specloom.speculative import SpeculativeConfig

KV_TYPES = ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]
FORMATS = ["fp8", "mxfp4", "nvfp4"]
DRAFTERS = ["eagle3", "mtp", "dspark"]
BUNDLED = os.path.join(os.path.dirname(__file__), "..", "specloom", "bundled", "smollm2-135m")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def targets(formats_dir: str) -> dict[str, str]:
    out = {"q4_1": "smollm2-135m"}
    for f in FORMATS:
        d = os.path.join(formats_dir, f"smollm2_{f}")
        if not os.path.isfile(os.path.join(d, "config.json")):
            sys.exit(f"{d}: missing; write it first with specloom quantize smollm2-135m --format {f} --out {d} "
                     "--with-drafters dspark,mtp --drafter-format bf16")
        out[f] = d
    return out


def encode(tok, prompts) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": p["text"]}]) for p in prompts]


def decode_runs(engine: Engine, ids: list[list[int]], max_tokens: int) -> dict:
    """Greedy generation of every prompt; totals for tau, acceptance per position and tokens/s."""
    engine.generate(prompt_token_ids=ids[0], max_tokens=8)  # warm-up (kernels, allocator)
    tokens = passes = 0
    seconds = 0.0
    acc: list[int] = []
    prop: list[int] = []
    outs = []
    for p in ids:
        r = engine.generate(prompt_token_ids=p, max_tokens=max_tokens)
        outs.append(r.token_ids)
        tokens += len(r.token_ids) - 1  # the prefill's token is not a decode step's
        passes += r.num_target_passes - 1  # tau as everywhere: the prefill pass and its token excluded
        seconds += r.total_seconds - r.prefill_seconds
        add_per_position(acc, r.accepted_per_position)
        add_per_position(prop, r.proposed_per_position)
    return {"tokens": tokens, "tau": tokens / max(passes, 1), "tokens_per_s": tokens / seconds,
            "acceptance_per_position": [round(a / q, 3) if q else 0.0 for a, q in zip(acc, prop)], "outputs": outs}


@torch.inference_mode()
def forced_logits(model, kv, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """Logits at the continuation's positions: the prompt in one pass, then one token per pass through the store."""
    ids = prompt + cont
    store = model.new_kv(len(ids) + 1, kv)
    out = [model(torch.tensor([prompt]), torch.arange(len(prompt))[None], store).logits[0, -1:]]
    store.commit()
    for i in range(len(prompt), len(ids) - 1):
        out.append(model(torch.tensor([[ids[i]]]), torch.tensor([[i]]), store).logits[0])
        store.commit()
    return torch.cat(out).float()


def section_kv(args, prompts) -> list[dict]:
    rows = []
    model, tok = load_target("smollm2-135m", "fp32", progress=False)
    c = model.config
    ids = encode(tok, prompts[: args.logit_prompts])
    ref_engine = Engine(model, tok, kv_dtype=torch.float32, speculation="off")
    conts = [ref_engine.generate(prompt_token_ids=p, max_tokens=args.logit_tokens, ignore_eos=True).token_ids
             for p in ids]
    refs = [forced_logits(model, "fp32", p, q) for p, q in zip(ids, conts)]
    dlogit = {}
    for kv in KV_TYPES:
        dlogit[kv] = max(float((forced_logits(model, kv, p, q) - r).abs().max()) for p, q, r in zip(ids, conts, refs))
        log(f"kv {kv}: max |dlogit| {dlogit[kv]:.3f} over {len(ids)} prompts x {args.logit_tokens} tokens")
    del model, ref_engine, refs
    gc.collect()
    model, tok = load_target("smollm2-135m", "bf16", progress=False)
    ids = encode(tok, prompts[: args.decode_prompts])
    plain_ref = None
    for kv in KV_TYPES:
        plain = decode_runs(Engine(model, tok, kv_dtype=kv, speculation="off"), ids, args.max_tokens)
        spec = SpeculativeConfig.parse({"method": "eagle3", "kv_cache_dtype": kv})
        eng = Engine(model, tok, spec, kv_dtype=kv, speculation="fixed")
        eagle = decode_runs(eng, ids, args.max_tokens)
        plain_ref = plain_ref or plain["outputs"]
        row = {"kv": kv, "target_bytes_per_1k": kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv) * 1000,
               "drafter_bytes_per_1k": eng.drafter.memory()["kv_per_1k_tokens"],
               "max_abs_dlogit_vs_fp32": round(dlogit[kv], 4),
               "eagle3_tau": round(eagle["tau"], 3), "eagle3_acceptance": eagle["acceptance_per_position"],
               "plain_tokens_per_s": round(plain["tokens_per_s"], 2),
               "eagle3_tokens_per_s": round(eagle["tokens_per_s"], 2),
               "eagle3_identical_to_plain_same_kv": sum(a == b for a, b in zip(eagle["outputs"], plain["outputs"])),
               "plain_same_as_fp32_kv": sum(a == b for a, b in zip(plain["outputs"], plain_ref)),
               "prompts": len(ids)}
        log(f"kv {kv}: {row}")
        rows.append(row)
    return rows


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def one_weights(args) -> None:
    """Child process: one target copy's load, memory, speed and logits against the Q4_1 original."""
    prompts = read_prompts(args.prompts, per_category=args.per_category)
    before = rss()
    t0 = time.perf_counter()
    model, tok = load_target(args.one_weights, "bf16", progress=False, weights_resident=args.resident)
    load_s = time.perf_counter() - t0
    resident = rss() - before
    weights_mb = module_bytes(model) / 2**20
    n = args.decode_prompts if args.resident == "dequantized" else args.quantized_decode_prompts
    ids = encode(tok, prompts[:n])
    plain = decode_runs(Engine(model, tok, speculation="off"), ids, args.max_tokens)
    del model
    gc.collect()
    cand, _ = load_target(args.one_weights, "fp32", progress=False, weights_resident=args.resident)
    ref, _ = load_target("smollm2-135m", "fp32", progress=False)
    worst, agree, total = 0.0, 0, 0
    with torch.inference_mode():
        for p in encode(tok, prompts[: args.logit_prompts]):
            x, pos = torch.tensor([p]), torch.arange(len(p))[None]
            a = cand(x, pos, cand.new_kv(len(p) + 1)).logits
            b = ref(x, pos, ref.new_kv(len(p) + 1)).logits
            worst = max(worst, float((a.float() - b.float()).abs().max()))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[1]
    print(json.dumps({"load_s": round(load_s, 2), "resident_mb": round(resident / 2**20, 1),
                      "weights_mb": round(weights_mb, 1),
                      "plain_tokens_per_s": round(plain["tokens_per_s"], 2),
                      "max_abs_dlogit_vs_q4_1": round(worst, 4),
                      "top1_agreement_vs_q4_1": round(agree / total, 4), "prompts": len(ids)}))


def section_weights(args, tgts) -> list[dict]:
    rows = []
    for resident in args.resident_modes:
        for name, path in tgts.items():
            if resident == "quantized" and name == "q4_1":
                continue  # a GGUF is always dequantised at load
            cmd = [sys.executable, __file__, "--one-weights", path, "--resident", resident, "--prompts", args.prompts,
                   "--per-category", str(args.per_category), "--decode-prompts", str(args.decode_prompts),
                   "--logit-prompts", str(args.logit_prompts),
                   "--quantized-decode-prompts", str(args.quantized_decode_prompts), "--max-tokens", str(args.max_tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{name} ({resident}): {out.stderr[-2000:]}")
            row = {"format": name, "resident": resident, **json.loads(out.stdout.strip().splitlines()[-1])}
            if os.path.isdir(path):
                row["checkpoint_mb"] = round(sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                                                 if f.startswith("model.") and f.endswith(".safetensors")) / 2**20, 1)
            log(f"weights: {row}")
            rows.append(row)
    return rows


def bundled_meta(drafter: str) -> dict:
    with open(os.path.join(BUNDLED, drafter, "config.json")) as f:
        return json.load(f).get("specloom") or {}


def section_other_copy(args, prompts, tgts) -> list[dict]:
    rows = []
    for name, path in tgts.items():
        model, tok = load_target(path, "bf16", progress=False)
        ids = encode(tok, prompts[: args.decode_prompts])
        actual = fingerprint(model, tok)
        for d in DRAFTERS:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                eng = Engine(model, tok, SpeculativeConfig.parse({"method": d}), speculation="fixed")
            r = decode_runs(eng, ids, args.max_tokens)
            meta = bundled_meta(d)
            behaviour = behavioural_distance(model, tok, meta["target_probe"])
            row = {"target": name, "drafter": d, "tau": round(r["tau"], 3),
                   "acceptance_per_position": r["acceptance_per_position"],
                   "structural_differences": compare(meta.get("target_fingerprint"), actual),
                   "behavioural_distance": {k: v for k, v in behaviour.items() if k != "seconds"},
                   "load_warnings": [str(w.message) for w in caught], "prompts": len(ids)}
            log(f"other copy: {row}")
            rows.append(row)
        del model
        gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats-dir", default="/work/runs/formats")
    ap.add_argument("--prompts", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval",
                                                     "spec_bench.jsonl"))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--logit-prompts", type=int, default=20)
    ap.add_argument("--logit-tokens", type=int, default=32)
    ap.add_argument("--decode-prompts", type=int, default=13)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quantized-decode-prompts", type=int, default=2,
                    help="prompts timed for the weights held quantized (6-20x slower)")
    ap.add_argument("--sections", default="kv,weights,other_copy")
    ap.add_argument("--resident-modes", default="dequantized,quantized", type=lambda s: s.split(","))
    ap.add_argument("--json", default=None)
    ap.add_argument("--one-weights", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--resident", default="dequantized", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_weights:
        return one_weights(args)
    prompts = read_prompts(args.prompts, per_category=args.per_category)
    # spread over the categories: the first prompt of each, then the second of each
    rank = [sum(q["category"] == p["category"] for q in prompts[:i]) for i, p in enumerate(prompts)]
    prompts = [p for _, _, p in sorted(zip(rank, range(len(prompts)), prompts), key=lambda t: t[:2])]
    tgts = targets(args.formats_dir)
    result = {"host_threads": torch.get_num_threads(), "command": " ".join(sys.argv),
              "prompts": os.path.basename(args.prompts)}
    sections = args.sections.split(",")
    run = {"kv": lambda: section_kv(args, prompts), "weights": lambda: section_weights(args, tgts),
           "other_copy": lambda: section_other_copy(args, prompts, tgts)}
    for s in sections:
        if s not in run:
            sys.exit(f"unknown section {s!r} ({', '.join(run)})")
    for s in sections:
        t0 = time.perf_counter()
        result[s] = run[s]()
        log(f"section {s}: {time.perf_counter() - t0:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
