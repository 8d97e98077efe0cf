"""Drafter checkpoints: finding them (bundled or a path), validating files, recording and checking the target.

Each drafter kind registers its format in its record (`@checkpoint_format("eagle3")`, drafters/base.py `Kind`) with `read_config(path, raw)`,
`build(path, raw, target)` and `save(model, path, meta)`; this module holds what they share:

* `find_drafter_dir(model, method, target_config)`: the user's path, or the drafter bundled with specloom for
  this target (`specloom/bundled/<target>/<method>/`, matched on architecture and shapes).
* `read_tensors(file)`: safetensors with a readable error for a truncated or corrupt file, naming the tensor;
  it and `read_prefixed` dequantise the modules a drafter stores quantized (`dequantized`: FP8 / MXFP4 / NVFP4,
  decided per module as the target loader decides, from the directory's own declarations).
* The `specloom` block in `config.json` (kind, target fingerprint, feature layer ids, tree defaults, training
  manifest, and `target_probe`: the target's behaviour on a fixed probe, behaviour.py). On load a fingerprint
  that differs from the target's gives a warning naming what differs, the behavioural distance to the recorded
  probe a log line (and a warning beyond its thresholds); shapes that cannot work give an error.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
import warnings

import torch

from ..behaviour import check_behaviour, record_probe
from ..errors import SpecloomError
from ..fingerprint import compare, fingerprint
from .base import KINDS, kind

log = logging.getLogger("specloom")
BUNDLED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bundled")
def checkpoint_format(method: str):
    """Decorator: kind `method`'s checkpoint format (its record's `format`, drafters/base.py)."""
    def deco(obj):
        kind(method).format = obj
        return obj

    return deco


def _format(method: str):
    fmt = KINDS[method].format if method in KINDS else None
    if fmt is None:
        raise SpecloomError(f"no checkpoint format registered for {method!r}")
    return fmt


def _target_key(cfg) -> dict:
    return {"architecture": cfg.model_type, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}


def bundled_dirs(method: str) -> list[str]:
    if not os.path.isdir(BUNDLED):
        return []
    out = []
    for target in sorted(os.listdir(BUNDLED)):
        d = os.path.join(BUNDLED, target, method)
        if os.path.isfile(os.path.join(d, "config.json")):
            out.append(d)
    return out


def find_drafter_dir(model: str | None, method: str, target_config) -> str:
    if model:
        if not os.path.exists(model):
            raise SpecloomError(f"{method} drafter {model!r}: no such file or directory")
        if not os.path.isdir(model):
            raise SpecloomError(f"{method} drafter {model!r}: expected a checkpoint directory")
        return model
    want = _target_key(target_config)
    for d in bundled_dirs(method):
        fp = (_load_json(os.path.join(d, "config.json")).get("specloom") or {}).get("target_fingerprint") or {}
        if all(fp.get(k) == v for k, v in want.items()):
            return d
    raise SpecloomError(
        f'no bundled {method} drafter for this target ({want["architecture"]}, {want["num_layers"]} layers, '
        f'hidden {want["hidden_size"]}); give one with "model": "<drafter dir>" (train one with `specloom train '
        f'{method}`)'
    )


def find_builtin_dir(method: str, target_config, declares) -> str:
    """A drafter built into the target checkpoint (MTP layers, DSpark): the target's own HF directory when its
    config declares one (`declares(raw_config) -> bool`), else an overlay bundled with specloom for this target
    (`bundled/<target>/<method>/`: the drafter tensors and config keys of such a checkpoint, without the target's
    own weights -- used for GGUF targets, which cannot carry them)."""
    src = getattr(target_config, "source_dir", None)
    if src:
        raw = _load_json(os.path.join(src, "config.json"))
        if declares(raw):
            return src
    want = _target_key(target_config)
    for d in bundled_dirs(method):
        fp = (_load_json(os.path.join(d, "config.json")).get("specloom") or {}).get("target_fingerprint") or {}
        if all(fp.get(k) == v for k, v in want.items()):
            return d
    where = f"the target checkpoint {src}" if src else "the target (a GGUF file cannot carry drafter layers)"
    raise SpecloomError(
        f"{method}: {where} has no built-in {method} drafter and specloom bundles none for this target "
        f'({want["architecture"]}, {want["num_layers"]} layers, hidden {want["hidden_size"]}); give a checkpoint '
        f'directory that has one with "model": "<dir>" (train one with `specloom train {method}`)'
    )


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise SpecloomError(f"{path}: missing (a drafter checkpoint needs its config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise SpecloomError(f"{path}: unreadable config ({e})") from None
    if not isinstance(raw, dict):
        raise SpecloomError(f"{path}: expected a JSON object")
    return raw


def read_drafter_config(path: str, method: str) -> dict:
    raw = _load_json(os.path.join(path, "config.json"))
    _format(method).read_config(path, raw)  # raises on a checkpoint of another kind
    return raw


def check_safetensors(path: str) -> None:
    """Validate a safetensors file's header against its size; name the first tensor that is cut off."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SpecloomError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise SpecloomError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SpecloomError(f"{path}: corrupt safetensors header") from None
    except OSError as e:
        raise SpecloomError(f"{path}: unreadable ({e})") from None
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info.get("data_offsets", [0, 0])[1]
        if end > data:
            raise SpecloomError(f"{path}: tensor {name!r} is truncated (needs {end} data bytes, file has {data})")


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    if path.endswith((".pt", ".bin")):
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many error types for corrupt pickles
            raise SpecloomError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from None
        return dequantized(tensors, os.path.dirname(path) or ".")
    check_safetensors(path)
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except Exception as e:
        raise SpecloomError(f"{path}: unreadable safetensors file ({e})") from None
    return dequantized(tensors, os.path.dirname(path) or ".")


def dequantized(tensors: dict[str, torch.Tensor], directory: str) -> dict[str, torch.Tensor]:
    """A drafter's tensors with every module stored in a quantized format (FP8, MXFP4, NVFP4) dequantised to
    fp32, the format decided per module from its tensors and what the directory's config.json /
    hf_quant_config.json declare for it (loading/dequant.py); dense tensors pass unchanged."""
    from ..loading.dequant import dense_tensors

    cfg = os.path.join(directory, "config.json")
    return dense_tensors(tensors, _load_json(cfg) if os.path.isfile(cfg) else {}, directory)


def weights_file(path: str) -> str:
    """The weights file of a single-file drafter checkpoint directory."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return f
    raise SpecloomError(f"{path}: no model.safetensors or pytorch_model.bin")


def read_prefixed(path: str, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors whose names start with one of `prefixes`, from every safetensors file of a checkpoint directory
    (the files named in its index, if any, and any others in it: drafters built into a target checkpoint add
    their own file)."""
    from safetensors import safe_open

    files = set(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files |= {os.path.join(path, v) for v in json.load(f)["weight_map"].values()}
        except (OSError, ValueError, KeyError) as e:
            raise SpecloomError(f"{index}: unreadable index ({e})") from None
    out = {}
    for fn in sorted(files):
        if not os.path.isfile(fn):
            raise SpecloomError(f"{path}: shard {os.path.basename(fn)} named in the index is missing")
        check_safetensors(fn)
        try:
            with safe_open(fn, framework="pt") as f:
                for k in f.keys():
                    if k.startswith(prefixes):
                        out[k] = f.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise SpecloomError(f"{fn}: unreadable safetensors file ({e})") from None
    return dequantized(out, path)


def add_to_target_checkpoint(target_dir: str, file_name: str, tensors: dict, config_keys: dict, meta_key: str,
                             meta: dict, replace_prefix: str | None = None) -> None:
    """Build a drafter into a target's HF directory: its tensors in their own safetensors file, its keys (and our
    metadata under `meta_key`) in the target's config.json, and the weight index updated when there is one
    (entries starting with `replace_prefix`, a previous drafter of the same kind, are dropped first)."""
    from safetensors.torch import save_file

    cfg_path = os.path.join(target_dir, "config.json")
    raw = _load_json(cfg_path)
    save_file(tensors, os.path.join(target_dir, file_name))
    raw.update(config_keys)
    raw[meta_key] = meta
    with open(cfg_path, "w") as f:
        json.dump(raw, f, indent=1)
    index = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            idx = json.load(f)
        wm = {k: v for k, v in idx.get("weight_map", {}).items()
              if not (replace_prefix and k.startswith(replace_prefix))}
        wm.update({k: file_name for k in tensors})
        idx["weight_map"] = wm
        with open(index, "w") as f:
            json.dump(idx, f, indent=1)


def init_from_checkpoint(model, path: str, kind: str, target, tokenizer) -> None:
    """Copy into `model` (being trained) every tensor it shares with the `kind` checkpoint at `path`."""
    other, _ = load_drafter(path, kind, target, tokenizer)
    own = model.state_dict()
    model.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in other.state_dict().items() if k in own})


# a checkpoint's decoding settings (not its weights, not its measurements): the tree shape and depth it decodes
# with by default and the shape table a host re-chooses the tree from (scripts/choose_eagle_tree.py, Medusa's tuning)
DECODING_SETTINGS = ("depth", "tree_width", "num_draft_tokens", "tree_choice", "tree_tuning", "draft_vocab")


def carried_settings(path: str, kind: str) -> dict:
    """The decoding settings of the `kind` checkpoint directory a training started from (`--init-from`), for the
    checkpoint it writes: a continued drafter decodes with its source's tuned tree, not the kind's generic default
    (an EAGLE-3 continued from the bundled one fell back to a 6-deep 24-node tree: 0.49x on a CPU host). Its
    measured tau is not carried (it belongs to the old weights); `settings_from` names the source. Empty where
    the source is another kind, has none, or is not a readable directory."""
    try:
        block = _load_json(os.path.join(path, "config.json")).get("specloom") or {}
    except SpecloomError:
        return {}
    if not isinstance(block, dict) or block.get("kind") != kind:
        return {}
    out = {k: block[k] for k in DECODING_SETTINGS if k in block}
    return {**out, "settings_from": path} if out else {}


def take(tensors: dict, name: str, shape: tuple, where: str) -> torch.Tensor:
    """A tensor by name with the shape the config implies, or a clear error naming it."""
    if name not in tensors:
        raise SpecloomError(f"{where}: tensor {name!r} is missing")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise SpecloomError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def check_target(meta: dict, target, tokenizer, where: str) -> dict | None:
    """Warn when the drafter was trained for another copy of the target (it still runs; verification keeps the
    output exact, only the speed suffers): the structural fingerprint first, then, when the checkpoint records
    one, the behavioural distance on the probe (behaviour.py: a log line, a warning beyond its thresholds).
    Returns that distance (None without a recording)."""
    diff = compare(meta.get("target_fingerprint"), fingerprint(target, tokenizer))
    if diff:
        msg = (f"{where}: this drafter was trained for another target ({'; '.join(diff)} differ); output stays "
               "exact but acceptance will be low")
        warnings.warn(msg, stacklevel=3)
        log.warning("specloom: warning: %s", msg)
    return check_behaviour(meta.get("target_probe"), target, where, tokenizer)


def load_drafter(path: str, method: str, target, tokenizer):
    """Read, build and check a drafter for `target`. Returns (model, specloom meta dict)."""
    raw = read_drafter_config(path, method)
    meta = raw.get("specloom") or {}
    model = _format(method).build(path, raw, target)
    check_target(meta, target, tokenizer, path)
    return model, meta


def save_drafter(method: str, model, path: str, meta: dict, **kw) -> None:
    os.makedirs(path, exist_ok=True)
    _format(method).save(model, path, meta, **kw)


def specloom_meta(kind: str, target, tokenizer, feature_ids, **extra) -> dict:
    """The `specloom` block of a drafter we write: kind, the target's structural fingerprint and its behaviour
    on the probe (`target_probe`, behaviour.py), the feature layer ids, and `extra`."""
    return {"kind": kind, "target_fingerprint": fingerprint(target, tokenizer),
            "target_probe": record_probe(target, tokenizer), "feature_ids": list(feature_ids), **extra}


def drafter_prior_tau(drafter, spec=None, target_config=None) -> float | None:
    """The drafter's measured tau, if it has one: `drafter.prior_tau`, else the `measured.mean_accepted_length`
    its checkpoint's config records (the bundled drafters' manifest figures); None when unknown."""
    tau = getattr(drafter, "prior_tau", None)
    if tau:
        return float(tau)
    if spec is None or target_config is None:
        return None
    try:
        raw = read_drafter_config(find_drafter_dir(spec.model, spec.method, target_config), spec.method)
    except Exception:  # no checkpoint (n-gram, draft_model), or one without a readable config
        return None
    for d in [raw, *(v for v in raw.values() if isinstance(v, dict))]:
        m = d.get("measured")
        if isinstance(m, dict) and isinstance(m.get("mean_accepted_length"), (int, float)):
            return float(m["mean_accepted_length"])
    return None
