"""What every checkpoint we write in the speculators format shares (the layout vLLM serves; drafters.md §7).

A speculators `config.json` carries `speculators_model_type` (eagle3 | dflash | dspark | mtp), a
`speculators_config` block -- the algorithm, the token proposal (greedy, its `speculative_tokens`) and the
verifier (`name_or_path`: the HF id or directory vLLM loads as the target when the drafter directory is served on
its own, `architectures`: the target's) -- and a `transformer_layer_config` (a HF config of the draft layers,
its RoPE scaling included: vLLM builds the draft layers' rotary embedding from it, not from the target's).

The fields and tensor names are checked against the `speculators` package's own config and model classes in
tests/test_speculators_export.py (speculators 0.9.0). Our readers ignore the fields they do not need.
"""

from __future__ import annotations

SPECULATORS_VERSION = "0.9.0"  # the release whose config and model classes our exports are validated with

# HF `architectures` of the targets specloom runs, by our model_type (the verifier entry of a speculators config)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


# the HF repositories the packaged aliases were converted from: what vLLM loads as the target (a trainer passes
# the alias it trained against; the verifier entry names the repository instead)
HF_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m",
          "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def speculators_config(algorithm: str, speculative_tokens: int, verifier: str | None,
                       verifier_architectures: list[str] | None) -> dict:
    verifier = HF_IDS.get(verifier, verifier) if verifier else None
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
    }


def rope_keys(rope_theta: float, rope_scaling) -> dict:
    """`rope_theta` and, for Llama-3.x frequency-dependent scaling (config.RopeScaling, factor != 1), the HF
    `rope_scaling` block (`rope_type: llama3`) of a draft layer config."""
    out = {"rope_theta": rope_theta}
    if rope_scaling is not None and rope_scaling.factor != 1:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": rope_scaling.factor,
                               "low_freq_factor": rope_scaling.low_freq_factor,
                               "high_freq_factor": rope_scaling.high_freq_factor,
                               "original_max_position_embeddings": rope_scaling.original_max_position,
                               "rope_theta": rope_theta}
    return out
