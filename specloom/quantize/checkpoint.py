"""`specloom quantize`: write a quantized HF checkpoint of any model specloom loads (an alias, a GGUF file, a HF
directory -- itself possibly quantized: it is dequantised first), or of a drafter directory.

A target directory gets config.json (the source's, or the HF config a GGUF file implies, with its
`quantization_config`), hf_quant_config.json for ModelOpt formats (NVFP4, MIXED_PRECISION), the tokenizer files,
`model.safetensors` with the target's tensors under their HF names, and one file per built-in drafter asked for
(`model-mtp.safetensors`, `model-dspark.safetensors`: quantize/builtin.py) whose config keys and metadata go into
config.json. When the drafter's format differs from the target's, the config is ModelOpt MIXED_PRECISION with
every quantized module named in `quantized_layers` with its own quant_algo; a dense drafter's modules are named in
the exclude list. A drafter directory (EAGLE-3, DFlash, ...) keeps its own files and config, its linears
quantized and its config declaring them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field

import torch

from ..errors import SpecloomError
from .builtin import BuiltinDrafter, find_source, parse_drafters
from .rtn import writer_for
from .select import (Written, declarations, head_modules, modules_of, quantize_tensors, unused_patterns, warn)

DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TOKENIZER_FILES = ("tokenizer", "special_tokens_map.json", "added_tokens.json", "vocab.", "merges.txt",
                    "generation_config.json", "chat_template")


@dataclass
class Report:
    out: str
    quantized: Written
    files: dict[str, list[str]] = field(default_factory=dict)  # file -> the tensor names it holds

    @property
    def formats(self) -> dict[str, str]:
        return {m: w.name for m, w in self.quantized.formats.items()}


def _dense_dtype(name: str) -> torch.dtype:
    if name not in DENSE_DTYPES:
        raise SpecloomError(f"--dense-dtype: unknown dtype {name!r} (choose {', '.join(DENSE_DTYPES)})")
    return DENSE_DTYPES[name]


def _prepare_out(out: str, sources: list[str]) -> None:
    if any(os.path.exists(s) and os.path.exists(out) and os.path.samefile(s, out) for s in sources):
        raise SpecloomError(f"--out {out}: is the source itself; write the quantized checkpoint elsewhere")
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out)):
        raise SpecloomError(f"--out {out}: exists and is not an empty directory")
    os.makedirs(out, exist_ok=True)


def _save(path: str, tensors: dict) -> list[str]:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    return sorted(tensors)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _write_declarations(out: str, raw: dict, q: Written, exclude: list[str]) -> dict:
    qc, hq = declarations(q, exclude)
    raw = {**raw, "quantization_config": qc}
    if hq is not None:
        _write_json(os.path.join(out, "hf_quant_config.json"), hq)
    return raw


def _source_tensors(source, raw: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the source under its HF name, dense (GGUF blocks and quantized modules dequantised)."""
    from ..loading import _hf_dir_tensors
    from ..loading.dequant import dense_tensors
    from ..loading.gguf_file import dequantize_gguf, gguf_raw_tensors

    if source.kind == "gguf":
        return {name: dequantize_gguf(t) for name, t in gguf_raw_tensors(source.path, raw)}
    return dense_tensors(dict(_hf_dir_tensors(source.path)), raw, source.path)


def _hf_config(source, raw: dict) -> dict:
    if source.kind == "hf":
        return {k: v for k, v in raw.items() if k != "quantization_config"}
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(raw.get("model_type"))
    return {**({"architectures": [arch]} if arch else {}), **raw}


def _write_tokenizer(source, out: str, config) -> None:
    if source.kind == "hf":
        for name in sorted(os.listdir(source.path)):
            if name.startswith(_TOKENIZER_FILES) and os.path.isfile(os.path.join(source.path, name)):
                shutil.copy2(os.path.join(source.path, name), os.path.join(out, name))
        return
    from ..tokenizer import Tokenizer

    Tokenizer.from_gguf(source.path, config.eos_token_ids).hf.save_pretrained(out)


def _is_drafter_dir(raw: dict) -> bool:
    from ..drafters.block.format import layout_of

    return layout_of(raw) not in ("a target model", "unknown", "builtin", "draft_model")


def quantize(model: str, fmt: str, out: str, exclude=(), with_drafters=None, drafter_format: str | None = None,
             dense_dtype: str = "bf16", keep_refs: bool = False, progress: bool = True) -> Report:
    """Write `model` quantized to `fmt` into `out` (see the module docstring). `keep_refs`: keep the writer's
    reference dequantisation of each quantized module in the report (tests)."""
    from ..loading import load_config, resolve

    writer = writer_for(fmt)
    dwriter = writer if drafter_format is None else writer_for(drafter_format, "--drafter-format")
    dt = _dense_dtype(dense_dtype)
    drafters = parse_drafters(with_drafters)
    exclude = [str(p) for p in exclude or ()]
    source = resolve(model)
    if source.kind == "hf":
        from ..drafters.checkpoint import _load_json

        raw0 = _load_json(os.path.join(source.path, "config.json"))
        if _is_drafter_dir(raw0):
            if drafters or drafter_format is not None:
                raise SpecloomError(f"{model}: a drafter directory carries no built-in drafters; --with-drafters "
                                    "and --drafter-format are for a target")
            return quantize_drafter_dir(source.path, fmt, out, exclude, dense_dtype, keep_refs, progress)
    config, raw = load_config(source)
    overlays = {d.name: find_source(d, config) for d in drafters if not d.declares(raw)}  # before writing anything
    _prepare_out(out, [source.path])
    if progress:
        print(f"specloom: quantizing {model} ({source.kind}: {source.path}) to {writer.name}", file=sys.stderr,
              flush=True)
    tensors = _source_tensors(source, raw)
    L = config.num_layers
    base = _hf_config(source, raw)
    own: dict[str, dict] = {}  # drafter tensors the source holds itself, by kind
    for d in _declared_by(raw):
        prefixes = d.prefixes(raw, L)
        own[d.name] = {n: tensors.pop(n) for n in [n for n in tensors if n.startswith(prefixes)]}
        for k in d.keys + (d.meta_key,):
            base.pop(k, None)  # re-added below when this drafter is written
    parts = [(None, tensors, writer)]
    for d in drafters:
        parts.append((d, _drafter_tensors(d, raw, own, overlays, L, base), dwriter))
    q = Written()
    dense_exclude, files, all_modules, per_file = [], {}, set(), {}
    for d, ts, w in parts:
        all_modules |= modules_of(ts)
        before = set(q.tensors)
        quantize_tensors(ts, w, exclude, dt, q, keep_refs)
        per_file["model.safetensors" if d is None else d.file] = [n for n in q.tensors if n not in before]
        if d is not None and w is None:
            dense_exclude += [p.rstrip(".") for p in d.prefixes(_drafter_raw(d, base), L)]
    used = [p for p in exclude if p not in unused_patterns(exclude, all_modules)]
    if len(used) < len(exclude):
        warn("--exclude pattern(s) that match no module of the checkpoint, left out of its config: "
             + ", ".join(repr(p) for p in exclude if p not in used))
    if q.unfit:
        warn(f"{len(q.unfit)} linear(s) whose input width is not a multiple of the format's group stay dense "
             f"(named in the exclude list): {', '.join(q.unfit[:4])}{' ...' if len(q.unfit) > 4 else ''}")
    if not q.formats:
        raise SpecloomError("nothing to quantize: every linear is excluded (or none has a width the format fits)")
    for file, names in per_file.items():
        files[file] = _save(os.path.join(out, file), {n: q.tensors[n] for n in names})
    base.pop("torch_dtype", None)  # transformers 5 spells it `dtype`
    raw_out = _write_declarations(out, {**base, "dtype": dense_dtype_name(dt)}, q,
                                  used + head_modules(tensors) + dense_exclude)
    _write_json(os.path.join(out, "config.json"), raw_out)
    _write_tokenizer(source, out, config)
    if progress:
        n = len(q.formats)
        kinds = ", ".join(sorted({w.name for w in q.formats.values()}))
        print(f"specloom: wrote {out}: {n} linear(s) quantized ({kinds}), "
              f"{sum(os.path.getsize(os.path.join(out, f)) for f in files) / 2**20:.1f} MiB of weights",
              file=sys.stderr, flush=True)
    return Report(out, q, files)


def dense_dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _declared_by(raw: dict) -> list[BuiltinDrafter]:
    from .builtin import BUILTIN

    return [d for d in BUILTIN.values() if d.declares(raw)]


def _drafter_raw(d: BuiltinDrafter, base: dict) -> dict:
    return {k: base[k] for k in d.keys if k in base}


def _drafter_tensors(d: BuiltinDrafter, raw: dict, own: dict, overlays: dict, L: int, base: dict) -> dict:
    """Drafter `d`'s tensors, from the source itself or the bundled overlay; its config keys and metadata go
    into `base`."""
    from ..drafters.checkpoint import _load_json, read_prefixed

    if d.name in overlays:
        src_raw = _load_json(os.path.join(overlays[d.name], "config.json"))
        ts = read_prefixed(overlays[d.name], d.prefixes(src_raw, L))
    else:
        src_raw, ts = raw, own[d.name]
    if not ts:
        raise SpecloomError(f"--with-drafters {d.name}: the checkpoint declares it but holds none of its tensors")
    base.update(d.config_keys(src_raw))
    meta = d.meta(src_raw)
    if meta:
        base[d.meta_key] = meta
    return ts


def quantize_drafter_dir(path: str, fmt: str, out: str, exclude=(), dense_dtype: str = "bf16",
                         keep_refs: bool = False, progress: bool = True) -> Report:
    """A drafter directory with its linears quantized: every *.safetensors file rewritten under its own name,
    config.json with a `quantization_config` (and hf_quant_config.json for ModelOpt), other files copied."""
    import glob

    from ..drafters.checkpoint import _load_json, read_tensors

    writer = writer_for(fmt)
    dt = _dense_dtype(dense_dtype)
    exclude = [str(p) for p in exclude or ()]
    raw = _load_json(os.path.join(path, "config.json"))
    _prepare_out(out, [path])
    q = Written()
    per_file = {}
    for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        ts = read_tensors(fn)  # dequantised if the drafter was quantized already
        before = set(q.tensors)
        quantize_tensors(ts, writer, exclude, dt, q, keep_refs)
        per_file[os.path.basename(fn)] = (set(modules_of(ts)), [n for n in q.tensors if n not in before])
    if not per_file:
        raise SpecloomError(f"{path}: no *.safetensors weights to quantize")
    used = [p for p in exclude if p not in unused_patterns(exclude, set().union(*(m for m, _ in per_file.values())))]
    if len(used) < len(exclude):
        warn("--exclude pattern(s) that match no module of the drafter, left out of its config: "
             + ", ".join(repr(p) for p in exclude if p not in used))
    files = {f: _save(os.path.join(out, f), {n: q.tensors[n] for n in names}) for f, (_, names) in per_file.items()}
    heads = head_modules(q.tensors)
    raw_out = _write_declarations(out, {k: v for k, v in raw.items() if k != "quantization_config"}, q,
                                  used + heads)
    _write_json(os.path.join(out, "config.json"), raw_out)
    for name in sorted(os.listdir(path)):
        src = os.path.join(path, name)
        if os.path.isfile(src) and not name.endswith((".safetensors", ".bin")) and name not in (
                "config.json", "hf_quant_config.json", "model.safetensors.index.json"):
            shutil.copy2(src, os.path.join(out, name))
    if progress:
        print(f"specloom: wrote {out}: drafter with {len(q.formats)} linear(s) in {writer.name}",
              file=sys.stderr, flush=True)
    return Report(out, q, files)
