"""`specloom generate`: one prompt, speed statistics; `--compare-plain` times plain decoding beside it."""

from __future__ import annotations

import json
import sys

from ..errors import SpecloomError
from .args import positive_int, common_options


def add(sub) -> None:
    p = sub.add_parser("generate", help="generate text and print speed statistics")
    common_options(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--sampling-rule", choices=("auto", "coupled", "rejection"), default="auto",
                   help="how sampled tokens are drawn under speculation: coupled (the text depends on the seed alone, "
                        "drafter or not), rejection (min(1, p/q)); auto: coupled when --seed is given")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2], over output tokens")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2], over output tokens")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="HF / vLLM's, > 0, over prompt and output tokens (1 = off)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--compare-plain", action="store_true",
                   help="also decode the same prompt without speculation in the same run (after a short warm-up "
                        "of both) and print both speeds, the speed-up and tau")
    p.add_argument("--compare-rounds", type=positive_int, default=2,
                   help="with --compare-plain: runs of each, interleaved A B B A ... (default 2)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..engine import Engine, load
    from ..host import host_info, host_line
    from ..sampling import SamplingParams

    pen = dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
               repetition_penalty=args.repetition_penalty)
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, **pen)  # checked before loading
    _check_prompt_before_loading(args)
    engine = load(args.model, speculative_config=args.speculative_config, dtype=args.dtype, kv_dtype=args.kv_dtype,
                  device=args.device, speculation=args.speculation, linear_kernel=args.linear_kernel)
    kw = dict(chat=args.chat, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, sampling_rule=args.sampling_rule, stop=args.stop, **pen)
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
    from ..models import invariant_attention

    if not model.uses_invariant_attention():
        return f"PyTorch's attention: {invariant_attention.unavailable_reason() or 'not on this device'}"
    choice = getattr(model, "kernel_choice", None)
    return f"linear kernel {choice.tag if choice is not None else 'default'} is not"


def _check_prompt_before_loading(args) -> None:
    """The prompt checked against the tokenizer and the model's config before the weights load (seconds to
    minutes): a model without a chat template under --chat, a prompt over the context, fail at once. The load
    reuses the tokenizer built here."""
    from ..engine import check_prompt, encode_prompt
    from ..loading import load_config, load_tokenizer, resolve

    try:
        config = load_config(resolve(args.model))[0]
        tokenizer = load_tokenizer(args.model)
    except SpecloomError:
        return  # a model that cannot even give its config or tokenizer: the load names what is wrong, in its order
    ids = encode_prompt(tokenizer, args.prompt, None, args.chat)
    check_prompt(ids, args.max_tokens, config.max_position, config.vocab_size)


def _divergence(engine, result, base) -> tuple[int | None, float | None]:
    """Where a speculative output first differs from plain decoding's, and the target's top-2 logit margin there."""
    from ..bench.harness import divergence_margin

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
