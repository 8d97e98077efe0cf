"""The drafters a target checkpoint can carry inside it, as `specloom quantize --with-drafters` writes them.

Each entry says how the drafter is declared in the target's config.json, which config keys and which tensors are
its own, and where specloom keeps its metadata; the tensors come from the target checkpoint itself when its
config declares the drafter, else from the overlay bundled for this target (specloom/bundled/<target>/<kind>/,
what a GGUF target uses). Readers: drafters/mtp/format.py (DeepSeek-V3 MTP layers `model.layers.{L+i}.*`) and
drafters/block/format.py (a built-in DSpark: `mtp.*` tensors and the `dspark_*` keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..drafters.block.format import DSPARK_FILE
from ..drafters.mtp.format import MTP_FILE, declares_mtp
from ..errors import SpecloomError


@dataclass(frozen=True)
class BuiltinDrafter:
    name: str
    declares: Callable[[dict], bool]
    keys: tuple[str, ...]  # its config.json keys
    prefixes: Callable[[dict, int], tuple[str, ...]]  # (its config, the target's layer count) -> tensor prefixes
    meta_key: str  # our metadata, inside a target's config.json
    file: str  # the safetensors file it is written to

    def config_keys(self, raw: dict) -> dict:
        return {k: raw[k] for k in self.keys if k in raw}

    def meta(self, raw: dict) -> dict | None:
        return raw.get(self.meta_key) or raw.get("specloom")


def _mtp_prefixes(raw: dict, num_layers: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{num_layers + i}." for i in range(int(raw.get("num_nextn_predict_layers") or 0)))


BUILTIN = {
    "mtp": BuiltinDrafter("mtp", declares_mtp, ("num_nextn_predict_layers",), _mtp_prefixes, "specloom_mtp",
                          MTP_FILE),
    "dspark": BuiltinDrafter(
        "dspark", lambda raw: "dspark_block_size" in raw,
        ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_markov_head_type",
         "dspark_noise_token_id", "n_mtp_layers", "enable_confidence_head", "dspark_confidence_head_with_markov",
         "dspark_intermediate_size"),
        lambda raw, num_layers: ("mtp.",), "specloom_dspark", DSPARK_FILE),
}


def parse_drafters(value) -> list[BuiltinDrafter]:
    """`dspark,mtp` (or a list) -> the entries, or one line naming the known kinds."""
    if not value:
        return []
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    bad = [n for n in names if n not in BUILTIN]
    if bad:
        raise SpecloomError(
            f"--with-drafters: {', '.join(map(repr, bad))} is not a drafter a target checkpoint carries (built-in "
            f"kinds: {', '.join(BUILTIN)}); a separate drafter directory (eagle3, dflash, ...) is quantized on its "
            "own: specloom quantize DRAFTER_DIR --format F --out DIR")
    return [BUILTIN[n] for n in dict.fromkeys(names)]


def find_source(d: BuiltinDrafter, target_config) -> str:
    """The directory holding the drafter's tensors for this target: the target's own, or the bundled overlay."""
    from ..drafters.checkpoint import find_builtin_dir

    try:
        return find_builtin_dir(d.name, target_config, d.declares)
    except SpecloomError as e:
        raise SpecloomError(f"--with-drafters {d.name}: {str(e).removeprefix(d.name + ': ')}") from None
