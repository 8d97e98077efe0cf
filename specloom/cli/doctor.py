"""`specloom doctor`: is the drafter this target's, does it pay here (verdict, exit status)."""

from __future__ import annotations

from .args import positive_int, device_option, kv_cache_dtype_option


def add(sub) -> None:
    p = sub.add_parser("doctor", help="before serving: is the drafter this target's, how much does it accept, "
                        "does it pay on this machine (verdict; exit 0 when it pays, 1 otherwise)")
    p.add_argument("model", help="the target: alias, a .gguf file or a HF model directory")
    p.add_argument("--speculative-config", required=True, metavar="JSON", help="the drafter, as for generate")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    kv_cache_dtype_option(p)
    p.add_argument("--prompts", default=None, metavar="FILE",
                    help="JSONL prompts for the acceptance probe (default: a few short packaged ones)")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="tokens per probe prompt (default 48)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON")
    device_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from ..doctor import read_doctor_prompts, refused, run_doctor
    from ..engine import load

    from ..errors import DrafterMismatch
    from ..speculative import SpeculativeConfig

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
        from ..atomic import write_json

        write_json(args.json, report.to_json(), indent=1)
    return 0 if report.verdict == "pays" else 1
