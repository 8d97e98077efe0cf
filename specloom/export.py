"""`specloom export`: a drafter written in the speculators format, the layout vLLM serves (drafters.md §7).

    specloom export smollm2-135m --speculative-config '{"method": "eagle3"}' --out exported/eagle3

reads the drafter exactly as `generate` would (the bundled one for the target, a `"model"` directory, or the
target's built-in layers for dspark / mtp), checks it against the target, and writes `config.json` +
`model.safetensors` with `speculators_model_type` eagle3 | dflash | dspark | mtp. Where the `speculators` package
is installed the result is validated with its own classes (`validate`): its pydantic config parses, and its model
class for that kind, built on the meta device, expects exactly our tensor names and shapes (the ones it takes from
the verifier excepted). The command prints the `vllm serve` line for the exported kind.

What has no speculators form: EAGLE-1 and Medusa (speculators 0.9.0 has neither kind; vLLM reads their original
layouts, which specloom writes already), draft models (an ordinary HF checkpoint), n-gram and suffix decoding (no
weights); MTP layers of a target that is not Qwen3 (speculators' mtp has Qwen3 layers only) or with more than one
layer. vLLM serves speculators mtp checkpoints for Qwen3-Next / MiMo verifiers only, so an exported Qwen3 MTP layer
is for the speculators tools (training, conversion), not for `vllm serve`.
"""

from __future__ import annotations

import json
import os

import torch

from .errors import SpecloomError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _form(method: str):
    """Kind `method`'s speculators form (its record's `export`), or a SpecloomError saying why it has none."""
    from .drafters import KINDS

    kind = KINDS.get(method)
    if kind is not None and kind.export is not None:
        return kind.export
    exportable = ", ".join(n for n, k in KINDS.items() if k.export is not None)
    why = kind.no_export if kind is not None and kind.no_export else "unknown kind" if kind is None else ""
    raise SpecloomError(f"{method}: no speculators format" + (f" ({why})" if why else "")
                        + f" (exportable kinds: {exportable})")


def write_speculators(method: str, model, out: str, meta: dict, verifier: str | None = None,
                      verifier_architectures: list[str] | None = None, dtype=torch.bfloat16) -> None:
    """Write the drafter network `model` (the one its kind's export form names: EagleDraftModel for eagle3,
    BlockDraftModel for dflash / dspark, MTPModel for mtp) in the speculators format into `out`."""
    _form(method).save(model, out, meta, dtype=dtype, verifier=verifier or "",
                       verifier_architectures=verifier_architectures)


def validate(path: str) -> dict:
    """Check a speculators-format directory with the `speculators` package's own classes: its config.json through
    `SpeculatorModelConfig.from_pretrained` (pydantic validation, the kind's config class chosen by
    `speculators_model_type`), then the kind's registered model class built from that config on the meta device,
    whose state dict must hold every tensor of our safetensors file under the same name and shape; the tensors it
    expects and we do not write must be among those it takes from the verifier (`_keys_to_ignore_on_load_missing`:
    embeddings, the verifier's head and norm, a full-vocabulary lm_head). SpecloomError when anything differs, or
    when speculators is not installed. Returns a summary."""
    from importlib.metadata import version

    try:
        from speculators import SpeculatorModel, SpeculatorModelConfig
    except ImportError as e:
        raise SpecloomError(f"speculators is not installed ({e}): pip install --no-deps speculators==0.9.0 "
                            "hs-connectors==0.9.0 datasets loguru") from None
    from safetensors import safe_open

    try:
        cfg = SpeculatorModelConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # pydantic's ValidationError and whatever transformers raises
        raise SpecloomError(f"{path}: speculators rejects config.json: {e}") from None
    cfg.speculators_config.verifier.name_or_path = None  # build offline: nothing is read from the verifier
    cfg.transformer_layer_config._attn_implementation = "eager"
    cls = SpeculatorModel.registered_model_class_from_config(cfg)
    with torch.device("meta"):
        model = cls(cfg)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        ours = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    unexpected = sorted(set(ours) - set(theirs))
    wrong = {k: (ours[k], theirs[k]) for k in ours if k in theirs and ours[k] != theirs[k]}
    ignorable = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    missing = sorted(k for k in set(theirs) - set(ours) if k not in ignorable)
    if unexpected or wrong or missing:
        raise SpecloomError(f"{path}: speculators' {cls.__name__} does not load this state dict: "
                            + "; ".join(x for x in (
                                f"unexpected {unexpected}" if unexpected else "",
                                f"shapes (ours, theirs) {wrong}" if wrong else "",
                                f"missing {missing}" if missing else "") if x))
    return {"speculators": version("speculators"), "config_class": type(cfg).__name__, "model_class": cls.__name__, "tensors": len(ours),
            "from_verifier": sorted(set(theirs) - set(ours))}


def vllm_command(method: str, out: str, verifier: str | None, num_tokens: int) -> str:
    """The `vllm serve` line for an exported directory (vLLM's method name is the speculators kind)."""
    spec = json.dumps({"method": method, "model": out, "num_speculative_tokens": num_tokens})
    return f"vllm serve {verifier or '<target HF id or directory>'} --speculative-config '{spec}'"


def _verifier_of(name: str, target) -> tuple[str | None, list[str]]:
    from .drafters.speculators_format import ARCHITECTURES, HF_IDS

    src = getattr(target, "source", None)
    archs = [ARCHITECTURES.get(target.config.model_type, "")] if target.config.model_type in ARCHITECTURES else []
    if src is not None and src.kind == "hf":
        try:
            with open(os.path.join(src.path, "config.json")) as f:
                archs = list(json.load(f).get("architectures") or archs)
        except (OSError, ValueError):
            pass
        return os.path.abspath(src.path), archs
    return HF_IDS.get(name), archs


def export(target_name: str, speculative_config, out: str, verifier: str | None = None, dtype: str = "bf16",
           device: str | None = "cpu") -> dict:
    """Load `target_name` and the drafter `speculative_config` names, write it in the speculators format into
    `out`, validate it where speculators is installed. Returns what happened (for the CLI)."""
    from .drafters import create_drafter
    from .loading import load_target
    from .speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse(speculative_config)
    if spec is None:
        raise SpecloomError('--speculative-config is required, e.g. \'{"method": "eagle3"}\'')
    form = _form(spec.method)
    if dtype not in DTYPES:
        raise SpecloomError(f"unknown --dtype {dtype!r} (bf16, fp16, fp32)")
    if os.path.isdir(out) and os.listdir(out):
        raise SpecloomError(f"{out}: exists and is not empty")
    if form.check_target is not None:  # before any weights load
        from .loading import load_config, resolve

        form.check_target(load_config(resolve(target_name))[0].model_type, target_name)
    target, tokenizer = load_target(target_name, "fp32", progress=False, device=device)
    drafter = create_drafter(spec, target, tokenizer)
    net = form.net(drafter)
    meta = dict((drafter.checkpoint or {}).get("meta") or {})
    ver, archs = _verifier_of(target_name, target)
    ver = verifier or ver
    write_speculators(spec.method, net, out, meta, ver, archs, DTYPES[dtype])
    tokens = form.tokens(spec, meta, net)
    report = {"out": out, "method": spec.method, "verifier": ver, "source": (drafter.checkpoint or {}).get("path"),
              "vllm": vllm_command(spec.method, os.path.abspath(out), ver, tokens) if form.vllm else None}
    try:
        report["validated"] = validate(out)
    except SpecloomError as e:
        if "not installed" not in str(e):
            raise
        report["validated"] = None
        report["not_validated"] = str(e)
    return report


# -- the subcommand (registered by specloom/cli/) ----------------------------------------------------------------

def add_parser(sub):
    e = sub.add_parser("export", help="write a drafter in the speculators format (what vLLM serves): eagle3, dflash, "
                       "dspark, mtp (Qwen3 targets); validated with the speculators package where it is installed")
    e.add_argument("model", help="the target: alias, a .gguf file or a HF model directory")
    e.add_argument("--speculative-config", required=True, metavar="JSON",
                   help='the drafter, as for generate: \'{"method": "eagle3"}\' (the bundled one) or '
                        '\'{"method": "dflash", "model": "runs/dflash"}\'')
    e.add_argument("--out", required=True, help="output directory (new or empty)")
    e.add_argument("--verifier", default=None, metavar="HF_ID_OR_DIR",
                   help="the target as vLLM loads it, written into speculators_config.verifier (default: the HF "
                        "directory given, or the HF repository an alias was converted from)")
    e.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="tensor dtype written (default bf16)")
    e.add_argument("--device", default="cpu", metavar="{cpu,cuda,cuda:N}", help="where the drafter is read")
    return e


def run(args) -> int:
    import sys

    r = export(args.model, args.speculative_config, args.out, args.verifier, args.dtype, args.device)
    print(r["out"])
    err = sys.stderr
    v = r.get("validated")
    if v:
        print(f"[speculators {v['speculators']}: {v['config_class']} parses config.json; {v['model_class']} takes all "
              f"{v['tensors']} tensors by name and shape (from the verifier: {', '.join(v['from_verifier']) or '-'})]",
              file=err)
    else:
        print(f"[not validated: {r.get('not_validated')}]", file=err)
    if not r["verifier"]:
        print("[no verifier recorded (a GGUF file): give --verifier <HF id or dir> for `vllm serve <dir>`; the long "
              "form below names the target itself]", file=err)
    if r["vllm"]:
        print(r["vllm"], file=err)
    else:
        print("[vLLM serves speculators mtp checkpoints for Qwen3-Next / MiMo verifiers only: this one is for the "
              "speculators tools]", file=err)
    return 0
