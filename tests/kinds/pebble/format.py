"""The pebble kind's checkpoint format (config.json + pebble.safetensors) and its export form (pebble-export.json)."""

from __future__ import annotations

import json
import os

from ..base import export_form
from ..checkpoint import checkpoint_format, read_tensors
from ...errors import SpecloomError

from .drafter import PebbleNet


@checkpoint_format("pebble")
class PebbleFormat:
    @staticmethod
    def read_config(path: str, raw: dict) -> None:
        if raw.get("architectures") != ["PebbleDrafter"]:
            raise SpecloomError(f"{path}: not a pebble drafter")

    @staticmethod
    def build(path: str, raw: dict, target) -> PebbleNet:
        return PebbleNet(float(read_tensors(os.path.join(path, "pebble.safetensors"))["value"][0]))

    @staticmethod
    def save(model: PebbleNet, path: str, meta: dict, **kw) -> None:
        from safetensors.torch import save_file

        save_file({"value": model.value.detach().clone()}, os.path.join(path, "pebble.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"architectures": ["PebbleDrafter"], "specloom": meta}, f)


@export_form("pebble", vllm=False)
def save_pebble_export(model: PebbleNet, out: str, meta: dict, **kw) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "pebble-export.json"), "w") as f:
        json.dump({"value": float(model.value.detach()), "dtype": str(kw.get("dtype"))}, f)
