"""Mixture-of-experts layouts of the Llama block: the same attention and pre-norm block as `llama.py`, whose MLP is
the MoE MLP (`moe.py`) on the layers the config makes sparse. One record per checkpoint layout:

* `qwen3_moe` -- Qwen3-MoE: q/k RMSNorm, `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`, `decoder_sparse_step`,
  `mlp_only_layers` (dense layers of `intermediate_size`), `moe_intermediate_size`, `norm_topk_prob`.
* `qwen2_moe` -- Qwen2-MoE: q/k/v biases, plus a shared expert (`mlp.shared_expert`) scaled by
  sigmoid(`mlp.shared_expert_gate`).
* `mixtral` -- Mixtral: every layer sparse, `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`
  (gate/up/down, renamed at load), experts of `intermediate_size`, top-k weights always renormalised.
"""

from __future__ import annotations

from .family import FamilySpec, register_family_spec
from .llama import LlamaForCausalLM
from .transformer import register_family

for _name in ("qwen3_moe", "qwen2_moe", "mixtral"):
    register_family(_name)(LlamaForCausalLM)

QWEN3_MOE = register_family_spec(FamilySpec(
    name="qwen3_moe",
    model_cls=LlamaForCausalLM,
    model_types=("qwen3_moe",),
    qk_norm_model_types=frozenset({"qwen3_moe"}),
    moe_defaults={},
))

QWEN2_MOE = register_family_spec(FamilySpec(
    name="qwen2_moe",
    model_cls=LlamaForCausalLM,
    model_types=("qwen2_moe",),
    qkv_bias_model_types=frozenset({"qwen2_moe"}),
    moe_defaults={},
))

MIXTRAL = register_family_spec(FamilySpec(
    name="mixtral",
    model_cls=LlamaForCausalLM,
    model_types=("mixtral",),
    moe_defaults={"norm_topk_prob": True},
    hf_renames=(
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    ),
))
