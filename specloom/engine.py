"""The engine: a loaded target (plus, later, a drafter) and the decoding loop with its statistics.

`Engine.generate` takes a raw prompt, chat messages or token ids and returns a `GenerationResult`. After the
prefill, every step is the same loop, with or without a drafter (plain decoding is the root-only tree):

    tree = drafter.propose(ctx)                                   # root = last chosen token
    out  = target(tree.tokens, kv.length + tree.depth, kv, attn_mask=tree.ancestor_mask, capture=...)
    res  = verify(tree, out.logits, params, generator)
    kv.commit(res.path); drafter.on_verified(ctx, res, out); stats.record(tree, res)

Every pass that yields tokens counts in `num_target_passes`, so tau = generated tokens / passes (1.0 plain).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import SpecloomError
from .drafters import DRAFTERS, DraftContext, Drafter
from .kv import KVCache
from .models import DecoderLM, ForwardOutput
from .sampling import SamplingParams, sample_token
from .speculative import SpeculativeConfig
from .tokenizer import Tokenizer
from .tree import DraftTree
from .verify import VerifyResult, verify

if TYPE_CHECKING:
    from .serving.grammar import Constraint

TREE_SLACK = 256  # KV slots beyond the sequence for the nodes of one draft tree


def acceptance_rates(accepted: list[int], proposed: list[int]) -> list[float]:
    """alpha_k = drafts whose k-th token was accepted / drafts that proposed a k-th token."""
    return [a / p if p else 0.0 for a, p in zip(accepted, proposed)]


def mean_accepted_length(num_tokens: int, num_passes: int, num_requests: int = 1) -> float:
    """tau = tokens per verification step; each request's prefill pass and the token it yields are excluded."""
    steps = num_passes - num_requests
    return (num_tokens - num_requests) / steps if steps > 0 else 1.0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    num_target_passes: int
    mean_accepted_length: float  # tau: tokens per verification step (the prefill's first token excluded)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)  # drafts that proposed a k-th token
    accepted_per_position: list[int] = field(default_factory=list)  # ... whose k-th token was accepted
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    draft_seconds: float = 0.0  # time in the drafter (prefill, propose, on_verified), part of total_seconds
    logprobs: list | None = None  # serving: per token (logprob, [(alternative id, logprob), ...]) when asked

    @property
    def acceptance_per_position(self) -> list[float]:
        return acceptance_rates(self.accepted_per_position, self.proposed_per_position)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second, prefill included (as a user feels it)."""
        return len(self.token_ids) / self.total_seconds if self.total_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_second"] = self.tokens_per_second
        d["acceptance_per_position"] = self.acceptance_per_position
        d["num_prompt_tokens"] = len(self.prompt_token_ids)
        d["num_generated_tokens"] = len(self.token_ids)
        return d


class StopChecker:
    """Finds stop strings in the generated text; returns the text cut before the first one."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]

    def check(self, ids: list[int]) -> str | None:
        if not self.stop:
            return None
        text = self.tokenizer.decode(ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else None


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

    def _kv_for(self, n: int) -> KVCache:
        if self._kv is None or self._kv.max_len < n:
            size = min(self.max_model_len + TREE_SLACK, max(n, 1024))  # n includes the tree slack
            self._kv = self.model.new_kv(size, dtype=self.kv_dtype)
        self._kv.reset()
        return self._kv

    # -- decoding -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: list[int], kv: KVCache, capture: tuple[int, ...] = ()) -> ForwardOutput:
        """Run the prompt through the target in chunks; return the logits of the last position and, when
        `capture` asks for them, the hidden states of every prompt position."""
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
    ) -> GenerationResult:
        """`on_tokens(new_ids)`, if given, is called after every step with the tokens that step added (several
        under speculation); returning False stops generation with finish_reason "abort" (a client went away).

        `constraint` (specloom.serving.grammar, one per request): grammar-constrained output, exact under
        speculation -- drafts the grammar rejects are pruned, every tree row's logits are masked with the grammar
        state after that row's path, and the state advances over emitted tokens only."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise SpecloomError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.encode(prompt, messages, chat)
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
        generator = None if params.greedy else params.generator(self.model.device)
        eos = frozenset() if ignore_eos else self.tokenizer.eos_token_ids
        stopper = StopChecker(self.tokenizer, stop or [])
        drafter = self.drafter
        capture = drafter.needs_hidden if drafter else ()
        stats = _Stats()

        t0 = time.perf_counter()
        kv = self._kv_for(len(ids) + max_tokens + TREE_SLACK)
        target_out = self.prefill(ids, kv, capture)
        tokens = list(ids)  # the whole sequence; tokens[-1] is the root: chosen, not yet run by the target
        first_logits = target_out.logits[0, -1]
        if constraint is not None:
            constraint.mask_row(first_logits)
        first = sample_token(first_logits, params, generator)
        if constraint is not None:
            constraint.advance([first])
        ctx = DraftContext(tokens, len(ids), params, generator, 0)
        t_draft = time.perf_counter()
        if drafter:
            drafter.prefill(ctx, target_out)
        draft_s = time.perf_counter() - t_draft
        t_prefill = time.perf_counter() - t0
        out: list[int] = []
        finish, text = None, None
        emitted = [first]
        device = self.model.device
        while True:
            n_before = len(out)
            for tok in emitted:  # EOS, stop strings and max_tokens cut inside a multi-token step
                out.append(tok)
                tokens.append(tok)
                if tok in eos:
                    finish = "stop"
                    break
                text = stopper.check(out)
                if text is not None:
                    finish = "stop"
                    break
                if len(out) >= max_tokens:
                    finish = "length"
                    break
            if on_tokens is not None and len(out) > n_before and on_tokens(out[n_before:]) is False and not finish:
                finish = "abort"
            if finish:
                break
            # one speculative step: propose -> one target pass over the tree -> verify -> commit
            ctx.k = min(drafter.num_speculative_tokens, max_tokens - len(out) - 1) if drafter else 0
            t_draft = time.perf_counter()
            tree = drafter.propose(ctx) if ctx.k > 0 else DraftTree([tokens[-1]], [-1])
            draft_s += time.perf_counter() - t_draft
            if constraint is not None:
                tree = constraint.prune(tree)
            x = torch.tensor([tree.tokens], device=device)
            pos = torch.tensor([tree.positions(kv.length)], device=device)
            mask = None if tree.is_chain else tree.ancestor_mask(device)
            target_out = self.model(x, pos, kv, attn_mask=mask, capture=capture)
            if constraint is not None:
                constraint.mask(tree, target_out.logits[0])
            result = verify(tree, target_out.logits[0], params, generator)
            if constraint is not None:
                constraint.advance(result.tokens)
            kv.commit(result.path)
            if drafter:
                t_draft = time.perf_counter()
                drafter.on_verified(ctx, result, target_out)
                draft_s += time.perf_counter() - t_draft
            stats.record(tree, result)
            emitted = result.tokens
        total = time.perf_counter() - t0
        if text is None:
            text = self.tokenizer.decode(out)
        return GenerationResult(
            text=text,
            token_ids=out,
            prompt_token_ids=ids,
            finish_reason=finish,
            num_target_passes=stats.passes,
            mean_accepted_length=mean_accepted_length(len(out), stats.passes),
            num_draft_tokens=stats.drafted,
            num_accepted_tokens=stats.accepted,
            proposed_per_position=stats.proposed_at,
            accepted_per_position=stats.accepted_at,
            prefill_seconds=t_prefill,
            total_seconds=total,
            draft_seconds=draft_s,
        )


class _Stats:
    """Per-request counters. `passes` counts every target pass that yields tokens, the prefill included (it
    yields the first token). tau (mean accepted length) counts verification steps only, as vLLM and Spec-Bench
    do: tokens emitted by verification steps / verification steps = 1 + accepted / steps; 1.0 when plain."""

    def __init__(self):
        self.passes = 1
        self.drafted = 0
        self.accepted = 0
        self.proposed_at: list[int] = []
        self.accepted_at: list[int] = []

    def record(self, tree: DraftTree, result: VerifyResult) -> None:
        self.passes += 1
        if len(tree) == 1:
            return
        self.drafted += len(tree) - 1
        self.accepted += result.num_accepted
        depth = tree.max_depth
        while len(self.proposed_at) < depth:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for d in range(depth):
            self.proposed_at[d] += 1
        for d in range(result.num_accepted):
            self.accepted_at[d] += 1


def load(
    model: str,
    speculative_config: "str | dict | SpeculativeConfig | None" = None,
    dtype: str | torch.dtype = "bf16",
    max_model_len: int | None = None,
    progress: bool = True,
    kv_dtype: str | torch.dtype | None = None,
) -> Engine:
    """Load a target (alias, .gguf file or HF directory) and return an `Engine`. `kv_dtype` None = automatic
    (fp32 on CPU, where attention over few queries is faster in fp32; the model's dtype elsewhere)."""
    from .loading import load_config, load_target, parse_dtype, resolve

    spec = SpeculativeConfig.parse(speculative_config)  # checked before the (slow) model load
    kv_dt = None if kv_dtype in (None, "auto") else parse_dtype(kv_dtype)
    if spec is not None:  # fail fast, before the target's weights load
        DRAFTERS[spec.method].check(spec, load_config(resolve(model))[0])
    target, tokenizer = load_target(model, dtype, progress=progress)
    return Engine(target, tokenizer, spec, max_model_len=max_model_len, kv_dtype=kv_dt)
