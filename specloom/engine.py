"""The engine: a loaded target (plus a drafter) and `generate`, the one-row case of the speculative step.

`Engine.generate` takes a raw prompt, chat messages or token ids and returns a `GenerationResult`. It runs the
same code as the serving scheduler (step.py), over a KV store of one row:

    row = stepper.new_row(request, 0); stepper.prefill(row, len(prompt))       # chunked; samples the first token
    while not row.finish:
        row.ctx.k = drafter depth                                                # capped by the token budget
        stepper.step([row])   # propose -> prune -> one target pass -> mask -> verify -> commit -> drafter update

Every pass that yields tokens counts in `num_target_passes`, so tau = generated tokens / passes (1.0 plain).
"""

from __future__ import annotations

import torch

from .constraint import Constraint
from .drafters import DRAFTERS, Drafter
from .errors import SpecloomError
from .kv import KVCache
from .models import DecoderLM, ForwardOutput
from .results import GenerationResult, StopChecker, acceptance_rates, mean_accepted_length  # noqa: F401
from .sampling import SamplingParams
from .speculative import SpeculativeConfig
from .step import TREE_SLACK, Request, Stepper
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
    ):
        self.model = model
        self.kv_dtype = kv_dtype  # None: the model's choice (fp32 on CPU, see DecoderLM.new_kv)
        self.tokenizer = tokenizer
        self.speculative_config = speculative_config
        self.drafter: Drafter | None = (
            DRAFTERS[speculative_config.method].create(speculative_config, model, tokenizer)
            if speculative_config else None
        )
        self.max_model_len = min(max_model_len or model.config.max_position, model.config.max_position)
        self.prefill_chunk = prefill_chunk
        self._kv: KVCache | None = None

    # -- inputs ---------------------------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: list[dict] | None = None, chat: bool = False) -> list[int]:
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        if prompt is None:
            raise SpecloomError("give a prompt, chat messages or prompt token ids")
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def check_request(self, ids: list[int], max_tokens) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise SpecloomError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if not ids:
            raise SpecloomError("the prompt is empty")
        if len(ids) + max_tokens > self.max_model_len:
            raise SpecloomError(
                f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together they exceed the "
                f"model's context of {self.max_model_len} tokens"
            )
        vocab = self.model.config.vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise SpecloomError(f"prompt token ids must lie in [0, {vocab})")

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
        out, hidden = None, {c: [] for c in capture}
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = ids[start:start + self.prefill_chunk]
            tokens = torch.tensor([chunk], device=self.model.device)
            positions = torch.arange(start, start + len(chunk), device=self.model.device)[None]
            out = self.model(tokens, positions, kv, capture=capture, num_logits=1)
            kv.commit()
            for c in hidden:
                hidden[c].append(out.hidden[c])
        if capture and len(hidden[capture[0]]) > 1:
            out = ForwardOutput(out.logits, {c: torch.cat(v, 1) for c, v in hidden.items()})
        return out

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
        stop: list[str] | None = None,
        ignore_eos: bool = False,
        on_tokens=None,
        constraint: Constraint | None = None,
        logprobs: int | None = None,
    ) -> GenerationResult:
        """`on_tokens(new_ids)`, if given, is called after every step with the tokens that step added (several
        under speculation); returning False stops generation with finish_reason "abort" (a client went away).

        `constraint` (a `specloom.constraint.Constraint`, e.g. serving/grammar.py's, one per request):
        grammar-constrained output, exact under speculation -- drafts the grammar rejects are pruned, every tree
        row's logits are masked with the grammar state after that row's path, and the state advances over
        emitted tokens only."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.encode(prompt, messages, chat)
        self.check_request(ids, max_tokens)
        req = Request(ids, max_tokens, params, stop or [], ignore_eos, constraint, on_tokens, logprobs)
        kv = self._kv_for(len(ids) + max_tokens + TREE_SLACK)
        stepper = Stepper(self.model, self.drafter, kv, self.tokenizer, self.prefill_chunk)
        row = stepper.new_row(req, 0)
        while not row.finish and row.prefilled < len(ids):
            stepper.prefill(row, len(ids))
        while not row.finish:
            row.ctx.k = row.cap(self.drafter)
            stepper.step([row])
        if row.error is not None:
            raise row.error
        return row.result()


def load(
    model: str,
    speculative_config: "str | dict | SpeculativeConfig | None" = None,
    dtype: str | torch.dtype = "bf16",
    max_model_len: int | None = None,
    progress: bool = True,
    kv_dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = "cpu",
) -> Engine:
    """Load a target (alias, .gguf file or HF directory) and return an `Engine`. `kv_dtype` None = automatic
    (fp32 on CPU, where attention over few queries is faster in fp32; the model's dtype elsewhere). `device`:
    `cpu` (default), `cuda` or `cuda:N`, or None for `cuda` when PyTorch sees a GPU (the CLI's default); the
    drafter is built on the target's device."""
    from .loading import load_config, load_target, parse_device, parse_dtype, resolve

    dev = parse_device(device)  # a bad device fails before anything loads
    spec = SpeculativeConfig.parse(speculative_config)  # checked before the (slow) model load
    kv_dt = None if kv_dtype in (None, "auto") else parse_dtype(kv_dtype)
    if spec is not None:  # fail fast, before the target's weights load
        DRAFTERS[spec.method].check(spec, load_config(resolve(model))[0])
    target, tokenizer = load_target(model, dtype, progress=progress, device=dev)
    return Engine(target, tokenizer, spec, max_model_len=max_model_len, kv_dtype=kv_dt)
