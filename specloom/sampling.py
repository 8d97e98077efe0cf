"""Sampling parameters and the one function that turns logits into the distribution we sample from.

`probs_from_logits` applies temperature, then top-k, then top-p (nucleus) and renormalises. Speculative
verification applies the very same function to the target's p and the drafter's q, so filtering can never make
the two disagree.

Two sampling rules (`SamplingParams.rule`), both exact (every token is distributed as the target's own):

* "rejection": each request owns a `torch.Generator` seeded from its `seed`; verification accepts a draft x with
  probability min(1, p(x)/q(x)) and draws from the residual otherwise (verify.py). A seeded request is
  reproducible whatever runs beside it, but its text depends on the drafts (they consume the random numbers).
* "coupled": the randomness is keyed to the output position: the token at sequence index t is
  argmax(log p_t + G_t), G_t Gumbel noise over the vocabulary drawn from (seed, t) alone (`position_noise`).
  Gumbel-max makes that a sample from p_t; a draft is accepted iff it equals it, and drafters draw their own
  proposals with the same noise (argmax(log q + G_t)), which keeps acceptance high where q is close to p. The
  text is a function of (prompt, sampling parameters, seed) alone: the same with speculation on or off, with any
  drafter, tree shape, batch or server history (the drafter-invariant coupling of Daliri, Musco and Suresh, 2024).

"auto" (the default) is "coupled" for a seeded request and "rejection" for an unseeded one.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch

from .errors import SpecloomError


RULES = ("auto", "coupled", "rejection")
GREEDY_BELOW = 1e-5  # a temperature below this is greedy decoding


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    rule: str = "auto"  # "auto" | "coupled" | "rejection" (module docstring)
    # penalties.py: applied to the target's logits before everything above, exactly under speculation
    presence_penalty: float = 0.0  # OpenAI: [-2, 2], over output tokens
    frequency_penalty: float = 0.0  # OpenAI: [-2, 2], over output tokens
    repetition_penalty: float = 1.0  # HF / vLLM: > 0, over prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs

    def __post_init__(self):
        if self.rule not in RULES:
            raise SpecloomError(f"sampling rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not (self.temperature >= 0.0):
            raise SpecloomError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecloomError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SpecloomError(f"top_k must be >= 0 (or -1 for off), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise SpecloomError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0.0 < self.repetition_penalty <= 100.0):
            raise SpecloomError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        for pair in self.logit_bias:
            if (len(pair) != 2 or not isinstance(pair[0], int) or isinstance(pair[0], bool) or pair[0] < 0
                    or not (-100.0 <= pair[1] <= 100.0)):
                raise SpecloomError(f"logit_bias takes token ids >= 0 with biases in [-100, 100], got {pair}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that logits / temperature overflow (as vLLM: below 1e-5)."""
        return self.temperature < GREEDY_BELOW

    @property
    def coupled(self) -> bool:
        """Sampling with position-keyed noise (module docstring): "coupled", or "auto" with a seed."""
        return not self.greedy and (self.rule == "coupled" or (self.rule == "auto" and self.seed is not None))

    def noise_seed(self) -> int | None:
        """The key of a coupled request's noise: its seed (a fresh random one when it has none); None otherwise."""
        if not self.coupled:
            return None
        return self.seed if self.seed is not None else random.getrandbits(63)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def argmax_ids(logits: torch.Tensor) -> list:
    """`logits.argmax(-1).tolist()` (the first maximum; NaN counts as the maximum): NumPy's argmax for fp32 logits
    on the CPU, where PyTorch's takes 8x longer (SmolLM2's 49,152-token vocabulary, one core: 390 vs 49 us for a
    verification pass of 11 rows, 65 vs 6 us for one row: 0.7 % of a plain decode step)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V) fp32 after temperature, top-k and top-p. Greedy -> one-hot."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits (V,) under `params` (argmax when greedy)."""
    if params.greedy:
        return argmax_ids(logits.reshape(-1))
    probs = probs_from_logits(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


_MASK = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64 over both (any int seed, negative ones too)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    for mult, shift in ((0xBF58476D1CE4E5B9, 30), (0x94D049BB133111EB, 27)):
        z = ((z ^ (z >> shift)) * mult) & _MASK
    return (z ^ (z >> 31)) >> 1


def position_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel noise (vocab,) fp32 for the token at sequence index `position` of a request keyed `seed`: drawn on
    the CPU from (seed, position) alone, so every device, batch and drafter sees the same numbers (read-only)."""
    return _noise(seed, position, vocab).to(device)


@functools.lru_cache(maxsize=256)
def _noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    # cached: the drafter draws a position's draft and the verifier checks it with the same numbers
    g = torch.Generator().manual_seed(_mix(seed, position))
    u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
    return (-torch.log(-torch.log(u))).float()


def coupled_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token at sequence index `position` under the coupled rule: argmax(log p + G), p the filtered
    distribution of `logits` (V,), G `position_noise(seed, position)`."""
    p = probs_from_logits(logits, params)
    return int((p.log() + position_noise(seed, position, p.shape[-1], p.device)).argmax())
