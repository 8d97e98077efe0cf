"""The engine: a loaded target (plus a drafter) and `generate`, the one-row case of the speculative step.

`Engine.generate` takes a raw prompt, chat messages or token ids and returns a `GenerationResult`. It runs the
same code as the serving scheduler (step.py), over a KV store of one row:

    row = stepper.new_row(request, 0); stepper.prefill(row, len(prompt))       # chunked; samples the first token
    policy.admit(row, drafter)            # DepthPolicy (depth.py), the scheduler's mechanism
    while not row.finish:
        plan = policy.plan(stepper, [row])     # depth from the cost curve and this request's acceptance
        rep = stepper.step([row], plan)        # propose -> prune -> one target pass -> mask -> verify -> commit
        policy.observe([row], plan, rep)       # the curve, the acceptance and the drafting cost learn

`speculation` picks the depth: "auto" (what `specloom.load` and the CLI use) chooses it every step from this
host's cached verify-cost curve c(1, n) and the request's acceptance (EWMA, started from the drafter's measured
tau): E[tokens | alpha](k) / (c(1, nodes(k)) + draft_cost(k)), plain decoding when no depth pays by 2 %;
"fixed" always drafts the drafter's own depth (the constructor's default, which the exactness tests use); "off"
never drafts. Every pass that yields tokens counts in `num_target_passes`, so tau = generated tokens / passes.
"""

from __future__ import annotations

import torch

from .constraint import Constraint
from .drafters import DRAFTERS, Drafter, create_drafter
from .errors import SpecloomError
from .kv import KVCache
from .kv_quant import kv_dtype_arg
from .models import DecoderLM, ForwardOutput
from .results import GenerationResult, StopChecker, acceptance_rates, mean_accepted_length  # noqa: F401
from . import penalties
from .sampling import SamplingParams
from .speculative import SpeculativeConfig
from .step import Request, Stepper, joined, prefill_chunk
from .kv import TREE_SLACK
from .tokenizer import Tokenizer


class Engine:
    def __init__(
        self,
        model: DecoderLM,
        tokenizer: Tokenizer,
        speculative_config: SpeculativeConfig | None = None,
        max_model_len: int | None = None,
        prefill_chunk: int = 512,
        kv_dtype: torch.dtype | None = None,
        speculation: str = "fixed",
        cost=None,
    ):
        from .depth import speculation_mode

        mode = speculation_mode(speculation)
        self.model = model
        # None: the model's choice (fp32 on CPU, see DecoderLM.new_kv); a torch dtype or a kv_quant type / name
        self.kv_dtype = kv_dtype_arg(kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
        self.tokenizer = tokenizer
        self.speculative_config = speculative_config
        self.drafter: Drafter | None = (
            create_drafter(speculative_config, model, tokenizer) if speculative_config else None
        )
        self.max_model_len = min(max_model_len or model.config.max_position, model.config.max_position)
        self.prefill_chunk = prefill_chunk
        self._kv: KVCache | None = None
        self.speculation = "auto" if mode == "load_aware" else mode
        self.cost = cost  # BatchCost over one row (auto); measured or read from the host's cache when first needed
        self._policy = None

    # -- speculation depth ----------------------------------------------------------------------------------
    def depth_policy(self):
        """The engine's `DepthPolicy` (kept across requests: drafting cost, tree size and acceptance learned
        online); None without a drafter or with speculation off."""
        from .cost import batch_cost_cached
        from .depth import DepthPolicy

        if self.drafter is None or self.speculation == "off":
            return None
        mode = "load_aware" if self.speculation == "auto" else self.speculation
        if self._policy is None or self._policy.mode != mode:
            if mode == "load_aware" and self.cost is None:
                import sys

                self.cost = batch_cost_cached(self.model, 1, log=lambda m: print(f"specloom: {m}", file=sys.stderr,
                                                                                   flush=True))
            self._policy = DepthPolicy.for_drafter(mode, self.drafter, self.cost if mode == "load_aware" else None,
                                                   self.prior_tau(), calibrate=False)
        return self._policy

    def prior_tau(self) -> float | None:
        """The drafter's measured tau (its checkpoint manifest's figure; None without one or without a drafter):
        the depth policy's prior acceptance, here and in the scheduler."""
        from .drafters.checkpoint import drafter_prior_tau

        if self.drafter is None:
            return None
        return drafter_prior_tau(self.drafter, self.speculative_config, self.model.config)

    # -- inputs ---------------------------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: list[dict] | None = None, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, messages, chat)

    def check_request(self, ids: list[int], max_tokens) -> None:
        check_prompt(ids, max_tokens, self.max_model_len, self.model.config.vocab_size)

    def _kv_for(self, n: int) -> KVCache:
        if self._kv is None or self._kv.max_len < n:
            size = min(self.max_model_len + TREE_SLACK, max(n, 1024))  # n includes the tree slack
            self._kv = self.model.new_kv(size, dtype=self.kv_dtype)
        self._kv.reset()
        return self._kv

    # -- decoding -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: list[int], kv: KVCache, capture: tuple[int, ...] = ()) -> ForwardOutput:
        """Run the prompt through the target in chunks (no sampling); return the logits of the last position
        and, when `capture` asks for them, the hidden states of every prompt position."""
        out, hidden = None, {}
        for start in range(0, len(ids), self.prefill_chunk):
            out = prefill_chunk(self.model, kv, 0, ids[start:start + self.prefill_chunk], start, capture, hidden)
        return joined(out, hidden)

    @torch.inference_mode()
    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        prompt_token_ids: list[int] | None = None,
        chat: bool = False,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        sampling_rule: str = "auto",
        stop: list[str] | None = None,
        ignore_eos: bool = False,
        on_tokens=None,
        constraint: Constraint | None = None,
        logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
    ) -> GenerationResult:
        """`on_tokens(new_ids)`, if given, is called after every step with the tokens that step added (several
        under speculation); returning False stops generation with finish_reason "abort" (a client went away).

        `constraint` (a `specloom.constraint.Constraint`, e.g. serving/grammar.py's, one per request):
        grammar-constrained output, exact under speculation -- drafts the grammar rejects are pruned, every tree
        row's logits are masked with the grammar state after that row's path, and the state advances over
        emitted tokens only.

        `sampling_rule` (sampling.py): "auto" (coupled for a seeded request, else rejection), "coupled" (the text
        a function of prompt, parameters and seed alone, speculation or not) or "rejection".

        `presence_penalty`, `frequency_penalty` (OpenAI's, over output tokens), `repetition_penalty` (HF / vLLM's,
        over prompt and output tokens) and `logit_bias` (token id -> bias): penalties.py, exact under
        speculation (each draft-tree node penalised by its own path)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, rule=sampling_rule,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty,
                                logit_bias=tuple(sorted((logit_bias or {}).items())))
        penalties.check_vocab(params, self.model.config.vocab_size)
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.encode(prompt, messages, chat)
        self.check_request(ids, max_tokens)
        req = Request(ids, max_tokens, params, stop or [], ignore_eos, constraint, on_tokens, logprobs)
        kv = self._kv_for(len(ids) + max_tokens + TREE_SLACK)
        policy = self.depth_policy()
        if policy is None:
            from .depth import DepthPolicy

            policy = DepthPolicy("off", 0)
        stepper = Stepper(self.model, self.drafter if policy.mode != "off" else None, kv, self.tokenizer,
                          self.prefill_chunk)
        row = stepper.new_row(req, 0)
        policy.admit(row, stepper.drafter)
        while not row.finish and row.prefilled < len(ids):
            stepper.prefill(row, len(ids))
        depths, drafted = [], 0
        while not row.finish:
            plan = policy.plan(stepper, [row])
            rep = stepper.step([row], plan)
            policy.observe([row], plan, rep)
            depths.append(plan.depths[0])
            drafted += len(rep.trees[0]) > 1 and 0 not in rep.forced  # (a grammar-forced tree is not a draft)
        if row.error is not None:
            raise row.error
        result = row.result()
        result.speculation = {"mode": self.speculation if self.drafter is not None else "off",
                              "steps": len(depths), "mean_depth": sum(depths) / len(depths) if depths else 0.0,
                              "drafted_steps": drafted, "drafting_at_end": row.drafting}
        return result


def encode_prompt(tokenizer, prompt: str | None = None, messages: list[dict] | None = None,
                  chat: bool = False) -> list[int]:
    """A request's prompt token ids: `messages` through the chat template, or `prompt` raw (`chat`: as one user
    turn). Needs the tokenizer only, so the CLI checks a prompt before the weights load."""
    if messages is not None:
        return tokenizer.encode_chat(messages)
    if prompt is None:
        raise SpecloomError("give a prompt, chat messages or prompt token ids")
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def check_prompt(ids: list[int], max_tokens, max_model_len: int, vocab: int) -> None:
    """One clear error for a request the model cannot run: max_tokens, an empty prompt, the context, the ids."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise SpecloomError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not ids:
        raise SpecloomError("the prompt is empty")
    if len(ids) + max_tokens > max_model_len:
        raise SpecloomError(
            f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together they exceed the "
            f"model's context of {max_model_len} tokens"
        )
    if max(ids) >= vocab or min(ids) < 0:
        raise SpecloomError(f"prompt token ids must lie in [0, {vocab})")


def load(
    model: str,
    speculative_config: "str | dict | SpeculativeConfig | None" = None,
    dtype: str | torch.dtype = "bf16",
    max_model_len: int | None = None,
    progress: bool = True,
    kv_dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = "cpu",
    speculation: str = "auto",
    linear_kernel: str = "auto",
) -> Engine:
    """Load a target (alias, .gguf file or HF directory) and return an `Engine`. `kv_dtype` (`--kv-cache-dtype`)
    None / "auto" = automatic (fp32 on CPU, where attention over few queries is faster in fp32; the model's dtype
    elsewhere), else fp32, bf16, fp16, fp8_e4m3, fp8_e5m2 or int8 (kv_quant.py: a scale per token and head). `device`:
    `cpu` (default), `cuda` or `cuda:N`, or None for `cuda` when PyTorch sees a GPU (the CLI's default); the
    drafter is built on the target's device. `speculation`: "auto" (default: depth per step from this host's
    verify-cost curve and the request's acceptance, plain decoding where the drafter cannot pay), "fixed" or
    "off". `linear_kernel`: "auto" (the host's measured, numerics-preserving choice) or a kernel name
    (`models/cpu_packing.py`; `fp32`/`int8` change a bf16 target's numerics and are opt-in only)."""
    from .loading import load_config, load_target, parse_device, resolve

    dev = parse_device(device)  # a bad device fails before anything loads
    spec = SpeculativeConfig.parse(speculative_config)  # checked before the (slow) model load
    kv_dt = kv_dtype_arg(kv_dtype)  # a bad KV type fails before anything loads
    if spec is not None:  # fail fast, before the target's weights load
        DRAFTERS[spec.method].check(spec, load_config(resolve(model))[0])
    if speculation not in ("auto", "load_aware", "fixed", "off"):
        raise SpecloomError(f"speculation must be auto, fixed or off, got {speculation!r}")
    from .models.cpu_packing import KERNELS

    if linear_kernel not in ("auto", *KERNELS):
        raise SpecloomError(f"unknown linear kernel {linear_kernel!r} (auto, {', '.join(KERNELS)})")
    drafting = None
    if spec is not None and speculation != "off":  # the kernel is chosen for speculation, not plain decoding
        from .host.kernel_choice import MULTI, Drafting

        drafting = Drafting(width=min(1 + spec.num_speculative_tokens, 16) if spec.num_speculative_tokens else MULTI)
    target, tokenizer = load_target(model, dtype, progress=progress, device=dev, kernel=linear_kernel,
                                    drafting=drafting)
    return Engine(target, tokenizer, spec, max_model_len=max_model_len, kv_dtype=kv_dt, speculation=speculation)
