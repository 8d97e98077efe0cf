"""`specloom` command line: `generate`, `bench`, `serve`, `bench-serve`, `data`, `train`, `quantize`, `export`,
`doctor` and `plot`.

Every `SpecloomError` (bad input, impossible setting) is printed as one line `specloom: error: ...` and exits
with status 2; there is no traceback for a user's mistake.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading

from .errors import SpecloomError


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def _seconds(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not 0 <= t < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value}")
    return t


def _device(p: argparse.ArgumentParser) -> None:
    # checked in main() (loading.parse_device), so that a bad name is one SpecloomError line, not argparse usage
    p.add_argument("--device", default=None, metavar="{cpu,cuda,cuda:N}",
                   help="where the target and its drafter run (default: cuda when PyTorch sees a GPU, else cpu)")


KV_CACHE_DTYPES = "auto,fp32,bf16,fp16,fp8_e4m3,fp8_e5m2,int8"  # kv_quant.CHOICES (checked in main())


def _kv_cache_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default="auto", metavar=f"{{{KV_CACHE_DTYPES}}}",
                   help="the target's KV cache type (vLLM's name; --kv-dtype is an alias). auto: fp32 on CPU (faster "
                        "there for attention over few queries), the model's dtype elsewhere; fp8_e4m3, fp8_e5m2 and "
                        "int8 store codes with one fp32 scale per token and head. The drafter's own KV: "
                        "\"kv_cache_dtype\" in --speculative-config")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="alias (smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b), "
                   "a .gguf file or a HF model directory")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weights and KV dtype (default bf16)")
    _kv_cache_dtype(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM-style JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--max-tokens", type=_positive_int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--speculation", default="auto", choices=["auto", "fixed", "off"],
                   help="draft depth per step: auto (default: from this host's verify-cost curve and the request's "
                        "acceptance; plain decoding where the drafter cannot pay), fixed (the drafter's own depth), "
                        "off")
    p.add_argument("--linear-kernel", default="auto", choices=["auto", "onednn", "invariant", "native", "fp32", "int8"],
                   help="the target's linear kernel: auto (default: measured once per host among the kernels that "
                        "keep the model's numerics); fp32 and int8 change a bf16 model's numerics (opt-in)")
    _device(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specloom", description="Exact speculative decoding in PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log loading details")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text and print speed statistics")
    _common(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--compare-plain", action="store_true",
                   help="also decode the same prompt without speculation in the same run (after a short warm-up "
                        "of both) and print both speeds, the speed-up and tau")
    g.add_argument("--compare-rounds", type=_positive_int, default=2,
                   help="with --compare-plain: runs of each, interleaved A B B A ... (default 2)")

    b = sub.add_parser("bench", help="benchmark a candidate against a baseline, interleaved in one run")
    _common(b)
    b.add_argument("--prompts", required=True, help="JSONL file; each line has turns[0] or prompt")
    b.add_argument("--limit", type=_positive_int, default=None, help="use the first N prompts")
    b.add_argument("--per-category", type=_positive_int, default=None, help="use the first N prompts of each category")
    b.add_argument("--categories", default=None, help="comma-separated categories to keep (e.g. summarization,rag)")
    b.add_argument("--baseline", default="plain", metavar="NAME[,NAME...]",
                   help="baseline(s) timed interleaved with the candidate, comma-separated: plain (specloom without "
                        "speculation, default), hf (HF transformers generate, fp32), hf-assisted (HF assisted "
                        "generation with --baseline-draft), hf-lookup (HF prompt lookup), llama.cpp, "
                        "llama.cpp-lookup (llama-cpp-python: pip install 'specloom[llama]'), llama.cpp-draft "
                        "(llama.cpp's draft-model speculation: scripts/build_llama_speculative.sh); the first is "
                        "the report's main baseline")
    b.add_argument("--baseline-draft", default=None, metavar="MODEL",
                   help="draft model of hf-assisted and llama.cpp-draft (default: the candidate's draft_model)")
    b.add_argument("--baseline-draft-tokens", type=_positive_int, default=None, metavar="K",
                   help="tokens drafted per step by hf-assisted and llama.cpp-draft (default: each library's own: "
                        "HF 20 with its confidence stop, llama.cpp 3)")
    b.add_argument("--baseline-lookup-tokens", type=_positive_int, default=10, metavar="N",
                   help="tokens copied per lookup by hf-lookup and llama.cpp-lookup (default 10; n-gram up to 2)")
    b.add_argument("--repeats", type=_positive_int, default=1, metavar="N",
                   help="decode each prompt N times with every runner (rounds interleaved, the order reversed each "
                        "round) and keep each runner's fastest time: on a shared host a single timing per prompt "
                        "moves by +-20 %%; the fastest of N is the run least slowed by other work (default 1)")
    b.add_argument("--raw", action="store_true", help="use prompts as raw text (default: chat template if any)")
    b.add_argument("--compare", default=None, metavar="JSON",
                   help='several drafters vs plain in one run: \'{"name": {speculative config}, ...}\'')
    b.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the full report here")

    d = sub.add_parser("data", help="self-distillation data: the target answers prompts (and its own Magpie "
                       "queries) through the batch step; store token ids and loss masks")
    d.add_argument("--target", required=True, help="target model (alias, .gguf or HF directory)")
    d.add_argument("--prompts", nargs="*", default=[], help="JSONL files or directories of them (never eval/)")
    d.add_argument("--magpie", type=int, default=0, metavar="N",
                   help="also N conversations whose user query the target writes itself (Magpie)")
    d.add_argument("--out", required=True, help="output directory (rerun to resume)")
    d.add_argument("--max-new-tokens", type=_positive_int, default=256, help="per answer")
    d.add_argument("--rows", "--batch-size", dest="rows", type=_positive_int, default=64,
                   help="rows decoded together (continuous batching)")
    d.add_argument("--max-prompt-tokens", type=_positive_int, default=640, help="skip longer prompts")
    d.add_argument("--limit", type=_positive_int, default=None, help="use the first N prompts")
    d.add_argument("--sampled-fraction", type=float, default=0.3, help="share of answers sampled (rest greedy)")
    d.add_argument("--temperature-range", type=float, nargs=2, default=(0.7, 1.0), metavar=("LOW", "HIGH"))
    d.add_argument("--multi-turn-fraction", type=float, default=0.2,
                   help="share of conversations with a second, Magpie-written user turn")
    d.add_argument("--shard-tokens", type=_positive_int, default=200_000)
    d.add_argument("--max-minutes", type=float, default=None,
                   help="start no new conversation after this long (the running ones finish; a rerun resumes)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    d.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp32", "auto"],
                   help="KV store of the generator (default bf16: batched decode reads the KV of every row each step)")
    _device(d)

    t = sub.add_parser("train", help="train a drafter on `specloom data` output")
    t.add_argument("kind", help="medusa | eagle | eagle3 | draft_model | mtp | dflash | dspark | target (a new small "
                   "model trained from scratch jointly with --mtp N MTP layers; --target names its tokenizer)")
    t.add_argument("--target", required=True, help="the target model the data was made with")
    t.add_argument("--data", required=True, nargs="+", help="directories written by `specloom data`")
    t.add_argument("--out", required=True, help="output checkpoint directory (rerun to resume)")
    t.add_argument("--init-from", default=None, help="start from this drafter checkpoint")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    t.add_argument("--epochs", type=_positive_int, default=1)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tokens-per-batch", type=_positive_int, default=4096)
    t.add_argument("--ttt-steps", type=_positive_int, default=3, help="training-time-test unroll (eagle, eagle3)")
    t.add_argument("--draft-vocab", type=_positive_int, default=None,
                   help="draft vocabulary size: the most frequent answer tokens (eagle3: default 8192; medusa: "
                        "default the whole vocabulary, a smaller one makes the heads' output layer cheaper)")
    t.add_argument("--draft-vocab-coverage", type=float, default=None,
                   help="eagle3, medusa: choose the draft vocabulary as the fewest tokens covering this share of "
                        "the answer tokens (at most --draft-vocab)")
    t.add_argument("--loss-fraction", type=float, default=0.5,
                   help="fraction of positions scored per batch by large-vocabulary losses (speed knob)")
    t.add_argument("--token-weight", type=float, default=0.5, help="eagle: weight of the token loss")
    t.add_argument("--medusa-heads", type=_positive_int, default=4)
    t.add_argument("--draft-layers", type=_positive_int, default=None,
                   help="draft_model: target layers kept (default 2); dflash, dspark: draft layers (default 1)")
    t.add_argument("--block-size", type=_positive_int, default=None,
                   help="dflash, dspark: tokens per block (default: dflash 6 = 5 drafts, dspark 5 = 5 drafts)")
    t.add_argument("--num-anchors", type=_positive_int, default=32,
                   help="dflash, dspark: blocks (anchors) trained per sequence and batch")
    t.add_argument("--markov-rank", type=int, default=32, help="dspark: Markov head rank (0 = none)")
    t.add_argument("--markov-head", choices=("vanilla", "gated", "rnn"), default="vanilla",
                   help="dspark: Markov head type")
    t.add_argument("--draft-intermediate", type=_positive_int, default=None,
                   help="dflash, dspark: MLP width of the draft layers (default: half the target's)")
    t.add_argument("--mask-token-id", type=int, default=None,
                   help="dflash, dspark: the MASK token of the block (default: the highest-id special token that "
                        "is not BOS/EOS/pad and never occurs in the data, e.g. SmolLM2's <empty_output>)")
    import importlib

    from .drafters import KINDS

    for module in dict.fromkeys(m for kind in KINDS.values() for m in kind.trainers):  # kinds' own options
        add = getattr(importlib.import_module(module), "add_arguments", None)
        if add is not None:
            add(t)
    t.add_argument("--max-data-tokens", type=_positive_int, default=None, help="read only this many tokens")
    t.add_argument("--cache-hidden-gb", type=float, default=None,
                   help="tokens-only data: keep up to this many GB of recomputed hidden states in memory for later "
                        "epochs (default: half the memory available at start; 0: recompute every batch)")
    t.add_argument("--eval-fraction", type=float, default=0.02)
    t.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this long (then evaluate and save as at the end)")
    t.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="held-out evaluation every N steps (the learning curve in evals.json and the manifest)")
    t.add_argument("--save-every", type=_positive_int, default=100)
    t.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32 (default: bf16 autocast)")
    _device(t)

    sv = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and load-aware speculation")
    sv.add_argument("model")
    sv.add_argument("--speculative-config", default=None, help="JSON, as for generate")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    sv.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    sv.add_argument("--max-num-seqs", type=_positive_int, default=16,
                    help="most sequences running at once (fewer when --memory-budget allows fewer)")
    sv.add_argument("--memory-budget", default=None,
                    help="memory for target weights + drafter weights + KV caches, e.g. 4GiB; the KV pool gets "
                         "what the weights leave (default: room for --max-num-seqs sequences)")
    sv.add_argument("--max-model-len", type=_positive_int, default=2048,
                    help="longest prompt + completion per sequence (sizes each KV pool row)")
    _kv_cache_dtype(sv)
    sv.add_argument("--speculation", default=None, choices=["load_aware", "fixed", "off"],
                    help="depth per step: from load and acceptance (default with a drafter), always "
                         "num_speculative_tokens, or never")
    sv.add_argument("--max-queue", type=int, default=None,
                    help="requests that may wait for a free sequence slot before new ones get 429 "
                         "(default: 4 x the pool's sequences)")
    sv.add_argument("--no-doctor", action="store_true",
                    help="skip the start-up check (`specloom doctor`'s quick part: fingerprints, a short acceptance "
                         "probe, predicted speed-up and verdict in the log)")
    sv.add_argument("--served-model-name", default=None, help="the model id clients use (default: MODEL)")
    sv.add_argument("--metrics-require-key", action="store_true",
                    help="require the --api-key on /metrics too (default: /metrics is open, as vLLM's)")
    sv.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                    help="on SIGTERM: stop admitting, give the running requests this long to finish, then end the "
                         "rest with a 503 and exit 0 (default 30)")
    sv.add_argument("--special-tokens-in-input", action="store_true",
                    help="parse special-token strings (e.g. <|im_end|>) in message content and completions prompts "
                         "as special tokens (default: plain text, so content cannot forge a chat turn)")
    _device(sv)

    bs = sub.add_parser("bench-serve", help="throughput and latency vs concurrency through the server: speculation "
                                            "off / fixed / load-aware, side by side in one run")
    bs.add_argument("model")
    bs.add_argument("--speculative-config", default=None)
    bs.add_argument("--concurrency", type=_positive_int, nargs="+", default=[1, 2, 4, 8, 16])
    bs.add_argument("--modes", nargs="+", default=["off", "fixed", "load_aware"],
                    choices=["off", "fixed", "load_aware"])
    bs.add_argument("--prompts", required=True, help="JSONL prompts (Spec-Bench style)")
    bs.add_argument("--max-tokens", type=_positive_int, default=64)
    bs.add_argument("--requests-per-level", type=_positive_int, default=8, help="at least; 2 x concurrency if more")
    bs.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    bs.add_argument("--max-model-len", type=_positive_int, default=1024)
    _kv_cache_dtype(bs)
    bs.add_argument("--json", default=None, help="write the report here")
    bs.add_argument("--plot", default=None, help="PNG: throughput, latency and speed-up vs concurrency")
    _device(bs)

    sk = sub.add_parser("bench-soak", help="soak and fault test: a real `specloom serve` for N minutes under "
                                           "greedy load, client disconnects, malformed and poisoned requests")
    sk.add_argument("model")
    sk.add_argument("--prompts", required=True, help="JSONL prompts (Spec-Bench style)")
    sk.add_argument("--speculative-config", default='{"method": "ngram"}', help="JSON, as for serve ('' for none)")
    sk.add_argument("--speculation", default="fixed", choices=["load_aware", "fixed", "off"],
                    help="the server's depth policy (default fixed: acceptance independent of load)")
    sk.add_argument("--minutes", type=float, default=10.0)
    sk.add_argument("--concurrency", type=_positive_int, default=16)
    sk.add_argument("--num-prompts", type=_positive_int, default=32, help="distinct prompts (each sent alone first)")
    sk.add_argument("--max-tokens", type=_positive_int, default=64)
    sk.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"],
                    help="fp32 (default): a batched greedy answer equals its alone answer exactly")
    sk.add_argument("--max-model-len", type=_positive_int, default=1024)
    sk.add_argument("--disconnect-fraction", type=float, default=0.12)
    sk.add_argument("--malformed-fraction", type=float, default=0.05)
    sk.add_argument("--poisoned-fraction", type=float, default=0.03)
    sk.add_argument("--warmup-fraction", type=float, default=0.2,
                    help="the first part of the soak that RSS flatness does not cover")
    sk.add_argument("--seed", type=int, default=0)
    sk.add_argument("--json", default=None, help="write the summary here")
    sk.add_argument("--server-log", default=None, help="the server's output (default: a temporary file)")
    _device(sk)

    dr = sub.add_parser("doctor", help="before serving: is the drafter this target's, how much does it accept, "
                        "does it pay on this machine (verdict; exit 0 when it pays, 1 otherwise)")
    dr.add_argument("model", help="the target: alias, a .gguf file or a HF model directory")
    dr.add_argument("--speculative-config", required=True, metavar="JSON", help="the drafter, as for generate")
    dr.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    _kv_cache_dtype(dr)
    dr.add_argument("--prompts", default=None, metavar="FILE",
                    help="JSONL prompts for the acceptance probe (default: a few short packaged ones)")
    dr.add_argument("--max-tokens", type=_positive_int, default=48, help="tokens per probe prompt (default 48)")
    dr.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON")
    _device(dr)
    from .quantize.cli import add_parser as add_quantize

    add_quantize(sub)
    from .export import add_parser as add_export

    add_export(sub)

    pl = sub.add_parser("plot", help="draw acceptance per position from bench reports (needs matplotlib)")
    pl.add_argument("reports", nargs="+", help="JSON reports written by `specloom bench --json`")
    pl.add_argument("--out", required=True, help="PNG file to write")

    tm = sub.add_parser("token-map", help="rank a tokenizer's tokens by frequency over prompts: the ranking a "
                        "draft model's reduced vocabulary (\"draft_vocab\": N) takes its N tokens from")
    tm.add_argument("model", help="the target (alias, .gguf or HF directory): its tokenizer")
    tm.add_argument("--prompts", nargs="+", required=True, help="JSONL files or directories of them (`turns` or "
                    "`prompt`, as `specloom data` reads); use training prompts, not the benchmark's")
    tm.add_argument("--out", required=True, help="JSON file to write")

    rp = sub.add_parser("report", help="the peer report: one table per target (specloom plain, specloom + drafter, "
                        "every peer) and a bar chart, from `specloom bench --baseline plain,... --json` runs")
    rp.add_argument("out", help="Markdown file to write (the chart goes beside it as .png)")
    rp.add_argument("--bench", nargs="+", required=True, metavar="JSON", help="bench reports, one per target")
    rp.add_argument("--png", default=None, help="where the bar chart goes (default: OUT with .png)")
    return parser


def _generate(args) -> int:
    from .engine import Engine, load
    from .host import host_info, host_line
    from .sampling import SamplingParams

    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # checked before loading
    _check_prompt_before_loading(args)
    engine = load(args.model, speculative_config=args.speculative_config, dtype=args.dtype, kv_dtype=args.kv_dtype,
                  device=args.device, speculation=args.speculation, linear_kernel=args.linear_kernel)
    kw = dict(chat=args.chat, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, stop=args.stop)
    plain = None
    if args.compare_plain:
        plain = Engine(engine.model, engine.tokenizer, None, engine.max_model_len, kv_dtype=engine.kv_dtype)
        for e in (plain, engine):  # warm-up: one-time kernel set-up, the verify-cost curve (cached per host)
            e.generate(args.prompt, **{**kw, "max_tokens": min(8, args.max_tokens)})
    runs = {"spec": [], "plain": []}
    for i in range(args.compare_rounds if plain is not None else 1):  # A B, B A, ...: drift hits both alike
        order = [("spec", engine), ("plain", plain)][:: 1 if i % 2 == 0 else -1] if plain is not None else [
            ("spec", engine)]
        for name, e in order:
            runs[name].append(e.generate(args.prompt, **kw))
    result = runs["spec"][0]
    base = runs["plain"][0] if plain is not None else None
    tps = _decode_tps(runs["spec"])
    base_tps = _decode_tps(runs["plain"]) if base is not None else 0.0
    host = host_info(engine.model.device)
    choice = getattr(engine.model, "kernel_choice", None)
    if args.json:
        d = result.to_dict()
        d["host"] = host
        d["linear_kernel"] = choice.to_dict() if choice is not None else None
        if base is not None:
            d["plain"] = {k: v for k, v in base.to_dict().items() if k not in ("logprobs", "prompt_token_ids")}
            d["rounds"] = args.compare_rounds
            d["decode_tokens_per_second"], d["plain"]["decode_tokens_per_second"] = tps, base_tps  # over the rounds
            d["speedup"] = _ratio(tps, base_tps)
            d["identical_to_plain"] = result.token_ids == base.token_ids
            d["first_difference"], d["top2_margin_at_divergence"] = _divergence(engine, result, base)
        print(json.dumps(d))
        return 0
    print(result.text)
    err = sys.stderr
    spec = ""
    if engine.drafter is not None:
        s = result.speculation or {}
        alpha = ", ".join(f"{a:.2f}" for a in result.acceptance_per_position)
        spec = (f"; {engine.drafter.method}, speculation {s.get('mode', engine.speculation)} (mean depth "
                f"{s.get('mean_depth', 0):.1f}, {s.get('drafted_steps', 0)}/{s.get('steps', 0)} steps drafted): "
                f"{result.num_accepted_tokens}/{result.num_draft_tokens} drafted tokens accepted, acceptance per "
                f"position [{alpha}]")
    print(f"\n[{_speed(result, tps)}, {result.num_target_passes} target passes, tau {result.mean_accepted_length:.2f}"
          f"{spec}, finish: {result.finish_reason}]", file=err)
    if base is not None:
        ratio = _ratio(tps, base_tps)
        invariant = passes_invariant(engine.model)
        same = "identical output" + (" (batch-invariant passes: bit for bit by construction)" if invariant else "")
        if base.token_ids != result.token_ids:
            j, margin = _divergence(engine, result, base)
            at = f" (top-2 logit margin there {margin:.3f})" if margin is not None else ""
            same = (f"outputs part at token {j}{at}: " + (
                "a defect, since this host's passes are batch-invariant -- please report it" if invariant else
                f"this host's passes are not batch-invariant ({invariance_gap(engine.model)}), so a multi-token "
                "pass can round a near-tie differently"))
        rounds = f", {args.compare_rounds} rounds interleaved" if args.compare_rounds > 1 else ""
        print(f"[plain decoding, same prompt, same run: {_speed(base, base_tps)}]\n"
              f"[speed-up {ratio:.2f}x ({tps:.1f} vs {base_tps:.1f} tokens/s, prefill excluded{rounds}), "
              f"tau {result.mean_accepted_length:.2f}, {same}]", file=err)
    print(f"[{host_line(host)}; {choice.describe() if choice is not None else 'linear kernel: default'}]", file=err)
    return 0


def passes_invariant(model) -> bool:
    """Whether every pass computes a position the same way (batch-invariant attention and linears), so greedy
    speculative output equals plain decoding bit for bit."""
    choice = getattr(model, "kernel_choice", None)
    return model.uses_invariant_attention() and choice is not None and bool(choice.invariant)


def invariance_gap(model) -> str:
    """What keeps a model's passes from being batch-invariant, in a few words."""
    from .models import invariant_attention

    if not model.uses_invariant_attention():
        return f"PyTorch's attention: {invariant_attention.unavailable_reason() or 'not on this device'}"
    choice = getattr(model, "kernel_choice", None)
    return f"linear kernel {choice.tag if choice is not None else 'default'} is not"


def _check_prompt_before_loading(args) -> None:
    """The prompt checked against the tokenizer and the model's config before the weights load (seconds to
    minutes): a model without a chat template under --chat, a prompt over the context, fail at once. The load
    reuses the tokenizer built here."""
    from .engine import check_prompt, encode_prompt
    from .loading import load_config, load_tokenizer, resolve

    try:
        config = load_config(resolve(args.model))[0]
        tokenizer = load_tokenizer(args.model)
    except SpecloomError:
        return  # a model that cannot even give its config or tokenizer: the load names what is wrong, in its order
    ids = encode_prompt(tokenizer, args.prompt, None, args.chat)
    check_prompt(ids, args.max_tokens, config.max_position, config.vocab_size)


def _divergence(engine, result, base) -> tuple[int | None, float | None]:
    """Where a speculative output first differs from plain decoding's, and the target's top-2 logit margin there."""
    from .bench.harness import divergence_margin

    a, b = base.token_ids, result.token_ids
    if a == b:
        return None, None
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    margin = divergence_margin(engine, list(result.prompt_token_ids), a, b) if j < min(len(a), len(b)) else None
    return j, margin


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _decode_tps(results) -> float:
    """Decode tokens per second over several runs (tokens after the first / time after the prefill)."""
    t = sum(r.total_seconds - r.prefill_seconds for r in results)
    return sum(len(r.token_ids) - 1 for r in results) / t if t > 0 else 0.0


def _speed(r, tps: float) -> str:
    """`128 tokens, 41.2 tokens/s (prefill of 80 tokens: 95 ms, not counted)`."""
    return (f"{len(r.token_ids)} tokens, {tps:.1f} tokens/s (prefill of "
            f"{len(r.prompt_token_ids)} tokens: {r.prefill_seconds * 1000:.0f} ms, not counted)")


def _bench(args) -> int:
    from .bench.harness import run_bench

    if args.compare:
        from .bench.multi import run_compare

        try:
            candidates = json.loads(args.compare)
        except json.JSONDecodeError as e:
            raise SpecloomError(f"--compare is not valid JSON: {e.msg}") from None
        run_compare(args.model, args.prompts, candidates, limit=args.limit, per_category=args.per_category,
                    categories=args.categories.split(",") if args.categories else None,
                    max_tokens=args.max_tokens, dtype=args.dtype, chat=not args.raw, json_out=args.json_out,
                    device=args.device, speculation=args.speculation, linear_kernel=args.linear_kernel,
                    kv_dtype=args.kv_dtype)
        return 0
    run_bench(
        args.model, prompts=args.prompts, limit=args.limit, per_category=args.per_category,
        categories=args.categories.split(",") if args.categories else None,
        max_tokens=args.max_tokens, dtype=args.dtype,
        speculative_config=args.speculative_config, baseline=args.baseline, chat=not args.raw, kv_dtype=args.kv_dtype,
        json_out=args.json_out, device=args.device, speculation=args.speculation, linear_kernel=args.linear_kernel,
        baseline_draft=args.baseline_draft, baseline_draft_tokens=args.baseline_draft_tokens,
        baseline_lookup_tokens=args.baseline_lookup_tokens, repeats=args.repeats,
    )
    return 0


def _data(args) -> int:
    import sys

    from .training.selfdistill import build_dataset

    build_dataset(args.target, args.prompts, args.out, max_new_tokens=args.max_new_tokens, rows=args.rows,
                  max_prompt_tokens=args.max_prompt_tokens, limit=args.limit, magpie=args.magpie,
                  sampled_fraction=args.sampled_fraction, multi_turn_fraction=args.multi_turn_fraction,
                  temperature_range=tuple(args.temperature_range), shard_tokens=args.shard_tokens, seed=args.seed,
                  dtype=args.dtype, kv_dtype=args.kv_dtype, device=args.device, command=" ".join(["specloom", *sys.argv[1:]]),
                  max_minutes=args.max_minutes)
    return 0


def _train(args) -> int:
    from .training.train import run_training

    args.command = "specloom train " + args.kind
    run_training(args)
    print(args.out)
    return 0


def _startup_doctor(engine) -> float | None:
    """`specloom doctor`'s quick part before serving (two short prompts, no plain run): its findings and verdict
    in the log; its tau becomes the live acceptance monitor's start-up figure, except for a mismatched drafter
    (the monitor then compares with the manifest's figure, and says that it runs degraded)."""
    from .doctor import run_doctor

    report = run_doctor(engine, quick=True)
    for line in report.lines():
        print(f"specloom: doctor: {line}", file=sys.stderr, flush=True)
    return report.tau if report.verdict != "mismatch" else None


def _serve(args) -> int:
    import signal

    import uvicorn

    from .engine import load
    from .kv_quant import kv_dtype_arg
    from .serving.api import Server, build_app, parse_size
    from .serving.lifecycle import Lifecycle
    from .serving.listen import listen

    logging.getLogger("specloom.serve").setLevel(logging.INFO)  # admission, pool size, load-aware depth changes
    budget = parse_size(args.memory_budget)  # checked before the model loads
    if args.metrics_require_key and not args.api_key:
        raise SpecloomError("--metrics-require-key needs --api-key (the key /metrics would require)")
    sock = listen(args.host, args.port)  # so is the port: taken or out of range is one line, at once
    port = sock.getsockname()[1]
    # HTTP first, in a thread (/health: 503 "starting" while the model loads); the scheduler (all model work) in
    # the main thread: see BatchScheduler's `start`.
    life = Lifecycle()
    uv = uvicorn.Server(uvicorn.Config(build_app(life), host=args.host, port=port, log_level="warning",
                                       timeout_graceful_shutdown=10))
    uv.install_signal_handlers = lambda: None  # signals stay with the main thread

    def http():
        uv.run(sockets=[sock])
        if life.server is not None:  # the HTTP server stopped: stop scheduling too
            life.server.scheduler.close()

    http_thread = threading.Thread(target=http, daemon=True)
    http_thread.start()

    def on_sigterm(signum, frame):
        if life.state != "ready":  # still starting (nothing to finish), or a second SIGTERM: stop at once
            raise KeyboardInterrupt
        print(f"specloom: SIGTERM: draining -- no new requests; the running ones get up to {args.shutdown_timeout:g} "
              "s to finish", file=sys.stderr, flush=True)
        threading.Thread(target=life.drain, args=(args.shutdown_timeout,), daemon=True).start()  # not under a lock

    signal.signal(signal.SIGTERM, on_sigterm)  # a service manager's stop: drain, then exit 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: stop at once
    try:
        engine = load(args.model, args.speculative_config, dtype=args.dtype, max_model_len=args.max_model_len,
                      device=args.device)
        kv_dtype = kv_dtype_arg(args.kv_dtype)
        expected_tau = _startup_doctor(engine) if engine.drafter is not None and not args.no_doctor else None
        server = Server(engine, args.served_model_name or args.model, args.api_key, args.max_num_seqs, budget,
                        args.speculation, max_queue=args.max_queue, kv_dtype=kv_dtype, start=False,
                        special_tokens_in_input=args.special_tokens_in_input,
                        metrics_require_key=args.metrics_require_key, expected_tau=expected_tau)
        life.ready(server)
        m = server.memory
        mib = 2 ** 20
        print(f"specloom: serving {server.model_name} on http://{args.host}:{port}/v1 -- {m['rows']} sequences of "
              f"{m['row_tokens']} tokens; target weights {m['target_weights'] / mib:.0f} MiB, drafter weights "
              f"{m['drafter_weights'] / mib:.0f} MiB, KV pool {server.scheduler.pool.nbytes / mib:.0f} MiB; "
              f"speculation {server.scheduler.policy.mode}", file=sys.stderr, flush=True)
        server.scheduler.run()  # returns when drained (or the HTTP server stopped)
    except KeyboardInterrupt:
        pass
    finally:
        uv.should_exit = True  # uvicorn finishes the responses in flight (at most 10 s), then closes
    http_thread.join(timeout=15)
    return 0


def _bench_serve(args) -> int:
    from .bench.serve_load import run_serve_bench

    run_serve_bench(args.model, args.speculative_config, args.concurrency, args.modes, args.prompts,
                    args.max_tokens, args.dtype, args.requests_per_level, args.max_model_len, args.json, args.plot,
                    device=args.device, kv_dtype=args.kv_dtype)
    return 0


def _bench_soak(args) -> int:
    from .bench.soak import run_soak

    if not 0 < args.minutes < float("inf"):
        raise SpecloomError(f"--minutes must be a positive number, got {args.minutes}")
    s = run_soak(args.model, args.prompts, args.speculative_config or None, args.minutes, args.concurrency,
                 args.num_prompts, args.max_tokens, args.dtype, args.max_model_len, args.speculation,
                 args.disconnect_fraction, args.malformed_fraction, args.poisoned_fraction, args.warmup_fraction,
                 args.seed, args.json, args.server_log, args.device,
                 command=" ".join(["specloom", *sys.argv[1:]]))
    return 0 if s["passed"] else 1


def _export(args) -> int:
    from .export import run

    return run(args)


def _quantize(args) -> int:
    from .quantize.cli import run

    return run(args)


def _doctor(args) -> int:
    from .doctor import read_doctor_prompts, refused, run_doctor
    from .engine import load

    from .errors import DrafterMismatch
    from .speculative import SpeculativeConfig

    prompts = read_doctor_prompts(args.prompts)  # a bad file fails before the model loads
    try:
        engine = load(args.model, speculative_config=args.speculative_config, dtype=args.dtype,
                      kv_dtype=args.kv_dtype, device=args.device, speculation="fixed")
        report = run_doctor(engine, prompts, args.max_tokens)
    except DrafterMismatch as e:  # made for another model: known from its config, before any weights load
        spec = SpeculativeConfig.parse(args.speculative_config)
        report = refused(spec.method, spec.model, e)
    for line in report.lines():
        print(line)
    if args.json:
        from .atomic import write_json

        write_json(args.json, report.to_json(), indent=1)
    return 0 if report.verdict == "pays" else 1


def _token_map(args) -> int:
    from .atomic import write_json
    from .drafters.token_map import build_token_map
    from .loading import load_config, load_tokenizer, resolve
    from .prompts import read_prompts

    texts = [r["text"] for r in read_prompts(args.prompts, refuse_eval=True)]
    tok = load_tokenizer(args.model)
    vocab_size = load_config(resolve(args.model))[0].vocab_size  # the model's (its embedding may be padded)
    m = build_token_map(tok, texts, vocab_size, sorted(set(args.prompts)),
                        " ".join(["specloom", *sys.argv[1:]]))
    write_json(args.out, m)
    share = [sum(m["counts"][:n]) / max(1, m["tokens_counted"]) for n in (16384, 32768, 65536)]
    print(f"{args.out}: {len(m['ranked'])} distinct tokens of {m['tokens_counted']} counted over {len(texts)} "
          f"prompts; the top 16384 / 32768 / 65536 cover " + " / ".join(f"{s:.1%}" for s in share))
    return 0


def _plot(args) -> int:
    from .bench.plots import plot_acceptance

    plot_acceptance(args.reports, args.out)
    print(args.out)
    return 0


def _report(args) -> int:
    from .bench.peer_report import write_report

    png = write_report(args.out, args.bench, args.png)
    print(f"{args.out}\n{png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        import warnings

        warnings.filterwarnings("ignore")
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    try:
        if hasattr(args, "device"):  # before anything loads: a bad device is one line, no traceback
            from .loading import parse_device

            args.device = str(parse_device(args.device))
        if args.command in ("generate", "bench", "serve", "bench-serve", "doctor"):  # so is a bad --kv-cache-dtype
            from .kv_quant import kv_dtype_arg

            kv_dtype_arg(args.kv_dtype)
        return {"generate": _generate, "bench": _bench, "plot": _plot, "bench-serve": _bench_serve,
                "bench-soak": _bench_soak, "data": _data, "train": _train,
                "serve": _serve, "quantize": _quantize, "doctor": _doctor, "export": _export,
                "report": _report, "token-map": _token_map}[args.command](args)
    except SpecloomError as e:
        print(f"specloom: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
