"""Mixture-of-experts facts of a model config: how many experts, how tokens are routed, which layers are sparse.

`parse_moe(cfg, defaults, num_layers, intermediate_size)` reads them from a HF `config.json` dict for a family
whose record allows experts (`FamilySpec.moe_defaults` is not None); every field is typed and bounded through
config_fields.py, and an inconsistency is one SpecloomError naming the field. The HF key names differ between
layouts and are all accepted:

* experts: `num_experts` (Qwen2/3-MoE), `num_local_experts` (Mixtral; transformers 5 also writes it for Qwen3-MoE),
  `n_routed_experts` (DeepSeek-V3); `num_experts_per_tok` of them per token;
* routed expert size: `moe_intermediate_size`, else `intermediate_size` (Mixtral);
* scoring: `scoring_func` `softmax` (default) or `sigmoid` (DeepSeek-V3: an `e_score_correction_bias` per expert
  added for the selection only, unless `topk_method` says `greedy`), `norm_topk_prob`, `routed_scaling_factor`,
  group-limited selection `n_group` / `topk_group`;
* shared expert: `shared_expert_intermediate_size` (Qwen2-MoE: module `shared_expert`, scaled by
  sigmoid(`shared_expert_gate`)) or `n_shared_experts` (DeepSeek: module `shared_experts`, size
  `n_shared_experts * moe_intermediate_size`, unscaled);
* sparse layers: `decoder_sparse_step` (every n-th layer), `mlp_only_layers` (dense despite the step),
  `first_k_dense_replace` (the first k layers dense). Layers past `num_hidden_layers` (MTP layers) follow the
  same rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .config_fields import bool_field, float_field, int_field, layer_ids, str_field
from .errors import SpecloomError

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
SCORINGS = ("softmax", "sigmoid")
_MISSING = object()

# field -> (least, most): generous sanity limits, as config_fields.BOUNDS
BOUNDS = {
    "num_experts": (0, 1 << 14),
    "num_experts_per_tok": (1, 1 << 14),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (1, 1 << 20),
    "n_shared_experts": (1, 64),
    "n_group": (1, 1 << 10),
    "topk_group": (1, 1 << 10),
    "decoder_sparse_step": (1, 1 << 10),
    "first_k_dense_replace": (0, 1 << 10),
    "moe_layer_freq": (1, 1 << 10),
}


def _int(cfg: dict, key: str, default=_MISSING, bound: str | None = None) -> int:
    """cfg[key] as an int (config_fields.int_field: type, presence) within BOUNDS[bound or key]."""
    v = int_field(cfg, key) if default is _MISSING else int_field(cfg, key, default)
    lo, hi = BOUNDS[bound or key]
    if not lo <= v <= hi:
        raise SpecloomError(f"model config field {key} must be an integer in [{lo}, {hi}], got {v}")
    return v


def _layer_list(cfg: dict, key: str, num_layers: int) -> list[int]:
    v = layer_ids(cfg, key) or []
    bad = [i for i in v if not 0 <= i < num_layers]
    if bad:
        raise SpecloomError(f"model config field {key} must list layer ids in [0, {num_layers - 1}], got {bad[0]}")
    return v


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # `gate.e_score_correction_bias`: added to the scores for selection only
    n_group: int = 1  # group-limited routing: experts in n_group groups, only the best topk_group groups chosen from
    topk_group: int = 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_name: str = "shared_expert"  # its HF module: "shared_expert" (Qwen2-MoE) or "shared_experts" (DeepSeek)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(Linear(H, 1))
    decoder_sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()
    first_k_dense: int = 0

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (or MTP layer `num_layers + i`) has the MoE MLP."""
        return (layer not in self.mlp_only_layers and layer >= self.first_k_dense
                and (layer + 1) % self.decoder_sparse_step == 0)

    def gated_mlps(self, prefix: str = "mlp.") -> list[str]:
        """The module prefixes of this MoE MLP's SwiGLU MLPs (each with gate/up/down projections)."""
        out = [f"{prefix}experts.{e}." for e in range(self.num_experts)]
        if self.shared_intermediate_size:
            out.append(f"{prefix}{self.shared_name}.")
        return out


def gated_mlp_prefixes(config, layer: int) -> list[str]:
    """Within decoder layer `layer` of a ModelConfig: the prefixes of its SwiGLU MLPs (`mlp.` for a dense layer;
    every expert and the shared expert for a sparse one)."""
    moe = getattr(config, "moe", None)
    if moe is not None and moe.is_sparse(layer):
        return moe.gated_mlps()
    return ["mlp."]


def parse_moe(cfg: dict, defaults: Mapping | None, num_layers: int, intermediate_size: int) -> MoEConfig | None:
    """The MoE facts of a HF config dict, or None for a dense model. `defaults`: the family's values for keys the
    config may leave out (None: the family has no MoE layers; the config's expert keys are then not read)."""
    if defaults is None:
        return None
    cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
    key = next((k for k in _EXPERT_KEYS if cfg.get(k) is not None), None)
    if key is None:
        return None
    experts = _int(cfg, key, bound="num_experts")
    if experts == 0:
        return None  # HF: no expert layers
    top_k = _int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise SpecloomError(f"model config field num_experts_per_tok must be an integer in [1, {experts}] "
                            f"({key}), got {top_k}")
    inter = _int(cfg, "moe_intermediate_size", intermediate_size)
    scoring = str_field(cfg, "scoring_func", "softmax")
    if scoring not in SCORINGS:
        raise SpecloomError(f"model config field scoring_func must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    topk_method = str_field(cfg, "topk_method", "noaux_tc" if scoring == "sigmoid" else "greedy")
    n_group = _int(cfg, "n_group", 1)
    topk_group = _int(cfg, "topk_group", 1 if n_group == 1 else n_group)
    if experts % n_group:
        raise SpecloomError(f"model config field n_group ({n_group}) must divide {key} ({experts})")
    if topk_group > n_group:
        raise SpecloomError(f"model config field topk_group must be an integer in [1, {n_group}] (n_group), "
                            f"got {topk_group}")
    if n_group > 1 and experts // n_group < 2:
        raise SpecloomError(f"model config field n_group ({n_group}) leaves fewer than 2 experts per group "
                            f"({key} {experts}); group scores sum each group's best two")
    if top_k > topk_group * (experts // n_group):
        raise SpecloomError(f"model config field num_experts_per_tok ({top_k}) exceeds the experts of the "
                            f"topk_group ({topk_group}) groups it may choose from ({topk_group * experts // n_group})")
    shared_inter, shared_name, shared_gate = 0, "shared_expert", False
    if cfg.get("shared_expert_intermediate_size"):
        shared_inter, shared_gate = _int(cfg, "shared_expert_intermediate_size"), True
    elif cfg.get("n_shared_experts"):
        shared_inter, shared_name = _int(cfg, "n_shared_experts") * inter, "shared_experts"
    step = _int(cfg, "decoder_sparse_step", 1)
    dense = _layer_list(cfg, "mlp_only_layers", num_layers)
    first_k = _int(cfg, "first_k_dense_replace", 0)
    freq = _int(cfg, "moe_layer_freq", 1)
    if freq != 1:
        raise SpecloomError(f"model config field moe_layer_freq {freq} is not supported (only 1; use "
                            "decoder_sparse_step for every n-th layer)")
    return MoEConfig(
        num_experts=experts, top_k=top_k, intermediate_size=inter, scoring=scoring,
        norm_topk_prob=bool_field(cfg, "norm_topk_prob", False),
        routed_scaling_factor=float_field(cfg, "routed_scaling_factor", 1.0),
        score_correction_bias=scoring == "sigmoid" and topk_method != "greedy",
        n_group=n_group, topk_group=topk_group,
        shared_intermediate_size=shared_inter, shared_name=shared_name, shared_expert_gate=shared_gate,
        decoder_sparse_step=step, mlp_only_layers=frozenset(dense), first_k_dense=first_k,
    )
