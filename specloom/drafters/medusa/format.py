"""Medusa checkpoint formats (drafters.md §1.4): read v0.1, "version 2" and Medusa-1.0/2 full models; write v2.

* v0.1: `config.json` (`medusa_num_heads`, `medusa_num_layers`) + `medusa_lm_head.pt` with
  `{h}.{l}.linear.{weight,bias}` and per-head `{h}.{num_layers}.weight [V, H]`.
* "version 2" (`version: "2"`): `medusa_lm_head.safetensors` with the ResBlocks only (heads share the base
  LM head). This is what `specloom train medusa` writes (plus the `specloom` block).
* Medusa-1.0/2 (axolotl): the full model's safetensors with `medusa_head.{h}.…` tensors (the base weights in the
  same files are ignored: the target is loaded separately).
The reference's weight-tied ResBlocks (the same tensor under every layer index) load as independent copies.
A truncated head vocabulary (specloom's, after vLLM's `token_map`): an int64 tensor `token_map` (V_d sorted,
distinct target ids) beside the heads and `medusa_vocab_size: V_d` in config.json; own heads then have V_d rows.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from ...config_fields import int_field
from ...errors import SpecloomError
from ..checkpoint import checkpoint_format, read_tensors, take
from .drafter import TOPK, MedusaHeads


def _token_map(tensors: dict, raw: dict, V: int, where: str) -> torch.Tensor | None:
    """The checked token_map of a checkpoint (None: the heads score the whole vocabulary)."""
    size = raw.get("medusa_vocab_size")
    if "token_map" not in tensors:
        if size not in (None, V):
            raise SpecloomError(f"{where}: config.json sets medusa_vocab_size {size} but there is no token_map tensor")
        return None
    tm = tensors["token_map"]
    if tm.dim() != 1 or tm.is_floating_point() or tm.is_complex() or tm.dtype == torch.bool:
        raise SpecloomError(f"{where}: token_map must be a 1-D integer tensor of target token ids, got "
                            f"{tm.dtype} of shape {tuple(tm.shape)}")
    tm = tm.long()
    if size is not None and size != tm.numel():
        raise SpecloomError(f"{where}: token_map holds {tm.numel()} ids but config.json sets medusa_vocab_size {size}")
    if not TOPK <= tm.numel() <= V:
        raise SpecloomError(f"{where}: token_map holds {tm.numel()} ids; a head vocabulary needs {TOPK} to {V}")
    if int(tm.min()) < 0 or int(tm.max()) >= V:
        raise SpecloomError(f"{where}: token_map ids must lie in [0, {V}) (the target's vocabulary), found "
                            f"{int(tm.min())}..{int(tm.max())}")
    if tm.numel() > 1 and not bool((tm[1:] > tm[:-1]).all()):
        raise SpecloomError(f"{where}: token_map must hold distinct target ids in increasing order")
    return tm


def _files(path: str) -> list[str]:
    for pattern in ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "*.safetensors", "pytorch_model*.bin"):
        found = sorted(glob.glob(os.path.join(path, pattern)))
        if found:
            return found
    raise SpecloomError(f"{path}: no medusa_lm_head.safetensors / medusa_lm_head.pt / model weights found")


@checkpoint_format("medusa")
class MedusaFormat:
    @staticmethod
    def read_config(path: str, raw: dict) -> None:
        if "medusa_num_heads" not in raw:
            kind = raw.get("speculators_model_type") or (raw.get("specloom") or {}).get("kind") or "non-Medusa"
            raise SpecloomError(f"{path}: this is a {kind} checkpoint (no medusa_num_heads in config.json)")

    @staticmethod
    def build(path: str, raw: dict, target) -> MedusaHeads:
        H, V = target.config.hidden_size, target.config.vocab_size
        what = f"{path}: drafter config"
        K = int_field(raw, "medusa_num_heads", what=what)
        nl = int_field(raw, "medusa_num_layers", 1, what=what)
        tensors: dict = {}
        for f in _files(path):
            tensors.update(read_tensors(f))
        tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
        where = path
        own_head = f"0.{nl}.weight" in tensors
        if raw.get("version") == "2":
            own_head = False
        # v0.1 configs may declare fewer heads than the file holds (the reference overrides to 5): trust the file
        present = {int(k.split(".")[0]) for k in tensors if k.split(".")[0].isdigit()}
        if present and max(present) + 1 != K:
            K = max(present) + 1
        token_map = _token_map(tensors, raw, V, where)
        rows = V if token_map is None else token_map.numel()
        if own_head and tuple(tensors[f"0.{nl}.weight"].shape) != (rows, H):
            got = tuple(tensors[f"0.{nl}.weight"].shape)
            raise SpecloomError(f"{where}: head 0's output layer has shape {got}; expected ({rows}, {H}) -- "
                                + ("the target's vocabulary" if token_map is None else
                                   f"one row per token_map id ({rows})"))
        heads = MedusaHeads(H, K, nl, rows if own_head else None, token_map)
        state = {}
        for k in range(K):
            for layer in range(nl):
                w = take(tensors, f"{k}.{layer}.linear.weight", (H, H), where)
                state[f"{k}.{layer}.linear.weight"] = w
                state[f"{k}.{layer}.linear.bias"] = take(tensors, f"{k}.{layer}.linear.bias", (H,), where)
            if own_head:
                state[f"{k}.{nl}.weight"] = take(tensors, f"{k}.{nl}.weight", (rows, H), where)
        if token_map is not None:
            state["token_map"] = token_map
        heads.load_state_dict({k: v.to(target.dtype) if v.is_floating_point() else v for k, v in state.items()})
        heads.to(target.device).eval().requires_grad_(False)
        heads.attach_target(target, pack=True)
        return heads

    @staticmethod
    def save(heads: MedusaHeads, path: str, meta: dict, dtype=torch.bfloat16, fmt: str = "v2") -> None:
        from safetensors.torch import save_file

        sd = {k: (v.detach().cpu().to(dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
              for k, v in heads.state_dict().items()}
        raw = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
               "base_model_name_or_path": meta.get("target", ""), "specloom": meta}
        if heads.token_map is not None:
            raw["medusa_vocab_size"] = heads.token_map.numel()
        os.makedirs(path, exist_ok=True)
        if fmt == "v2" and heads.vocab is None:
            raw["version"] = "2"
            save_file(sd, os.path.join(path, "medusa_lm_head.safetensors"))
        elif fmt == "v0.1":
            torch.save(sd, os.path.join(path, "medusa_lm_head.pt"))
        else:
            raise ValueError(f"cannot write Medusa format {fmt!r} for these heads")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f, indent=1)
